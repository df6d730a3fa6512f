"""Tunix's GRPO / DAPO / Dr.GRPO learners on gmpo_jax's fused LM-head loss (and GMPO through Tunix).

One call switches a learner: :func:`register` puts a policy loss function into Tunix's public registry
(``tunix.rl.function_registry.register_policy_loss_fn``) and returns its name; pass that name as the
config's ``policy_loss_fn``. The function has the signature Tunix's learners call
(``model, train_example, algo_config, pad_id, eos_id``) and returns ``(loss, aux)`` like Tunix's
``grpo`` loss, but it never materialises the ``[B, T, V]`` logits: it takes the final hidden states
from the model (:func:`final_hidden_states`), the LM-head weight from the model without a copy
(:func:`lm_head`) and calls :func:`gmpo_jax.fused_linear_policy_loss`.

>>> from gmpo_jax.integrations import tunix as gtx            # doctest: +SKIP
>>> config = GRPOConfig(..., policy_loss_fn=gtx.register())  # Tunix's own loss, fused  # doctest: +SKIP
>>> config = GRPOConfig(..., policy_loss_fn=gtx.register("gmpo", objective=gmpo_jax.GMPO()))  # doctest: +SKIP

How Tunix's settings map (``objective=None``, i.e. Tunix's ``grpo`` loss):

=====================================  =============================================================
Tunix                                  gmpo_jax
=====================================  =============================================================
``epsilon``, ``epsilon_high``          ``GRPO(epsilon_low=, epsilon_high=)`` (``epsilon_high`` defaults
                                       to ``epsilon`` as in Tunix)
``loss_algo="grpo"`` / ``"gspo-token"``  ``importance_sampling_level="token"`` / ``"sequence"`` (GSPO and
                                       GSPO-token have the same value and gradients for per-sequence
                                       advantages under every linear aggregation)
``loss_agg_mode="token-mean"``         ``loss_type="dapo"`` (normaliser: token count)
``"sequence-mean-token-mean"``         ``loss_type="grpo"`` times ``B / (non-empty rows)``
``"sequence-mean-token-scale"``        ``loss_type="dapo"``, ``num_items_in_batch = T * non-empty rows``
``"seq-mean-token-sum"``,              ``loss_type="dapo"``, ``num_items_in_batch = non-empty rows``
``"sequence-mean-token-sum-norm"``
``beta``, ``kl_loss_mode="low_var_kl"``  ``beta=``, ``ref_logps=`` (k3 KL, in the same fused pass)
other ``kl_loss_mode`` / ``kl_clamp_value``  a second fused pass (:func:`gmpo_jax.fused_linear_logprobs`)
                                       feeding Tunix's own ``compute_kl_divergence`` / ``aggregate_loss``
``old_per_token_logps``                ``old_logps=`` (None: on-policy)
``sampler_is_weights``                 ``rollout_is_ratio=``
``temperature`` (from the rollout config)  ``temperature=`` (0 and 1 mean none, as in Tunix)
=====================================  =============================================================

With ``objective=gmpo_jax.GMPO(...)`` the objective's epsilons are used (Tunix's ``epsilon`` is ignored);
``beta`` and the reference still come from the Tunix config (the objective's own ``beta`` must be 0);
``loss_agg_mode`` must be ``"sequence-mean-token-mean"`` (GMPO's own reduction is per sequence).

Metrics (aux, Tunix's names): ``kl`` (mean per-token KL over unmasked tokens, 0 without a reference),
``pg_clipfrac``, ``pg_clipfrac_low``, ``pg_clipfrac_high``, ``log_ratio/min``, ``log_ratio/max``;
``kl_loss`` when the KL ran as a second pass; ``entropy`` with ``compute_entropy=True`` (one more pass).

Not mapped (``NotImplementedError`` naming the feature): packed batches (``segment_ids``), token-level
(2-D) advantages, dual-clip PPO (``epsilon_c``), models with a final-logit softcap (Gemma 1/2), models
whose ``__call__`` has no ``output_hidden_states``; with GMPO also ``gspo-token``, other aggregation
modes and ``sampler_is_weights``. Tunix clamps token log-ratios to [-20, 20] (and GSPO-token's to 10)
before ``exp``; gmpo_jax does not clamp (it is exact wherever float32 can represent the ratio), so the two
differ only for ratios beyond e^20.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import gmpo_jax

__all__ = ["DEFAULT_NAME", "register", "make_policy_loss_fn", "final_hidden_states", "lm_head", "loss_arguments"]

DEFAULT_NAME = "gmpo_jax"

_AGG_MODES = (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "seq-mean-token-sum",
    "sequence-mean-token-sum-norm",
)
_TUNIX_BUILTIN_LOSSES = ("grpo", "ppo")


def register(
    name: str = DEFAULT_NAME,
    objective: gmpo_jax.GMPO | None = None,
    *,
    compute_entropy: bool = False,
    chunk_size: int | None = None,
    implementation: Any | None = None,
) -> str:
    """Register the fused policy loss with Tunix under ``name`` and return ``name``.

    Pass the result as ``policy_loss_fn=`` of ``GRPOConfig`` / ``DAPOConfig`` / ``DrGRPOConfig`` (they do
    not validate the name) before building the learner, which looks the function up in its ``__init__``.

    Args:
      name: the registry name; Tunix's own ``"grpo"`` and ``"ppo"`` are refused (nothing of Tunix is
        overwritten). Registering a name again replaces the earlier function (Tunix logs a warning).
      objective: None for Tunix's own GRPO-family loss as its config describes it, or a
        :class:`gmpo_jax.GMPO` for GMPO.
      compute_entropy: also report Tunix's ``entropy`` metric (one more fused pass, no gradient).
      chunk_size, implementation: passed to :func:`gmpo_jax.fused_linear_policy_loss`.

    Returns:
      ``name``.

    Raises:
      ValueError: ``name`` is one of Tunix's built-in losses.
      TypeError: ``objective`` is neither None nor a ``gmpo_jax.GMPO``.
    """
    from tunix.rl import function_registry

    if name in _TUNIX_BUILTIN_LOSSES:
        raise ValueError(f"{name=} is a Tunix built-in loss; choose another name (default {DEFAULT_NAME!r})")
    fn = make_policy_loss_fn(
        objective, compute_entropy=compute_entropy, chunk_size=chunk_size, implementation=implementation
    )
    function_registry.register_policy_loss_fn(name)(fn)
    return name


def make_policy_loss_fn(
    objective: gmpo_jax.GMPO | None = None,
    *,
    compute_entropy: bool = False,
    chunk_size: int | None = None,
    implementation: Any | None = None,
) -> Callable:
    """The fused policy loss as a Tunix policy loss function (see :func:`register` for the arguments).

    Returns:
      ``loss_fn(model, train_example, algo_config, pad_id, eos_id, **unused) -> (loss, aux)``: ``loss`` a
      float32 scalar carrying the gradient to every parameter of ``model`` (LM head included), ``aux`` a
      dict of float32 scalars under Tunix's metric names. Never materialises ``[B, T, V]`` logits when
      traced under ``jax.jit`` (Tunix's trainer jits its train step).
    """
    if objective is not None and not isinstance(objective, gmpo_jax.GMPO):
        raise TypeError(f"objective must be None (Tunix's loss) or a gmpo_jax.GMPO, got {type(objective).__name__}")

    def policy_loss_fn(model, train_example, algo_config, pad_id, eos_id, **unused):
        del unused
        kwargs, scale = loss_arguments(algo_config, train_example, objective)
        ids, mask = train_example.completion_ids, train_example.completion_mask
        hidden = final_hidden_states(
            model,
            train_example.prompt_ids,
            ids,
            pad_id=pad_id,
            eos_id=eos_id,
            segment_ids=getattr(train_example, "segment_ids", None),
        )
        weight, layout = lm_head(model)
        if weight.dtype != hidden.dtype:  # Tunix's heads compute in the activation dtype
            weight = weight.astype(hidden.dtype)
        fused = dict(weight_layout=layout, chunk_size=chunk_size, implementation=implementation)
        loss, a = gmpo_jax.fused_linear_policy_loss(
            hidden, weight, ids, mask, train_example.advantages, **kwargs, **fused
        )
        loss = loss * scale
        aux = {
            "kl": a.kl,
            "pg_clipfrac": a.clip_fraction,
            "pg_clipfrac_low": a.clip_fraction_low,
            "pg_clipfrac_high": a.clip_fraction_high,
            "log_ratio/min": a.log_ratio_min,
            "log_ratio/max": a.log_ratio_max,
        }

        ref = train_example.ref_per_token_logps
        if (ref is not None and kwargs["ref_logps"] is None) or compute_entropy:
            extra, more = _second_pass(
                hidden,
                weight,
                ids,
                mask,
                ref if kwargs["ref_logps"] is None else None,
                algo_config,
                kwargs["temperature"],
                fused,
                compute_entropy,
            )
            loss = loss + extra
            aux.update(more)
        return loss, aux

    policy_loss_fn.__name__ = policy_loss_fn.__qualname__ = "gmpo_jax_policy_loss_fn"
    return policy_loss_fn


def _second_pass(hidden, weight, ids, mask, ref, algo_config, temperature, fused: dict, compute_entropy: bool):
    """``(loss term, metrics)`` of what the fused objective cannot fold in: Tunix's other KL modes (``ref``
    not None) and the entropy metric, from one more fused log-prob pass and Tunix's own functions."""
    from tunix.rl import common

    out = gmpo_jax.fused_linear_logprobs(
        hidden, weight, ids, completion_mask=mask, temperature=temperature, return_entropy=compute_entropy, **fused
    )
    logp, entropy = out if compute_entropy else (out, None)
    agg = algo_config.loss_agg_mode
    extra, aux = jnp.float32(0.0), {}
    if ref is not None:
        kl = common.compute_kl_divergence(
            logp, ref, algo_config.kl_loss_mode, clamp_value=getattr(algo_config, "kl_clamp_value", None)
        )
        aux["kl"] = jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1)
        aux["kl_loss"] = common.aggregate_loss(kl, mask, agg)
        beta = float(getattr(algo_config, "beta", None) or 0.0)
        if beta != 0.0:
            extra = beta * aux["kl_loss"]
    if compute_entropy:
        aux["entropy"] = common.aggregate_loss(entropy, mask, agg)
    return extra, aux


