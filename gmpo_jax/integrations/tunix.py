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

Both of Tunix's layouts work. Padded: one sequence per row, ``prompt_ids [B, P]`` left-padded,
``completion_ids [B, T]``, ``advantages [B]`` (or ``[B, T]``). Packed (``RLTrainingConfig(
max_seq_token_per_tpu=...)``, ``tunix.rl.utils.pack_sequences``): ``prompt_ids [B, 0]``, ``completion_ids
[B, L]`` the packed buffer (each sequence's prompt then its completion), ``completion_mask`` 1 on the
completion tokens, ``advantages [B, L]``, ``segment_ids [B, L]`` (1, 2, ... per sequence, 0 padding) and
``segment_positions [B, L]``. With packed rows every Tunix aggregation is applied per packed sequence,
exactly as it is per row of the padded layout, so the same sequences give the same loss and gradients in
either layout ("sequence" below: a row padded, a positive-id run of ``segment_ids`` packed; "non-empty":
with at least one completion token; ``n`` all sequences, ``n+`` the non-empty ones).

How Tunix's settings map (``objective=None``, i.e. Tunix's ``grpo`` loss):

=====================================  =============================================================
Tunix                                  gmpo_jax
=====================================  =============================================================
``epsilon``, ``epsilon_high``          ``GRPO(epsilon_low=, epsilon_high=)`` (``epsilon_high`` defaults
                                       to ``epsilon`` as in Tunix)
``loss_algo="grpo"`` / ``"gspo-token"``  ``importance_sampling_level="token"`` / ``"sequence"`` (GSPO and
                                       GSPO-token have the same value and gradients when the advantage
                                       and the per-token weights are constant within each sequence,
                                       under every linear aggregation)
``loss_agg_mode="token-mean"``         ``loss_type="dapo"`` (normaliser: token count)
``"sequence-mean-token-mean"``         ``loss_type="grpo"`` times ``n / n+`` (grpo divides by ``n``)
``"sequence-mean-token-scale"``        ``loss_type="dapo"``, ``num_items_in_batch = norm * n+`` (``norm``:
                                       ``max_completion_length=``, default the width of
                                       ``completion_ids`` as in Tunix: ``T`` padded, ``L`` packed)
``"seq-mean-token-sum"``,              ``loss_type="dapo"``, ``num_items_in_batch = n+``
``"sequence-mean-token-sum-norm"``
``beta``, ``kl_loss_mode="low_var_kl"``  ``beta=``, ``ref_logps=`` (k3 KL, in the same fused pass)
other ``kl_loss_mode`` / ``kl_clamp_value``  a second fused pass (:func:`gmpo_jax.fused_linear_logprobs`)
                                       feeding Tunix's ``compute_kl_divergence``, aggregated per sequence
``old_per_token_logps``                ``old_logps=`` (None: on-policy)
``sampler_is_weights``                 ``rollout_is_ratio=``
``temperature`` (from the rollout config)  ``temperature=`` (0 and 1 mean none, as in Tunix)
``segment_ids``, ``segment_positions``     ``segment_ids=`` (and the model's positions, see
                                       :func:`final_hidden_states`)
``advantages`` ``[B]`` or ``[B, T]``       ``advantages`` as given (per token in the GRPO family)
=====================================  =============================================================

