"""The objective step shared by both ops and the reference: numerator, metric sums and ``d loss / d logp``
(:func:`evaluate`), then the loss and its metrics (:func:`loss_and_aux`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.base import Objective
from gmpo_jax.objectives.inputs import PolicyInputs
from gmpo_jax.objectives.metrics import LossAux, MetricSums


def evaluate(
    objective: Objective, logp: jax.Array, inputs: PolicyInputs, denominator: jax.Array, *, with_grads: bool
) -> tuple[jax.Array, MetricSums, jax.Array | None]:
    """The objective on the log-probs ``[C, T]`` of whole sequences: ``(numerator, sums, dlogp)``.

    ``dlogp = d (numerator / denominator) / d logp`` (``jax.grad`` of :meth:`Objective.chunk_numerator`,
    whose selects implement SPEC.md's strict boundary rule), exactly 0 at masked tokens; None without
    ``with_grads``. ``denominator`` is the whole call's (global) normaliser, so chunks and shards give
    final per-token gradients. Shared by the LM-head scan, the logits VJP and the dense reference.
    """
    with jax.named_scope("gmpo_jax/objective"):
        if not with_grads:
            num, sums = objective.chunk_numerator(logp, inputs)
            return num, sums, None
        (num, sums), g = jax.value_and_grad(lambda lp: objective.chunk_numerator(lp, inputs), has_aux=True)(logp)
        return num, sums, jnp.where(inputs.mask, g / denominator, 0.0)


def loss_and_aux(
    numerator: jax.Array, denominator: jax.Array, sums: MetricSums, mask: jax.Array
) -> tuple[jax.Array, LossAux]:
    """``(numerator / denominator, LossAux)`` from the global sums and the whole call's mask (SPEC.md "Metrics")."""
    n = jnp.maximum(jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32), 1.0)
    any_tok = jnp.any(mask)
    aux = LossAux(
        kl=sums.kl / n,
        clip_fraction=sums.clipped / n,
        clip_fraction_low=sums.clipped_low / n,
        clip_fraction_high=sums.clipped_high / n,
        loss_numerator=jax.lax.stop_gradient(numerator),
        loss_denominator=denominator,
        log_ratio_min=jnp.where(any_tok, sums.log_ratio_min, 0.0),
        log_ratio_max=jnp.where(any_tok, sums.log_ratio_max, 0.0),
        entropy_threshold=jnp.zeros((), jnp.float32),
        kl_term=sums.kl_term / denominator,
        entropy=sums.entropy / n,
    )
    return numerator / denominator, aux
