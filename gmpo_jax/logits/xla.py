"""Portable XLA path of the policy loss from logits: one fused read forward, one fused read+write backward.

Forward: the log-sum-exp is a two-level reduction that reads the logits once. Level one is a
*variadic* reduction over windows of ``LSE_WINDOW`` (128) vocabulary columns carrying the pair
(window max ``m_w``, sum of ``exp(z - m_w)`` excluding one instance of the max: ``gmpo_jax._lse``, issue
31), combined with one ``exp`` per element (the smaller maximum is rescaled to the larger one); the lazy
slice ``logits[:, :T]``, the float32 upcast and the ``-inf`` padding of a partial last window fuse into it (no ``[B, T, V]`` float32 copy, no copy of the
logits; the partials are ``[B, T, V / 128]``). Level two merges the partials with plain reductions
(max, then a sum of ``(s_w + 1) exp(m_w - max)`` over the windows below the max, ``s_w`` at it, and their
count), which XLA evaluates as a tree; ``lse = m + log1p(s)`` and ``logp = (z_id - m) - log1p(s)``.

Why two levels (issue 16): a single online (max, sum) reduction is evaluated left to right on
XLA:CPU, and once a dominant logit has set the running sum near 1, each later term below ``2^-24``
of it is dropped: the sum's error grows with ``V`` (sequential summation, ``(V - 1) * 2^-24``
relative) and depends on where the dominant logit sits (0.6 % of the mass lost on a Qwen-sized row
with the target 17 above the rest, placed first; correct when placed last). With windows the
sequential part has at most 127 additions: the error is ``<= 127 * 2^-24`` of the sum whatever ``V``
and the order. That was not enough while the sum held the maximum's ``exp(0) = 1``: a tail of mass
``1e-3`` rounded to ulps of 1 is hundreds of ulps of the log-sum-exp (issue 31); kept apart from it, the
tail is accurate relative to itself (tests/kernels/test_tiny_tail_lse.py). ``lse="two_pass"`` (max, then sum of exp: two reads) is
kept for comparison (GPU timings: docs/performance.md, "Loss from logits"), but on the
CPU they materialise a float32 copy of the logits (XLA:CPU does not fuse the upcast into both
reductions), which the one-read default never does.

Backward: one elementwise fusion over the full ``[B, T(+1), V]`` writes
``dz = c (onehot - exp(z / tau - lse))`` in the logits' dtype, with ``c = dloss/dlogp / tau`` padded
by zeros for the extra last position (selected, never multiplied: rows without gradient are exactly 0
whatever the logits hold there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import _lse
from gmpo_jax._dispatch import UnsupportedConfigError
from gmpo_jax._lse import shifted

__all__ = ["XlaLogitsBackend"]


def _lse_combine(a, b):
    """Merges two ``(max, sum excluding one instance of the max)`` states (``gmpo_jax._lse``)."""
    (m1, s1), (m2, s2) = a, b
    first = m1 >= m2
    hi = jnp.where(first, m1, m2)
    lo = jnp.where(first, m2, m1)
    s_hi = jnp.where(first, s1, s2)
    s_lo = jnp.where(first, s2, s1)
    e = jnp.where(hi == -jnp.inf, 0.0, jnp.exp(lo - hi))  # both -inf: nothing to rescale
    return hi, s_hi + (s_lo + 1.0) * e


LSE_WINDOW = _lse.WINDOW  # columns per first-level partial: the Mosaic kernels' block width


def _online_lse(z):
    """``(m, log1p(l))`` of float32 ``z`` along the last axis in one read of ``z`` (``m`` the maximum, ``l``
    the sum of ``exp(z - m)`` excluding one instance of it, ``gmpo_jax._lse``): windowed partials merged by
    a tree (see the module docstring for why not one sequential reduction). ``lse = m + log1p(l)``."""
    V = z.shape[-1]
    k = min(LSE_WINDOW, V)
    nw = -(-V // k)
    if nw * k != V:  # a partial last window: -inf columns add nothing (fused into the reduction's input)
        z = jnp.pad(z, [(0, 0)] * (z.ndim - 1) + [(0, nw * k - V)], constant_values=-jnp.inf)
    zw = z.reshape(z.shape[:-1] + (nw, k))
    # each element is the state (z, 0): its own maximum, nothing else; the identity is (-inf, -1)
    m_w, s_w = lax.reduce(
        (zw, jnp.zeros_like(zw)), (jnp.float32(-jnp.inf), jnp.float32(-1.0)), _lse_combine, (zw.ndim - 1,)
    )
    m, l, _ = _lse.merge(m_w, s_w, axis=-1)
    return m, jnp.log1p(l)


def _two_pass_lse(z):
    m = jnp.max(z, axis=-1, keepdims=True)
    l, _, _ = _lse.tail(z, m)
    # l >= 0 exactly for a row with a finite logit (the max and sum fusions may round z apart at |z| ~ 1e10)
    m = m[..., 0]
    return m, jnp.log1p(jnp.where(m == -jnp.inf, l, jnp.maximum(l, 0.0)))


@dataclasses.dataclass(frozen=True)
class XlaLogitsBackend:
    """Portable backend (any platform). ``lse``: ``"online"`` (default: one read, windowed partials merged by
    a tree, order-independent to float32 rounding) or ``"two_pass"`` (two reads)."""

    lse: str = "online"
    name: str = "xla"

    def check_supported(self, *, dtype, B, T, Tl, V):
        if self.lse not in ("online", "two_pass"):
            raise UnsupportedConfigError(f"lse={self.lse!r}")

    def logprobs(self, logits, ids, *, T, temperature, mask=None):
        """``(logp [B, T] f32, lse [B, T] f32)`` of ``z = logits[:, :T] / temperature``.

        ``ids`` must be in ``[0, V)`` wherever the caller cares (others yield garbage, not errors). ``mask``
        (the completion mask) is not used: every row is read.
        """
        V = logits.shape[-1]
        with jax.named_scope("gmpo_jax/xla/logits_lse"):
            x = logits[:, :T] if logits.shape[1] != T else logits
            z = x.astype(jnp.float32) / temperature
            m, l1 = _online_lse(z) if self.lse == "online" else _two_pass_lse(z)
            m_ref = jnp.where(m == -jnp.inf, 0.0, m)
            tgt = jnp.take_along_axis(x, jnp.clip(ids, 0, V - 1)[..., None], axis=-1)[..., 0]
            # relative to the maximum: exact for the argmax (logp = -log1p(l)); exactly <= 0
            logp = jnp.minimum((tgt.astype(jnp.float32) / temperature - m_ref) - l1, 0.0)
            lse = m + l1
        return logp, lse

    def dlogits(self, logits, ids, lse, dlogp, *, T, temperature):
        """``dlogp / tau * (onehot(ids) - softmax(z))`` as ``logits.dtype``, shaped like ``logits``."""
        B, Tl, V = logits.shape
        with jax.named_scope("gmpo_jax/xla/dlogits"):
            pad = ((0, 0), (0, Tl - T))
            c = jnp.pad(dlogp / temperature, pad)[..., None]
            lse_p = jnp.pad(lse, pad)[..., None]
            ids_p = jnp.pad(ids, pad)[..., None]
            p = jnp.exp(shifted(logits.astype(jnp.float32) / temperature, lse_p))  # exactly <= 1
            hit = lax.broadcasted_iota(jnp.int32, (1, 1, V), 2) == ids_p
            g = jnp.where(hit, 1.0 - p, -p)
            return jnp.where(c != 0.0, c * g, 0.0).astype(logits.dtype)


def entropy_and_lse(logits, T: int, temperature):
    """``(H [B, T], lse [B, T])`` float32 of ``softmax(z)``, ``z = logits[:, :T] / temperature``:
    ``H = -sum_v p_v (z_v - lse)``, in XLA (reductions fused with the float32 conversion; the same windowed
    log-sum-exp as :class:`XlaLogitsBackend`)."""
    z = logits[:, :T].astype(jnp.float32) / temperature
    m, l1 = _online_lse(z)
    # H = log1p(l) - sum_v p_v (z_v - m), p_v = exp(z_v - m - log1p(l)): relative to the maximum, no
    # cancellation against the log-sum-exp (the maximum's own term is 0)
    d = shifted(z, jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    p = jnp.exp(d - l1[..., None])
    e = _lse.window_sum(jnp.where(p > 0, p * d, 0.0))
    return jnp.where(m == -jnp.inf, 0.0, l1 - e), m + l1


def entropy_dlogits(logits, T: int, temperature, gamma, ent, lse):
    """``gamma dH/dlogits = -(gamma / tau) p (log p + H)`` as float32 ``[B, Tl, V]`` (0 at the dropped last
    position): the entropy term's logits gradient for per-token cotangents ``gamma [B, T]``."""
    B, Tl, _ = logits.shape
    pad = ((0, 0), (0, Tl - T))
    g = jnp.pad(gamma / temperature, pad)[..., None]
    h = jnp.pad(ent, pad)[..., None]
    d = shifted(logits.astype(jnp.float32) / temperature, jnp.pad(lse, pad)[..., None])
    p = jnp.exp(d)
    return jnp.where((g != 0.0) & (p > 0), -g * p * (d + h), 0.0)
