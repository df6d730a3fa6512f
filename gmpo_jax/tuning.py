"""Tuned constants of every backend: small reviewed tables, no autotuning, no environment variables.

Each tuned value has one provenance line in the comment above it: device, date, jax version, what was
compared, where the record is. The measured numbers are in ``docs/performance.md`` (raw records in
``benchmarks/results/*.jsonl``); the session notes those lines name are in git history (``docs/performance.md``'s introduction says
where). To measure a
variant: ``python -m benchmarks.run ... --tuning "NAME=..."`` (``benchmarks/README.md``), one per run.

* XLA LM-head path (``xla_chunked``): chunks are groups of whole sequences; ``rows = chunk_size * T``
  tokens go through the LM head at once and keep one ``[rows, vocab_block]`` float32 logits block live
  (plus a few same-sized temporaries in the gradient pass), so ``rows * vocab_block`` bounds workspace
  memory: ``TARGET_ROWS``, ``LOGITS_BLOCK_ELEMENTS``.
* Mosaic GPU LM-head kernels: ``MOSAIC_BLOCKS`` (keyed by GPU and head), ``MOSAIC_DEFAULT``,
  ``SAVED_LOGITS_MIN_H``.
* Mosaic GPU logits kernels (``gmpo_jax.logits.mosaic_gpu``): ``LOGITS_FWD``, ``LOGITS_BWD``,
  ``LOGITS_FUSED``.
* Exact work skipping (``gmpo_jax.lm_head.rows``): ``ROW_BUCKETS``, ``ROW_ALIGN``.
"""

from __future__ import annotations

# Target number of token rows per chunk (a chunk never splits a sequence, so long sequences exceed it).
# H200, 2026-11-30, jax 0.11.2: rows x vocab_block 16384x2048 vs 8192x2048, 8192x4096, 4096x8192, Qwen2.5-0.5B head N=16384 bf16 fwd+bwd (daf34c4); docs/performance.md "xla_chunked".
TARGET_ROWS = 16384
# Budget of float32 elements for one [rows, vocab_block] logits block (2**25 elements = 128 MiB).
# Same sweep as TARGET_ROWS: its winner 16384 x 2048 is 2**25 elements; docs/performance.md "xla_chunked".
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
# (device_kind, H, V); other GPUs and heads use MOSAIC_DEFAULT. The gradient kernel's two output staging
# tiles share shared memory with its ring, hence fewer stages; "logprob_saved" is the log-prob kernel that
# also writes the logits tiles for the gradient pass (``save_logits``): its two float16 staging tiles leave
# room for three stages at 64 x 256.
# H200, 2026-11-30 (fourth session), jax 0.11.2: log-prob 64x256x4 and dz 64x256x3 vs 64x256x3/4, 128x128x2/3/4, 64x128x6 per kernel at R = 8192, both heads (gaps <= the ~2 % spread at Qwen); docs/performance.md "Block sizes".
MOSAIC_BLOCKS: dict[tuple[str, int, int], dict[str, tuple[int, int, int, int]]] = {
    ("NVIDIA H200", 896, 151936): {"logprob": (64, 256, 64, 4), "grad": (64, 256, 64, 3)},  # Qwen2.5-0.5B
    ("NVIDIA H200", 4096, 128256): {"logprob": (64, 256, 64, 4), "grad": (64, 256, 64, 3)},  # Llama-3-8B
}
# The H200 winners as the default; "logprob_saved": H200, 2026-11-30, jax 0.11.2: 64x256x3 as fast as x4 in the sweep above (cf4bd95); docs/performance.md "Block sizes".
MOSAIC_DEFAULT: dict[str, tuple[int, int, int, int]] = {
    "logprob": (64, 256, 64, 4),
    "grad": (64, 256, 64, 3),
    "logprob_saved": (64, 256, 64, 3),
    # the dz kernel writing float32 (logits_precision): its two 64 x 128 float32 staging tiles and a 4-deep ring fit
    # shared memory (193 KiB); not measured yet (2026-12-01: no GPU this session).
    "grad_f32": (64, 128, 64, 4),
}


