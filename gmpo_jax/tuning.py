"""Default block sizes: small reviewed tables, no autotuning, no environment variables.

XLA path (``xla_chunked``): chunk rows and vocabulary block below. Mosaic GPU LM-head kernels:
``MOSAIC_BLOCKS``, keyed by GPU and head, filled from ``python3 -m benchmarks.kernels_bench --sweep``.

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


# Mosaic GPU LM-head kernels: (block_m per warpgroup, block_n, block_k, num_stages) per kernel, keyed by
# (device_kind, H, V). From ``python3 -m benchmarks.kernels_bench --sweep`` on an H200 (2026-11-30, fourth
# session, jax 0.11.2, R = 8192; benchmarks/KERNELS_NOTES.md): log-prob kernel, Qwen 64x256x3 3.59 ms vs
# 64x256x4 3.67, 128x128x3 3.62, 128x128x4 3.64, 64x128x6 3.94; Llama 64x256x4 14.00 ms vs 64x256x3 14.03,
# 128x128x3 14.21, 128x128x4 14.96, 64x128x6 17.23 (the Qwen gaps are within the ~2 % run-to-run spread, so
# both heads keep 64x256x4). Gradient (dz) kernel: Llama 64x256x3 13.64 ms vs 128x128x3 14.36, 128x128x2
# 16.42, 64x128x6 18.37; Qwen 64x256x3 3.87 vs 128x128x3 3.89. The gradient kernel's two output staging
# tiles share shared memory with its ring, hence fewer stages. "logprob_saved" is the log-prob kernel that
# also writes the logits tiles for the gradient pass (``save_logits``): its two float16 staging tiles
# leave room for three stages at 64 x 256 (which cost nothing measurable above). Other GPUs and heads use
# MOSAIC_DEFAULT.
MOSAIC_BLOCKS: dict[tuple[str, int, int], dict[str, tuple[int, int, int, int]]] = {
    ("NVIDIA H200", 896, 151936): {"logprob": (64, 256, 64, 4), "grad": (64, 256, 64, 3)},    # Qwen2.5-0.5B
    ("NVIDIA H200", 4096, 128256): {"logprob": (64, 256, 64, 4), "grad": (64, 256, 64, 3)},   # Llama-3-8B
}
MOSAIC_DEFAULT: dict[str, tuple[int, int, int, int]] = {
    "logprob": (64, 256, 64, 4), "grad": (64, 256, 64, 3), "logprob_saved": (64, 256, 64, 3)}


# Mosaic GPU LM head: keep a single chunk's logits (float16) for the gradient pass only for hidden sizes
# this large. Measured on an H200 (2026-11-30, benchmarks/RESULTS.md "Issue 3, fourth session"), fwd+bwd,
# recompute vs keep: Llama-3 (H 4096) 8192 rows 57.35 -> 43.85 ms (all kept), 16384 rows 108.4 -> 98.8 ms
# (half kept); Qwen2.5-0.5B (H 896) 16384 rows 29.64 -> 29.97 ms (15 % kept), 512 rows 1.364 -> 1.605 ms
# (84 % kept). The recompute a kept tile saves grows with H, its memory traffic does not. Between 896 and
# 4096 nothing was measured: the threshold sits at the next real head below 4096 (Qwen2.5-7B's 3584).
SAVED_LOGITS_MIN_H = 3584


def mosaic_blocks(device_kind: str, H: int, V: int, kind: str) -> tuple[int, int, int, int]:
    """``(block_m, block_n, block_k, num_stages)`` of the Mosaic kernel ``kind`` (``"logprob"`` / ``"grad"``)
    on ``device_kind`` for a head of ``H x V`` (``kind`` may also be ``"logprob_saved"``): the table's
    entry, else ``MOSAIC_DEFAULT``'s."""
    entry = MOSAIC_BLOCKS.get((device_kind, H, V), {})
    return entry.get(kind, MOSAIC_DEFAULT[kind])


# Exact work skipping (``gmpo_jax.lm_head.rows``): the backend runs on the smallest of ROW_BUCKETS static
# prefixes of the reordered rows that holds the rows a pass needs (at most 1 / ROW_BUCKETS of the rows
# computed in vain, one compiled program per prefix size), each a multiple of ROW_ALIGN rows (the Mosaic
# kernels' largest row block). On the CPU (tests, the demo) one bucket: no reordering, no extra compiles.
ROW_BUCKETS = 8
ROW_ALIGN = 128


def row_buckets(backend) -> int:
    """The backend's ``row_buckets`` if it sets one, else ``ROW_BUCKETS`` for compiled kernels on a GPU and
    1 (no skipping) on the CPU or in the Pallas interpreter."""
    import jax

    own = getattr(backend, "row_buckets", None)
    if own is not None:
        return int(own)
    if getattr(backend, "interpret", False) or jax.default_backend() != "gpu":
        return 1
    return ROW_BUCKETS
