"""The Tunix policy loss function on the fused LM-head loss (:func:`make_policy_loss_fn`): the model's final hidden
states and LM head, the mapped batch and objective, and a second fused pass for what the objective cannot fold
in (Tunix's other KL modes, the entropy metric), aggregated as Tunix aggregates."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

import gmpo_jax
from gmpo_jax.integrations.tunix.mapping import (
    _check_max_completion_length,
    _check_objective,
    _live,
    loss_arguments,
)
from gmpo_jax.integrations.tunix.model import final_hidden_states, lm_head, logit_softcap
from gmpo_jax.objectives import Sequences
from gmpo_jax.options import as_head_options

__all__ = ["make_policy_loss_fn"]


def make_policy_loss_fn(
    objective: gmpo_jax.GMPO | None = None,
    *,
    compute_entropy: bool = False,
    head: gmpo_jax.HeadOptions | None = None,
    max_completion_length: int | None = None,
) -> Callable:
    """The fused policy loss as a Tunix policy loss function (see
    :func:`~gmpo_jax.integrations.tunix.register` for the arguments).

    The loss is Tunix's ``grpo`` loss (or GMPO) of the module docstring's table: for a GRPO-family
    config ``aggregate(ptl, mask)`` with the per-token ``ptl = -min(r A, clip(r, 1 - eps, 1 + eps_high) A)
    (* sampler_is_weights) + beta kl`` (``r = exp(logp - old)``) and Tunix's ``loss_agg_mode`` applied
    per sequence (a row padded, a segment packed). Both layouts of ``train_example`` work: padded
    (``segment_ids`` None) and packed (``prompt_ids [B, 0]``, ``completion_ids``, ``completion_mask``,
    ``advantages``, ``segment_ids``, ``segment_positions`` all ``[B, L]``).

    Returns:
      ``loss_fn(model, train_example, algo_config, pad_id, eos_id, **unused) -> (loss, aux)``: ``loss`` a
      float32 scalar carrying the gradient to every parameter of ``model`` (LM head included), ``aux`` a
      dict of float32 scalars under Tunix's metric names. Never materialises ``[B, T, V]`` logits when
      traced under ``jax.jit`` (Tunix's trainer jits its train step). ``loss_fn`` raises what
      :func:`loss_arguments`, :func:`final_hidden_states` and :func:`lm_head` raise.

    Raises:
      TypeError: ``objective`` is neither None nor a ``gmpo_jax.GMPO``; ``head`` not a ``gmpo_jax.HeadOptions``.
      ValueError: a GMPO objective whose ``beta`` is not 0; ``max_completion_length`` not a positive integer.
    """
    head = as_head_options(head)
    _check_objective(objective)
    _check_max_completion_length(max_completion_length)

    def policy_loss_fn(model, train_example, algo_config, pad_id, eos_id, **unused):
        del unused
        args = loss_arguments(algo_config, train_example, objective, max_completion_length=max_completion_length)
        batch = args.batch
        ids, mask, segment_ids = batch.completion_ids, batch.completion_mask, batch.segment_ids
        hidden = final_hidden_states(
            model,
            train_example.prompt_ids,
            ids,
            pad_id=pad_id,
            eos_id=eos_id,
            segment_ids=segment_ids,
            segment_positions=getattr(train_example, "segment_positions", None),
        )
        weight, layout = lm_head(model)
        if weight.dtype != hidden.dtype and head.logits_precision is None:  # Tunix's heads: the activation dtype
            weight = weight.astype(hidden.dtype)
        model_head = dataclasses.replace(head, weight_layout=layout, softcap=logit_softcap(model))
        loss, a = gmpo_jax.fused_linear_policy_loss(
            hidden, weight, batch, objective=args.objective, temperature=args.temperature, head=model_head
        )
        loss = loss * args.scale
        aux = {
            "kl": a.kl,
            "pg_clipfrac": a.clip_fraction,
            "pg_clipfrac_low": a.clip_fraction_low,
            "pg_clipfrac_high": a.clip_fraction_high,
            "log_ratio/min": a.log_ratio_min,
            "log_ratio/max": a.log_ratio_max,
        }

        ref = train_example.ref_per_token_logps
        if (ref is not None and batch.ref_logps is None) or compute_entropy:
            norm = max_completion_length or ids.shape[1]
            extra, more = _second_pass(
                hidden,
                weight,
                ids,
                _live(mask, segment_ids),
                segment_ids,
                ref if batch.ref_logps is None else None,
                algo_config,
                args.temperature,
                model_head,
                compute_entropy,
                norm,
            )
            loss = loss + extra
            aux.update(more)
        return loss, aux

    policy_loss_fn.__name__ = policy_loss_fn.__qualname__ = "gmpo_jax_policy_loss_fn"
    return policy_loss_fn


def _second_pass(
    hidden, weight, ids, live, segment_ids, ref, algo_config, temperature, head, compute_entropy: bool, norm
):
    """``(loss term, metrics)`` of what the fused objective cannot fold in: Tunix's other KL modes (``ref``
    not None) and the entropy metric, from one more fused log-prob pass, Tunix's ``compute_kl_divergence``
    and :func:`_aggregate` (Tunix's ``aggregate_loss`` per sequence)."""
    from tunix.rl import common

    out = gmpo_jax.fused_linear_logprobs(
        hidden, weight, ids, completion_mask=live, temperature=temperature, return_entropy=compute_entropy, head=head
    )
    logp, entropy = out if compute_entropy else (out, None)
    agg = algo_config.loss_agg_mode
    extra, aux = jnp.float32(0.0), {}
    if ref is not None:
        kl = common.compute_kl_divergence(
            logp, ref, algo_config.kl_loss_mode, clamp_value=getattr(algo_config, "kl_clamp_value", None)
        )
        aux["kl"] = jnp.sum(jnp.where(live, kl, 0.0)) / jnp.maximum(jnp.sum(live), 1)
        aux["kl_loss"] = _aggregate(kl, live, segment_ids, agg, norm)
        beta = float(getattr(algo_config, "beta", None) or 0.0)
        if beta != 0.0:
            extra = beta * aux["kl_loss"]
    if compute_entropy:
        aux["entropy"] = _aggregate(entropy, live, segment_ids, agg, norm)
    return extra, aux


def _aggregate(x: jax.Array, live: jax.Array, segment_ids: jax.Array | None, agg: str, norm) -> jax.Array:
    """Tunix's ``common.aggregate_loss(x, mask, agg)`` with a sequence (row padded, segment packed) in place
    of its row; ``norm`` is the ``sequence-mean-token-scale`` divisor. Float32 scalar."""
    x = jnp.where(live, x.astype(jnp.float32), 0.0)
    seqs = Sequences.of(live, segment_ids)
    lengths = seqs.lengths(live)
    nonempty = jnp.maximum(jnp.sum(lengths > 0), 1).astype(jnp.float32)
    if agg == "token-mean":
        return jnp.sum(x) / jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)
    if agg == "sequence-mean-token-mean":
        return jnp.sum(seqs.sum(x, live) / jnp.maximum(lengths, 1.0)) / nonempty
    if agg == "sequence-mean-token-scale":
        return jnp.sum(x) / norm / nonempty
    return jnp.sum(x) / nonempty  # seq-mean-token-sum, sequence-mean-token-sum-norm (Tunix's default norm)
