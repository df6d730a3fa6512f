"""Log-sum-exp statistics that stay accurate when many tiny terms sit beside a dominant one (issue 31).

Every log-sum-exp of the library (XLA paths, kernels, merges of blocks, splits and vocabulary shards) keeps
the state ``(m, l)`` of a set of logits ``z``:

.. math::
   m = \\max_v z_v, \\qquad l = \\sum_v e^{z_v - m} - 1, \\qquad \\mathrm{lse} = m + \\mathrm{log1p}(l),

i.e. the sum of exponentials EXCLUDING one instance of the maximum (its ``e^0 = 1``). A float32 sum that
holds the maximum's 1 rounds every later term to ``2^-24`` of 1, while the result's own ulp is ``2^-24``
of ``lse``: with ``m = 0`` and a tail of mass ``1e-3`` that rounding alone is ~100 ulps of ``lse``, and
it accumulates over the blocks (the bug: ``V = 151936`` logits at -17 beside one at 0 lost 1e-3 of the tail
mass). Kept apart, the tail is summed relative to itself and ``log1p`` keeps its digits.

* Within a block: ``l = sum_v where(z_v == m, 0, e^{z_v - m}) + (count(z_v == m) - 1)`` (ties at the
  maximum are exact ones).
* Merging two states, ``m1 >= m2``: ``(m1, l1 + (l2 + 1) e^{m2 - m1})``; several at once (:func:`merge`):
  ``l = sum_j where(m_j == M, l_j, (l_j + 1) e^{m_j - M}) + (count(m_j == M) - 1)``.
* The empty state (no finite logit) is ``(-inf, -1)``: it adds nothing to a merge and finishes as
  ``lse = -inf``.

Sums of many terms are formed in windows of :data:`WINDOW` (a sequential float32 sum of ``n`` terms errs by
up to ``(n - 1) 2^-24`` of it, whatever the exclusion): :func:`window_sum`.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["WINDOW", "shifted", "window_sum", "tail", "merge", "log_softmax", "logsumexp"]

WINDOW = 128  # terms per first-level partial sum (the Mosaic kernels' block width)


def shifted(z, ref):
    """``z - ref`` (float32, broadcast shapes) for ``ref >= max(z)`` along the vocabulary (a row maximum
    or log-sum-exp): exactly ``<= 0``, and exactly 0 where ``z == ref``; ``-inf`` logits stay ``-inf``.
    XLA may contract ``(x / T) - ref`` into a fused multiply-add whose unrounded product differs from the
    rounded ``z`` that gave ``ref`` by up to half an ulp of ``z`` (~1e3 at ``|z| ~ 1e10``, a tiny
    temperature): the maximum would get ``exp(+-1e3)`` instead of ``exp(0)``."""
    return jnp.where(z == ref, 0.0, jnp.minimum(z - ref, 0.0))


def window_sum(q, axis: int = -1):
    """``sum(q, axis)`` as a sum of :data:`WINDOW`-term partial sums (zero-padded): at most ``WINDOW - 1``
    sequential additions and a reduction of ``n / WINDOW`` partials, whatever the backend's summation order."""
    axis = axis % q.ndim
    n = q.shape[axis]
    if n <= WINDOW:
        return jnp.sum(q, axis=axis)
    nw = -(-n // WINDOW)
    if nw * WINDOW != n:
        pad = [(0, 0)] * q.ndim
        pad[axis] = (0, nw * WINDOW - n)
        q = jnp.pad(q, pad)
    q = q.reshape(q.shape[:axis] + (nw, WINDOW) + q.shape[axis + 1 :])
    return jnp.sum(jnp.sum(q, axis=axis + 1), axis=axis)


def tail(z, m, axis: int = -1):
    """``(l, d, q)`` of float32 logits ``z`` whose maximum along ``axis`` is ``m`` (kept dims, any value where
    the row has no finite logit): ``d = z - m`` (:func:`shifted`, 0 at the maximum), ``q = e^d`` and ``l``
    the sum excluding one instance of the maximum (module docstring; ``-1`` for a row with no finite logit)."""
    m_ref = jnp.where(jnp.isneginf(m), 0.0, m)
    d = shifted(z, m_ref)
    q = jnp.exp(d)
    tie = d == 0.0  # the maximum's instances (never true on a row without a finite logit: d = -inf there)
    l = window_sum(jnp.where(tie, 0.0, q), axis) + (jnp.sum(tie, axis=axis, dtype=jnp.float32) - 1.0)
    return l, d, q


def merge(m, l, axis: int = 0, exp=jnp.exp):
    """Merges partial states ``(m, l)`` (same shapes) along ``axis`` into ``(M, L, w)``: ``M`` the maximum,
    ``L`` the merged sum excluding one instance of it, ``w = exp(m - M)`` each part's rescale (0 for an
    empty part; ``exp``: ``jnp.exp``, or ``jnp.exp2`` for base-2 states). Exact in the count of parts that
    hold the maximum; an empty part ``(-inf, -1)`` adds nothing; all empty: ``(-inf, -1)``."""
    M = jnp.max(m, axis=axis, keepdims=True)
    same = m == M
    w = exp(m - jnp.where(jnp.isneginf(M), 0.0, M))
    L = jnp.sum(jnp.where(same, l, (l + 1.0) * w), axis=axis) + (jnp.sum(same, axis=axis, dtype=jnp.float32) - 1.0)
    return jnp.squeeze(M, axis), L, w


def log_softmax(z, axis: int = -1):
    """``z - logsumexp(z)`` of float32 ``z`` from the tail state (differentiable: the maximum carries the
    gradient of the excluded instance)."""
    m = jnp.max(z, axis=axis, keepdims=True)
    l, d, _ = tail(z, m, axis)
    return d - jnp.expand_dims(jnp.log1p(l), axis)


def logsumexp(z, axis: int = -1):
    """``log sum_v exp(z_v)`` along ``axis`` of float32 ``z`` (``-inf`` for a row without a finite logit)."""
    m = jnp.max(z, axis=axis, keepdims=True)
    l, _, _ = tail(z, m, axis)
    return jnp.squeeze(m, axis) + jnp.log1p(l)