# Every LM-head kernel's pipeline (``kernels.LMHeadBlocks.in_flight``): 1 leaves one wgmma product running while the next
# is issued (its ring slot released a step later), 0 waits for each. 0: 1 gained nothing (H100, 2026-12-05: each
# gradient GEMM within -2.0 % .. +7.5 % of 0, the default step +0.2 .. +1.1 %; docs/performance.md "The GEMM levers
# measured").
WGMMA_IN_FLIGHT = 0
# The gradient GEMMs on a runtime row prefix (``ROW_PREFIX_GRADIENT``; ``kernels.lm_head_dhidden`` /
# ``lm_head_dweight``): (block_m, block_n, block_k, num_stages) of ``dz W^T`` (float32 out, added in place), of ``h^T
# dz`` with a 16-bit result (a single chunk) and with a float32 one. 128 x 256 tiles, a 3-deep ring: of
# ``benchmarks/gemm_probe.py``'s sizes the fastest, or within 0.5 % of it, at both headline heads (H100, 2026-12-05;
# where 256 does not divide H, as Qwen's 896, dh falls back to 128 columns; docs/performance.md "The GEMM levers
# measured").
DHIDDEN_BLOCKS = (64, 256, 64, 3)
DWEIGHT_BLOCKS_16 = (64, 256, 64, 3)
DWEIGHT_BLOCKS_32 = (64, 256, 64, 3)


# Mosaic GPU LM head: keep a single chunk's logits (float16) for the gradient pass only for hidden sizes
# this large. The recompute a kept tile saves grows with H, its memory traffic does not; between 896 and
# 4096 nothing was measured, so the threshold sits at the next real head below 4096 (Qwen2.5-7B's 3584).
# H200, 2026-11-30 (fourth session), jax 0.11.2: recompute vs keep, fwd+bwd, Llama-3 head (faster) and Qwen2.5-0.5B head (not faster) (cf4bd95, 2592d74); docs/performance.md "LM head: mosaic_gpu".
SAVED_LOGITS_MIN_H = 3584


def mosaic_blocks(device_kind: str, H: int, V: int, kind: str) -> tuple[int, int, int, int]:
    """``(block_m, block_n, block_k, num_stages)`` of the Mosaic kernel ``kind`` (``"logprob"`` / ``"grad"``)
    on ``device_kind`` for a head of ``H x V`` (``kind`` may also be ``"logprob_saved"``): the table's
    entry, else ``MOSAIC_DEFAULT``'s."""
    entry = MOSAIC_BLOCKS.get((device_kind, H, V), {})
    return entry.get(kind, MOSAIC_DEFAULT[kind])


# Mosaic GPU logits kernels, three-pass path: the fields of ``kernels.LogitsBlocks`` of the forward
# (log-sum-exp) and backward (dlogits) kernels. float32 logits run the same blocks; not swept.
# H200, 2026-11-30, jax 0.11.2: forward 128x4 vs 128x6, 256 columns, target picked in the kernel, Llama-3 vocabulary B = 2 / 16 x 1025 rows bf16 (bb6779a, run 2); docs/performance.md "Block sizes".
LOGITS_FWD = {"block_v": 128, "stages": 4, "pick_target": False}
# H200, 2026-11-30, jax 0.11.2: backward 128x3x32 vs 128x3x8, 128x2x32, 64x4, 256x2 (block_v x stages x tiles), same run (bb6779a, run 2); docs/performance.md "Block sizes".
LOGITS_BWD = {"block_v": 128, "stages": 3, "tiles_per_cta": 32}
# Fused two-pass logits kernel (``kernels.FusedLogitsBlocks``): bytes of one tile, input and output ring
# stages (4 x 16 KB + 2 x 16 KB = 96 KB of shared memory: two CTAs per SM) and, for clusters of 4 CTAs per
# row, clusters per 132 SMs (scaled to the device's SM count; 64 would not all fit at once).
# H200, 2026-11-30 (fifth and sixth sessions), jax 0.11.2: 62 vs 58 / 60 clusters of 4, 2 x 124, 2 x 132, 8 x 31, 5+1 and 3+2 stages, GRPO, Llama-3 vocabulary B = 2 / 16 (fdadff4, 8b7aadd); docs/performance.md "Block sizes".
LOGITS_FUSED = {"tile_bytes": 16384, "stages": 4, "out_stages": 2, "clusters_of_4_per_132_sms": 62}


