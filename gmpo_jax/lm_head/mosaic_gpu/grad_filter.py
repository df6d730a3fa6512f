"""The gradient filter (``grad_filter``; docs/DESIGN.md, docs/SPEC.md) as a plan that the gradient pass executes.

Forward: the log-prob kernel runs one vocabulary split per ``filter_window``, so that its statistics give each
row's softmax mass off its target per window and how unevenly the window spreads it (:func:`_window_mass`).
Backward: :func:`plan` decides which (row, window) blocks are kept (:class:`FilterPlan`);
``_GradPass.filtered_windows`` runs each window of the head (the columns before ``filter_tail``) on the static
prefix of its rows reordered live first, and the tail (the rest, its windows kept together) in one step on the
prefix of the union of its rows; :func:`correct` then adds the dropped windows' correction to ``dh`` and to the row
sums that the rounding cancellation subtracts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import tuning
from gmpo_jax._dispatch import UnsupportedConfigError
from gmpo_jax.lm_head.mosaic_gpu.layout import _vocab

__all__ = ["FilterPlan", "plan", "correct", "filter_tiles", "filter_head"]


class FilterPlan(NamedTuple):
    """What the gradient pass runs with the filter: ``live`` ``[n_windows, Rp]`` bool (the kept (row, window)
    blocks), ``mass`` ``[Rp, n_windows]`` (``D``: each row's mass off its target per window, padding rows 0),
    ``tiles`` (vocabulary tiles per window) and ``n_head`` (the full windows before the tail)."""

    live: jax.Array
    mass: jax.Array
    tiles: int
    n_head: int


def filter_tiles(backend, block_n: int) -> int:
    """Vocabulary tiles of ``block_n`` columns per gradient-filter window of ``backend``.

    Raises:
      UnsupportedConfigError: ``filter_window`` not a multiple of ``block_n``.
    """
    if backend.filter_window % block_n:  # (positive: checked when constructed)
        raise UnsupportedConfigError(
            f"filter_window={backend.filter_window} must be a multiple of the kernels' {block_n}-column tiles"
        )
    return backend.filter_window // block_n


def filter_head(backend, block_n: int, V: int) -> int:
    """The gradient filter's head: its full windows before ``filter_tail`` (each run on its own rows); the
    columns after them are the tail (``_GradPass.filtered_windows``).

    Raises:
      UnsupportedConfigError: ``filter_window`` not a multiple of ``block_n``, or ``filter_tail`` not a multiple of
        ``filter_window``.
    """
    tiles = filter_tiles(backend, block_n)
    if backend.filter_tail % backend.filter_window:  # (positive: checked when constructed)
        raise UnsupportedConfigError(
            f"filter_tail={backend.filter_tail} must be a multiple of filter_window={backend.filter_window}"
        )
    return min(backend.filter_tail // backend.filter_window, V // (tiles * block_n))


def plan(backend, window_mass, gp, block_n: int, V: int) -> FilterPlan:
    """The filter's plan for the gradient pass ``gp`` (row-padded to ``Rp``) from ``window_mass``
    ``[R, n_windows, 2]`` (``logprobs(with_window_mass=True)`` of the same rows: :func:`_window_mass`) at
    ``backend.grad_filter``."""
    Rp = gp.hp.shape[0]
    pad = ((0, Rp - window_mass.shape[0]), (0, 0), (0, 0))
    stats = jnp.pad(window_mass, pad)  # padding rows: no mass, no cotangent
    n_head = filter_head(backend, block_n, V)
    live = _filter_live(stats[..., 1], gp, backend.grad_filter, backend.filter_window, n_head)
    return FilterPlan(live=live, mass=stats[..., 0], tiles=filter_tiles(backend, block_n), n_head=n_head)


def correct(carry, fplan: FilterPlan, coef, hidden, weight, bias, temperature, weight_layout: str, window: int):
    """The pass's ``(dh, dw_acc, db_acc, rowsum)`` with the dropped windows' correction (:func:`_dropped_mass`):
    ``dh -= coef D m`` (``m`` each window's tilted mean column, :func:`_window_means`) and the row sums less
    ``coef sum_k D_k`` (``coef`` ``[Rp]``: the cotangent over the temperature; ``hidden`` ``[Rp, H]`` the pass's
    rows: their mean over the rows with a cotangent tilts the means)."""
    dh, dw_acc, db_acc, rowsum = carry
    dropped = _dropped_mass(fplan.mass, fplan.live)  # [Rp, n_windows]
    has = coef != 0
    h_sum = jnp.dot(has.astype(hidden.dtype), hidden, preferred_element_type=jnp.float32)  # 0 / 1: exact
    h_mean = h_sum / jnp.maximum(jnp.sum(has), 1).astype(jnp.float32)
    means = _window_means(weight, bias, weight_layout, window, h_mean, temperature)
    dh = dh - coef[:, None] * jnp.dot(dropped, means, precision=lax.Precision.HIGHEST)
    return dh, dw_acc, db_acc, rowsum - coef * jnp.sum(dropped, axis=1)


def _window_mass(m2, l, t2, lse, ids, window: int, V: int):
    """``[R, n_windows, 2]`` float32 from the log-prob kernel's per-split statistics (one split per window,
    ``[n_windows, R]``): each row's softmax mass off its target per vocabulary window, ``D = (l + 1) 2^(m2 - lse2)``
    less the target's ``2^(t2 - lse2)`` in its own window (float32 rounding: about ``1e-7`` of the row's largest
    probability), and beside it the window's score ``s = D sqrt(2 ln(n / n_eff))``: ``n`` the window's columns,
    ``n_eff = l + 1 = D / p_max`` (``p_max`` its largest probability). ``s`` bounds what dropping the window moves
    beyond the mean-column correction (:func:`_dropped_mass`; docs/DESIGN.md "The gradient filter"): an evenly spread
    mass scores 0, a mass on one column ``D sqrt(2 ln n)``. In a target's own window ``s`` is not used (kept)."""
    from gmpo_jax.kernels import _common as C

    lse2 = (lse * C.LOG2E)[None]
    total = jnp.where(l >= 0, (l + 1.0) * jnp.exp2(m2 - lse2), 0.0)  # l: one instance of the max excluded
    n_w = m2.shape[0]
    own = jnp.arange(n_w, dtype=jnp.int32)[:, None] == (ids.astype(jnp.int32) // window)[None]
    target = jnp.where(own, jnp.exp2(t2 - lse2), 0.0)
    mass = jnp.maximum(total - target, 0.0)
    width = jnp.minimum(window, V - window * jnp.arange(n_w, dtype=jnp.float32))[:, None]  # the last one partial
    spread = jnp.sqrt(2.0 * jnp.log(jnp.maximum(width / jnp.maximum(l + 1.0, 1.0), 1.0)))
    return jnp.stack([mass, mass * spread], axis=-1).swapaxes(0, 1)


def _filter_live(score, gp, tau: float, window: int, n_head: int):
    """``[n_windows, Rp]`` bool from ``score`` ``[Rp, n_windows]`` (:func:`_window_mass`' ``s``): the (row, window)
    blocks the filter keeps: rows with a cotangent, in their target's window, in every window whose score exceeds
    ``tau``, and in every window when the row has an entropy term's cotangent (kept exact); the windows from
    ``n_head`` on (the tail) are kept together: all of them where any one is."""
    Rp, n_w = score.shape
    has_coef = gp.coef != 0
    ent = jnp.zeros((Rp,), bool) if gp.entropy is None else gp.entropy[0] != 0
    own = jnp.arange(n_w, dtype=jnp.int32)[:, None] == (gp.ids_p // window)[None]
    live = (has_coef | ent)[None] & ((score.T > tau) | own | ent[None])
    if n_head < n_w:
        live = live.at[n_head:].set(jnp.any(live[n_head:], axis=0))
    return live


def _dropped_mass(mass, live):
    """``[Rp, n_windows]``: each row's softmax mass in the windows the filter drops (``mass`` ``[Rp, n_windows]``,
    ``live`` ``[n_windows, Rp]``), 0 in the kept ones. The dropped entries of row ``r`` would have added
    ``-c_r sum_(v dropped) p_v W_v`` to its ``dh`` (``c_r``: its cotangent over the temperature); ``grads`` adds
    ``-c_r sum_k D_rk mean_k(W)`` instead (``_window_means``), exact for what every column of a window shares (a
    direction shared by all columns, as trained heads have, adds up coherently over thousands of dropped columns:
    left out, it dominated the error on heavy-tailed rows, docs/performance.md). What remains of window ``k`` is
    ``-c_r sum_(v in k) (p_v - D_rk / n_k) (W_v - mean_k(W))``, at most ``|c_r| min(D_rk, s_rk) max_(v in k) |W_v -
    mean_k(W)|`` (``s_rk`` the window's score, :func:`_window_mass`; Pinsker's inequality): the filter drops a window
    only where ``s_rk <= tau``. And the kept ``dz`` of a row then
    sums to ``c_r sum_k D_rk`` instead of 0 (its target is kept), so the rounding that ``cancel_rounding`` removes is
    the stored row sum less that: cancelling the stored sum alone would also move ``dh`` by ``c_r D_r W[:, id]``,
    which on a trained head (large target columns) is many times the dropped entries' own ``sum_v dz_v W_v``."""
    return jnp.where(live.T, 0.0, mass)


def _window_means(weight, bias, weight_layout: str, window: int, h_mean, temperature):
    """Each vocabulary window's tilted mean weight column, ``[n_windows, H]`` float32: the columns weighted by
    ``softmax((h_mean W + b) / temperature)`` over the window (``h_mean`` ``[H]``), so a bias of ``-inf``, as
    ``vocab_size`` padding sets, leaves a column out (a window with none gets 0). One read of the weight for the
    weights (a GEMV of ``h_mean`` rounded to the weight's dtype, float32 results) and one for the sums (float32).

    Why tilted: a dropped window's mass sits on its columns unevenly, the same way for every row where the
    unevenness comes from what the rows share (a frequency direction, as trained heads have: each token's prior
    logit); the even mean then misses ``D (E_q[W] - mean(W))`` coherently over rows and windows, and the mean
    hidden state's softmax weights it back (docs/performance.md "A score instead of the mass": on ``heavy-rough``
    12.7x the exact path's error with even means at ``tau = 1e-2``, 1.28x tilted; the smooth members unchanged)."""
    V = _vocab(weight, weight_layout)
    w = weight if weight_layout == "vh" else weight.T  # [V, H] (a transposed read inside the reduction)
    t = jnp.asarray(temperature, jnp.float32)
    hm = h_mean.astype(weight.dtype)
    dims = (((0,), (0,)), ((), ())) if weight_layout == "hv" else (((0,), (1,)), ((), ()))
    logit = lax.dot_general(hm, weight, dims, preferred_element_type=jnp.float32) / t  # [V]
    if bias is not None:
        logit = logit + bias.astype(jnp.float32) / t
    n_full, rest = divmod(V, window)

    def sums(lo: int, hi: int, n: int):  # [n, H] weighted column sums and [n] total weights of the windows
        blk = lax.slice_in_dim(w, lo, hi, axis=0).astype(jnp.float32).reshape(n, (hi - lo) // n, -1)
        z = logit[lo:hi].reshape(n, -1)
        top = jnp.max(z, axis=1, keepdims=True)
        pi = jnp.where(jnp.isfinite(z), jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        return jnp.sum(blk * pi[:, :, None], axis=1), jnp.sum(pi, axis=1)

    parts = ([sums(0, n_full * window, n_full)] if n_full else []) + ([sums(n_full * window, V, 1)] if rest else [])
    total = jnp.concatenate([p[0] for p in parts], axis=0)
    count = jnp.concatenate([p[1] for p in parts], axis=0)
    return jnp.where(count[:, None] > 0, total / jnp.where(count > 0, count, 1.0)[:, None], 0.0)


def _filter_sizes(Rp: int) -> tuple[int, ...]:
    """The gradient filter's static row prefixes of a window: ``Rp / 2**k`` for ``k < tuning.GRAD_FILTER_LEVELS``,
    rounded up to ``tuning.ROW_ALIGN`` rows, ``Rp`` included."""
    from gmpo_jax.kernels._common import cdiv

    align = tuning.ROW_ALIGN
    return tuple(sorted({min(Rp, cdiv(cdiv(Rp, 2**k), align) * align) for k in range(tuning.GRAD_FILTER_LEVELS)}))
