"""Per-token quantities every objective shares: the log importance ratio, its range, the k3 KL.

Elementwise ``jnp`` only (the fused logits kernel traces a token-local objective's gradient through them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _token_log_ratio(logp, old_logps, mask):
    """Per-token log importance ratio ``r = logp - old`` (0 on masked tokens); ``old_logps`` None is
    on-policy: ``old = stop_gradient(logp)`` (value 0, slope 1)."""
    old = jax.lax.stop_gradient(logp) if old_logps is None else old_logps
    return jnp.where(mask, logp - old, 0.0)


def _log_ratio_range(r: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(min, max)`` of the unmasked log ratios, no gradient (``(inf, -inf)`` if all masked)."""
    r = jax.lax.stop_gradient(r)
    return (jnp.min(jnp.where(mask, r, jnp.inf)), jnp.max(jnp.where(mask, r, -jnp.inf)))


def _k3_kl(logp: jax.Array, ref: jax.Array, mask: jax.Array) -> jax.Array:
    """Schulman's k3 estimator ``exp(d) - d - 1`` with ``d = ref - logp`` (0 on masked tokens).

    For ``|d| < 1/2`` it is the Taylor series ``sum_{n=2..8} d**n / n!`` (truncation below 5e-8 of the
    value): the plain form cancels there (float32 loses ``2**-24 / (d**2 / 2)`` of it, 1 % at
    ``d = 3e-3``)."""
    d = jnp.where(mask, ref - logp, 0.0)
    near = (d > -0.5) & (d < 0.5)
    y = jnp.where(near, d, 0.0)
    series = 1.0 / 40320.0
    for n in range(7, 1, -1):
        series = 1.0 / math.factorial(n) + y * series
    return jnp.where(near, y * y * series, jnp.exp(d) - d - 1.0)
