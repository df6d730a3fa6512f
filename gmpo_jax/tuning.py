"""Default block sizes: a small reviewed table, no autotuning, no environment variables.

Chunks are groups of whole sequences; ``rows = chunk_size * T`` tokens go through the LM head at once.
The XLA path keeps one ``[rows, vocab_block]`` float32 logits block live (plus a few same-sized
temporaries in the gradient pass), so ``rows * vocab_block`` is what bounds workspace memory.
Values were chosen by the sweep in ``benchmarks/`` (see benchmarks/RESULTS.md for the measurements).
"""

from __future__ import annotations

# Target number of token rows per chunk (a chunk never splits a sequence, so long sequences exceed it).
TARGET_ROWS = 8192
# Budget of float32 elements for one [rows, vocab_block] logits block (2**24 elements = 64 MiB).
LOGITS_BLOCK_ELEMENTS = 2**24
MIN_VOCAB_BLOCK = 128
MAX_VOCAB_BLOCK = 8192


def default_chunk_size(B: int, T: int) -> int:
    """Sequences per chunk: about ``TARGET_ROWS`` tokens, at least one sequence, at most ``B``."""
    return max(1, min(B, TARGET_ROWS // max(T, 1)))


def xla_vocab_block(rows: int, V: int) -> int:
    """Vocabulary block of the XLA path: the logits-block budget over the rows, a multiple of 128."""
    vb = LOGITS_BLOCK_ELEMENTS // max(rows, 1)
    vb = max(MIN_VOCAB_BLOCK, min(MAX_VOCAB_BLOCK, (vb // 128) * 128))
    return min(vb, V)
