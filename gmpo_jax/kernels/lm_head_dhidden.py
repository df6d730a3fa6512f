"""The LM-head hidden-gradient kernel (Hopper, Pallas Mosaic GPU): ``dh = dz W^T`` of a vocabulary window on a
runtime row prefix.

Kernel file ``lm_head_dhidden.py`` (``<input>_<stage>``, see ``_common``): reads a window's ``dz`` (written by
``lm_head_dlogits``) and the window's weight columns, writes the window's float32 ``dh``; entry point
:func:`lm_head_dhidden_window`. With :func:`~gmpo_jax.kernels.lm_head_dweight.lm_head_dweight_window` it replaces the
two XLA GEMMs of the gradient pass when the live rows are a prefix of a runtime length (``tuning.ROW_PREFIX_GRADIENT``).

.. math::
   \\partial h_{r,:} = \\sum_{v \\in \\text{window}} \\partial z_{r,v}\\, W_{:,v}, \\qquad r < n_\\text{rows}.

The product runs on the LM-head pipeline (``_lm_head_pipeline.logits_tile_loop``) with the roles renamed: the
"hidden" operand is ``dz`` (``[Rp, Kw]``, the contraction over the window's ``Kw`` columns), the "weight" is the
window's columns in the other layout (``[H, Kw]`` read as ``Kw x H`` transposed tiles, or ``[Kw, H]`` as is), and the
"vocabulary tiles" are ``block_n``-column tiles of ``H``. The grid is a :class:`~gmpo_jax.kernels.RowPrefixGrid`: one
compiled kernel serves every prefix length; the row blocks past it are not computed and their rows not written. It
has one CTA per (row block, ``block_n`` columns of ``H``), the ``H / block_n`` CTAs of a row block adjacent, so they
run together and read that block's ``dz`` from HBM once between them (L2); a CTA that looped over several output
tiles would stream its ``[rows_per_cta, Kw]`` ``dz`` once per tile, ``H / block_n`` times the bytes (at ``Kw`` of
thousands of columns, more than the GEMM's own time).
"""

from __future__ import annotations

import jax.numpy as jnp

from gmpo_jax.kernels import _lm_head_pipeline as P


def dhidden_blocks(H: int, blocks: tuple[int, int, int, int] = (64, 256, 64, 3), in_flight: int = 0) -> P.LMHeadBlocks:
    """Block sizes of :func:`lm_head_dhidden_window`: ``blocks`` = ``(block_m, block_n, block_k, num_stages)``, the
    output tile ``2 block_m x block_n`` (two warpgroups of ``block_m`` rows); where ``block_n`` does not divide ``H``,
    128 (else 64) columns with a 4-deep ring. ``in_flight``: :class:`~gmpo_jax.kernels.LMHeadBlocks`'s. The default
    (128 x 256, 3 stages) stages each float32 output tile in two halves (``tile_gemm``); 128 x 128 with 4 stages
    stages it whole (192 KiB of shared memory)."""
    bm, bn, bk, stages = blocks
    if H % bn:  # the fallback: 128 (64) columns, a 4-deep ring
        bn, stages = (128 if H % 128 == 0 else 64), 4
    return P.LMHeadBlocks(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, in_flight=in_flight)


def lm_head_dhidden_window(dz, weight, *, weight_layout: str, n_rows, cfg: P.LMHeadBlocks, acc=None, interpret=None):
    """``dz W^T`` on the first ``n_rows`` rows: ``out[r] = sum_v dz[r, v] W[:, v]`` for the row blocks of
    ``cfg.rows_per_cta`` rows that hold them; with ``acc``, ``out[r] = acc[r] + sum_v dz[r, v] W[:, v]`` there, in
    ``acc``'s buffer (the hidden gradient summed over the vocabulary windows).

    Args:
      dz: ``[Rp, Kw]`` bf16/f16, ``Kw`` a multiple of ``cfg.block_k`` (a window's columns, zero past the
        vocabulary), ``Rp`` a multiple of ``cfg.rows_per_cta``.
      weight: the window's columns, ``[H, Kw]`` (``weight_layout="hv"``) or ``[Kw, H]`` (``"vh"``), same dtype, ``H``
        a multiple of ``cfg.block_n``.
      n_rows: int32 scalar (traced or not), the rows with work, ``0 <= n_rows <= Rp``.
      cfg: :func:`dhidden_blocks`.
      acc: None, or ``[Rp, H]`` float32 to add the product to (updated in place when it is dead afterwards).

    Raises:
      ValueError: ``weight_layout`` not ``"hv"`` / ``"vh"``, or ``dz`` and ``weight`` not of one 16-bit dtype.

    Returns:
      ``[Rp, H]`` float32: rows ``[0, ceil(n_rows / rows_per_cta) * rows_per_cta)`` hold the product (plus ``acc``),
      the others are not written: undefined without ``acc``, ``acc``'s with it.
    """
    if weight_layout not in ("hv", "vh"):
        raise ValueError(f"lm_head_dhidden: weight_layout must be 'hv' or 'vh', got {weight_layout!r}")
    Rp, Kw = dz.shape
    H = weight.shape[0] if weight_layout == "hv" else weight.shape[1]
    bn, bk = cfg.block_n, cfg.block_k
    assert Kw % bk == 0 and H % bn == 0 and Rp % cfg.rows_per_cta == 0, (dz.shape, weight.shape, cfg)
    assert (weight.shape[1] if weight_layout == "hv" else weight.shape[0]) == Kw, (dz.shape, weight.shape)
    gemm_layout = "vh" if weight_layout == "hv" else "hv"  # the weight as the pipeline's [N = H, K = Kw] operand
    # a CTA per output tile, a row block's tiles adjacent (they share its dz)
    row_grid = P.RowPrefixGrid.fixed(cfg.rows_per_cta, Rp // cfg.rows_per_cta, H // bn, 1, rows_fastest=False)
    return P.tile_gemm(
        dz,
        weight,
        name="lm_head_dhidden",
        out_shape=(Rp, H),
        out_dtype=jnp.float32,
        rhs_layout=gemm_layout,
        cfg=cfg,
        k_iters=Kw // bk,
        num_splits=row_grid.max_splits,
        tiles_per_split=0,
        num_tiles=H // bn,
        row_grid=row_grid,
        info=row_grid.info(n_rows),
        acc=acc,
        interpret=interpret,
    )
