"""The LM-head log-sum-exp kernel (Hopper, Pallas Mosaic GPU): wgmma logits tiles, online log-sum-exp.

Kernel file ``lm_head_lse.py`` (``<input>_<stage>``, see ``_common``): reads hidden states and the LM-head
weight, computes per-split log-sum-exp statistics; entry point :func:`lm_head_lse_partials`, merged by
:func:`lm_head_merge_splits`. The forward of ``gmpo_jax.lm_head.mosaic_gpu``.

For rows ``r`` of ``hidden`` and the LM-head weight ``W``,

.. math::
   z_{r,v} = (h_r \\cdot W_{:,v} + b_v) / T, \\qquad
   \\mathrm{lse}_r = \\log \\sum_v e^{z_{r,v}}, \\qquad
   \\log p_r = z_{r,\\mathrm{id}_r} - \\mathrm{lse}_r .

By default the kernel never writes logits to device memory (``save_tiles`` keeps some for the
gradient pass, below). The grid is ``(splits, row blocks)``: each CTA
owns ``2 * block_m`` rows and a contiguous range of vocabulary tiles (a *split*); for every
tile it computes ``z`` with wgmma (float32 accumulation), keeps a running maximum and sum of
exponentials per row (base 2, so the exponentials are single ``ex2`` instructions), and picks
the target logit when the tile holds it. Each split writes three float32 numbers per row
(max, sum, target); :func:`lm_head_merge_splits` merges the splits in XLA (``splits * rows`` floats,
negligible). Vocabulary columns past ``V`` (the tail of the last tile, zero-filled by the bulk
copy) are masked to ``-inf``.

``save_tiles=n`` also writes the first ``n`` vocabulary tiles, relative to their row's running maximum,
for a gradient pass that reads instead of recomputing them: ``d = z2 - m`` in float16 (``d <= 0``: 11 significant bits where
the softmax has its mass; a probability ``p`` rebuilt from it is off by at most ``p |ln p| 2**-11``) and
``m`` per tile and row in float32, so that ``z2 - lse2 = d + m - lse2``. That is ``2 V + 4 V / block_n``
bytes per row (250 KiB at Llama-3's vocabulary) written once, against ``2 H V`` flops recomputed.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels import _lm_head_pipeline as P
from gmpo_jax.kernels._compat import iota, layout_cast, plgpu


def lm_head_lse_partials(
    hidden,
    weight,
    bias,
    ids,
    row_scale,
    *,
    weight_layout: str,
    vocab_size: int,
    cfg: P.LMHeadBlocks,
    num_splits: int,
    tiles_per_split: int | None = None,
    with_entropy: bool = False,
    save_tiles: int = 0,
    softcap: float | None = None,
    terms: tuple[tuple[int, int], ...] = ((0, 0),),
    row_grid: P.RowPrefixGrid | None = None,
    n_rows=None,
    interpret=None,
):
    """Per-split online log-sum-exp statistics of the logits ``z = (hidden W + bias) / T``, never stored.
    With ``softcap`` (a static ``cap > 0``): ``z = cap tanh((hidden W + bias) / cap) / T`` (Gemma).
    With split operands (``terms``, ``_lm_head_pipeline.split_terms``): ``hidden W = sum_(i, j) in terms hidden_i W_j``.

    Args:
      hidden: ``[Rp, H]`` bf16/f16, ``Rp`` a multiple of ``2 * cfg.block_m``; with ``terms``, ``[Rp, P H]``: its
        ``P`` bfloat16 parts side by side.
      weight: ``[H, V]`` (``weight_layout="hv"``) or ``[V, H]`` (``"vh"``), same dtype; with ``terms``, its parts
        side by side along ``H`` (``[Q H, V]`` or ``[V, Q H]``).
      bias: ``[num_tiles * block_n]`` f32 (zero-padded past ``V``) or None.
      ids: ``[Rp]`` int32 target ids (any value; ids outside ``[0, V)`` pick nothing).
      row_scale: ``[Rp]`` f32, ``log2(e) / temperature`` per row.
      tiles_per_split: None (``ceil(num_tiles / num_splits)``), or the vocabulary tiles of every split but the
        last, with ``num_splits = ceil(num_tiles / tiles_per_split)`` (the gradient filter's fixed windows).
      with_entropy: also accumulate ``e2`` (two more float32 operations per logit).
      save_tiles: also return the first ``save_tiles`` logits tiles (module docstring; at most the number
        of tiles); the epilogue then stages a ``[block_m, block_n]`` float16 tile per warpgroup in shared
        memory (``cfg`` must leave room).
      row_grid, n_rows: a :class:`~gmpo_jax.kernels._lm_head_pipeline.RowPrefixGrid` of ``Rp`` rows and the runtime number
        of rows with work (an int32 scalar, traced or not): only the row blocks holding the first ``n_rows``
        rows are computed, on as many splits as fill the GPU (``num_splits`` and ``tiles_per_split`` are then
        ignored; the outputs have ``row_grid.max_splits`` split rows). The statistics of the other rows are
        those of an empty split (the merge gives ``lse = -inf``); their kept logits are not written.

    Returns:
      ``(m2, l, t2)`` or, with ``with_entropy``, ``(m2, l, t2, e2)``, each ``[num_splits, Rp]`` f32:
      per split the running max of ``z2 = z * log2 e``, the sum of ``exp2(z2 - m2)`` less one (one instance
      of the maximum excluded, ``gmpo_jax._lse``; -1 for a split without a finite logit), the target's
      ``z2`` (0 when the split does not hold the target) and ``sum exp2(z2 - m2) (z2 - m2)``. With
      ``save_tiles``, two more: ``d`` ``[Rp, save_tiles * block_n]`` f16 (``z2 - m``, ``-inf`` past ``V``)
      and ``m`` ``[save_tiles, Rp]`` f32 (the running maximum after each tile, 0 while it is ``-inf``).
    """
    rows = hidden.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    num_tiles = C.cdiv(vocab_size, bn)
    if row_grid is not None:
        num_splits, tiles_per_split = row_grid.max_splits, 0
    elif tiles_per_split is None:
        tiles_per_split = C.cdiv(num_tiles, num_splits)
    if row_grid is None:
        assert C.cdiv(num_tiles, tiles_per_split) == num_splits, (num_tiles, num_splits, tiles_per_split)
    k_iters = P.part_k_iters(hidden, weight, weight_layout, terms, bk)
    assert rows % (2 * bm) == 0
    has_bias = bias is not None
    n_stats = 4 if with_entropy else 3
    assert 0 <= save_tiles <= num_tiles, (save_tiles, num_tiles)
    save_logits = save_tiles > 0

    def body(h_ref, w_ref, b_ref, row_refs, outs, smem, cta):
        ids_ref, scale_ref = row_refs
        a_smem, b_smem, epi_smem, loaded, consumed = smem
        stat_smem, tile_smem = epi_smem if save_logits else (epi_smem, None)
        outs, saved = (outs[:n_stats], outs[n_stats:]) if save_logits else (outs, ())
        split, row0, my_rows, tile0, n_tiles, wg, _ = cta

        def init_carry():
            ids_v = C.row_vector(ids_ref, my_rows, bm, interpret)
            scale_v = C.row_vector(scale_ref, my_rows, bm, interpret)
            m2 = layout_cast(jnp.full((bm,), -jnp.inf, jnp.float32), C.ROW, interpret)
            l = layout_cast(jnp.full((bm,), -1.0, jnp.float32), C.ROW, interpret)  # empty: (-inf, -1)
            t2 = layout_cast(jnp.full((bm,), 0.0, jnp.float32), C.ROW, interpret)
            stats = (m2, l, t2) + (
                (layout_cast(jnp.full((bm,), 0.0, jnp.float32), C.ROW, interpret),) if with_entropy else ()
            )
            return (ids_v, scale_v) + stats

        def epilogue(tile, z, carry):
            ids_v, scale_v, m2, l, t2, *e2 = carry  # e2: [the entropy's sum] with_entropy, else []
            shape = (bm, bn)
            if has_bias:
                z = z + C.bcast_cols(C.col_vector(b_ref, tile * bn, bn, interpret), shape)
            if softcap is not None:
                z, _ = C.soft_cap(z, softcap)
            z2 = z * C.bcast_rows(scale_v, shape)
            col = iota(jnp.int32, shape, 1, plgpu.Layout.WGMMA, interpret) + tile * bn
            z2 = jnp.where(col < vocab_size, z2, -jnp.inf)
            m_new = jnp.maximum(m2, z2.max(axis=1))
            # a row whose logits so far are all -inf (a split of masked / padded vocabulary: a -inf bias):
            # keep l = 0 and m = -inf instead of exp2(-inf - -inf) = NaN
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            d = z2 - C.bcast_rows(m_ref, shape)
            p = jnp.exp2(d)
            rescale = jnp.exp2(m2 - m_ref)
            if with_entropy:
                # e2 = sum_v p_v (z2_v - m): moves with the maximum like the whole sum l + 1 (the shift is 0
                # while the row is empty, and max(d, -256) keeps p * d = 0 * -inf away from masked columns)
                shift = jnp.where(m2 == -jnp.inf, 0.0, m2 - m_ref)
                e2 = [rescale * (e2[0] + (l + 1.0) * shift) + (p * jnp.maximum(d, -256.0)).sum(axis=1)]
            # l excludes one instance of the maximum (d == 0 exactly there): the tail is never rounded to
            # ulps of the maximum's exp2(0) = 1 (issue 31)
            l = C.online_merge(m2, l, m_new, rescale, *C.tile_tail(p, d == 0.0))
            t2 = t2 + jnp.where(col == C.bcast_rows(ids_v, shape), z2, 0.0).sum(axis=1)
            if save_logits:
                d_out, m_out = saved

                def store():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores left SMEM
                    tile_smem[wg] = d.astype(jnp.float16)
                    stat_smem[wg, n_stats] = m_ref
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(tile_smem.at[wg], d_out.at[pl.ds(my_rows, bm), pl.ds(tile * bn, bn)])
                    plgpu.copy_smem_to_gmem(stat_smem.at[wg, n_stats], m_out.at[tile, pl.ds(my_rows, bm)])

                if save_tiles == num_tiles:
                    store()
                else:
                    pl.when(tile < save_tiles)(store)
            return (ids_v, scale_v, m_new, l, t2, *e2)

        def finish(carry):
            for i, v in enumerate(carry[2:]):
                stat_smem[wg, i] = v
            plgpu.commit_smem()
            dst = (split, pl.ds(my_rows, bm))
            for i, out in enumerate(outs):
                plgpu.copy_smem_to_gmem(stat_smem.at[wg, i], out.at[dst])
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
            tile0=tile0,
            num_tiles=n_tiles,
            k_iters=k_iters,
            cfg=cfg,
            init_carry=init_carry,
            epilogue=epilogue,
            finish=finish,
            interpret=interpret,
            terms=terms,
        )

    stat = jax.ShapeDtypeStruct((num_splits, rows), jnp.float32)
    out_type = (stat,) * n_stats
    epilogue_smem = plgpu.SMEM((2, n_stats + save_logits, bm), jnp.float32)  # sized in lm_head_lse_epilogue_bytes
    if save_logits:
        out_type += (
            jax.ShapeDtypeStruct((rows, save_tiles * bn), jnp.float16),
            jax.ShapeDtypeStruct((save_tiles, rows), jnp.float32),
        )
        epilogue_smem = (epilogue_smem, plgpu.SMEM((2, bm, bn), jnp.float16, transforms=C.smem_transforms(2)))
    info = None if row_grid is None else row_grid.info(n_rows)
    out = P.launch(
        body,
        name="lm_head_lse",
        hidden=hidden,
        weight=weight,
        bias=bias,
        row_inputs=(ids, row_scale),
        out_type=out_type,
        epilogue_smem=epilogue_smem,
        weight_layout=weight_layout,
        cfg=cfg,
        num_splits=num_splits,
        tiles_per_split=tiles_per_split,
        num_tiles=num_tiles,
        row_grid=row_grid,
        info=info,
        interpret=interpret,
    )
    if row_grid is None:
        return out
    # what the grid did not compute is an empty split's statistics: (m2, l, t2, e2) = (-inf, -1, 0, 0)
    written = row_grid.written(info)
    empty = (-jnp.inf, -1.0, 0.0, 0.0)
    stats = tuple(jnp.where(written, x, jnp.float32(e)) for x, e in zip(out[:n_stats], empty))
    return stats + tuple(out[n_stats:])


def lm_head_lse_epilogue_bytes(cfg: P.LMHeadBlocks, *, n_stats: int, save: bool) -> int:
    """Shared memory of :func:`lm_head_lse_partials`' epilogue: the ``n_stats`` statistics' staging per warpgroup,
    plus with ``save_tiles`` one more row of it (the running maxima) and the two float16 logits tiles."""
    return 2 * (n_stats + save) * cfg.block_m * 4 + save * 2 * cfg.block_m * cfg.block_n * 2


def lm_head_merge_splits(m2, l, t2, e2=None):
    """Merges per-split statistics into ``(logp, lse)``, or ``(logp, lse, entropy)`` given ``e2``, in
    natural-log units.

    ``logp = (t2 - lse2) * ln 2`` is formed in the kernels' base-2 units, where the target's ``t2`` and
    the running max are the same rounded number at a one-hot softmax (tiny temperatures): converting
    each to natural units first and subtracting could leave an ulp (~0.5 at ``|z| / T ~ 1e7``) and a
    positive log-prob. ``logp <= 0`` is then exact (as in the XLA paths). The entropy
    ``H = lse - E_p[z] = (log2 l - e2 / l) ln 2`` (relative to the max: no cancellation of large
    logits) is clipped to ``[0, log V]`` like the XLA path's and is 0 for a row with no finite logit.
    ``l`` is the sum excluding one instance of the maximum (``gmpo_jax._lse``): ``lse2 = m + log2(1 + l)``
    from ``log1p`` and ``logp = ((t2 - m) - log2(1 + l)) ln 2``, so a tail of tiny terms is not rounded to
    ulps of the maximum's 1.
    """
    m_all, m_ref, alpha, l_all, log2_l, lse2 = C.merge_splits(m2, l)  # a row with no finite logit: lse = -inf
    # relative to the maximum: exact for the argmax (logp = -log1p(l)); the merged l excludes it
    logp = jnp.minimum(((t2.sum(axis=0) - m_ref) - log2_l) * C.LN2, 0.0)
    if e2 is None:
        return logp, lse2 * C.LN2
    # each split's sum re-based to the global max; an empty split (l = -1, m2 = -inf) adds nothing
    shift = jnp.where(m2 == -jnp.inf, 0.0, m2 - m_ref[None])
    e_all = (alpha * (e2 + (l + 1.0) * shift)).sum(axis=0)
    empty = m_all == -jnp.inf
    ent = jnp.where(empty, 0.0, (log2_l - e_all / jnp.where(empty, 1.0, 1.0 + l_all)) * C.LN2)
    return logp, lse2 * C.LN2, ent
