"""Kept logits: the plan of how many leading vocabulary tiles a single chunk's log-prob kernel keeps for the
gradient pass, and ``dz`` formed from them.

``logprobs_for_grads`` (the policy loss's single-chunk call, where no float32 weight-gradient accumulator is
needed): when the chunk's logits fit the memory it is given, the log-prob kernel also writes them (float16,
relative to each row's running maximum: ``kernels.lm_head_lse``) and ``grads`` forms ``dz`` from them window by
window in XLA instead of recomputing the logits: ``6 N H V`` flops in all instead of ``8 N H V``. Only for a
bfloat16 weight, without ``logits_precision``, for hidden sizes ``H >= save_min_hidden``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax.lm_head.mosaic_gpu.layout import _per_column, block_config, window_tiles

__all__ = ["SavedLogits", "save_plan", "keeps_logits", "saved_bytes"]


class SavedLogits(NamedTuple):
    """The logits of a chunk as the log-prob kernel saved them (``save_logits``): ``d = z2 - m`` ``[Rp,
    n_tiles * block_n]`` float16 and the running maxima ``m`` ``[n_tiles, Rp]`` float32, ``z2`` in base-2
    units (``z * log2(e) / T``)."""

    d: jax.Array
    m: jax.Array

    @property
    def block_n(self) -> int:
        return self.d.shape[1] // self.m.shape[0]


def save_plan(backend, *, rows: int, H: int, V: int, budget_bytes: int) -> int:
    """How many leading vocabulary tiles of the logits ``backend.logprobs_for_grads`` keeps (0: none): the most
    whose peak extra memory (:func:`saved_bytes`) fits ``budget_bytes``; 0 without ``save_logits``, with a
    ``logits_precision``, for ``H < save_min_hidden``, or when the log-prob kernel's saved tiles and the dz
    kernel's tiles differ in shape (table entries)."""
    from gmpo_jax.kernels import _common as C

    cfg = block_config(rows=rows, H=H, V=V, kind="logprob_saved", interpret=backend.interpret)
    grad = block_config(rows=rows, H=H, V=V, kind="grad", interpret=backend.interpret)
    if (
        not backend.save_logits
        or backend.logits_precision is not None  # float16 tiles would undo the float32 logits
        or H < backend.save_min_hidden
        or (cfg.block_m, cfg.block_n) != (grad.block_m, grad.block_n)
    ):
        return 0
    Rp = C.cdiv(rows, cfg.rows_per_cta) * cfg.rows_per_cta
    n_tiles = C.cdiv(V, cfg.block_n)
    for t in range(n_tiles, 0, -1):  # not monotone in t: the recomputed rest's window shrinks as t grows
        if _saved_bytes(backend.workspace_bytes, Rp, H, n_tiles, cfg.block_n, t) <= budget_bytes:
            return t
    return 0


def keeps_logits(backend, *, rows: int, H: int, V: int, weight_dtype, budget_bytes: int) -> bool:
    """Whether ``backend.logprobs_for_grads`` would keep any logits tile of ``rows`` rows (a bfloat16 weight
    and :func:`save_plan` > 0)."""
    return (
        jnp.dtype(weight_dtype) == jnp.dtype(jnp.bfloat16)
        and save_plan(backend, rows=rows, H=H, V=V, budget_bytes=budget_bytes) > 0
    )


def saved_bytes(backend, *, rows: int, H: int, V: int, save_tiles: int) -> int:
    """Peak device memory that ``logprobs_for_grads`` and ``grads`` use beyond the inputs and the returned
    gradients when ``save_tiles`` leading tiles of the logits are kept: the float32 hidden-state gradient plus
    the larger of (the float16 tiles and their per-tile maxima, with one window of the saved part) and (one
    window of the recomputed rest, after the kept tiles are freed)."""
    from gmpo_jax.kernels import _common as C

    cfg = block_config(rows=rows, H=H, V=V, kind="logprob_saved", interpret=backend.interpret)
    Rp = C.cdiv(rows, cfg.rows_per_cta) * cfg.rows_per_cta
    return _saved_bytes(backend.workspace_bytes, Rp, H, C.cdiv(V, cfg.block_n), cfg.block_n, save_tiles)


def _saved_bytes(workspace_bytes: int, Rp: int, H: int, n_tiles: int, bn: int, save_tiles: int) -> int:
    per_column = _per_column(Rp, H, 2, 2)
    kept = (
        Rp * save_tiles * (bn * 2 + 4)
        + window_tiles(workspace_bytes, Rp, H, save_tiles, bn, 2, 2, kept=True) * bn * per_column
    )
    rest = (
        window_tiles(workspace_bytes, Rp, H, n_tiles - save_tiles, bn, 2, 2) * bn * per_column
        if save_tiles < n_tiles
        else 0
    )
    return Rp * H * 4 + max(kept, rest)


def _dz_from_saved(
    saved: SavedLogits, v0, wt: int, ids_w, lse2, coef, width, dtype, softcap=None, scale=None, entropy=None
):
    """``dz = coef (onehot - exp2(d + m - lse2))`` of the window of ``wt`` saved tiles from column ``v0`` and of
    the first ``Rp = lse2.shape[0]`` rows (one XLA fusion: the float16 tiles read once, ``dz`` written once; ``saved``
    may hold more rows, never copied), ``[Rp, wt * block_n]``; columns
    ``>= width`` and ``-inf`` logits give 0, and ``|z2 - lse2|`` within ``snap_tolerance`` counts as 0
    (``p = 1``) as in the dz kernel. ``entropy``: ``(gamma / T, H)`` ``[Rp]`` of an entropy term, which adds
    ``-(gamma / T) p (ln p + H)`` as the dz kernel does. Returns ``(dz, None)``; with ``softcap``, ``dz``
    times ``1 - t**2`` (``t = z / cap``, ``z = (d + m) / scale`` the capped logit) and, second, its float32
    row sums (the exact row no longer sums to 0; ``cancel_rounding`` takes the stored minus these)."""
    from gmpo_jax.kernels import _common as C

    bn = saved.block_n
    Rp = lse2.shape[0]  # saved's first Rp rows (it may hold more: a row prefix's forward), sliced inside the fusion
    d = lax.dynamic_slice(saved.d, (0, v0), (Rp, wt * bn)).reshape(Rp, wt, bn).astype(jnp.float32)
    m = lax.dynamic_slice(saved.m, (v0 // bn, 0), (wt, Rp)).T  # [Rp, wt]
    z = d + (m - lse2[:, None])[:, :, None]
    z = jnp.where(jnp.abs(z) <= C.snap_tolerance(lse2)[:, None, None], 0.0, z).reshape(Rp, wt * bn)
    col = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    p = jnp.where(col < width, jnp.exp2(z), 0.0)
    onehot = jnp.where(col == ids_w[:, None], 1.0, 0.0)
    dz = coef[:, None] * (onehot - p)
    if entropy is not None:  # ln p = z2 ln 2, clamped where p underflows to 0 (the dz kernel's epilogue)
        gamma, ent = entropy
        dz = dz - gamma[:, None] * p * (jnp.maximum(z, -256.0) * C.LN2 + ent[:, None])
    if softcap is None:
        return dz.astype(dtype), None
    zc = (d + m[:, :, None]).reshape(Rp, wt * bn) / scale[:, None]  # the capped logit (before the temperature)
    t = jnp.where(col < width, zc / softcap, 0.0)
    dz = dz * (1.0 - t * t)
    return dz.astype(dtype), jnp.sum(dz, axis=1)
