"""Entropy selection: the tokens that receive policy gradient (``top_entropy_quantile``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def high_entropy_tokens(
    entropy: jax.Array, mask: jax.Array, top_entropy_quantile: float
) -> tuple[jax.Array, jax.Array]:
    """The tokens whose entropy is in the top ``top_entropy_quantile`` of the unmasked tokens.

    ``threshold = quantile(entropy[mask], 1 - top_entropy_quantile)`` (linear interpolation, as
    ``numpy.quantile`` and TRL's ``get_high_entropy_mask``) and ``select = mask & (entropy >= threshold)``.

    Args:
      entropy: ``[B, T]`` float per-token entropies (of the temperature-scaled softmax).
      mask: ``[B, T]`` bool; only these tokens enter the quantile and may be selected.
      top_entropy_quantile: Python float in ``(0, 1]``; 1 selects every unmasked token.

    Returns:
      ``(select [B, T] bool, threshold float32 scalar)``; with no unmasked token, nothing is selected and
      the threshold is 0. On sharded inputs (data parallel) the quantile is over the global batch.

    References: Wang et al., "Beyond the 80/20 Rule", arXiv 2506.01939; TRL ``top_entropy_quantile``.
    """
    e = jnp.where(mask, entropy.astype(jnp.float32), jnp.nan)
    threshold = jnp.nanquantile(e, 1.0 - top_entropy_quantile)
    return mask & (e >= threshold), jnp.where(jnp.any(mask), threshold, 0.0)
