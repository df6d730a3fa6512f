"""Dense oracles of both ops: the same losses computed with full ``[B, T, V]`` logits and plain ``jax.grad``.

For tests and as the "naive JAX" baseline of the benchmarks. It shares the objective math of
``gmpo_jax.objectives`` (the independent float64 NumPy implementation lives in ``tests/``) but none of
the fused machinery: logits are materialised, log-softmaxed and differentiated by autodiff.
By default inputs are upcast to float32 and the matmul runs at ``Precision.HIGHEST``; ``upcast=False``
keeps the inputs' dtype with float32 accumulation (what a straightforward bf16 training step does).
The arguments are those of the fused functions; of a :class:`~gmpo_jax.HeadOptions` only ``weight_layout``,
``softcap`` and ``vocab_size`` apply (the others choose how the fused path computes the same values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import _lse
from gmpo_jax import _validation as V_
from gmpo_jax.objectives import (
    LossAux,
    Objective,
    PolicyInputs,
    evaluate,
    high_entropy_tokens,
    loss_and_aux,
    token_mean,
)
from gmpo_jax.options import as_head_options

__all__ = ["logits", "logprobs", "policy_loss", "policy_loss_from_logits"]


def logits(hidden, weight, *, bias=None, temperature=1.0, head=None, upcast=True):
    """Full logits ``(hidden @ W + bias) / temperature`` as float32 ``[B, T, V]``; with ``head.softcap``,
    ``softcap * tanh((hidden @ W + bias) / softcap) / temperature`` (Gemma's final-logit cap); columns from
    ``head.vocab_size`` on are ``-inf``."""
    head = as_head_options(head)
    if upcast:
        hidden, weight = hidden.astype(jnp.float32), weight.astype(jnp.float32)
    contract = ((2,), (0,)) if head.weight_layout == "hv" else ((2,), (1,))
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else lax.Precision.DEFAULT
    z = lax.dot_general(hidden, weight, (contract, ((), ())), precision=prec, preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if head.softcap is not None:
        z = jnp.where(z == -jnp.inf, -jnp.inf, head.softcap * jnp.tanh(z / head.softcap))
    if head.vocab_size is not None:
        z = jnp.where(jnp.arange(z.shape[-1]) < head.vocab_size, z, -jnp.inf)
    return z / V_.as_temperature(temperature)


def _target_logprobs(z, ids, V=None):
    """``log_softmax(z)[ids]`` in float32; NaN where an id lies outside ``[0, V)`` (``V``: the real vocabulary)."""
    V = z.shape[-1] if V is None else V
    logp_all = _lse.log_softmax(z.astype(jnp.float32), axis=-1)  # the tail kept apart from the max (issue 31)
    logp = jnp.take_along_axis(logp_all, jnp.clip(ids, 0, V - 1)[..., None], axis=-1)[..., 0]
    return jnp.where((ids >= 0) & (ids < V), logp, jnp.nan)


def _entropy(z):
    ls = _lse.log_softmax(z, axis=-1)
    return -jnp.sum(jnp.where(jnp.isfinite(ls), jnp.exp(ls) * ls, 0.0), axis=-1)


def _loss(objective: Objective, z, inputs: PolicyInputs, V=None) -> tuple[jax.Array, LossAux]:
    """The loss from float32 ``[B, T, V]`` logits ``z`` (temperature applied)."""
    threshold = entropy = None
    if objective.top_entropy_quantile != 1.0:
        entropy = _entropy(lax.stop_gradient(z))
        select, threshold = high_entropy_tokens(entropy, inputs.mask, objective.top_entropy_quantile)
        inputs = inputs._replace(token_select=select)
    logp = _target_logprobs(z, inputs.ids, V)
    denom = objective.denominator(inputs.mask, inputs.num_items, inputs.segment_ids).astype(jnp.float32)
    num, sums, _ = evaluate(objective, logp, inputs, denom, with_grads=False)
    if inputs.entropy_coef is not None:  # -c sum w H, differentiated by autodiff through full logits
        ent = _entropy(z)
        w = objective.entropy_weights(inputs.mask, inputs.segment_ids)
        num = num - inputs.entropy_coef * jnp.sum(jnp.where(w != 0, w * ent, 0.0))
        entropy = ent if entropy is None else entropy
    loss, aux = loss_and_aux(num, denom, sums, inputs.mask)
    if entropy is not None:
        aux = aux._replace(entropy=token_mean(entropy, inputs.mask))
    return loss, aux if threshold is None else aux._replace(entropy_threshold=threshold)


def logprobs(
    hidden,
    weight,
    completion_ids,
    *,
    completion_mask=None,
    bias=None,
    temperature=1.0,
    return_entropy=False,
    head=None,
    upcast=True,
):
    """Dense counterpart of :func:`gmpo_jax.fused_linear_logprobs` (``[B, T]`` float32, and the entropies with
    ``return_entropy``); ``upcast``: see the module docstring."""
    head = as_head_options(head)
    B, T, H, V = V_.check_lm_head(hidden, weight, bias, head.weight_layout)
    V_.check_ids(completion_ids, B, T)
    mask = jnp.ones((B, T), bool) if completion_mask is None else V_.as_mask(completion_mask)
    ids = jnp.where(mask, V_.as_ids(completion_ids), 0)
    z = logits(hidden, weight, bias=bias, temperature=temperature, head=head, upcast=upcast)
    logp = jnp.where(mask, _target_logprobs(z, ids, head.vocab_size), 0.0)
    if return_entropy:
        return logp, jnp.where(mask, _entropy(lax.stop_gradient(z)), 0.0)
    return logp


def policy_loss(
    hidden,
    weight,
    batch,
    *,
    objective: Objective,
    bias=None,
    temperature=1.0,
    reference=None,
    head=None,
    upcast=True,
):
    """Dense counterpart of :func:`gmpo_jax.fused_linear_policy_loss`: the same arguments (no ``sharding``), the
    same checks and ``(loss, LossAux)`` result, gradients by ``jax.grad`` through full logits."""
    head = as_head_options(head)
    V_.check_policy_inputs(
        hidden=hidden,
        weight=weight,
        batch=batch,
        objective=objective,
        bias=bias,
        temperature=temperature,
        reference=reference,
        weight_layout=head.weight_layout,
        vocab_size=head.vocab_size,
    )
    inputs = V_.policy_inputs(batch, objective, temperature)
    if reference is not None:
        ref = logprobs(
            reference.hidden,
            reference.weight,
            inputs.ids,
            completion_mask=inputs.mask,
            bias=reference.bias,
            temperature=temperature,
            head=head,
            upcast=upcast,
        )
        inputs = inputs._replace(ref_logps=lax.stop_gradient(ref))
    z = logits(hidden, weight, bias=bias, temperature=temperature, head=head, upcast=upcast)
    return _loss(objective, z, inputs, head.vocab_size)


def policy_loss_from_logits(logits, batch, *, objective: Objective, temperature=1.0):
    """Dense counterpart of :func:`gmpo_jax.policy_loss_from_logits` (``[B, T + 1, V]`` or ``[B, T, V]``
    logits): float32 ``log_softmax`` of the first ``T`` positions, the same checks and ``(loss, LossAux)``,
    gradients by ``jax.grad``."""
    _, T, _, _ = V_.check_logits_inputs(logits, batch, objective, temperature)
    inputs = V_.policy_inputs(batch, objective, temperature)
    z = jnp.asarray(logits)[:, :T].astype(jnp.float32) / inputs.temperature
    return _loss(objective, z, inputs)
