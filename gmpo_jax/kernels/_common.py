"""The one module of Mosaic GPU helpers that every kernel of ``gmpo_jax.kernels`` shares.

Files of this package are named ``<input>_<stage>.py``: the input the kernel reads (``lm_head``: hidden
states and the LM-head weight, the logits recomputed tile by tile with wgmma; ``logits``: logits that
already exist in device memory) and the stage it computes (``lse``: per-split online log-sum-exp
statistics, ``dlogits``: the gradient of the logits, ``fused``: both, in one kernel). Each file holds one
kernel; its entry point is named for the input and what it returns (``lm_head_lse_partials``,
``lm_head_dlogits_window``, ``logits_lse_partials``, ``logits_dlogits``, ``logits_lse_and_dlogits``), its
block sizes are one of the frozen configs ``LMHeadBlocks`` / ``LogitsBlocks`` / ``FusedLogitsBlocks``.
``_compat.py`` is the jax 0.10.2 / 0.11.2 shim.

Here: the constants (shared memory, base-2 units, the 64-row warpgroup block), the shared-memory
transforms, ``cdiv`` and int32 index helpers (the kernels trace with ``jax_enable_x64`` on), the two
vocabulary-split heuristics, broadcasts and per-row vector loads in the WGMMA layout, the one merge of
per-split log-sum-exp statistics, the backward's snap tolerance, the logits kernels' block config and
block placement, and the LM-head kernels' block config and warp-specialised logits-tile pipeline:

Both LM-head kernels (log-prob forward, gradient of the logits) run the same loop: a CTA owns
``2 * block_m`` rows (one warpgroup per ``block_m`` rows) and a contiguous range of vocabulary
tiles; for every vocabulary tile it computes the ``[block_m, block_n]`` logits tile with wgmma,
streaming ``[2 * block_m, block_k]`` hidden tiles and ``[block_k, block_n]`` weight tiles through
a ``num_stages``-deep ring of shared-memory slots filled by a third (memory) warpgroup with bulk
tensor copies. What happens to the finished f32 tile (online log-sum-exp, or the gradient of
the logits) is the kernel's epilogue.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmpo_jax import _lse
from gmpo_jax.kernels._compat import load_vector, needs_value_matmul, plgpu, value_matmul, wgmma

# Hopper: 227 KiB of shared memory per block (232448 bytes).
SMEM_BYTES = 232448
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # of the LM-head kernels
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
BLOCK_ROWS = 64  # rows of one warpgroup's WGMMA register tile (m = 64): the logits kernels' row block
ROW = plgpu.Layout.WGMMA.reduce(1)  # a per-row vector of a WGMMA tile (a row lives in one quad of threads)
# float32 constants for a select between two constants: ``jnp.where(c, 1.0, 0.0)`` of Python floats is a
# float64 array under jax_enable_x64 (issue 31: no float64 work on the GPU path)
ONE, ZERO = np.float32(1.0), np.float32(0.0)


# ------------------------------------------------------------------------------------------------
# Index arithmetic (int32 with or without jax_enable_x64)
# ------------------------------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of Python ints (or int32 scalars)."""
    return -(-a // b)


def i32(x):
    """``x`` as an int32 scalar. Loop bounds and ``lax`` operands in the kernels go through it: with
    ``jax_enable_x64`` a Python int becomes int64 there (``lax.rem(int32, 3)`` fails to trace, a
    ``fori_loop(0, 3)`` index is int64); without x64 this is what they were anyway."""
    return jnp.asarray(x, jnp.int32)


def rem(a, b):
    """``lax.rem`` of int32 indices (either may be a Python int)."""
    return lax.rem(i32(a), i32(b))


def div(a, b):
    """``lax.div`` of int32 indices (either may be a Python int)."""
    return lax.div(i32(a), i32(b))


# ------------------------------------------------------------------------------------------------
# Shared memory, splits, broadcasts, per-row vectors
# ------------------------------------------------------------------------------------------------
def smem_transforms(itemsize: int, row_bytes: int = 128):
    """Transforms of a tile staged in shared memory by bulk tensor copies: 8-row x ``row_bytes`` tiles,
    swizzled over ``row_bytes`` (32, 64 or 128; wgmma operands and the logits kernels' tiles use 128)."""
    return (plgpu.TilingTransform((8, row_bytes // itemsize)), plgpu.SwizzleTransform(row_bytes))


def _even_splits(num_tiles: int, splits: int) -> int:
    """The splits left when ``num_tiles`` are dealt ``ceil(num_tiles / splits)`` per split (none empty)."""
    return cdiv(num_tiles, cdiv(num_tiles, splits))


def lm_head_num_splits(num_row_ctas: int, num_vocab_tiles: int, num_sms: int, min_tiles: int = 4) -> int:
    """Vocabulary splits per row block of the LM-head kernels so that the grid fills the GPU in whole waves.

    Deterministic and cheap: the fewest splits (at most 32) whose CTA count wastes the least of
    the last wave, counting only splits that leave at least ``min_tiles`` vocabulary tiles per split (the
    gradient kernel's windows pass 1: on few rows, the gradient filter's or a small batch's, the grid is what
    limits it; on many rows one split already fills the GPU).
    """
    best, best_eff = 1, 0.0
    for s in range(1, 33):
        if s > 1 and num_vocab_tiles / s < min_tiles:
            break
        ctas = num_row_ctas * s
        eff = ctas / (cdiv(ctas, num_sms) * num_sms)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
        if eff > 0.95:
            break
    return _even_splits(num_vocab_tiles, best)


def logits_num_splits(num_row_blocks: int, num_tiles: int, num_sms: int = 132, ctas_per_sm: int = 2) -> int:
    """Vocabulary splits of the logits log-sum-exp kernel: enough CTAs for ~4 waves, at least 8 tiles per
    split."""
    want = max(1, cdiv(4 * num_sms * ctas_per_sm, num_row_blocks))
    return _even_splits(num_tiles, max(1, min(want, num_tiles // 8)))


def bcast_rows(v, shape):
    """A per-row vector ``[m]`` broadcast along the columns of a ``shape = (m, n)`` tile."""
    return lax.broadcast_in_dim(v, shape, [0])


def bcast_cols(v, shape):
    """A per-column vector ``[n]`` broadcast along the rows of a ``shape = (m, n)`` tile."""
    return lax.broadcast_in_dim(v, shape, [1])


def row_vector(ref, start, size, interpret):
    """Loads ``ref[start:start+size]`` (GMEM) as a per-row vector of the WGMMA layout."""
    return load_vector(ref.at[pl.ds(start, size)], ROW, interpret)


def col_vector(ref, start, size, interpret):
    """Loads ``ref[start:start+size]`` (GMEM) as a per-column vector of the WGMMA layout."""
    return load_vector(ref.at[pl.ds(start, size)], plgpu.Layout.WGMMA.reduce(0), interpret)


def load_row_vectors(pairs, row0, barrier, interpret):
    """Per-row vectors ``ref[row0:row0 + 64]`` in the WGMMA row layout, staged through SMEM by TMA.

    ``pairs``: ``(gmem_ref [R], smem_ref [64])``; ``barrier``: one barrier expecting ``len(pairs)`` copies.
    """
    for gmem, smem in pairs:
        plgpu.copy_gmem_to_smem(gmem.at[pl.ds(row0, BLOCK_ROWS)], smem, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    return tuple(load_vector(smem, ROW, interpret) for _, smem in pairs)


# ------------------------------------------------------------------------------------------------
# Log-sum-exp statistics (base 2): the merge of the splits, the backward's snap
# ------------------------------------------------------------------------------------------------
class MergedSplits(NamedTuple):
    """Per-split log-sum-exp statistics merged along axis 0 (float32, each ``[R]`` unless noted)."""

    m_all: jax.Array  # the maximum of ``z2`` over every split (``-inf``: no finite logit)
    m_ref: jax.Array  # ``m_all``, 0 where it is ``-inf`` (the reference the sums are re-based to)
    alpha: jax.Array  # ``[S, R]`` ``exp2(m2 - m_ref)``: each split's rescale factor
    l_all: jax.Array  # ``sum exp2(z2 - m_ref) - 1`` over every split (one instance of the max excluded)
    log2_l: jax.Array  # ``log2(1 + l_all)``, from ``log1p`` (``-inf`` for an empty row)
    lse2: jax.Array  # ``m_all + log2_l``: the base-2 log-sum-exp (``-inf`` for an empty row)


def merge_splits(m2, l) -> MergedSplits:
    """Merges per-split online log-sum-exp statistics ``m2`` (running max of ``z2``) and ``l`` (sum of
    ``exp2(z2 - m2)`` excluding one instance of the max: ``gmpo_jax._lse``), both ``[S, R]`` float32, into
    the row's base-2 log-sum-exp; a split (or a row) with no finite logit (``m2 = -inf``, ``l = -1``) adds
    nothing (no NaN from ``-inf - -inf``). Used by both ops' log-sum-exp kernels (``lm_head_merge_splits``,
    ``logits_merge_splits``)."""
    m_all, l_all, alpha = _lse.merge(m2, l, axis=0, exp=jnp.exp2)
    m_ref = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    log2_l = jnp.log1p(l_all) * LOG2E
    return MergedSplits(m_all, m_ref, alpha, l_all, log2_l, m_all + log2_l)


def log2_1p(x):
    """``log2(1 + x)`` for ``x >= -1`` inside a kernel (Mosaic GPU lowers no ``log1p``): for ``|x| < 1/2``
    ``2 atanh(s) log2(e)``, ``s = x / (2 + x)``, by its odd series to ``s**11`` (``|s| <= 1/3``: truncation
    below ``3e-7`` of it at ``s = 1/3``, below ``1e-9`` at ``x <= 1/2``, ``s <= 1/5``), else ``log2(1 + x)``
    (there ``1 + x`` carries ``x``'s digits); ``-inf`` at ``x = -1`` (an empty row)."""
    s = x / (2.0 + x)
    s2 = s * s
    series = s * (2.0 * LOG2E) * (1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9 + s2 / 11)))))
    return jnp.where(jnp.abs(x) < 0.5, series, jnp.log2(1.0 + x))


def tile_tail(p, tie, exact_one: bool = True):
    """``(tail, ties)`` ``[m]`` of a ``[m, n]`` tile's exponentials ``p`` relative to the running maximum and
    ``tie`` (``[m, n]`` bool) where the logit equals it: the sum of ``p`` off the ties, and their count (an
    exact integer). ``exact_one``: ``p`` is exactly ``exp2(0) = 1`` at every tie (the exponent was formed
    as ``z - m``), so the count is ``round(sum p - tail)`` (one select per logit more than ``sum p``; the
    rounding is exact for ``sum p < 2**21``); otherwise it is counted (a second select)."""
    tail = jnp.where(tie, 0.0, p).sum(axis=1)
    if exact_one:
        return tail, jnp.round(p.sum(axis=1) - tail)
    return tail, jnp.where(tie, ONE, ZERO).sum(axis=1)


def online_merge(m_old, l_old, m_new, rescale, tail, ties):
    """The running state ``(m, l)`` (``l``: the sum excluding one instance of the maximum, ``gmpo_jax._lse``)
    after a tile: ``l_new`` for the old state ``(m_old, l_old)`` rescaled to ``m_new`` by ``rescale =
    exp2(m_old - m_new)`` (0 when ``m_old = -inf``) plus the tile's :func:`tile_tail` ``(tail, ties)``
    relative to ``m_new``. O(1) per row; the maximum's own ``1`` never enters a sum with the tail."""
    same = m_old == m_new
    return jnp.where(same, l_old + (tail + ties), l_old * rescale + (rescale + (tail + (ties - 1.0))))


# |d| <= 3 * 2**-23 |lse2| is 3 to 6 float32 ulps of the log-sum-exp: what its roundings can move it
# by (about 2.5 ulps: the forward's fused multiply-add residual, the trip through natural-log units, the
# backward's residual).
SNAP_RELATIVE = 3 * 2.0**-23


def softcap_tanh(x, cap: float):
    """``tanh(y)``, ``y = x / cap``, to float32 relative accuracy: for ``|y| < 1/4`` its odd Taylor series to
    ``y**9`` (truncation below ``3e-9`` relative), else ``1 - 2 / (2**(2 log2(e) y) + 1)`` from one ``exp2``
    (Mosaic GPU's exponential; exact limits ``+-1``; there ``|tanh| > 0.24``, so the form's absolute error of
    an ulp of 1 is a few ulps of the result). The exponential form alone lost ``cap * 1e-7`` absolutely:
    0.1 nats on a logit of 16 under a cap of 1e6. Gemma's final-logit soft cap is ``cap * softcap_tanh(z,
    cap)``, its derivative ``1 - t**2``."""
    y = x * (1.0 / cap)
    y2 = y * y
    series = y * (1.0 + y2 * (-1.0 / 3 + y2 * (2.0 / 15 + y2 * (-17.0 / 315 + y2 * (62.0 / 2835)))))
    ex = 1.0 - 2.0 / (jnp.exp2(y * (2.0 * LOG2E)) + 1.0)
    return jnp.where(jnp.abs(y) < 0.25, series, ex)


def soft_cap(z, cap: float):
    """``(cap * tanh(z / cap), tanh(z / cap))`` of a logits tile (:func:`softcap_tanh`); a ``-inf`` logit (a
    masked vocabulary column's bias) stays ``-inf``, not ``-cap``."""
    t = softcap_tanh(z, cap)
    return jnp.where(z == -jnp.inf, -jnp.inf, cap * t), t


def snap_tolerance(lse2):
    """Per-row tolerance under which a backward kernel treats ``z2 - lse2`` as exactly 0 (``p = 1``).

    The gradient kernels recompute ``z2 = z * scale`` and subtract a log-sum-exp that reached them
    through other roundings (natural-log units in between, a fused multiply-add of ``z * scale - lse2``
    that skips the rounding of ``z * scale``): up to about 2.5 ulps of ``lse2``. At ordinary temperatures
    that is a relative error of ~1e-7 in one probability; at tiny temperatures (``|z| / T ~ 1e7``) an
    ulp of ``lse2`` is ~1, so the argmax of a one-hot softmax got ``p = 2**(+-0.5)`` and a gradient of
    ``~0.4 / T`` instead of 0 (seen on an H200 at ``T = 1e-6``). Snapping
    ``|z2 - lse2| <= SNAP_RELATIVE |lse2| = 3 * 2**-23 |lse2|`` to 0 restores ``p = 1`` there; the XLA paths get the same by
    setting ``z - ref`` to exactly 0 where ``z == ref`` (``gmpo_jax.lm_head.xla_chunked.shifted``).

    Limit: a logit whose probability differs from 1 by less than the snap (``|log2 p| <= 3 * 2**-23
    |lse2|``) counts as the maximum. That is below float32's resolution unless ``|lse2| >= 2**23 / 3``
    (``|z| / T`` above ~1.9e6 nats), where it also covers exact ties (``p = 1/2``, ``log2 p = -1``): there two tied
    maxima both get ``p = 1``. At such temperatures float32 cannot resolve those probabilities anyway (the
    XLA path's are off by ~50 %); a tie at ``|z| / T = 8e4`` is exact (tests).
    """
    return jnp.abs(lse2) * SNAP_RELATIVE


# ------------------------------------------------------------------------------------------------
# The logits kernels (logits_lse, logits_dlogits): block config and block placement
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LogitsBlocks:
    """Block sizes of the logits kernels ``logits_lse`` and ``logits_dlogits`` (hashable; a static argument).

    block_v: vocabulary columns per tile; a multiple of 128 bytes of the dtype (64 for 16-bit, 32 for
      float32) and at most 256 (one TMA box).
    stages: depth of the shared-memory ring (bytes in flight per CTA: stages * 64 * block_v * itemsize,
      doubled in the backward for the output tiles).
    tiles_per_cta: backward only: vocabulary tiles each CTA walks (the grid is split over the
      vocabulary so that many CTAs are in flight; the forward picks its own split, see logits_num_splits).
    pick_target: forward only: pick the target logit in the kernel (a compare, select and add per
      element); False leaves it to a ``[B, T]`` gather outside and keeps the running max in raw logit
      units so that the exponent is one fused multiply-add per element.
    """

    block_v: int = 128
    stages: int = 4
    tiles_per_cta: int = 32
    pick_target: bool = True

    def __post_init__(self):
        if self.block_v % 32 or not 32 <= self.block_v <= 256:
            raise ValueError(f"{self.block_v=} must be a multiple of 32 in [32, 256]")
        if self.stages < 1:
            raise ValueError(f"{self.stages=} must be >= 1")
        if self.tiles_per_cta < 1:
            raise ValueError(f"{self.tiles_per_cta=} must be >= 1")

    def check_dtype(self, dtype) -> None:
        """Raises ``ValueError`` unless ``block_v`` is a multiple of 128 bytes of ``dtype``."""
        if self.block_v % (128 // jnp.dtype(dtype).itemsize):
            raise ValueError(f"block_v={self.block_v} must be a multiple of 128 bytes of {jnp.dtype(dtype)}")


def row_block_start(rows: int):
    """First row of this CTA's 64-row block (grid axis ``"rows"``), the last block slid back to end at
    ``rows``."""
    return jnp.minimum(lax.axis_index("rows") * BLOCK_ROWS, rows - BLOCK_ROWS)


def row_block_flags(live):
    """``[R]`` float32 with, at the first row of each CTA's 64-row block (:func:`row_block_start`: the last
    block slid back to end at ``R``), 1.0 if any of the block's rows is ``live`` (``[R]`` bool) and 0.0 if
    none is; 0.0 at every other row. A kernel that stages it with its per-row vectors reads entry 0 of its
    block's copy: whether the block has any work (the three-pass logits kernels skip the blocks without).
    Block starts are distinct (the slid-back start ``R - 64`` is a multiple of 64 only when it is not slid)."""
    R = live.shape[0]
    starts = jnp.minimum(jnp.arange(cdiv(R, BLOCK_ROWS), dtype=jnp.int32) * BLOCK_ROWS, R - BLOCK_ROWS)
    rows = starts[:, None] + jnp.arange(BLOCK_ROWS, dtype=jnp.int32)[None, :]
    any_live = jnp.any(live[rows], axis=1)
    return jnp.zeros((R,), jnp.float32).at[starts].set(any_live.astype(jnp.float32), unique_indices=True)


def by_block_flag(flag_smem, live_pass, dead_pass) -> None:
    """In a kernel: ``live_pass()`` when this CTA's row block has work (entry 0 of its shared-memory copy of
    :func:`row_block_flags`), else ``dead_pass()``; ``live_pass()`` alone when ``flag_smem`` is None."""
    if flag_smem is None:
        live_pass()
        return
    live = flag_smem[0] != 0.0
    pl.when(live)(live_pass)
    pl.when(~live)(dead_pass)


def tile_start(j, block_v: int, vocab: int):
    """Column of vocabulary tile ``j``: nominally ``j * block_v``, slid back to end at ``vocab``."""
    return jnp.minimum(j * block_v, vocab - block_v)


# ------------------------------------------------------------------------------------------------
# The LM-head kernels (lm_head_lse, lm_head_dlogits): block config and the logits-tile pipeline
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LMHeadBlocks:
    """Block sizes of the LM-head kernels (``lm_head_lse``, ``lm_head_dlogits``; hashable, static).

    block_m: rows per compute warpgroup (the CTA owns ``2 * block_m`` rows); 64 or 128.
    block_n: vocabulary columns per logits tile; multiple of 64, at most 256.
    block_k: hidden columns per pipeline step; 64 (128-byte swizzle of 16-bit operands).
    num_stages: depth of the shared-memory ring.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"{self.block_m=} must be 64 or 128")
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"{self.block_n=} must be a multiple of 64 in [64, 256]")
        if self.block_k != 64:
            raise ValueError(f"{self.block_k=} must be 64")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be at least 2")

    @property
    def rows_per_cta(self) -> int:
        """Rows of one CTA: two compute warpgroups of ``block_m`` rows."""
        return 2 * self.block_m

    def smem_bytes(self, itemsize: int, extra: int = 0) -> int:
        """Shared memory of a CTA: the operand ring of ``itemsize``-byte operands plus ``extra`` bytes."""
        ring = self.num_stages * (self.rows_per_cta + self.block_n) * self.block_k * itemsize
        return ring + extra + 1024  # barriers, alignment


def logits_tile_loop(
    *,
    hidden_ref,  # GMEM [Rp, H]
    weight_ref,  # GMEM [H, V] ("hv") or [V, H] ("vh")
    weight_layout: str,
    a_smem,  # SMEM [stages, 2*bm, bk]
    b_smem,  # SMEM [stages, bk, bn] or [stages, bn, bk]
    loaded,  # Barrier(num_arrivals=2, num_barriers=stages)
    consumed,  # Barrier(num_arrivals=2, num_barriers=stages)
    row0,  # first row of this CTA
    tile0,  # first vocabulary tile of this CTA
    num_tiles,  # vocabulary tiles of this CTA (traced int32)
    k_iters: int,
    cfg: LMHeadBlocks,
    init_carry,  # () -> carry (compute warpgroups)
    epilogue,  # (tile_index, z f32[bm, bn] WGMMA layout, carry) -> carry
    finish,  # (carry) -> None
    interpret=None,
    terms: tuple[tuple[int, int], ...] = ((0, 0),),
):
    """Runs the warp-specialised logits-tile pipeline inside a 3-warpgroup kernel.

    ``terms``: the products summed into each logits tile, ``(i, j)`` = hidden part ``i`` times weight part
    ``j``, each part ``k_iters * block_k`` wide along the contraction, side by side in ``hidden_ref`` and
    ``weight_ref`` (split-bfloat16 operands, :func:`split_terms`); ``((0, 0),)``: the plain product."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
    wg = lax.axis_index("wg")
    steps = len(terms) * k_iters  # pipeline steps per vocabulary tile

    @pl.when(wg == 2)
    def _memory_warpgroup():
        plgpu.set_max_registers(40, action="decrease")
        total = num_tiles * steps

        @pl.loop(0, total)
        def _step(step):
            slot = rem(step, stages)
            n = tile0 + div(step, steps)
            k = rem(step, steps)
            hk = wk = k
            if len(terms) > 1:  # which parts this step multiplies, and where along their contraction
                term, k_in = div(k, k_iters), rem(k, k_iters)
                hk = _static_lookup([i for i, _ in terms], term) * k_iters + k_in
                wk = _static_lookup([j for _, j in terms], term) * k_iters + k_in

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            plgpu.copy_gmem_to_smem(
                hidden_ref.at[pl.ds(row0, 2 * bm), pl.ds(hk * bk, bk)], a_smem.at[slot], loaded.at[slot]
            )
            if weight_layout == "hv":
                w_src = weight_ref.at[pl.ds(wk * bk, bk), pl.ds(n * bn, bn)]
            else:
                w_src = weight_ref.at[pl.ds(n * bn, bn), pl.ds(wk * bk, bk)]
            plgpu.copy_gmem_to_smem(w_src, b_smem.at[slot], loaded.at[slot])

        # Observe the last phases of the `consumed` barriers too (every phase of a barrier is
        # waited on by every thread that waits on it: the interpreter checks this; on the device
        # it is a no-op that keeps the memory warpgroup alive until the slots are released).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(step):
            plgpu.barrier_wait(consumed.at[rem(step, stages)])

    @pl.when(wg < 2)
    def _compute_warpgroup():
        plgpu.set_max_registers(232, action="increase")
        a_rows = pl.ds(wg * bm, bm)

        def tile_body(t, carry):
            transpose_b = weight_layout == "vh"

            def matmul(acc_ref):
                def k_body(k, _):
                    slot = rem(t * steps + k, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    wgmma(
                        acc_ref,
                        a_smem.at[slot].at[a_rows],
                        b_smem.at[slot],
                        transpose_b=transpose_b,
                        interpret=interpret,
                    )
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return ()

                lax.fori_loop(0, i32(steps), k_body, ())
                return acc_ref[...]

            def value_mm():
                def k_body(k, acc):
                    slot = rem(t * steps + k, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    acc = acc + value_matmul(a_smem.at[slot].at[a_rows], b_smem.at[slot], transpose_b=transpose_b)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return acc

                return lax.fori_loop(0, i32(steps), k_body, jnp.zeros((bm, bn), jnp.float32))

            if needs_value_matmul(transpose_b, interpret):
                z = value_mm()
            else:
                z = pl.run_scoped(matmul, plgpu.ACC((bm, bn), jnp.float32))
            return epilogue(tile0 + t, z, carry)

        carry = lax.fori_loop(0, num_tiles, tile_body, init_carry())
        finish(carry)


def _static_lookup(values, index):
    """``values[index]`` of a static list of ints at a traced int32 ``index`` (a chain of selects)."""
    out = i32(values[0])
    for i, v in enumerate(values[1:], 1):
        out = jnp.where(index == i, i32(v), out)
    return out


def split_terms(parts_a: int, parts_b: int, order: int) -> tuple[tuple[int, int], ...]:
    """The products ``(i, j)`` of a split-bfloat16 product ``a b = sum_ij a_i b_j`` that are kept: ``i + j
    <= order`` (part ``i`` of an operand is about ``2**(-8 i)`` of it, so a dropped product is at most about
    ``2**(-8 (order + 1))`` of ``|a| |b|``), the largest first. ``parts_*``: the operands' part counts (1 for a
    bfloat16 operand: it is its own single part). ``order`` 2 with three parts each is XLA's
    ``BF16_BF16_F32_X6`` (float32-accurate), 1 with two parts its ``BF16_BF16_F32_X3``."""
    return tuple((i, s - i) for s in range(order + 1) for i in range(parts_a) if 0 <= s - i < parts_b)


def part_k_iters(hidden, weight, weight_layout: str, terms, block_k: int) -> int:
    """Pipeline steps along one operand part's contraction (``H / block_k``), checking that ``hidden``
    (``[Rp, P H]``) and ``weight`` (``[Q H, V]`` / ``[V, Q H]``) hold the parts ``terms`` names."""
    n_h, n_w = 1 + max(i for i, _ in terms), 1 + max(j for _, j in terms)
    hdim = hidden.shape[1] // n_h
    w_k = weight.shape[0] if weight_layout == "hv" else weight.shape[1]
    assert hidden.shape[1] == n_h * hdim and w_k == n_w * hdim and hdim % block_k == 0, (hidden.shape, weight.shape)
    return hdim // block_k


class CtaBlock(NamedTuple):
    """Where this CTA and warpgroup of an LM-head kernel work (traced int32 scalars)."""

    split: jax.Array  # the vocabulary split (grid axis ``"split"``)
    row0: jax.Array  # the CTA's first row (it owns ``2 * block_m``)
    my_rows: jax.Array  # this consumer warpgroup's first row
    tile0: jax.Array  # the split's first vocabulary tile (of ``num_tiles``)
    n_tiles: jax.Array  # the split's vocabulary tiles (the last split may have fewer)
    wg: jax.Array  # this warpgroup (grid axis ``"wg"``)


def cta_block(block_m: int, tiles_per_split: int, num_tiles: int) -> CtaBlock:
    """This CTA's rows and vocabulary tiles: split ``s`` walks tiles ``[s * tiles_per_split, ...)`` of
    ``num_tiles``."""
    row0 = lax.axis_index("rows") * (2 * block_m)
    split, my_rows = lax.axis_index("split"), row0 + lax.axis_index("wg") * block_m
    tile0 = split * tiles_per_split
    return CtaBlock(split, row0, my_rows, tile0, jnp.minimum(tiles_per_split, num_tiles - tile0), lax.axis_index("wg"))


# A bulk copy moves a multiple of a warpgroup's 128 threads' bytes: the row-prefix info is 32 int32 (3 used).
INFO_WORDS = 32


@dataclasses.dataclass(frozen=True)
class RowPrefixGrid:
    """The grid of an LM-head kernel whose live rows are a prefix of a runtime length (exact row skipping).

    The kernel is compiled once for ``num_row_ctas`` row blocks of ``rows_per_cta`` rows; at run time only the
    first ``nb = cdiv(n_rows, rows_per_cta)`` blocks have work, and each is dealt ``splits[nb]`` vocabulary
    splits of ``tiles[nb]`` tiles (the last split may have fewer or none), so that a short prefix still fills
    the GPU (``lm_head_num_splits`` per prefix length). The grid is ``(1, num_ctas)``: CTA ``i`` takes row block
    ``i // s`` and split ``i % s`` and returns at once when its row block is past ``nb``. The kernel reads
    ``(nb, s, tiles)`` from a small int32 vector (:meth:`info`) staged through shared memory, so one compiled
    kernel serves every prefix length (one ``lax.switch`` branch per length would compile one kernel each).

    Outputs of the blocks past ``nb`` and of splits ``>= s`` are not written: :meth:`live_splits` says which
    split rows hold statistics; callers read only the first ``nb * rows_per_cta`` rows.
    """

    rows_per_cta: int
    num_row_ctas: int
    splits: tuple[int, ...]  # per number of live row blocks nb in [0, num_row_ctas]
    tiles: tuple[int, ...]  # vocabulary tiles per split, per nb

    @classmethod
    def balanced(cls, rows_per_cta: int, num_row_ctas: int, num_tiles: int, num_sms: int, min_tiles: int = 4):
        """Splits per prefix length from :func:`lm_head_num_splits` (as a kernel compiled for that length)."""
        splits = tuple(lm_head_num_splits(max(nb, 1), num_tiles, num_sms, min_tiles) for nb in range(num_row_ctas + 1))
        return cls(rows_per_cta, num_row_ctas, splits, tuple(cdiv(num_tiles, s) for s in splits))

    @classmethod
    def fixed(cls, rows_per_cta: int, num_row_ctas: int, num_tiles: int, tiles_per_split: int):
        """The same splits of ``tiles_per_split`` tiles for every prefix length (the gradient filter's windows)."""
        s = cdiv(num_tiles, tiles_per_split)
        return cls(rows_per_cta, num_row_ctas, (s,) * (num_row_ctas + 1), (tiles_per_split,) * (num_row_ctas + 1))

    @property
    def max_splits(self) -> int:
        """Rows of the per-split outputs."""
        return max(self.splits)

    @property
    def num_ctas(self) -> int:
        """The grid's CTAs: the most any prefix length has work for."""
        return max(1, max(nb * s for nb, s in enumerate(self.splits)))

    def info(self, n_rows) -> jax.Array:
        """``[nb, s, tiles per split, 0, ...]``: ``INFO_WORDS`` int32 for ``n_rows`` live rows (traced or not)."""
        nb = jnp.clip(cdiv(jnp.asarray(n_rows, jnp.int32), self.rows_per_cta), 0, self.num_row_ctas)
        s = jnp.asarray(self.splits, jnp.int32)[nb]
        t = jnp.asarray(self.tiles, jnp.int32)[nb]
        return jnp.zeros((INFO_WORDS,), jnp.int32).at[:3].set(jnp.stack([nb, s, t]).astype(jnp.int32))

    def live_splits(self, info) -> jax.Array:
        """``[max_splits]`` bool: which rows of a per-split output were written."""
        return jnp.arange(self.max_splits, dtype=jnp.int32) < info[1]


def _dynamic_cta_block(block_m: int, num_tiles: int, info_smem) -> tuple[CtaBlock, jax.Array]:
    """This CTA's block under a :class:`RowPrefixGrid` (its ``info`` in this warpgroup's shared memory), and
    whether it has work."""
    wg = lax.axis_index("wg")
    nb, s, tps = info_smem[wg, 0], info_smem[wg, 1], info_smem[wg, 2]
    i = i32(lax.axis_index("rows"))
    block, split = div(i, s), rem(i, s)
    row0 = block * (2 * block_m)
    tile0 = split * tps
    n_tiles = jnp.clip(num_tiles - tile0, 0, tps)
    return CtaBlock(split, row0, row0 + wg * block_m, tile0, n_tiles, wg), block < nb


def launch(
    body,
    *,
    hidden,
    weight,
    bias,
    row_inputs,
    out_type,
    epilogue_smem,
    weight_layout: str,
    cfg: LMHeadBlocks,
    num_splits: int,
    tiles_per_split: int,
    num_tiles: int,
    row_grid: RowPrefixGrid | None = None,
    info=None,
    interpret=None,
):
    """Runs an LM-head kernel with three warpgroups (two consumers, one memory warpgroup:
    ``logits_tile_loop``) on the grid ``(num_splits, rows / (2 block_m))`` (split ``s`` walks tiles
    ``[s * tiles_per_split, ...)`` of ``num_tiles``), or, with ``row_grid`` and its ``info`` (:class:`RowPrefixGrid`),
    on the grid that serves a runtime row prefix (``num_splits`` then ``row_grid.max_splits``).

    ``body(h_ref, w_ref, b_ref, row_refs, out_refs, smem, cta)`` gets the references of ``hidden``, ``weight``,
    ``bias`` (None without one), the per-row inputs ``row_inputs`` and the outputs ``out_type`` (a tuple,
    or one ``ShapeDtypeStruct``), ``smem = (a_smem, b_smem, epilogue, loaded, consumed)``: the
    operand rings of ``logits_tile_loop``, the scratch ``epilogue_smem`` (a ``plgpu.SMEM``) of the
    kernel's own epilogue, and the ring's two barriers; and its :class:`CtaBlock`. Under ``row_grid`` a CTA
    without work does not run ``body``.
    """
    dtype = hidden.dtype
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
    transforms = smem_transforms(jnp.dtype(dtype).itemsize)
    b_shape = (stages, bk, bn) if weight_layout == "hv" else (stages, bn, bk)
    has_bias = bias is not None
    n_rows = len(row_inputs)
    dynamic = row_grid is not None

    def kernel(h_ref, w_ref, *refs):
        b_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
        row_refs, refs = refs[:n_rows], refs[n_rows:]
        info_ref, refs = (refs[0], refs[1:]) if dynamic else (None, refs)
        outs, smem = refs[:-1], refs[-1]
        if not dynamic:
            body(h_ref, w_ref, b_ref, row_refs, outs, smem, cta_block(bm, tiles_per_split, num_tiles))
            return
        *smem, info_smem, info_bar = smem
        wg = lax.axis_index("wg")  # each warpgroup stages its own copy of the info
        plgpu.copy_gmem_to_smem(info_ref, info_smem.at[wg], info_bar.at[wg])
        plgpu.barrier_wait(info_bar.at[wg])
        cta, live = _dynamic_cta_block(bm, num_tiles, info_smem)
        pl.when(live)(lambda: body(h_ref, w_ref, b_ref, row_refs, outs, tuple(smem), cta))

    scratch = [
        plgpu.SMEM((stages, 2 * bm, bk), dtype, transforms=transforms),
        plgpu.SMEM(b_shape, dtype, transforms=transforms),
        epilogue_smem,
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    if dynamic:
        assert row_grid.rows_per_cta == 2 * bm and row_grid.num_row_ctas * 2 * bm == hidden.shape[0]
        scratch += [plgpu.SMEM((3, INFO_WORDS), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=3)]
        grid = (1, row_grid.num_ctas)
    else:
        grid = (num_splits, hidden.shape[0] // (2 * bm))
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[scratch],
        grid=grid,
        grid_names=("split", "rows"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return call(hidden, weight, *((bias,) if has_bias else ()), *row_inputs, *((info,) if dynamic else ()))