def loss_arguments(
    algo_config: Any, train_example: Any, objective: gmpo_jax.GMPO | None = None
) -> tuple[dict, jax.Array]:
    """Map a Tunix GRPO-family config and ``TrainExample`` onto :func:`gmpo_jax.fused_linear_policy_loss`.

    Args:
      algo_config: a ``GRPOConfig`` / ``DAPOConfig`` / ``DrGRPOConfig`` (read: ``epsilon``,
        ``epsilon_high``, ``epsilon_c``, ``beta``, ``kl_loss_mode``, ``kl_clamp_value``, ``loss_algo``,
        ``loss_agg_mode``, ``temperature``).
      train_example: a Tunix ``TrainExample`` (``completion_mask [B, T]``, ``advantages [B]``,
        ``old_per_token_logps``, ``ref_per_token_logps``, ``sampler_is_weights``).
      objective: None (Tunix's loss) or a ``gmpo_jax.GMPO``.

    Returns:
      ``(kwargs, scale)``: keyword arguments ``objective``, ``old_logps``, ``ref_logps``,
      ``rollout_is_ratio``, ``num_items_in_batch``, ``temperature``; and a float32 scalar by which the
      fused loss is multiplied (``B / non-empty rows`` for ``sequence-mean-token-mean``, else 1).
      ``ref_logps`` is None when the KL cannot be folded into the objective (then the caller computes it).

    Raises:
      NotImplementedError: a Tunix feature with no gmpo_jax counterpart (listed in the module docstring).
      ValueError: an unknown ``loss_agg_mode`` / ``loss_algo``, or a GMPO objective with its own ``beta``.
    """
    agg = algo_config.loss_agg_mode
    loss_algo = getattr(algo_config, "loss_algo", "grpo")
    _check_supported(algo_config, train_example, agg, loss_algo)
    mask = train_example.completion_mask
    B, T = mask.shape
    beta = float(getattr(algo_config, "beta", None) or 0.0)
    ref = train_example.ref_per_token_logps
    fold_kl = (
        ref is not None
        and beta != 0.0
        and algo_config.kl_loss_mode == "low_var_kl"
        and getattr(algo_config, "kl_clamp_value", None) is None
    )
    rows = jnp.sum(jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    sampler_is = getattr(train_example, "sampler_is_weights", None)
    kl_beta = beta if fold_kl else 0.0
    if objective is None:
        objective, scale, num_items = _tunix_objective(algo_config, agg, loss_algo, kl_beta, B, T, rows)
    else:
        objective, scale, num_items = _gmpo_objective(objective, agg, loss_algo, kl_beta, sampler_is, B, rows)

    temperature = getattr(algo_config, "temperature", None)
    temperature = 1.0 if temperature in (None, 0.0, 1.0) else temperature
    kwargs = dict(
        objective=objective,
        old_logps=train_example.old_per_token_logps,
        ref_logps=ref if fold_kl else None,
        rollout_is_ratio=sampler_is,
        num_items_in_batch=num_items,
        temperature=temperature,
    )
    return kwargs, jax.lax.stop_gradient(jnp.asarray(scale, jnp.float32))


def _check_supported(algo_config: Any, train_example: Any, agg: str, loss_algo: str) -> None:
    """Raise for the Tunix features with no gmpo_jax counterpart (the module docstring lists them)."""
    if agg not in _AGG_MODES:
        raise ValueError(f"unknown Tunix {agg=}; expected one of {_AGG_MODES}")
    if loss_algo not in ("grpo", "gspo-token"):
        raise ValueError(f"unknown Tunix {loss_algo=}; expected 'grpo' or 'gspo-token'")
    if getattr(algo_config, "epsilon_c", None) is not None:
        raise NotImplementedError("dual-clip PPO (algo_config.epsilon_c) is not supported by gmpo_jax")
    if getattr(train_example, "segment_ids", None) is not None:
        raise NotImplementedError("packed batches (train_example.segment_ids) are not supported yet")
    adv = train_example.advantages
    if adv.ndim != 1:
        raise NotImplementedError(f"token-level advantages ({adv.shape=}) are not supported; gmpo_jax takes [B]")


def _tunix_objective(algo_config: Any, agg: str, loss_algo: str, beta: float, B: int, T: int, rows):
    """``(GRPO objective, loss scale, num_items_in_batch)`` reproducing Tunix's own loss and aggregation."""
    eps = algo_config.epsilon
    eps_high = getattr(algo_config, "epsilon_high", eps)
    scale, num_items = jnp.float32(1.0), None
    if agg == "sequence-mean-token-mean":
        loss_type, scale = "grpo", B / jnp.maximum(rows, 1.0)
    else:
        loss_type = "dapo"
        num_items = {"token-mean": None, "sequence-mean-token-scale": T * rows}.get(agg, rows)
    objective = gmpo_jax.GRPO(
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        beta=beta,
        importance_sampling_level="sequence" if loss_algo == "gspo-token" else "token",
    )
    return objective, scale, num_items


def _gmpo_objective(objective, agg: str, loss_algo: str, beta: float, sampler_is, B: int, rows):
    """``(GMPO objective with Tunix's beta, loss scale, None)``; raises where Tunix's options do not apply."""
    if objective.beta != 0.0:
        raise ValueError(f"{objective.beta=}: with Tunix set beta in its config (algo_config.beta)")
    if loss_algo != "grpo":
        raise NotImplementedError(f"GMPO is token-level; Tunix {loss_algo=} has no GMPO counterpart")
    if agg != "sequence-mean-token-mean":
        raise NotImplementedError(f"GMPO reduces per sequence; Tunix {agg=} is not supported with it")
    if sampler_is is not None:
        raise NotImplementedError("sampler_is_weights (rollout importance weights) do not apply to GMPO")
    objective = gmpo_jax.GMPO(
        epsilon_low=objective.epsilon_low,
        epsilon_high=objective.epsilon_high,
        beta=beta,
        use_bias_correction_kl=objective.use_bias_correction_kl,
    )
    return objective, B / jnp.maximum(rows, 1.0), None


def final_hidden_states(
    model: Any,
    prompt_ids: jax.Array,
    completion_ids: jax.Array,
    *,
    pad_id: int,
    eos_id: int,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Final (post-norm) hidden states of a Tunix model at the positions that predict ``completion_ids``.

    Runs the model the way Tunix's ``compute_per_token_logps`` does (``tunix.rl.common.process_ids`` for
    positions and the causal padding mask) with ``output_hidden_states=True`` and takes the sown
    ``all_hidden_states``; the model's own logits are then unused and XLA removes them when this runs
    under ``jax.jit``. (Called eagerly, the model still computes them once, without gradient.)

    Args:
      model: a Tunix NNX causal LM whose ``__call__`` takes ``output_hidden_states`` (Qwen2, Qwen3,
        Gemma3, ...).
      prompt_ids: ``[B, P]`` int32, left-padded with ``pad_id``.
      completion_ids: ``[B, T]`` int32, right-padded with ``pad_id``.
      pad_id, eos_id: the tokenizer's ids.
      segment_ids: must be None (packed batches are not supported).

    Returns:
      ``[B, T, D]`` in the model's activation dtype; row ``t`` predicts ``completion_ids[:, t]``.

    Raises:
      NotImplementedError: packed ``segment_ids``; a model without ``output_hidden_states``.
    """
    from flax import nnx
    from tunix.rl import common

    if segment_ids is not None:
        raise NotImplementedError("packed batches (segment_ids) are not supported yet")
    params = inspect.signature(model.__call__).parameters
    if "output_hidden_states" not in params:
        raise NotImplementedError(
            f"{type(model).__name__}.__call__ has no output_hidden_states argument, so its "
            "final hidden states cannot be read without its logits"
        )
    tokens, positions, attn_mask, input_seg_ids = common.process_ids(prompt_ids, completion_ids, pad_id, eos_id)
    kwargs = dict(positions=positions, cache=None, attention_mask=attn_mask, output_hidden_states=True)
    if "segment_ids" in params:  # as Tunix passes it: the per-position non-pad mask
        kwargs["segment_ids"] = input_seg_ids
    model(tokens, **kwargs)
    sown = nnx.pop(model, nnx.Intermediate)
    x = sown["all_hidden_states"]
    x = x.get_value() if isinstance(x, nnx.Variable) else x
    x = x[-1] if isinstance(x, (tuple, list)) else x
    T = completion_ids.shape[1]
    return x[:, -T - 1 : -1]


def lm_head(model: Any) -> tuple[jax.Array, str]:
    """The LM-head weight of a Tunix model and its layout, without a copy.

    Args:
      model: a Tunix model with an ``lm_head`` ``Einsum`` (``w`` of shape ``[D, V]``, layout ``"hv"``) or a
        tied ``embedder`` (``input_embedding`` ``[V, D]``, layout ``"vh"``).

    Returns:
      ``(weight, layout)``: the parameter's own array (traced inside ``nnx.value_and_grad``, so gradients
      reach it) and the ``weight_layout`` for gmpo_jax.

    Raises:
      NotImplementedError: the model applies a final-logit softcap (Gemma 1/2).
      TypeError: no LM head found.
    """
    softcap = getattr(model, "final_logits_softcap", None)
    if softcap is None:
        softcap = getattr(getattr(model, "config", None), "final_logit_softcap", None)
    if softcap is not None:
        raise NotImplementedError(f"final-logit softcap ({softcap=}) is not supported by gmpo_jax's fused loss")
    head = getattr(model, "lm_head", None)
    if head is not None:
        w = head.w[...]
        if getattr(head, "einsum_str", "").replace(" ", "").split("->")[0].split(",")[-1] not in ("DV", ""):
            raise TypeError(f"unexpected LM-head einsum {head.einsum_str!r}; expected '...,DV->...'")
        return w, "hv"
    embedding = getattr(getattr(model, "embedder", None), "input_embedding", None)
    if embedding is not None:
        return embedding[...], "vh"
    raise TypeError(f"{type(model).__name__} has neither an lm_head Einsum nor an embedder.input_embedding")
