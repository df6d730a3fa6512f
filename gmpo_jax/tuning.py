"""Default block sizes: a small reviewed table, no autotuning, no environment variables.

Chunks are groups of whole sequences; ``rows = chunk_size * T`` tokens go through the LM head at once.
The XLA path keeps one ``[rows, vocab_block]`` float32 logits block live (plus a few same-sized
temporaries in the gradient pass), so ``rows * vocab_block`` is what bounds workspace memory.
Values come from a sweep on an NVIDIA H200 (jax 0.11.2, 2026-11-30, Qwen2.5-0.5B head H=896 V=151936,
N=16384 bf16, forward+backward; benchmarks/RESULTS.md): rows x vocab_block = 8192 x 2048: 47.0 ms,
8192 x 4096: 44.6 ms, 4096 x 8192: 45.6 ms, 16384 x 2048: 43.4 ms (peak 1.44-1.48 GiB in all four).
"""

from __future__ import annotations

# Target number of token rows per chunk (a chunk never splits a sequence, so long sequences exceed it).
TARGET_ROWS = 16384
# Budget of float32 elements for one [rows, vocab_block] logits block (2**25 elements = 128 MiB).
LOGITS_BLOCK_ELEMENTS = 2**25
MIN_VOCAB_BLOCK = 128
MAX_VOCAB_BLOCK = 8192  # keeps the weight block slice small


def default_chunk_size(B: int, T: int) -> int:
    """Sequences per chunk: about ``TARGET_ROWS`` tokens, at least one sequence, at most ``B``."""
    return max(1, min(B, TARGET_ROWS // max(T, 1)))


def xla_vocab_block(rows: int, V: int) -> int:
    """Vocabulary block of the XLA path: the logits-block budget over the rows, a multiple of 128."""
    vb = LOGITS_BLOCK_ELEMENTS // max(rows, 1)
    vb = max(MIN_VOCAB_BLOCK, min(MAX_VOCAB_BLOCK, (vb // 128) * 128))
    return min(vb, V)
