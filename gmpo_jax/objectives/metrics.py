"""Metrics: the per-chunk metric sums (:class:`MetricSums`) and what the loss returns beside it (:class:`LossAux`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.ratios import _log_ratio_range
from gmpo_jax.objectives.sequences import _masked_sum


class MetricSums(NamedTuple):
    """Metric accumulators over a chunk; float32 scalars. The first :attr:`ADDITIVE` are sums (added over
    chunks, ``psum`` over devices), the log-ratio range a min / max.

    Attributes:
      kl: ``sum m kl`` (the per-token KL, bias-corrected where the loss is).
      kl_term: the numerator of the loss's KL part without ``beta``: the per-token KL aggregated as the loss
        aggregates it (per-sequence means summed for gmpo / grpo / sapo, the token sum otherwise).
      entropy: ``sum m H`` where the loss computes the entropies (``entropy_coef``), else 0.
    """

    kl: jax.Array
    kl_term: jax.Array
    entropy: jax.Array
    clipped: jax.Array
    clipped_low: jax.Array
    clipped_high: jax.Array
    log_ratio_min: jax.Array
    log_ratio_max: jax.Array

    ADDITIVE = 6  # the leading fields that are sums

    @staticmethod
    def zeros() -> MetricSums:
        z = jnp.zeros((), jnp.float32)
        return MetricSums(
            *(z,) * MetricSums.ADDITIVE, jnp.array(jnp.inf, jnp.float32), jnp.array(-jnp.inf, jnp.float32)
        )

    def combine(self, other: MetricSums) -> MetricSums:
        n = MetricSums.ADDITIVE
        return MetricSums(
            *(a + b for a, b in zip(self[:n], other[:n])),
            jnp.minimum(self.log_ratio_min, other.log_ratio_min),
            jnp.maximum(self.log_ratio_max, other.log_ratio_max),
        )

    def all_reduce(self, axis) -> MetricSums:
        """The sums over the devices of the mesh axis ``axis`` (inside ``jax.shard_map``)."""
        lax = jax.lax
        return MetricSums(
            *(lax.psum(x, axis) for x in self[: MetricSums.ADDITIVE]),
            lax.pmin(self.log_ratio_min, axis),
            lax.pmax(self.log_ratio_max, axis),
        )

    def with_entropy(self, entropy: jax.Array, mask: jax.Array) -> MetricSums:
        """These sums with ``entropy`` set to ``sum mask * entropy`` (no gradient; any shapes that match)."""
        e = jax.lax.stop_gradient(entropy).astype(jnp.float32).reshape(mask.shape)
        return self._replace(entropy=_masked_sum(e, mask))


class LossAux(NamedTuple):
    """Metrics returned beside the loss; float32 scalars, no gradient (SPEC.md "Metrics").

    Attributes:
      kl: ``sum m kl / max(sum m, 1)``: mean per-token k3 KL to the reference (0 without a reference).
      clip_fraction: fraction of unmasked tokens clipped on the side that matters for their advantage
        (low-clipped with ``A < 0`` or high-clipped with ``A > 0``; CISPO: high only; SAPO: 0).
      clip_fraction_low: the low-clipped part of ``clip_fraction``.
      clip_fraction_high: the high-clipped part of ``clip_fraction``.
      loss_numerator: the loss before normalisation; ``loss == loss_numerator / loss_denominator``.
        Sum numerators and denominators over micro-batches to re-normalise exactly. Like every field
        here it carries no gradient: to train on a re-normalised loss, differentiate
        ``loss * loss_denominator / global_denominator`` (``loss`` does carry the gradient).
      loss_denominator: the loss type's normaliser for this call (``B`` for grpo / sapo / gmpo, the token
        count for bnpo / dapo / cispo, ``B * max_completion_length`` for dr_grpo; ``B`` is the number of
        sequences: of a packed batch, its positive-id runs).
      log_ratio_min: smallest unmasked token log importance ratio ``logp - old`` (0 if all masked).
      log_ratio_max: largest unmasked token log importance ratio (0 if all masked).
      entropy_threshold: with ``top_entropy_quantile < 1``, the entropy at or above which a token received
        policy gradient (:func:`high_entropy_tokens`); else 0.
      kl_term: the KL term exactly as the loss aggregates it, without ``beta``: the numerator of the loss's
        KL part over ``loss_denominator``, so that ``loss = policy part + beta * kl_term`` (+ the entropy
        term), i.e. ``loss(beta) - loss(0) == beta * kl_term``. gmpo / grpo / sapo: the mean over
        sequences of each sequence's token-mean KL; bnpo / dapo / cispo: ``sum m kl`` over the normaliser
        (with ``num_items_in_batch``: over it); dr_grpo: over ``B * max_completion_length``. ``kl`` is
        TRL's token mean (the metric to compare with TRL); the two agree for bnpo and dapo / cispo
        without ``num_items_in_batch``. 0 without a KL term.
      entropy: ``sum m H / max(sum m, 1)``, the mean per-token entropy of ``softmax(z / temperature)`` over
        the unmasked tokens (TRL's ``entropy`` metric), where the loss computes the entropies anyway
        (``entropy_coef`` given, or ``top_entropy_quantile < 1``); else 0.
    """

    kl: jax.Array
    clip_fraction: jax.Array
    clip_fraction_low: jax.Array
    clip_fraction_high: jax.Array
    loss_numerator: jax.Array
    loss_denominator: jax.Array
    log_ratio_min: jax.Array
    log_ratio_max: jax.Array
    entropy_threshold: jax.Array
    kl_term: jax.Array
    entropy: jax.Array


def token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum mask * x / max(sum mask, 1)`` in float32, no gradient (e.g. :attr:`LossAux.entropy`)."""
    n = jnp.maximum(jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32), 1.0)
    return _masked_sum(jax.lax.stop_gradient(x).astype(jnp.float32), mask) / n


def _count(x: jax.Array | None) -> jax.Array:
    """The number of True entries as float32 (counted in int32); 0 for None."""
    return jnp.zeros((), jnp.float32) if x is None else jnp.sum(x, dtype=jnp.int32).astype(jnp.float32)


def _objective_sums(r, a, mask, clipped_low, clipped_high, kl_sum=None, kl_term=None) -> MetricSums:
    """An objective's :class:`MetricSums` (entropy 0): a token counts as clipped low where its lower bound
    clipped (``clipped_low``, ``[B, T]`` bool or None: never) and ``A < 0``, high where its upper bound
    clipped and ``A > 0`` (``a``: ``[B, T]`` advantages); the log-ratio range of ``r``; ``kl_sum`` /
    ``kl_term`` (None: 0) as computed by the objective."""
    cl = None if clipped_low is None else mask & clipped_low & (a < 0)
    ch = None if clipped_high is None else mask & clipped_high & (a > 0)
    either = cl if ch is None else ch if cl is None else cl | ch
    z = jnp.zeros((), jnp.float32)
    lo, hi = _log_ratio_range(r, mask)
    return MetricSums(
        kl=z if kl_sum is None else kl_sum,
        kl_term=z if kl_term is None else kl_term,
        entropy=z,
        clipped=_count(either),
        clipped_low=_count(cl),
        clipped_high=_count(ch),
        log_ratio_min=lo,
        log_ratio_max=hi,
    )
