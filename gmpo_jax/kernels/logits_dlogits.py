"""The logits dlogits kernel (Pallas Mosaic GPU): the gradient of existing logits, read once, written once.

Kernel file ``logits_dlogits.py`` (``<input>_<stage>``, see ``_common``): reads logits ``[R, V]`` that
already exist in device memory and writes ``dz = c_r * (onehot(id_r) - exp2(z2 - lse2_r))`` with ``c_r =
dloss/dlogp_r / T`` (0 on rows that carry no gradient, selected, never multiplied, so garbage logits there
cannot leak NaN); entry point :func:`logits_dlogits`. The backward of the logits backend's three-pass path.

A hand-written ring (the pipeline helper's predicated stores do not run in the interpreter): ``[64,
block_v]`` tiles come in by bulk tensor copies, ``dz`` is formed in float32 in registers (WGMMA layout)
and leaves through a second ring of output tiles. The grid is ``(vocabulary splits of tiles_per_cta
tiles, row blocks)``. A row block or vocabulary tile that does not fill the last block slides back to
end at ``R`` (resp. ``V``) and rewrites its overlap with bitwise identical values (in place: see
:func:`logits_dlogits`). Per-row vectors are staged through shared memory by TMA.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels._compat import iota, plgpu

__all__ = ["logits_dlogits"]


def logits_dlogits(
    x, ids, k_rows, lse2_rows, c_rows, *, cfg: C.LogitsBlocks, inplace: bool = False, block_live=None, interpret=None
):
    """``dz[r, v] = c_r * (onehot(ids_r)[v] - exp2(x[r, v] * k_r - lse2_r))`` in ``x.dtype``, ``[R, V]``.

    Args: ``x`` ``[R, V]`` bf16 / f16 / f32 logits; ``ids`` ``[R]`` int32 (outside ``[0, V)``: no one-hot);
    ``k_rows`` ``[R]`` float32 ``log2(e) / T``; ``lse2_rows`` ``[R]`` float32 base-2 log-sum-exp of ``x * k``
    (``logits_merge_splits``); ``c_rows`` ``[R]`` float32 ``d loss / d logp / T``. ``cfg``: ``block_v``,
    ``stages``, ``tiles_per_cta``. Rows with ``c_r == 0`` are exactly 0 whatever ``x`` holds there.

    ``block_live``: None, or ``[R]`` float32 ``_common.row_block_flags(c_rows != 0)``: a 64-row block without a
    row that carries gradient then reads nothing and stores zeros (exact: its rows are 0 either way); the
    masked tokens and zero-advantage sequences of a real RL batch fill whole blocks.

    With ``inplace``, ``dz`` is written into the buffer of ``x`` (``x`` is passed to the kernel as a
    ``jax.Ref``, which XLA aliases in and out: no second ``[R, V]`` buffer when the logits are dead
    afterwards, e.g. donated or an intermediate of the same jit; otherwise XLA copies them first). Then
    each CTA stores only the rows it owns (the slid-back last row block, its new rows), and ``V`` must be
    a multiple of ``block_v`` (no slid-back column tile), so no element is written by two CTAs: every
    element is read by the CTA that overwrites it, before it does, and the rows a slid-back block reads
    but does not own (possibly overwritten by their owner already) are discarded. Without ``inplace`` a
    slid-back block rewrites its overlap with bitwise identical values.
    """
    R, V = x.shape
    bm, bv, stages = C.BLOCK_ROWS, cfg.block_v, cfg.stages
    cfg.check_dtype(x.dtype)
    assert R >= bm and V >= bv, (R, V)
    num_tiles = C.cdiv(V, bv)
    num_row_blocks = C.cdiv(R, bm)
    tps = min(cfg.tiles_per_cta, num_tiles)
    num_splits = C.cdiv(num_tiles, tps)
    shape = (bm, bv)
    dtype = x.dtype
    # the rows the slid-back last row block owns (a multiple of the 8-row tiling): all it stores in place
    tail_rows = R - (num_row_blocks - 1) * bm
    if inplace and V % bv:
        raise ValueError(f"in place needs V % block_v == 0, got V={V}, block_v={bv}")

    skip = block_live is not None
    vectors = (ids, k_rows, lse2_rows, c_rows) + ((block_live,) if skip else ())

    def kernel(*refs):
        n_vec = len(vectors)
        scratch_refs = refs[-6:]
        x_smem, o_smem, loaded, ids_smem, f_smem, vec_barrier = scratch_refs
        if inplace:
            vec_refs, x_ref = refs[:n_vec], refs[n_vec]
            o_ref = x_ref
        else:
            x_ref, vec_refs, o_ref = refs[0], refs[1 : 1 + n_vec], refs[1 + n_vec]
        ids_ref, k_ref, lse_ref, c_ref = vec_refs[:4]
        split = lax.axis_index("split")
        last_rows = lax.axis_index("rows") == num_row_blocks - 1
        row0 = C.row_block_start(R)
        tile0 = split * tps
        n_tiles = jnp.minimum(tps, num_tiles - tile0)
        pairs = ((ids_ref, ids_smem), (k_ref, f_smem.at[0]), (lse_ref, f_smem.at[1]), (c_ref, f_smem.at[2]))
        if skip:
            pairs += ((vec_refs[4], f_smem.at[3]),)
        ids_v, k_v, lse_v, c_v, *_ = C.load_row_vectors(pairs, row0, vec_barrier, interpret)
        tol_v = C.snap_tolerance(lse_v)

        def tile(t):
            return (pl.ds(row0, bm), pl.ds(C.tile_start(tile0 + t, bv, V), bv))

        def fetch(t, slot):
            plgpu.copy_gmem_to_smem(x_ref.at[tile(t)], x_smem.at[slot], loaded.at[slot])

        def store(t, slot):
            """Tile ``t``; in place, only the rows the block owns (a TMA box has a static size, so the slid-back
            last row block stores a smaller one; a column slice of tiled shared memory is not contiguous, so
            in place needs ``V % block_v == 0``)."""
            dst_cols = pl.ds(C.tile_start(tile0 + t, bv, V), bv)
            if not inplace or tail_rows == bm:
                plgpu.copy_smem_to_gmem(o_smem.at[slot], o_ref.at[pl.ds(row0, bm), dst_cols])
                return
            for nr, cond in ((bm, ~last_rows), (tail_rows, last_rows)):
                pl.when(cond)(
                    lambda nr=nr: plgpu.copy_smem_to_gmem(
                        o_smem.at[slot, pl.ds(bm - nr, nr)], o_ref.at[pl.ds(row0 + bm - nr, nr), dst_cols]
                    )
                )

        def gradient_pass():
            for s in range(stages):  # prologue: fill the ring

                @pl.when(s < n_tiles)
                def _():
                    fetch(s, s)

            @pl.loop(0, n_tiles)
            def _step(t):
                slot = C.rem(t, stages)
                plgpu.barrier_wait(loaded.at[slot])
                col = iota(jnp.int32, shape, 1, plgpu.Layout.WGMMA, interpret)  # column within the tile
                z2 = x_smem.at[slot][...].astype(jnp.float32) * C.bcast_rows(k_v, shape) - C.bcast_rows(lse_v, shape)
                p = jnp.exp2(jnp.where(jnp.abs(z2) <= C.bcast_rows(tol_v, shape), 0.0, z2))  # see snap_tolerance
                g = jnp.where(col == C.bcast_rows(ids_v - C.tile_start(tile0 + t, bv, V), shape), 1.0 - p, -p)
                c = C.bcast_rows(c_v, shape)
                dz = jnp.where(c != 0.0, c * g, 0.0).astype(dtype)
                # the store that last read o_smem[slot] (tile t - stages) must be done; includes a barrier
                plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
                o_smem.at[slot][...] = dz
                plgpu.commit_smem()  # fence + warpgroup barrier: every thread has also finished reading x_smem[slot]
                store(t, slot)

                @pl.when(t + stages < n_tiles)
                def _():
                    fetch(t + stages, slot)

        def zero_pass():  # no row of the block carries gradient: one tile of zeros, stored to every tile
            col = iota(jnp.int32, shape, 1, plgpu.Layout.WGMMA, interpret)
            o_smem.at[0][...] = jnp.where(col < 0, C.ONE, C.ZERO).astype(dtype)  # (zeros in the stores' layout)
            plgpu.commit_smem()

            @pl.loop(0, n_tiles)
            def _step(t):
                plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)  # bounded stores in flight
                store(t, 0)

        C.by_block_flag(f_smem.at[3] if skip else None, gradient_pass, zero_pass)
        plgpu.wait_smem_to_gmem(0)

    transforms = C.smem_transforms(jnp.dtype(dtype).itemsize)
    scratch = [
        plgpu.SMEM((stages, bm, bv), dtype, transforms=transforms),
        plgpu.SMEM((stages, bm, bv), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=stages),
        plgpu.SMEM((bm,), jnp.int32),
        plgpu.SMEM((len(vectors) - 1, bm), jnp.float32),
        plgpu.Barrier(num_arrivals=len(vectors), num_barriers=1),
    ]
    grid = dict(grid=(num_splits, num_row_blocks), grid_names=("split", "rows"))
    kernel.__name__ = "logits_dlogits"  # its name in profiles
    if inplace:
        return C.call_in_place(kernel, scratch, grid, interpret, x, *vectors)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((R, V), dtype),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        **grid,
    )
    return call(x, *vectors)
