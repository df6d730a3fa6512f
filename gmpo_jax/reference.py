"""Dense oracle: the same losses computed with full ``[B, T, V]`` logits and plain ``jax.grad``.

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

from gmpo_jax import _validation as V_
from gmpo_jax.api import LossAux, _as_ids, _as_mask, _f32, _rollout_is_ratio
from gmpo_jax.objectives import ChunkData, Objective, finalize_metrics

__all__ = ["logits", "logprobs", "policy_loss"]


def logits(hidden, weight, *, bias=None, temperature=1.0, weight_layout="hv", upcast=True):
    """Full logits ``(hidden @ W + bias) / temperature`` as float32 ``[B, T, V]``."""
    if upcast:
        hidden, weight = hidden.astype(jnp.float32), weight.astype(jnp.float32)
    contract = ((2,), (0,)) if weight_layout == "hv" else ((2,), (1,))
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else lax.Precision.DEFAULT
    z = lax.dot_general(hidden, weight, (contract, ((), ())), precision=prec, preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return z / jnp.asarray(temperature, jnp.float32)


def logprobs(hidden, weight, completion_ids, *, completion_mask=None, bias=None, temperature=1.0,
             weight_layout="hv", upcast=True):
    """Dense counterpart of :func:`gmpo_jax.fused_linear_logprobs` (``[B, T]`` float32)."""
    B, T, H, V = V_.check_lm_head(hidden, weight, bias, weight_layout)
    V_.check_ids(completion_ids, B, T)
    mask = jnp.ones((B, T), bool) if completion_mask is None else _as_mask(completion_mask)
    ids = jnp.where(mask, _as_ids(completion_ids), 0)
    z = logits(hidden, weight, bias=bias, temperature=temperature, weight_layout=weight_layout, upcast=upcast)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, jnp.clip(ids, 0, V - 1)[..., None], axis=-1)[..., 0]
    logp = jnp.where((ids >= 0) & (ids < V), logp, jnp.nan)
    return jnp.where(mask, logp, 0.0)


def policy_loss(hidden, weight, completion_ids, completion_mask, advantages, *, objective: Objective,
                old_logps=None, ref_logps=None, ref_hidden=None, ref_weight=None, bias=None, ref_bias=None,
                rollout_is_ratio=None, num_items_in_batch=None, temperature=1.0, weight_layout="hv",
                upcast=True):
    """Dense counterpart of :func:`gmpo_jax.fused_linear_policy_loss`: same arguments (no chunking /
    implementation), same ``(loss, LossAux)`` result, gradients by ``jax.grad`` through full logits."""
    B, T, H, V = V_.check_policy_inputs(
        hidden=hidden, weight=weight, completion_ids=completion_ids, completion_mask=completion_mask,
        advantages=advantages, objective=objective, old_logps=old_logps, ref_logps=ref_logps,
        ref_hidden=ref_hidden, ref_weight=ref_weight, bias=bias, ref_bias=ref_bias,
        rollout_is_ratio=rollout_is_ratio, num_items_in_batch=num_items_in_batch, temperature=temperature,
        weight_layout=weight_layout, chunk_size=None)
    mask = _as_mask(completion_mask)
    f32 = _f32
    ris = _rollout_is_ratio(objective, rollout_is_ratio, warn=False)
    if ref_hidden is not None:
        ref_logps = jax.lax.stop_gradient(logprobs(
            ref_hidden, ref_weight, completion_ids, completion_mask=mask, bias=ref_bias,
            temperature=temperature, weight_layout=weight_layout, upcast=upcast))
    # masked positions: id 0 (any id is allowed there); unmasked out-of-range ids give NaN
    ids = _as_ids(completion_ids)
    z = logits(hidden, weight, bias=bias, temperature=temperature, weight_layout=weight_layout, upcast=upcast)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    safe = jnp.where(mask, ids, 0)
    logp = jnp.take_along_axis(logp_all, jnp.clip(safe, 0, V - 1)[..., None], axis=-1)[..., 0]
    logp = jnp.where((safe >= 0) & (safe < V), logp, jnp.nan)
    data = ChunkData(mask, f32(advantages), f32(old_logps), f32(ref_logps), ris)
    num, sums = objective.chunk_numerator(logp, data)
    denom = objective.denominator(mask, f32(num_items_in_batch)).astype(jnp.float32)
    aux = dict(loss_numerator=jax.lax.stop_gradient(num), loss_denominator=denom,
               **finalize_metrics(sums, mask))
    return num / denom, LossAux(**aux)
