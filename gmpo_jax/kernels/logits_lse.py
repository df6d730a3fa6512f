"""The logits log-sum-exp kernel (Pallas Mosaic GPU): per-split online statistics of existing logits.

Kernel file ``logits_lse.py`` (``<input>_<stage>``, see ``_common``): reads logits ``[R, V]`` that already
exist in device memory (the view of ``gmpo_jax.logits.mosaic_gpu``) and computes, per row and
per vocabulary *split*, the running maximum ``m`` of ``z2 = z * log2(e) / T``, the sum ``l`` of
``exp2(z2 - m)`` and (``pick_target``) the target's ``z2``; entry point :func:`logits_lse_partials`,
merged by :func:`logits_merge_splits` (``splits * R`` floats, negligible). The forward of the logits
backend's three-pass path.

Memory-bound by design: the kernel streams ``[64, block_v]`` tiles of the logits from device memory into
shared memory with bulk tensor copies (TMA, 128-byte swizzled tiles) through a ``stages``-deep ring
(``plgpu.emit_pipeline``), does float32 math in registers (WGMMA register layout: a row lives in one
quad of threads, so row reductions are two shuffles) and reads the logits once. Per-row vectors (ids,
scales) are staged through shared memory by TMA as in JAX's attention kernels. The grid is ``(splits,
row blocks)`` so that a small batch still fills the GPU. Without ``pick_target`` the running max is kept
in raw logit units, so the exponent is one fused multiply-add per element (measured faster on an H200;
docs/performance.md).

No padding, no copies: a row range or vocabulary range that does not fill the last block is handled by
sliding that block back to end at ``R`` (resp. ``V``); the columns a slid-back tile has already seen are
masked (``-inf``: nothing added to the sum, never picked as the target). Every copy is in bounds, and
the result does not depend on the grid. Constraints (checked by the backend): ``R >= 64`` and ``R % 8 ==
0``, ``V >= block_v`` and ``V`` a multiple of 128 bytes (the tiled copies' rule).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels._compat import iota, layout_cast, plgpu

__all__ = ["logits_lse_partials", "logits_merge_splits"]


def logits_lse_partials(x, ids, k_rows, *, cfg: C.LogitsBlocks, num_splits: int, block_live=None, interpret=None):
    """Per-split online log-sum-exp statistics (base 2) of the rows of ``x``.

    Args:
      x: ``[R, V]`` bf16 / f16 / f32 logits.
      ids: ``[R]`` int32 target ids (a value outside ``[0, V)`` picks nothing).
      k_rows: ``[R]`` float32, ``log2(e) / temperature`` per row.
      cfg: block sizes (``block_v``, ``stages``, ``pick_target``).
      num_splits: vocabulary splits (every split non-empty, see ``_common.logits_num_splits``).
      block_live: None, or ``[R]`` float32 ``_common.row_block_flags(live)``: a 64-row block without a live
        row reads nothing and reports ``m2 = l = t2 = 0`` for its rows (the caller defines what they mean).

    Returns:
      ``(m2, l, t2)``, each ``[num_splits, R]`` float32: running max of ``z2 = x * k``, sum of
      ``exp2(z2 - m2)`` less one (one instance of the maximum excluded, ``gmpo_jax._lse``; -1 for a split
      without a finite logit) and the target's ``z2`` (0 where the split does not hold it; 0 everywhere without
      ``cfg.pick_target``).
    """
    R, V = x.shape
    bm, bv, stages = C.BLOCK_ROWS, cfg.block_v, cfg.stages
    cfg.check_dtype(x.dtype)
    num_tiles = C.cdiv(V, bv)
    tps = C.cdiv(num_tiles, num_splits)
    assert C.cdiv(num_tiles, tps) == num_splits, (num_tiles, num_splits)
    assert R >= bm and V >= bv, (R, V)
    shape = (bm, bv)

    skip = block_live is not None
    vectors = (ids, k_rows) + ((block_live,) if skip else ())

    def kernel(x_ref, *refs):
        ids_ref, k_ref = refs[:2]
        m_out, l_out, t_out, stat_smem, ids_smem, k_smem, vec_barrier = refs[len(vectors) :]
        split = lax.axis_index("split")
        row0 = C.row_block_start(R)
        tile0 = split * tps
        n_tiles = jnp.minimum(tps, num_tiles - tile0)
        pairs = ((ids_ref, ids_smem), (k_ref, k_smem.at[0])) + (((refs[2], k_smem.at[1]),) if skip else ())
        ids_v, k_v, *_ = C.load_row_vectors(pairs, row0, vec_barrier, interpret)
        neg_inf = layout_cast(jnp.full((bm,), -jnp.inf, jnp.float32), C.ROW, interpret)
        zero = layout_cast(jnp.full((bm,), 0.0, jnp.float32), C.ROW, interpret)
        minus_one = layout_cast(jnp.full((bm,), -1.0, jnp.float32), C.ROW, interpret)  # l of an empty row

        def body(idx, x_smem, carry):
            m2, l, t2 = carry
            j = tile0 + idx[0]
            nominal = j * bv
            start = C.tile_start(j, bv, V)
            col = iota(jnp.int32, shape, 1, plgpu.Layout.WGMMA, interpret)  # column within the tile
            z2 = x_smem[...].astype(jnp.float32) * C.bcast_rows(k_v, shape)
            z2 = jnp.where(col >= nominal - start, z2, -jnp.inf)  # columns a slid-back tile already saw
            # online log-sum-exp: the new running max, the sum rescaled to it
            m_new = jnp.maximum(m2, z2.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # an all -inf row so far: no NaN
            d = z2 - C.bcast_rows(m_safe, shape)  # exactly 0 at the maximum
            p = jnp.exp2(d)
            # l excludes one instance of the maximum: the tail is not rounded to ulps of its 1 (issue 31)
            l = C.online_merge(m2, l, m_new, jnp.exp2(m2 - m_safe), *C.tile_tail(p, d == 0.0))
            # the target's column within the tile; one below `nominal` was picked by an earlier tile
            want = jnp.where(ids_v >= nominal, ids_v - start, -1)
            t2 = t2 + jnp.where(col == C.bcast_rows(want, shape), z2, 0.0).sum(axis=1)
            return m_new, l, t2

        def body_lean(idx, x_smem, carry):
            m, l, t2 = carry  # m: running max of the raw logits (k > 0: the max commutes with the scale)
            j = tile0 + idx[0]
            start = C.tile_start(j, bv, V)
            col = iota(jnp.int32, shape, 1, plgpu.Layout.WGMMA, interpret)
            xr = jnp.where(col >= j * bv - start, x_smem[...].astype(jnp.float32), -jnp.inf)
            m_new = jnp.maximum(m, xr.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(xr * C.bcast_rows(k_v, shape) - C.bcast_rows(m_safe * k_v, shape))
            # the maximum's p is a fused multiply-add's residual away from 1: its instances are counted
            tail = C.tile_tail(p, xr == C.bcast_rows(m_safe, shape), exact_one=False)
            l = C.online_merge(m, l, m_new, jnp.exp2((m - m_safe) * k_v), *tail)
            return m_new, l, t2

        def index_map(t):
            return (row0, C.tile_start(tile0 + t, bv, V))

        def stats_pass():
            # Traced in 32-bit mode: with jax_enable_x64 the pipeline's own `lax.min(max_concurrent_steps,
            # num_steps)` of a dynamic grid takes the Python int as int64 against its int32 step count and fails
            # (jax 0.10.2); everything it and the bodies compute is 32-bit anyway (a no-op without x64).
            with jax.enable_x64(False):
                m2, l, t2 = plgpu.emit_pipeline(
                    body if cfg.pick_target else body_lean,
                    grid=(n_tiles,),
                    in_specs=[
                        plgpu.BlockSpec(
                            (pl.Element(bm), pl.Element(bv)),
                            index_map,
                            transforms=C.smem_transforms(jnp.dtype(x.dtype).itemsize),
                        )
                    ],
                    max_concurrent_steps=stages,
                    init_carry=(neg_inf, minus_one, zero),
                )(x_ref)
            if not cfg.pick_target:
                m2 = m2 * k_v  # to the base-2 units of z2 (-inf stays -inf: k > 0)
            stat_smem[0] = m2
            stat_smem[1] = l
            stat_smem[2] = t2

        def skipped_pass():  # no live row in the block: nothing read
            for i in range(3):
                stat_smem[i] = zero

        C.by_block_flag(k_smem.at[1] if skip else None, stats_pass, skipped_pass)
        plgpu.commit_smem()
        dst = (split, pl.ds(row0, bm))
        plgpu.copy_smem_to_gmem(stat_smem.at[0], m_out.at[dst])
        plgpu.copy_smem_to_gmem(stat_smem.at[1], l_out.at[dst])
        plgpu.copy_smem_to_gmem(stat_smem.at[2], t_out.at[dst])
        plgpu.wait_smem_to_gmem(0)

    # Row pitch of the statistics padded to whole row blocks: a TMA stride must be a multiple of 16 bytes.
    stat = jax.ShapeDtypeStruct((num_splits, C.cdiv(R, bm) * bm), jnp.float32)
    kernel.__name__ = "logits_lse"  # its name in profiles
    call = plgpu.kernel(
        kernel,
        out_type=(stat, stat, stat),
        scratch_types=[
            plgpu.SMEM((3, bm), jnp.float32),
            plgpu.SMEM((bm,), jnp.int32),
            plgpu.SMEM((len(vectors) - 1, bm), jnp.float32),
            plgpu.Barrier(num_arrivals=len(vectors), num_barriers=1),
        ],
        grid=(num_splits, C.cdiv(R, bm)),
        grid_names=("split", "rows"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return tuple(o[:, :R] for o in call(x, *vectors))


def logits_merge_splits(m2, l, t2):
    """Merges per-split statistics (``[S, R]`` float32 each, see :func:`logits_lse_partials`) into
    ``(target z / T, log-sum-exp of z / T, lse2)``, each ``[R]`` float32.

    ``lse2`` is the base-2 log-sum-exp of ``z2 = z * log2(e) / T``, the unit the backward uses; a row with
    no finite logit has ``lse = lse2 = -inf``.
    """
    lse2 = C.merge_splits(m2, l).lse2
    return t2.sum(axis=0) * C.LN2, lse2 * C.LN2, lse2
