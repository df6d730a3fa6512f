"""The LM-head weight-gradient kernel (Hopper, Pallas Mosaic GPU): ``dW = h^T dz`` of a vocabulary window over a
runtime number of rows.

Kernel file ``lm_head_dweight.py`` (``<input>_<stage>``, see ``_common``): reads the hidden states and a window's
``dz`` (``lm_head_dlogits``), writes the window's weight-gradient block; entry point :func:`lm_head_dweight_window`.
With :func:`~gmpo_jax.kernels.lm_head_dhidden.lm_head_dhidden_window` it replaces the two XLA GEMMs of the gradient
pass when the live rows are a prefix of a runtime length (``tuning.ROW_PREFIX_GRADIENT``).

.. math::
   \\partial W_{:,v} = \\sum_{r < K} h_{r,:}\\, \\partial z_{r,v}, \\qquad
   K = \\lceil n_\\text{rows} / \\text{block\\_k} \\rceil\\, \\text{block\\_k}.

One kernel for both layouts: ``out[M, N] = lhs[:K]^T rhs[:K]`` with ``(lhs, rhs) = (h, dz)`` for a ``[H, V]`` weight
(the block ``[H, Kw]``) and ``(dz, h)`` for a ``[V, H]`` one (``[Kw, H]``). It runs on the LM-head pipeline
(``_lm_head_pipeline.logits_tile_loop``) with a transposed left operand: the CTA's "rows" are ``2 * block_m`` columns
of ``lhs``, its "vocabulary tiles" ``block_n``-column tiles of ``rhs``, and the contraction is over the first ``K``
rows of both, ``K`` read at run time (``CtaBlock.word``), so one compiled kernel serves every number of rows. The
rows from ``n_rows`` to ``K`` must hold finite values whose products vanish (``dz`` rows of zero cotangent, as the
dlogits kernel writes them on the same prefix); rows past ``K`` are not read.
"""

from __future__ import annotations

import jax.numpy as jnp

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels import _lm_head_pipeline as P


def dweight_blocks(
    N: int,
    out_dtype,
    blocks16: tuple[int, int, int, int] = (64, 256, 64, 3),
    blocks32: tuple[int, int, int, int] = (64, 256, 64, 3),
    in_flight: int = 0,
) -> P.LMHeadBlocks:
    """Block sizes of :func:`lm_head_dweight_window` for ``N`` output columns: ``blocks16`` for a 16-bit result (a
    single chunk's weight gradient; by default 128 x 256 tiles with a 3-deep ring, the dlogits kernel's tuned shape:
    208 KiB of shared memory with the staged output tiles), ``blocks32`` for a float32 one (by default also 128 x 256
    tiles with a 3-deep ring, each output tile staged in two column halves: ``tile_gemm``), each ``(block_m, block_n,
    block_k, num_stages)``; where ``block_n`` does not divide ``N``, 128 (else 64) columns with a 4-deep ring.
    ``in_flight``: :class:`~gmpo_jax.kernels.LMHeadBlocks`'s."""
    bm, bn, bk, stages = blocks16 if jnp.dtype(out_dtype).itemsize == 2 else blocks32
    if N % bn:  # the fallback: 128 (64) columns, a 4-deep ring
        bn, stages = (128 if N % 128 == 0 else 64), 4
    return P.LMHeadBlocks(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, in_flight=in_flight)


def lm_head_dweight_window(lhs, rhs, *, n_rows, cfg: P.LMHeadBlocks, num_sms: int, out_dtype, interpret=None):
    """``lhs[:K]^T rhs[:K]``, ``K`` = ``n_rows`` rounded up to ``cfg.block_k`` (the module docstring).

    Args:
      lhs: ``[Rp, M]`` bf16/f16, ``M`` a multiple of ``2 * cfg.block_m``.
      rhs: ``[Rp, N]``, same dtype, ``N`` a multiple of ``cfg.block_n``.
      n_rows: int32 scalar (traced or not), ``0 <= n_rows <= Rp``, ``Rp`` a multiple of ``cfg.block_k``.
      cfg: :func:`dweight_blocks`.
      num_sms: the device's SM count (the grid's splits of the ``N / block_n`` output tiles).
      out_dtype: the result's dtype (float32, or the weight's 16-bit dtype: the float32 sums rounded once).

    Raises:
      ValueError: ``lhs`` and ``rhs`` not of one 16-bit dtype, or ``num_sms < 1``.

    Returns:
      ``[M, N]`` in ``out_dtype`` (zeros when ``n_rows == 0``).
    """
    if num_sms < 1:
        raise ValueError(f"lm_head_dweight: num_sms must be >= 1, got {num_sms}")
    Rp, M = lhs.shape
    N = rhs.shape[1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    assert rhs.shape[0] == Rp and Rp % bk == 0 and M % (2 * bm) == 0 and N % bn == 0, (lhs.shape, rhs.shape, cfg)
    num_tiles = N // bn
    splits = P.lm_head_num_splits(M // (2 * bm), num_tiles, num_sms, min_tiles=1)
    steps = jnp.clip(C.cdiv(jnp.asarray(n_rows, jnp.int32), bk), 0, Rp // bk)
    info = jnp.zeros((P.INFO_WORDS,), jnp.int32).at[P.CONTRACTION_WORD].set(steps)
    return P.tile_gemm(
        lhs,
        rhs,
        name="lm_head_dweight",
        out_shape=(M, N),
        out_dtype=out_dtype,
        rhs_layout="hv",
        cfg=cfg,
        k_iters=None,  # the info vector's CONTRACTION_WORD
        num_splits=splits,
        tiles_per_split=C.cdiv(num_tiles, splits),
        num_tiles=num_tiles,
        info=info,
        transpose_a=True,
        interpret=interpret,
    )