With ``objective=gmpo_jax.GMPO(...)`` the objective's epsilons are used (Tunix's ``epsilon`` is ignored);
``beta`` and the reference still come from the Tunix config (the objective's own ``beta`` must be 0, checked by
:func:`register`: Tunix computes the reference log-probs only when its config's ``beta`` is non-zero);
``loss_agg_mode`` must be ``"sequence-mean-token-mean"`` (GMPO's own reduction is per sequence: the
geometric mean over each packed sequence, the mean of ``-A exp(s)`` over the ``n+`` non-empty sequences,
``A`` a sequence's mean token advantage).

Metrics (aux, Tunix's names): ``kl`` (mean per-token KL over unmasked tokens, 0 without a reference),
``pg_clipfrac``, ``pg_clipfrac_low``, ``pg_clipfrac_high``, ``log_ratio/min``, ``log_ratio/max``;
``kl_loss`` when the KL ran as a second pass; ``entropy`` with ``compute_entropy=True`` (one more pass);
the last two aggregated per sequence like the loss.

Not mapped (``NotImplementedError`` naming the feature): dual-clip PPO (``epsilon_c``), ``gspo-token``
with ``sampler_is_weights`` (per-token weights make GSPO-token's gradient differ from a sequence ratio's),
models whose ``__call__`` has no ``output_hidden_states``;
with GMPO also ``gspo-token``, other aggregation modes and ``use_bias_correction_kl`` with a KL that Tunix
computes itself (a ``kl_loss_mode`` other than ``"low_var_kl"``, or ``kl_clamp_value``) (GMPO takes ``sampler_is_weights`` as
``rollout_is_ratio``: each sequence's term times the geometric mean of its tokens' weights). ``gspo-token`` with
``[B, T]`` advantages that vary within a sequence gives GSPO-token's loss value but a sequence ratio's
gradient (Tunix's own learners give one advantage per sequence, also when packed). Tunix clamps token
log-ratios to [-20, 20] (and GSPO-token's to 10) before ``exp``; gmpo_jax does not clamp (it is exact
wherever float32 can represent the ratio), so the two differ only for ratios beyond e^20.

Where Tunix 0.1.7's own ``grpo`` loss differs on packed rows (docs/tunix.md): its ``aggregate_loss``
treats a packed row as one sequence (``sequence-mean-token-mean`` becomes a token mean per row, the
``token-scale`` / ``token-sum`` modes divide by packed rows, not sequences), ``gspo-token`` averages the
log-ratio over the whole row, and it calls the model with ``attention_mask=None``, which outside the
splash (flash) attention kernel leaves attention neither causal nor per segment.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gmpo_jax
from gmpo_jax._validation import _concrete, check_logits_precision
from gmpo_jax.objectives import Sequences

__all__ = [
    "DEFAULT_NAME",
    "register",
    "make_policy_loss_fn",
    "final_hidden_states",
    "lm_head",
    "logit_softcap",
    "loss_arguments",
]

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
    replace: bool = False,
    algo_config: Any | None = None,
    compute_entropy: bool = False,
    chunk_size: int | None = None,
    implementation: Any | None = None,
    max_completion_length: int | None = None,
    logits_precision: str | None = None,
) -> str:
    """Register the fused policy loss with Tunix under ``name`` and return ``name``.

    Pass the result as ``policy_loss_fn=`` of ``GRPOConfig`` / ``DAPOConfig`` / ``DrGRPOConfig`` (they do
    not validate the name) before building the learner, which looks the function up in its ``__init__``.

    Everything that can be checked before the learner's first step is checked here, so that a mistake
    raises now rather than inside the learner's loss after the first rollout: the objective (a GMPO's own
    ``beta`` must be 0: the learner passes the KL coefficient in its config's ``beta`` and computes the
    reference log-probs only when that ``beta`` is non-zero), the name and, when given, the learner's config
    (what :func:`loss_arguments` would raise on its first call for the config alone).

    Args:
      name: the registry name, a non-empty string; Tunix's own ``"grpo"`` and ``"ppo"`` are refused (nothing
        of Tunix is overwritten).
      objective: None for Tunix's own GRPO-family loss as its config describes it, or a
        :class:`gmpo_jax.GMPO` for GMPO, with ``beta=0`` (set the KL coefficient as the config's ``beta``).
      replace: a ``name`` already in Tunix's registry (registered earlier, by this function or another) is
        refused unless True; then the new function replaces it (Tunix logs a warning).
      algo_config: optional, the learner's ``GRPOConfig`` / ``DAPOConfig`` / ``DrGRPOConfig``: checked now
        (its ``policy_loss_fn`` must be ``name``; the aggregation mode, ``loss_algo``, ``epsilon_c`` and,
        with GMPO, the modes GMPO supports); create the config with ``policy_loss_fn=name``, then register.
      compute_entropy: also report Tunix's ``entropy`` metric (one more fused pass, no gradient).
      chunk_size, implementation: passed to :func:`gmpo_jax.fused_linear_policy_loss`.
      logits_precision: passed to it too; set (``"float32"``), the head weight keeps its own dtype (a float32
        weight with bfloat16 activations runs in the kernels, float32-accurate), else it is cast to the
        activations' dtype as Tunix's heads compute.
      max_completion_length: the per-token scale ``norm`` of ``loss_agg_mode="sequence-mean-token-scale"``
        (Dr.GRPO): each sequence's token sum is divided by it. None: Tunix's default, the width of
        ``completion_ids`` (the completion length ``T`` padded, the packed row length ``L`` packed); set
        it to the rollout's ``max_tokens_to_generate`` to give packed rows the padded layout's scale.

    Returns:
      ``name``.

    Raises:
      ValueError: ``name`` is one of Tunix's built-in losses, or already registered and ``replace`` is
        False; a GMPO objective whose ``beta`` is not 0; ``max_completion_length`` not a positive integer;
        ``algo_config.policy_loss_fn`` is not ``name``; what :func:`loss_arguments` raises for
        ``algo_config``'s aggregation mode or ``loss_algo``.
      NotImplementedError: a feature of ``algo_config`` with no gmpo_jax counterpart (module docstring).
      TypeError: ``name`` not a non-empty string; ``objective`` is neither None nor a ``gmpo_jax.GMPO``.

    Nothing is registered when it raises.
    """
    from tunix.rl import function_registry

    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if name in _TUNIX_BUILTIN_LOSSES:
        raise ValueError(f"{name=} is a Tunix built-in loss; choose another name (default {DEFAULT_NAME!r})")
    fn = make_policy_loss_fn(
        objective,
        compute_entropy=compute_entropy,
        chunk_size=chunk_size,
        implementation=implementation,
        max_completion_length=max_completion_length,
        logits_precision=logits_precision,
    )
    if algo_config is not None:
        configured = getattr(algo_config, "policy_loss_fn", name)
        if configured != name:
            raise ValueError(
                f"algo_config.policy_loss_fn={configured!r} but this registers {name=}: the learner would not "
                "use this loss; create the config with policy_loss_fn=name"
            )
        _check_config(algo_config, objective)
    try:
        function_registry.get_policy_loss_fn(name)
    except LookupError:
        pass
    else:
        if not replace:
            raise ValueError(
                f"a policy loss named {name!r} is already registered with Tunix; choose another name, or pass "
                "replace=True to replace it"
            )
    function_registry.register_policy_loss_fn(name)(fn)
    return name


def make_policy_loss_fn(
    objective: gmpo_jax.GMPO | None = None,
    *,
    compute_entropy: bool = False,
    chunk_size: int | None = None,
    implementation: Any | None = None,
    max_completion_length: int | None = None,
    logits_precision: str | None = None,
) -> Callable:
    """The fused policy loss as a Tunix policy loss function (see :func:`register` for the arguments).

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
      TypeError: ``objective`` is neither None nor a ``gmpo_jax.GMPO``; ``logits_precision`` not a string.
      ValueError: a GMPO objective whose ``beta`` is not 0; ``max_completion_length`` not a positive integer;
        an unknown ``logits_precision``.
    """
    check_logits_precision(logits_precision)
    _check_objective(objective)
    _check_max_completion_length(max_completion_length)

    def policy_loss_fn(model, train_example, algo_config, pad_id, eos_id, **unused):
        del unused
        kwargs, scale = loss_arguments(
            algo_config, train_example, objective, max_completion_length=max_completion_length
        )
        ids, mask = train_example.completion_ids, train_example.completion_mask
        segment_ids = kwargs["segment_ids"]
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
        if weight.dtype != hidden.dtype and logits_precision is None:  # Tunix's heads compute in the activation dtype
            weight = weight.astype(hidden.dtype)
        fused = dict(
            weight_layout=layout,
            chunk_size=chunk_size,
            implementation=implementation,
            softcap=logit_softcap(model),
            logits_precision=logits_precision,
        )
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
            norm = max_completion_length or ids.shape[1]
            extra, more = _second_pass(
                hidden,
                weight,
                ids,
                _live(mask, segment_ids),
                segment_ids,
                ref if kwargs["ref_logps"] is None else None,
                algo_config,
                kwargs["temperature"],
                fused,
                compute_entropy,
                norm,
            )
            loss = loss + extra
            aux.update(more)
        return loss, aux

    policy_loss_fn.__name__ = policy_loss_fn.__qualname__ = "gmpo_jax_policy_loss_fn"
    return policy_loss_fn


def _second_pass(
    hidden, weight, ids, live, segment_ids, ref, algo_config, temperature, fused: dict, compute_entropy: bool, norm
):
    """``(loss term, metrics)`` of what the fused objective cannot fold in: Tunix's other KL modes (``ref``
    not None) and the entropy metric, from one more fused log-prob pass, Tunix's ``compute_kl_divergence``
    and :func:`_aggregate` (Tunix's ``aggregate_loss`` per sequence)."""
    from tunix.rl import common

    out = gmpo_jax.fused_linear_logprobs(
        hidden, weight, ids, completion_mask=live, temperature=temperature, return_entropy=compute_entropy, **fused
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


def _live(mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """The tokens that count, bool ``[B, T]``: ``mask != 0``, and packed also ``segment_ids > 0``."""
    live = jnp.asarray(mask) != 0
    return live if segment_ids is None else live & (jnp.asarray(segment_ids) > 0)


def _sequence_counts(live: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(n, n+)`` float32: the sequences gmpo_jax's per-sequence normalisers count (``B`` padded, the
    positive-id runs packed, at least 1) and those with at least one live token."""
    seqs = Sequences.of(live, segment_ids)
    return seqs.count(), jnp.sum(seqs.lengths(live) > 0).astype(jnp.float32)


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


def loss_arguments(
    algo_config: Any,
    train_example: Any,
    objective: gmpo_jax.GMPO | None = None,
    *,
    max_completion_length: int | None = None,
) -> tuple[dict, jax.Array]:
    """Map a Tunix GRPO-family config and ``TrainExample`` onto :func:`gmpo_jax.fused_linear_policy_loss`.

    Tunix's ``loss_agg_mode`` is applied per sequence (a row padded, a positive-id run of ``segment_ids``
    packed; ``n`` sequences, ``n+`` of them with a completion token): with the per-token loss ``ptl`` and
    mask ``m``, ``token-mean`` = ``sum m ptl / sum m``; ``sequence-mean-token-mean`` = ``(1/n+) sum_s
    (sum_{t in s} m ptl / sum_{t in s} m)`` (gmpo_jax's ``grpo`` divides by ``n``, hence ``scale = n /
    n+``); ``sequence-mean-token-scale`` = ``sum m ptl / (norm n+)``; ``seq-mean-token-sum`` and
    ``sequence-mean-token-sum-norm`` = ``sum m ptl / n+``. GMPO: ``(1/n+) sum_s -A_s exp(s_s)`` (+ KL).

    Args:
      algo_config: a ``GRPOConfig`` / ``DAPOConfig`` / ``DrGRPOConfig`` (read: ``epsilon``,
        ``epsilon_high``, ``epsilon_c``, ``beta``, ``kl_loss_mode``, ``kl_clamp_value``, ``loss_algo``,
        ``loss_agg_mode``, ``temperature``).
      train_example: a Tunix ``TrainExample``: ``completion_mask [B, T]``, ``advantages [B]`` or
        ``[B, T]``, ``old_per_token_logps``, ``ref_per_token_logps``, ``sampler_is_weights`` and, packed,
        ``segment_ids [B, T]`` (then ``T`` is the packed row length).
      objective: None (Tunix's loss) or a ``gmpo_jax.GMPO``.
      max_completion_length: ``norm`` of ``sequence-mean-token-scale``; None: ``T`` (Tunix's default).

    Returns:
      ``(kwargs, scale)``: keyword arguments ``objective``, ``old_logps``, ``ref_logps``,
      ``rollout_is_ratio``, ``num_items_in_batch``, ``temperature``, ``segment_ids`` (None padded); and a
      float32 scalar by which the fused loss is multiplied (``n / n+`` for ``sequence-mean-token-mean``
      and GMPO, else 1). ``ref_logps`` is None when the KL cannot be folded into the objective (then the
      caller computes it).

    Raises:
      NotImplementedError: a Tunix feature with no gmpo_jax counterpart (listed in the module docstring).
      ValueError: an unknown ``loss_agg_mode`` / ``loss_algo``, a GMPO objective with its own ``beta``,
        ``advantages`` neither ``[B]`` nor ``[B, T]``, ``max_completion_length`` not a positive integer,
        or (checked when concrete) a packed ``completion_mask`` of 1 at a sequence's first token, which
        has no prediction in the packed layout (:func:`final_hidden_states`).
    """
    agg = algo_config.loss_agg_mode
    loss_algo = getattr(algo_config, "loss_algo", "grpo")
    _check_objective(objective)
    _check_config(algo_config, objective)
    _check_example(train_example, loss_algo)
    _check_max_completion_length(max_completion_length)
    mask = train_example.completion_mask
    segment_ids = getattr(train_example, "segment_ids", None)
    if segment_ids is not None:
        _check_sequence_starts(mask, segment_ids)
    B, T = mask.shape
    beta = float(getattr(algo_config, "beta", None) or 0.0)
    ref = train_example.ref_per_token_logps
    fold_kl = ref is not None and beta != 0.0 and _folds_kl(algo_config)
    n, nonempty = _sequence_counts(_live(mask, segment_ids), segment_ids)
    sampler_is = getattr(train_example, "sampler_is_weights", None)
    kl_beta = beta if fold_kl else 0.0
    if objective is None:
        norm = max_completion_length or T
        objective, scale, num_items = _tunix_objective(algo_config, agg, loss_algo, kl_beta, norm, n, nonempty)
    else:
        objective, scale, num_items = _gmpo_objective(objective, kl_beta, n, nonempty)

    temperature = getattr(algo_config, "temperature", None)
    temperature = 1.0 if temperature in (None, 0.0, 1.0) else temperature
    kwargs = dict(
        objective=objective,
        old_logps=train_example.old_per_token_logps,
        ref_logps=ref if fold_kl else None,
        rollout_is_ratio=sampler_is,
        num_items_in_batch=num_items,
        temperature=temperature,
        segment_ids=segment_ids,
    )
    return kwargs, jax.lax.stop_gradient(jnp.asarray(scale, jnp.float32))


def _check_max_completion_length(max_completion_length) -> None:
    if max_completion_length is None:
        return
    if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, (int, np.integer)):
        raise ValueError(f"max_completion_length must be a positive integer or None, got {max_completion_length!r}")
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be a positive integer or None, got {max_completion_length}")


def _check_objective(objective) -> None:
    """Raise for an objective the learner cannot run: neither None nor a GMPO, or a GMPO with its own beta."""
    if objective is None:
        return
    if not isinstance(objective, gmpo_jax.GMPO):
        raise TypeError(f"objective must be None (Tunix's loss) or a gmpo_jax.GMPO, got {type(objective).__name__}")
    beta = _concrete(objective.beta)
    if beta is None or beta.shape != () or float(beta) != 0.0:
        raise ValueError(
            f"objective.beta={objective.beta!r} must be 0 with Tunix: the learner passes the KL coefficient as its "
            "config's beta (GRPOConfig(beta=...)) and computes the reference log-probs "
            "(train_example.ref_per_token_logps) only when that beta is non-zero; gmpo_jax applies the config's "
            "beta. Pass GMPO(beta=0.0) and set the config's beta"
        )


def _folds_kl(algo_config: Any) -> bool:
    """True iff Tunix's KL is the k3 KL that the fused objective computes itself (else a second pass)."""
    return algo_config.kl_loss_mode == "low_var_kl" and getattr(algo_config, "kl_clamp_value", None) is None


def _check_config(algo_config: Any, objective) -> None:
    """Raise for the config's Tunix features with no gmpo_jax counterpart (the module docstring lists them),
    for ``objective`` (None or a GMPO) as :func:`loss_arguments` will use it."""
    agg = algo_config.loss_agg_mode
    loss_algo = getattr(algo_config, "loss_algo", "grpo")
    if agg not in _AGG_MODES:
        raise ValueError(f"unknown Tunix {agg=}; expected one of {_AGG_MODES}")
    if loss_algo not in ("grpo", "gspo-token"):
        raise ValueError(f"unknown Tunix {loss_algo=}; expected 'grpo' or 'gspo-token'")
    if getattr(algo_config, "epsilon_c", None) is not None:
        raise NotImplementedError("dual-clip PPO (algo_config.epsilon_c) is not supported by gmpo_jax")
    if objective is None:
        return
    if loss_algo != "grpo":
        raise NotImplementedError(f"GMPO is token-level; Tunix {loss_algo=} has no GMPO counterpart")
    if agg != "sequence-mean-token-mean":
        raise NotImplementedError(f"GMPO reduces per sequence; Tunix {agg=} is not supported with it")
    beta = float(getattr(algo_config, "beta", None) or 0.0)
    if objective.use_bias_correction_kl and beta != 0.0 and not _folds_kl(algo_config):
        raise NotImplementedError(
            "GMPO(use_bias_correction_kl=True) corrects the k3 KL that GMPO computes itself; Tunix's "
            f"kl_loss_mode={algo_config.kl_loss_mode!r} / kl_clamp_value="
            f"{getattr(algo_config, 'kl_clamp_value', None)!r} run as Tunix's own KL, which it would not "
            "correct: set kl_loss_mode='low_var_kl' and kl_clamp_value=None, or use_bias_correction_kl=False"
        )


def _check_example(train_example: Any, loss_algo: str) -> None:
    """Raise for the train example's Tunix features with no gmpo_jax counterpart, and its advantages' shape."""
    if loss_algo == "gspo-token" and getattr(train_example, "sampler_is_weights", None) is not None:
        raise NotImplementedError(
            "loss_algo='gspo-token' with train_example.sampler_is_weights is not supported: with per-token "
            "weights GSPO-token's gradient differs from gmpo_jax's sequence-level ratio's"
        )
    adv, mask = train_example.advantages, train_example.completion_mask
    if tuple(adv.shape) not in (tuple(mask.shape[:1]), tuple(mask.shape)):
        raise ValueError(
            f"train_example.advantages must be [B] or [B, T] = {tuple(mask.shape)} (completion_mask's shape), "
            f"got {tuple(adv.shape)}"
        )


def _check_sequence_starts(mask, segment_ids) -> None:
    """Raise if a concrete packed ``completion_mask`` counts a sequence's first token (see
    :func:`final_hidden_states`: nothing in the sequence predicts it)."""
    m, seg = _concrete(mask), _concrete(segment_ids)
    if m is None or seg is None or m.shape != seg.shape or seg.ndim != 2:
        return
    start = np.ones(seg.shape, bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    bad = np.argwhere(start & (seg > 0) & (m != 0))
    if bad.size:
        r, t = (int(i) for i in bad[0])
        raise ValueError(
            f"completion_mask[{r}, {t}] is 1 at the first token of a packed sequence (segment_ids[{r}, {t}] = "
            f"{int(seg[r, t])}): nothing in its sequence predicts that token. Each packed sequence must start "
            "with a masked (prompt) token, as Tunix's pack_sequences lays them out"
        )


def _tunix_objective(algo_config: Any, agg: str, loss_algo: str, beta: float, norm, n, nonempty):
    """``(GRPO objective, loss scale, num_items_in_batch)`` reproducing Tunix's own loss and aggregation,
    per sequence (``n`` sequences, ``nonempty`` with a completion token, ``norm`` the token-scale divisor)."""
    eps = algo_config.epsilon
    eps_high = getattr(algo_config, "epsilon_high", eps)
    scale, num_items = jnp.float32(1.0), None
    if agg == "sequence-mean-token-mean":
        loss_type, scale = "grpo", n / jnp.maximum(nonempty, 1.0)
    else:
        loss_type = "dapo"
        num_items = {"token-mean": None, "sequence-mean-token-scale": norm * nonempty}.get(agg, nonempty)
    objective = gmpo_jax.GRPO(
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        beta=beta,
        importance_sampling_level="sequence" if loss_algo == "gspo-token" else "token",
    )
    return objective, scale, num_items


def _gmpo_objective(objective, beta: float, n, nonempty):
    """``(GMPO objective with Tunix's beta, loss scale, None)`` (:func:`_check_config` checked the modes).
    ``sampler_is_weights`` pass as ``rollout_is_ratio`` (GMPO weights each sequence by the geometric mean of
    its tokens' weights, SPEC.md "Rollout correction")."""
    objective = gmpo_jax.GMPO(
        epsilon_low=objective.epsilon_low,
        epsilon_high=objective.epsilon_high,
        beta=beta,
        use_bias_correction_kl=objective.use_bias_correction_kl,
    )
    return objective, n / jnp.maximum(nonempty, 1.0), None


def final_hidden_states(
    model: Any,
    prompt_ids: jax.Array,
    completion_ids: jax.Array,
    *,
    pad_id: int,
    eos_id: int,
    segment_ids: jax.Array | None = None,
    segment_positions: jax.Array | None = None,
) -> jax.Array:
    """Final (post-norm) hidden states of a Tunix model at the positions that predict ``completion_ids``.

    Runs the model with ``output_hidden_states=True`` and takes the sown ``all_hidden_states``; the
    model's own logits are then unused and XLA removes them when this runs under ``jax.jit``. (Called
    eagerly, the model still computes them once, without gradient.) ``segment_ids`` reach the model when
    its ``__call__`` takes them (or ``**kwargs``), as in Tunix's ``compute_per_token_logps``.

    Padded layout (``segment_ids`` None): tokens ``concat(prompt_ids, completion_ids)``, positions and
    the causal padding mask from Tunix's ``common.process_ids``, the per-position non-pad mask as
    ``segment_ids``; returns ``x[:, P-1 : P+T-1]`` (``x`` the ``[B, P+T, D]`` states), so row ``t``
    predicts ``completion_ids[:, t]``.

    Packed layout (Tunix's ``pack_sequences``): tokens ``completion_ids`` (the packed buffer, prompts and
    completions), positions ``segment_positions``, ``segment_ids`` passed to the model, and the
    attention mask ``M[b, q, k] = (k <= q) and segment_ids[b, q] == segment_ids[b, k]`` (causal within a
    segment: what the splash kernel computes from ``segment_ids``; Tunix passes ``attention_mask=None``,
    which its non-flash attention takes as no mask at all). Returns ``y[:, t] = x[:, t - 1]`` for
    ``t >= 1`` and ``y[:, 0] = 0``: the shift of Tunix's packed log-probs (``logits[:, :-1]`` left-padded
    by one), so row ``t`` predicts token ``t``. Row 0, and the first row of every later sequence (which
    holds the previous sequence's last state), predict nothing within their sequence: the completion mask
    must be 0 there. Tunix's packing puts each sequence's prompt (mask 0) first, so it is;
    :func:`loss_arguments` checks a concrete mask.

    Args:
      model: a Tunix NNX causal LM whose ``__call__`` takes ``output_hidden_states`` (Qwen2, Qwen3,
        Gemma3, ...).
      prompt_ids: ``[B, P]`` int32, left-padded with ``pad_id``; ``[B, 0]`` when packed.
      completion_ids: ``[B, T]`` int32, right-padded with ``pad_id``; packed: the ``[B, L]`` buffer.
      pad_id, eos_id: the tokenizer's ids.
      segment_ids: None (padded) or ``[B, L]`` int, packed: 1, 2, ... per sequence, 0 for padding.
      segment_positions: ``[B, L]`` int, each token's position within its sequence; required with
        ``segment_ids`` (as in Tunix), else must be None.

    Returns:
      ``[B, T, D]`` (``[B, L, D]`` packed) in the model's activation dtype; row ``t`` predicts
      ``completion_ids[:, t]``.

    Raises:
      ValueError: ``segment_ids`` without ``segment_positions`` or the reverse, a packed ``prompt_ids``
        that is not ``[B, 0]``, or ``segment_ids`` / ``segment_positions`` not of ``completion_ids``'s
        shape.
      NotImplementedError: a model without ``output_hidden_states``.
    """
    from flax import nnx
    from tunix.rl import common

    params = inspect.signature(model.__call__).parameters
    if "output_hidden_states" not in params:
        raise NotImplementedError(
            f"{type(model).__name__}.__call__ has no output_hidden_states argument, so its "
            "final hidden states cannot be read without its logits"
        )
    takes_segment_ids = "segment_ids" in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    packed = segment_ids is not None
    if packed:
        _check_packed_layout(prompt_ids, completion_ids, segment_ids, segment_positions)
        tokens, positions, model_seg = completion_ids, segment_positions, segment_ids
        attn_mask = _packed_attention_mask(segment_ids)
    else:
        if segment_positions is not None:
            raise ValueError("segment_positions is given without segment_ids; pass both (packed) or neither")
        tokens, positions, attn_mask, model_seg = common.process_ids(prompt_ids, completion_ids, pad_id, eos_id)
    kwargs = dict(positions=positions, cache=None, attention_mask=attn_mask, output_hidden_states=True)
    if takes_segment_ids:  # as Tunix passes them: the packing ids, else the per-position non-pad mask
        kwargs["segment_ids"] = model_seg
    model(tokens, **kwargs)
    sown = nnx.pop(model, nnx.Intermediate)
    x = sown["all_hidden_states"]
    x = x.get_value() if isinstance(x, nnx.Variable) else x
    x = x[-1] if isinstance(x, (tuple, list)) else x
    if packed:
        return jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))
    T = completion_ids.shape[1]
    return x[:, -T - 1 : -1]


def _check_packed_layout(prompt_ids, completion_ids, segment_ids, segment_positions) -> None:
    """The packed layout's shapes, with errors naming the argument."""
    if segment_positions is None:
        raise ValueError(
            "segment_positions must be given with segment_ids (packed batches): each token's position "
            "within its sequence, as Tunix's pack_sequences sets train_example.segment_positions"
        )
    shape = tuple(completion_ids.shape)
    if tuple(prompt_ids.shape) != shape[:1] + (0,):
        raise ValueError(
            f"packed batches hold prompts and completions in completion_ids, so prompt_ids must be "
            f"[B, 0] = {shape[:1] + (0,)}, got {tuple(prompt_ids.shape)}"
        )
    for name, x in (("segment_ids", segment_ids), ("segment_positions", segment_positions)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have completion_ids' shape {shape}, got {tuple(x.shape)}")


def _packed_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """``[B, L, L]`` bool: causal attention within each segment (padding, id 0, attends to padding)."""
    L = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((L, L), bool))
    return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def logit_softcap(model: Any) -> float | None:
    """The final-logit soft cap ``c`` of a Tunix model (Gemma 1/2: ``logits = c tanh(logits / c)``), or None.

    Read from ``model.final_logits_softcap`` or ``model.config.final_logit_softcap``; passed as
    ``softcap=`` to the fused calls, so that their logits equal the model's own."""
    softcap = getattr(model, "final_logits_softcap", None)
    if softcap is None:
        softcap = getattr(getattr(model, "config", None), "final_logit_softcap", None)
    return None if softcap is None else float(softcap)


def lm_head(model: Any) -> tuple[jax.Array, str]:
    """The LM-head weight of a Tunix model and its layout, without a copy.

    Args:
      model: a Tunix model with an ``lm_head`` ``Einsum`` (``w`` of shape ``[D, V]``, layout ``"hv"``) or a
        tied ``embedder`` (``input_embedding`` ``[V, D]``, layout ``"vh"``).

    Returns:
      ``(weight, layout)``: the parameter's own array (traced inside ``nnx.value_and_grad``, so gradients
      reach it) and the ``weight_layout`` for gmpo_jax.

    Raises:
      TypeError: no LM head found.

    A model's final-logit soft cap (Gemma 1/2) is not part of the weight: :func:`logit_softcap` reads it.
    """
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
