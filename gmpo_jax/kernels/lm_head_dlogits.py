"""The LM-head dlogits kernel (Hopper, Pallas Mosaic GPU): the gradient of the logits, window by window.

Kernel file ``lm_head_dlogits.py`` (``<input>_<stage>``, see ``_common``): reads hidden states and the
LM-head weight, writes ``dz`` of a vocabulary window; entry point :func:`lm_head_dlogits_window`. The
backward of ``gmpo_jax.lm_head.mosaic_gpu``.

.. math::
   \\partial z_{r,v} = \\frac{g_r}{T}\\,\\big(\\mathbb{1}[v = \\mathrm{id}_r] - e^{z_{r,v} - \\mathrm{lse}_r}\\big),
   \\qquad \\partial h = \\partial z\\, W^\\top, \\qquad \\partial W \\mathrel{+}= h^\\top \\partial z .

:func:`lm_head_dlogits_window` recomputes the logits tiles of a vocabulary window with the same
wgmma pipeline as the forward kernel (``_common.logits_tile_loop``), forms ``dz`` in float32 in
registers and writes it once, in the inputs' 16-bit dtype, as a ``[rows, window]`` tile of
device memory (bulk tensor stores). The two products ``dz W^T`` and ``h^T dz`` are then plain
GEMMs (see ``gmpo_jax.lm_head.mosaic_gpu``): the hidden size (896 to 4096) is too large for a
``[block, H]`` float32 accumulator to live in registers, and splitting ``H`` across CTAs would
recompute the logits ``H / 128`` times. The window is sized so that the ``dz`` buffer stays
within a fixed workspace budget. Beside ``dz`` the kernel writes each row's sum of the *stored*
(16-bit) ``dz`` per split: the exact row sums to 0 (``sum_v softmax = 1``), so that sum is the row's
rounding error, and the backend cancels it in ``dh`` with ``- rowsum * W[:, id]`` (the product ``dz
W^T`` then acts on ``W_v - W_id``, free of the columns' shared direction; see
``gmpo_jax.lm_head.mosaic_gpu``). Each ``dW`` column block is written once per window (no
atomics), so results are bitwise reproducible.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels import _lm_head_pipeline as P
from gmpo_jax.kernels._compat import iota, layout_cast, plgpu


def lm_head_dlogits_window(
    hidden,
    weight,
    bias,
    ids,
    row_scale,
    row_lse2,
    row_coef,
    row_entropy=None,
    *,
    weight_layout: str,
    vocab_size: int,
    window_start: int,
    window_tiles: int,
    cfg: P.LMHeadBlocks,
    num_splits: int,
    softcap: float | None = None,
    terms: tuple[tuple[int, int], ...] = ((0, 0),),
    dz_dtype=None,
    row_grid: P.RowPrefixGrid | None = None,
    n_rows=None,
    interpret=None,
):
    """``dz = row_coef (onehot(ids) - exp2(z * row_scale - row_lse2))`` for the vocabulary columns
    ``[window_start, window_start + window_tiles * block_n)``, the logits ``z = hidden W + bias`` recomputed.
    With ``softcap``: ``z = cap t``, ``t = tanh((hidden W + bias) / cap)``, and ``dz`` is that of the uncapped
    logits, times ``1 - t**2``; ``rowsum`` is then the stored values' sum minus the float32 one (the exact row
    no longer sums to 0).

    Args:
      hidden: ``[Rp, H]`` bf16/f16, ``Rp`` a multiple of ``2 * cfg.block_m``; with ``terms``, its bfloat16 parts
        side by side (``kernels.lm_head_lse.lm_head_lse_partials``).
      weight: ``[H, V]`` (``"hv"``) or ``[V, H]`` (``"vh"``); with ``terms``, its parts side by side along ``H``.
      bias: ``[num_tiles * block_n]`` f32 zero-padded, or None.
      ids: ``[Rp]`` int32.
      row_scale: ``[Rp]`` f32 ``log2(e) / T``.
      row_lse2: ``[Rp]`` f32 ``lse * log2(e)``.
      row_coef: ``[Rp]`` f32 ``dlogp / T`` (0 on padding rows).
      row_entropy: None, or ``(gamma / T, H)``, two ``[Rp]`` f32: an entropy term's cotangent and the
        rows' entropies; ``dz`` then also holds ``-(gamma / T) p (log p + H)`` (still summing to 0).
      window_start: first column, a multiple of ``block_n``.
      terms: the split operands' products (``_lm_head_pipeline.split_terms``); ``((0, 0),)``: plain operands.
      dz_dtype: the stored ``dz``'s dtype: None (``hidden.dtype``) or float32 (twice the staging memory).
      row_grid, n_rows: a :class:`~gmpo_jax.kernels._lm_head_pipeline.RowPrefixGrid` of ``Rp`` rows over the
        window's tiles and the runtime number of rows with work (an int32 scalar, traced or not): only the row
        blocks holding the first ``n_rows`` rows are computed (``num_splits`` is then ignored). Their ``dz`` rows
        are written; the others' are not (undefined).

    Returns:
      ``(dz, rowsum)``: ``dz`` ``[Rp, window_tiles * block_n]`` in ``dz_dtype`` (columns past ``V`` are
      0); ``rowsum`` ``[num_splits, Rp]`` float32, each split's sum of its stored ``dz`` entries (0 where a
      ``row_grid`` computed nothing; ``row_grid.max_splits`` split rows).
    """
    rows = hidden.shape[0]
    bm, bn = cfg.block_m, cfg.block_n
    assert window_start % bn == 0
    first_tile = window_start // bn
    if row_grid is not None:
        num_splits, tiles_per_split = row_grid.max_splits, 0
    else:
        tiles_per_split = C.cdiv(window_tiles, num_splits)
        assert C.cdiv(window_tiles, tiles_per_split) == num_splits
    k_iters = P.part_k_iters(hidden, weight, weight_layout, terms, cfg.block_k)
    dtype = jnp.dtype(hidden.dtype if dz_dtype is None else dz_dtype)
    has_bias = bias is not None
    with_ent = row_entropy is not None

    def body(h_ref, w_ref, b_ref, row_refs, outs, smem, cta):
        ids_ref, scale_ref, lse_ref, coef_ref, *ent_refs = row_refs
        dz_out, rowsum_out = outs
        a_smem, b_smem, (out_smem, sum_smem), loaded, consumed = smem
        split, row0, my_rows, local0, n_tiles, wg, _ = cta

        def init_carry():
            lse2_v = C.row_vector(lse_ref, my_rows, bm, interpret)
            return (
                C.row_vector(ids_ref, my_rows, bm, interpret),
                C.row_vector(scale_ref, my_rows, bm, interpret),
                lse2_v,
                C.snap_tolerance(lse2_v),
                C.row_vector(coef_ref, my_rows, bm, interpret),
                layout_cast(jnp.full((bm,), 0.0, jnp.float32), C.ROW, interpret),
            ) + tuple(C.row_vector(r, my_rows, bm, interpret) for r in ent_refs)

        def epilogue(tile, z, carry):
            ids_v, scale_v, lse2_v, tol_v, coef_v, rowsum, *ent_v = carry
            shape = (bm, bn)
            if has_bias:
                z = z + C.bcast_cols(C.col_vector(b_ref, tile * bn, bn, interpret), shape)
            if softcap is not None:
                z, t = C.soft_cap(z, softcap)
            col = iota(jnp.int32, shape, 1, plgpu.Layout.WGMMA, interpret) + tile * bn
            z2 = z * C.bcast_rows(scale_v, shape) - C.bcast_rows(lse2_v, shape)
            z2 = jnp.where(jnp.abs(z2) <= C.bcast_rows(tol_v, shape), 0.0, z2)  # see C.snap_tolerance
            p = jnp.where(col < vocab_size, jnp.exp2(z2), 0.0)
            onehot = jnp.where(col == C.bcast_rows(ids_v, shape), C.ONE, C.ZERO)
            dz32 = C.bcast_rows(coef_v, shape) * (onehot - p)
            if with_ent:  # -(gamma / T) p (ln p + H); ln p = z2 ln 2, clamped where p underflows to 0
                log_p = jnp.maximum(z2, -256.0) * C.LN2
                dz32 = dz32 - C.bcast_rows(ent_v[0], shape) * p * (log_p + C.bcast_rows(ent_v[1], shape))
            if softcap is None:
                dz = dz32.astype(dtype)
                rowsum = rowsum + dz.astype(jnp.float32).sum(axis=1)  # the stored values' rounding error
            else:  # the chain rule through the cap; the exact row sum is not 0: keep the rounding error only
                dz32 = dz32 * (1.0 - t * t)
                dz = dz32.astype(dtype)
                rowsum = rowsum + (dz.astype(jnp.float32) - dz32).sum(axis=1)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store left SMEM
            out_smem[wg] = dz
            plgpu.commit_smem()
            local_col = (tile - first_tile) * bn
            plgpu.copy_smem_to_gmem(out_smem.at[wg], dz_out.at[pl.ds(my_rows, bm), pl.ds(local_col, bn)])
            return (ids_v, scale_v, lse2_v, tol_v, coef_v, rowsum, *ent_v)

        def finish(carry):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            sum_smem[wg] = carry[5]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sum_smem.at[wg], rowsum_out.at[split, pl.ds(my_rows, bm)])
            plgpu.wait_smem_to_gmem(0)

        P.logits_tile_loop(
            hidden_ref=h_ref,
            weight_ref=w_ref,
            weight_layout=weight_layout,
            a_smem=a_smem,
            b_smem=b_smem,
            loaded=loaded,
            consumed=consumed,
            row0=row0,
            tile0=first_tile + local0,
            num_tiles=n_tiles,
            k_iters=k_iters,
            cfg=cfg,
            init_carry=init_carry,
            epilogue=epilogue,
            finish=finish,
            interpret=interpret,
            terms=terms,
        )

    info = None if row_grid is None else row_grid.info(n_rows)
    dz, rowsum = P.launch(
        body,
        name="lm_head_dlogits",
        hidden=hidden,
        weight=weight,
        bias=bias,
        row_inputs=(ids, row_scale, row_lse2, row_coef) + (tuple(row_entropy) if with_ent else ()),
        out_type=(
            jax.ShapeDtypeStruct((rows, window_tiles * bn), dtype),
            jax.ShapeDtypeStruct((num_splits, rows), jnp.float32),
        ),
        epilogue_smem=(
            plgpu.SMEM((2, bm, bn), dtype, transforms=C.smem_transforms(dtype.itemsize)),
            plgpu.SMEM((2, bm), jnp.float32),
        ),
        weight_layout=weight_layout,
        cfg=cfg,
        num_splits=num_splits,
        tiles_per_split=tiles_per_split,
        num_tiles=window_tiles,
        row_grid=row_grid,
        info=info,
        interpret=interpret,
    )
    if row_grid is None:
        return dz, rowsum
    return dz, jnp.where(row_grid.written(info), rowsum, 0.0)
