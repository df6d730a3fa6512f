"""The custom VJP of :func:`gmpo_jax.policy_loss_from_logits`: the policy loss from logits that already exist.

``logits_policy_loss(cfg, objective, logits, inputs) -> (loss, aux)``: ``loss`` a float32 scalar, ``aux`` a
:class:`~gmpo_jax.objectives.LossAux`; the gradient w.r.t. ``logits`` ``[B, T(+1), V]`` in their dtype,
``dlogp / temperature * (onehot(id) - softmax(z))`` per counted token and 0 elsewhere (masked tokens, the
dropped last position); zero for ``inputs`` and ``objective``. Arguments checked and normalised by
``gmpo_jax.logits.api``. One memory-bound pass forward and one backward, or, for a token-local objective on a
backend that declares ``fused_dlogits``, ``dlogits`` written in the forward (docs/DESIGN.md "The logits op's
custom VJP").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax.logits.backend import capabilities
from gmpo_jax.logits.xla import entropy_and_lse, entropy_dlogits
from gmpo_jax.objectives import (
    LossAux,
    Objective,
    PolicyInputs,
    _concrete_value,
    evaluate,
    loss_and_aux,
    token_mean,
)

__all__ = ["LogitsConfig", "logits_policy_loss"]


@dataclasses.dataclass(frozen=True)
class LogitsConfig:
    """Static configuration of one call (hashable: the custom VJP's ``nondiff_argnums``): the resolved
    backend and the completion length ``T`` (the logits have ``T`` or ``T + 1`` positions)."""

    backend: Any
    T: int


def _token_local_loss(objective: Objective, logp, inputs: PolicyInputs, *, with_grads: bool):
    """``(loss, dlogp or None)`` of a token-local objective as one weighted sum,
    ``sum_{b,t} token_weights * token_loss``: the function whose gradient the fused kernel writes, and a
    single reduction after the logits pass instead of the per-sequence and batch reductions of
    ``chunk_numerator / denominator`` (fewer small kernels after the fused one)."""
    mask = inputs.mask
    weights = objective.token_weights(mask, inputs.num_items, inputs.segment_ids)
    adv = inputs.token_advantages()

    def total(lp):
        tl = objective.token_loss(lp, inputs.old_logps, inputs.ref_logps, adv, inputs.token_policy_weights(), mask=mask)
        return jnp.sum(jnp.where(mask, weights * tl, 0.0))

    if not with_grads:
        return total(logp), None
    loss, g = jax.value_and_grad(total)(logp)
    return loss, jnp.where(mask, g, 0.0)


def _objective(objective: Objective, logp, inputs: PolicyInputs, *, with_grads: bool, loss=None):
    """``(loss, aux, dlogp or None)`` on the ``[B, T]`` log-probs. ``loss``: a token-local objective's
    weighted sum already formed (the fused kernel writes each token's term; ``with_grads=False`` only)."""
    denom = objective.denominator(inputs.mask, inputs.num_items, inputs.segment_ids).astype(jnp.float32)
    if not objective.token_local or inputs.rollout_logps is not None:  # token_loss takes no sampler log-probs
        num, sums, dlogp = evaluate(objective, logp, inputs, denom, with_grads=with_grads)
        loss, aux = loss_and_aux(num, denom, sums, inputs.mask)
        return loss, aux, dlogp
    with jax.named_scope("gmpo_jax/objective"):
        if loss is None:
            loss, dlogp = _token_local_loss(objective, logp, inputs, with_grads=with_grads)
        else:
            dlogp = None
        _, sums, _ = evaluate(objective, jax.lax.stop_gradient(logp), inputs, denom, with_grads=False)
    _, aux = loss_and_aux(loss * denom, denom, sums, inputs.mask)
    return loss, aux, dlogp


def _entropy_term(objective: Objective, logits, inputs: PolicyInputs, T: int):
    """``(loss part, (gamma, H, lse))`` of the entropy term ``-entropy_coef sum w H / denominator`` (None, None
    without one); ``gamma [B, T] = d loss / d H``."""
    if inputs.entropy_coef is None:
        return None, None
    ent, lse = entropy_and_lse(lax.stop_gradient(logits), T, inputs.temperature)
    w = objective.entropy_weights(inputs.mask, inputs.segment_ids)
    denom = objective.denominator(inputs.mask, inputs.num_items, inputs.segment_ids).astype(jnp.float32)
    gamma = -inputs.entropy_coef.astype(jnp.float32) * w / denom
    return jnp.sum(jnp.where(w != 0, gamma * ent, 0.0)), (gamma, ent, lse)  # masked logits may hold NaN


def _add_entropy_term(objective: Objective, logits, inputs: PolicyInputs, T: int, loss, aux):
    """``(loss, aux, (gamma, H, lse) or None)`` with the entropy term added to the loss and its numerator."""
    ent_loss, ent = _entropy_term(objective, logits, inputs, T)
    if ent_loss is None:
        return loss, aux, None
    aux = aux._replace(
        loss_numerator=aux.loss_numerator + lax.stop_gradient(ent_loss) * aux.loss_denominator,
        entropy=token_mean(ent[1], inputs.mask),
    )
    return loss + ent_loss, aux, ent


def _id_ok(inputs: PolicyInputs, V: int):
    """Where the (masked-to-0) ids lie in ``[0, V)``; elsewhere the log-prob is NaN."""
    return (inputs.ids >= 0) & (inputs.ids < V)


def _run(cfg: LogitsConfig, objective: Objective, logits, inputs: PolicyInputs, *, with_grads: bool):
    logp, residual = cfg.backend.logprobs(logits, inputs.ids, T=cfg.T, temperature=inputs.temperature, mask=inputs.mask)
    logp = jnp.where(_id_ok(inputs, logits.shape[-1]), logp, jnp.nan)
    loss, aux, dlogp = _objective(objective, logp, inputs, with_grads=with_grads)
    loss, aux, ent = _add_entropy_term(objective, logits, inputs, cfg.T, loss, aux)
    return loss, aux, (residual, dlogp, ent)


def _fused(cfg: LogitsConfig, objective: Objective, logits) -> bool:
    """Whether the forward of the VJP writes ``dlogits`` itself (token-local objective, concrete
    hyper-parameters, a backend with ``logprobs_and_dlogits`` whose ``fused_plan`` accepts the shape)."""
    if not capabilities(cfg.backend).fused_dlogits or not objective.token_local:
        return False
    if any(_concrete_value(leaf) is None for leaf in jax.tree.leaves(objective)):
        return False
    B, Tl, V = logits.shape
    return cfg.backend.fused_plan(dtype=logits.dtype, R=B * Tl, V=V) is not None


def _run_fused(cfg: LogitsConfig, objective: Objective, logits, inputs: PolicyInputs):
    id_ok = _id_ok(inputs, logits.shape[-1])
    logp, loss, dlogits = cfg.backend.logprobs_and_dlogits(
        logits,
        inputs.ids,
        T=cfg.T,
        temperature=inputs.temperature,
        objective=objective,
        old_logps=inputs.old_logps,
        ref_logps=inputs.ref_logps,
        advantages=inputs.token_advantages(),
        rollout_is_ratio=inputs.token_policy_weights(),
        weights=objective.token_weights(inputs.mask, inputs.num_items, inputs.segment_ids),
        mask=inputs.mask,
        id_ok=id_ok,
    )
    logp = jnp.where(id_ok, logp, jnp.nan)
    loss, aux, _ = _objective(objective, logp, inputs, with_grads=False, loss=loss)
    loss, aux, ent = _add_entropy_term(objective, logits, inputs, cfg.T, loss, aux)
    if ent is not None:
        dlogits = (dlogits.astype(jnp.float32) + entropy_dlogits(logits, cfg.T, inputs.temperature, *ent)).astype(
            dlogits.dtype
        )
    return loss, aux, dlogits


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def logits_policy_loss(
    cfg: LogitsConfig, objective: Objective, logits, inputs: PolicyInputs
) -> tuple[jax.Array, LossAux]:
    """``(loss, aux)``; arguments checked and normalised by ``gmpo_jax.logits.api``."""
    loss, aux, _ = _run(cfg, objective, logits, inputs, with_grads=False)
    return loss, aux


def _logits_policy_loss_fwd(cfg, objective, logits, inputs):
    if inputs.rollout_logps is None and _fused(cfg, objective, logits):
        loss, aux, dlogits = _run_fused(cfg, objective, logits, inputs)
        return (loss, aux), (dlogits, None, None, None, None)
    loss, aux, (residual, dlogp, ent) = _run(cfg, objective, logits, inputs, with_grads=True)
    return (loss, aux), (logits, inputs, residual, dlogp, ent)


def _logits_policy_loss_bwd(cfg, res, cotangents):
    g, _ = cotangents  # the metrics carry no gradient
    g = jnp.asarray(g, jnp.float32)  # a Python float from jax.vjp too
    stored, inputs, residual, dlogp, ent = res
    if dlogp is None:  # fused: dlogits of a unit cotangent (XLA drops the multiply when g is the constant 1)
        return None, (stored.astype(jnp.float32) * g).astype(stored.dtype), None
    dlogits = cfg.backend.dlogits(stored, inputs.ids, residual, dlogp * g, T=cfg.T, temperature=inputs.temperature)
    if ent is not None:  # the entropy term's gradient, added by XLA (one fused pass)
        gamma, h, lse = ent
        term = entropy_dlogits(stored, cfg.T, inputs.temperature, gamma * g, h, lse)
        dlogits = (dlogits.astype(jnp.float32) + term).astype(dlogits.dtype)
    return None, dlogits, None


logits_policy_loss.defvjp(_logits_policy_loss_fwd, _logits_policy_loss_bwd)
