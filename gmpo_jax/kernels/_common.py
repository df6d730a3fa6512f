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
transforms, ``cdiv`` and int32 index helpers (the kernels trace with ``jax_enable_x64`` on), the logits
kernels' vocabulary-split heuristic, broadcasts and per-row vector loads in the WGMMA layout, the one merge of
per-split log-sum-exp statistics, the backward's snap tolerance, the logits kernels' block config and
block placement. The LM-head kernels' block config, warp-specialised logits-tile pipeline, grids and launch are
in ``_lm_head_pipeline.py``.

"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmpo_jax import _lse
from gmpo_jax.kernels._compat import load_vector, plgpu

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


def call_in_place(kernel, scratch, mesh_kwargs: dict, interpret, x, *inputs):
    """Runs ``kernel(*input_refs, x_ref, *scratch_refs)`` on the mesh ``plgpu.Mesh(**mesh_kwargs)`` with ``x`` passed
    as a ``jax.Ref`` (aliased in and out: the kernel reads and writes ``x``'s buffer, and XLA reuses it when ``x``
    is dead afterwards); returns the updated ``x``. ``scratch``: the scratch types, one positional argument each
    (shared by the mesh's warpgroups when it has several)."""
    # plgpu.kernel wraps its call in a custom_vmap, which rejects Ref effects (jax 0.10.2), so the mesh
    # kernel is built directly, as plgpu.kernel does.
    mesh = plgpu.Mesh(**mesh_kwargs)
    threads = {} if mesh.thread_name is None else {"collective_axes": mesh.thread_name}

    def body(*refs):
        pl.run_scoped(functools.partial(kernel, *refs), *scratch, **threads)

    body.__name__ = kernel.__name__  # the kernel's name in profiles
    call = pl.kernel(
        body,
        out_type=(),
        mesh=mesh,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )

    def run(x, *inputs):
        x_ref = jax.new_ref(x, memory_space=plgpu.GMEM if interpret else None)
        call(*inputs, x_ref)
        return jax.freeze(x_ref)

    # The interpreter needs the Ref in GMEM, and a Ref with a memory space exists only under jit (inlined
    # into an enclosing one); the device path is the plain Ref, measured that way.
    return (jax.jit(run) if interpret else run)(x, *inputs)
