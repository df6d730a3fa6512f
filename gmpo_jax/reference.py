"""Dense oracles of both ops: the same losses computed with full ``[B, T, V]`` logits and plain ``jax.grad``.

For tests and as the "naive JAX" baseline of the benchmarks. It shares the objective math of
``gmpo_jax.objectives`` (the independent float64 NumPy implementation lives in ``tests/``) but none of
the fused machinery: logits are materialised, log-softmaxed and differentiated by autodiff.
By default inputs are upcast to float32 and the matmul runs at ``Precision.HIGHEST``; ``upcast=False``
keeps the inputs' dtype with float32 accumulation (what a straightforward bf16 training step does).
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

__all__ = ["logits", "logprobs", "policy_loss", "policy_loss_from_logits"]


def logits(hidden, weight, *, bias=None, temperature=1.0, weight_layout="hv", upcast=True, softcap=None):
    """Full logits ``(hidden @ W + bias) / temperature`` as float32 ``[B, T, V]``; with ``softcap``,
    ``softcap * tanh((hidden @ W + bias) / softcap) / temperature`` (Gemma's final-logit cap)."""
    if upcast:
        hidden, weight = hidden.astype(jnp.float32), weight.astype(jnp.float32)
    contract = ((2,), (0,)) if weight_layout == "hv" else ((2,), (1,))
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else lax.Precision.DEFAULT
    z = lax.dot_general(hidden, weight, (contract, ((), ())), precision=prec, preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if softcap is not None:
        z = jnp.where(z == -jnp.inf, -jnp.inf, softcap * jnp.tanh(z / softcap))
    return z / jnp.asarray(temperature, jnp.float32)


def _target_logprobs(z, ids):
    """``log_softmax(z)[ids]`` in float32; NaN where an id lies outside ``[0, V)``."""
    V = z.shape[-1]
    logp_all = _lse.log_softmax(z.astype(jnp.float32), axis=-1)  # the tail kept apart from the max (issue 31)
    logp = jnp.take_along_axis(logp_all, jnp.clip(ids, 0, V - 1)[..., None], axis=-1)[..., 0]
    return jnp.where((ids >= 0) & (ids < V), logp, jnp.nan)


def _loss(objective: Objective, z, inputs: PolicyInputs, top_entropy_quantile) -> tuple[jax.Array, LossAux]:
    """The loss from float32 ``[B, T, V]`` logits ``z`` (temperature applied)."""
    V_.check_top_entropy_quantile(top_entropy_quantile)
    threshold = entropy = None
    if top_entropy_quantile != 1.0:
        ls = _lse.log_softmax(lax.stop_gradient(z), axis=-1)
        entropy = -jnp.sum(jnp.where(jnp.isfinite(ls), jnp.exp(ls) * ls, 0.0), axis=-1)
        select, threshold = high_entropy_tokens(entropy, inputs.mask, top_entropy_quantile)
        inputs = inputs._replace(token_select=select)
    logp = _target_logprobs(z, inputs.ids)
    denom = objective.denominator(inputs.mask, inputs.num_items, inputs.segment_ids).astype(jnp.float32)
    num, sums, _ = evaluate(objective, logp, inputs, denom, with_grads=False)
    if inputs.entropy_coef is not None:  # -c sum w H, differentiated by autodiff through full logits
        ls = _lse.log_softmax(z, axis=-1)
        ent = -jnp.sum(jnp.where(jnp.isfinite(ls), jnp.exp(ls) * ls, 0.0), axis=-1)
        w = objective.entropy_weights(inputs.mask, inputs.segment_ids)
        num = num - inputs.entropy_coef * jnp.sum(w * ent)
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
    weight_layout="hv",
    upcast=True,
    softcap=None,
):
    """Dense counterpart of :func:`gmpo_jax.fused_linear_logprobs` (``[B, T]`` float32)."""
    B, T, H, V = V_.check_lm_head(hidden, weight, bias, weight_layout)
    V_.check_ids(completion_ids, B, T)
    mask = jnp.ones((B, T), bool) if completion_mask is None else V_.as_mask(completion_mask)
    ids = jnp.where(mask, V_.as_ids(completion_ids), 0)
    z = logits(
        hidden, weight, bias=bias, temperature=temperature, weight_layout=weight_layout, upcast=upcast, softcap=softcap
    )
    return jnp.where(mask, _target_logprobs(z, ids), 0.0)


def policy_loss(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    *,
    objective: Objective,
    old_logps=None,
    ref_logps=None,
    ref_hidden=None,
    ref_weight=None,
    bias=None,
    ref_bias=None,
    rollout_is_ratio=None,
    num_items_in_batch=None,
    temperature=1.0,
    segment_ids=None,
    rollout_logps=None,
    rollout_is_mode=None,
    rollout_is_cap=None,
    top_entropy_quantile=1.0,
    softcap=None,
    entropy_coef=None,
    weight_layout="hv",
    upcast=True,
):
    """Dense counterpart of :func:`gmpo_jax.fused_linear_policy_loss`: same arguments (no chunking /
    implementation), same ``(loss, LossAux)`` result, gradients by ``jax.grad`` through full logits."""
    token_args = V_.token_args(locals())
    V_.check_policy_inputs(
        hidden=hidden,
        weight=weight,
        ref_hidden=ref_hidden,
        ref_weight=ref_weight,
        bias=bias,
        ref_bias=ref_bias,
        weight_layout=weight_layout,
        **token_args,
        chunk_size=None,
    )
    inputs = V_.policy_inputs(**token_args)
    if ref_hidden is not None:
        inputs = inputs._replace(
            ref_logps=lax.stop_gradient(
                logprobs(
                    ref_hidden,
                    ref_weight,
                    inputs.ids,
                    completion_mask=inputs.mask,
                    bias=ref_bias,
                    weight_layout=weight_layout,
                    upcast=upcast,
                    temperature=temperature,
                    softcap=softcap,
                )
            )
        )
    z = logits(
        hidden, weight, bias=bias, temperature=temperature, weight_layout=weight_layout, upcast=upcast, softcap=softcap
    )
    return _loss(objective, z, inputs, top_entropy_quantile)


def policy_loss_from_logits(
    logits,
    completion_ids,
    completion_mask,
    advantages,
    *,
    objective: Objective,
    old_logps=None,
    ref_logps=None,
    rollout_is_ratio=None,
    num_items_in_batch=None,
    temperature=1.0,
    segment_ids=None,
    rollout_logps=None,
    rollout_is_mode=None,
    rollout_is_cap=None,
    top_entropy_quantile=1.0,
    entropy_coef=None,
):
    """Dense counterpart of :func:`gmpo_jax.policy_loss_from_logits` (``[B, T + 1, V]`` or ``[B, T, V]``
    logits): float32 ``log_softmax`` of the first ``T`` positions, the same ``(loss, LossAux)``, gradients
    by ``jax.grad``."""
    B, T = jnp.shape(completion_ids)
    token_args = V_.token_args(locals())
    V_.check_token_inputs(
        B=B,
        T=T,
        V=jnp.shape(logits)[-1],
        **token_args,
    )
    inputs = V_.policy_inputs(**token_args)
    z = jnp.asarray(logits)[:, :T].astype(jnp.float32) / inputs.temperature
    return _loss(objective, z, inputs, top_entropy_quantile)