# Exact work skipping (``gmpo_jax.lm_head.rows``): the backend runs on the smallest of ROW_BUCKETS static
# prefixes of the reordered rows that holds the rows a pass needs (at most 1 / ROW_BUCKETS of the rows
# computed in vain, one compiled program per prefix size), each a multiple of ROW_ALIGN rows (the Mosaic
# kernels' largest row block). On the CPU (tests, the demo) one bucket: no reordering, no extra compiles.
ROW_BUCKETS = 8
ROW_ALIGN = 128
# The forward's skipping on one compiled log-prob kernel for every number of live rows (``Capabilities.row_prefix``,
# ``kernels.RowPrefixGrid``) instead of one per prefix size: fewer kernels to compile (Qwen2.5-0.5B 8 x 2048: 24 -> 17,
# Llama-3-8B 4 x 2048 with kept logits: 9 -> 1). Off: its first call is 18-47 % shorter, but its step is 3-5 % slower
# on the GRPO-like members at Llama-3 (its log-prob kernel on the prefix: +1.1 ms, H100, 2026-12-05, fa263c2; the
# prefix grid's CTA order since changed to the static grid's: the one program at Llama-3 went from +3.6-4.6 % to
# +2.4-3.0 % on the GRPO-like members and from +1.7 to +2.9 % on the full mask, H100, 2026-12-06, e17a367;
# docs/performance.md "The filter's gradient error on the GPU").
ROW_PREFIX_FORWARD = None
# The gradient pass on one program for every number of rows with a cotangent (``Capabilities.row_prefix_grads``): the
# dz kernel on a row-prefix grid and Pallas GEMMs that take the row count at run time (``kernels.lm_head_dhidden``,
# ``lm_head_dweight``) instead of XLA's GEMMs on a static prefix per bucket (whose slices cost 17-29 % in the version
# above); the gradient filter's windows each on the runtime prefix of their rows. Off: with ROW_PREFIX_FORWARD the
# first call is 3-10 s instead of 15-64 s (by host), but the step is slower where rows are live. H100, 2026-12-05,
# jax 0.11.2, fa263c2 with the 128 x 256 GEMMs: Qwen2.5-0.5B 8 x 2048 GRPO-like members 6-13 % faster, full mask
# 4.9 % slower; Llama-3-8B 4 x 2048 2-5 % slower on every member; Qwen 2 x 32768 5-6 % slower (docs/performance.md
# "The GEMM levers measured").
# Either flag None: on where the call runs the gradient filter (``grad_filter``), whose per-prefix program switches per
# window: first call 41 s at Qwen 8 x 2048 and 83 s at Llama-3 4 x 2048 against 10 / 7 s on one program, the step the
# same at Qwen and 8-12 % slower at Llama-3 (H100, 2026-12-06, e17a367; docs/performance.md "The filter's gradient
# error on the GPU").
ROW_PREFIX_GRADIENT = None

# The LM-head gradient filter (``grad_filter``, ``gmpo_jax.lm_head.mosaic_gpu``): vocabulary windows of
# GRAD_FILTER_WINDOW columns (a multiple of every kernel's tile width), each window's rows on the smallest of
# the prefixes Rp / 2**k, k < GRAD_FILTER_LEVELS; "auto" is the threshold GRAD_FILTER_AUTO of a window's score
# D sqrt(2 ln(n / n_eff)) (docs/SPEC.md). Each window costs a fixed overhead (switch, gathers, small ops): H200,
# 2026-12-02 (dbe89cd profile), Qwen 8 x 2048 peaked 10.5 ms at 4096 columns, 9.2 ms at 8192. The threshold is
# the worst member's (docs/performance.md "A score instead of the mass", float64 model at the Qwen head, with the
# tilted correction): at 1e-2 every member is within 1.21x of the exact path's hidden-gradient error (heavy-rough, a
# tail uneven per token, the worst; the rule is 1.5x) and 1.04x of its weight-gradient error, keeping 6-17 % of the
# (row, window) blocks; 5e-3 keeps up to 36 % within 1.07x.
GRAD_FILTER_WINDOW = 8192
GRAD_FILTER_LEVELS = 7
# From column GRAD_FILTER_TAIL on, the windows are one tail (kept together per row, run in one step on the union
# of their rows): BPE vocabularies put the frequent tokens first, so past it few rows need any window, mostly the
# same rows (peaked workload, Qwen2.5-0.5B head 8 x 2048 at 1e-3: 220 rows need a window past column 57344, 3-32
# each window), and one step replaces a dozen windows' fixed costs at the same work.
GRAD_FILTER_TAIL = 65536
GRAD_FILTER_AUTO = 1e-2


def row_buckets(backend) -> int:
    """The backend's ``row_buckets`` if it sets one, else ``ROW_BUCKETS`` for compiled kernels on a GPU and
    1 (no skipping) on the CPU or in the Pallas interpreter."""
    import jax

    own = getattr(backend, "row_buckets", None)
    if own is not None:
        if isinstance(own, bool) or not isinstance(own, int) or own < 1:
            raise ValueError(f"row_buckets must be None or an int >= 1 (1: no skipping), got row_buckets={own!r}")
        return own
    if getattr(backend, "interpret", False) or jax.default_backend() != "gpu":
        return 1
    return ROW_BUCKETS
