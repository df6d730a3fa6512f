"""Tunix's config and ``TrainExample`` mapped onto gmpo_jax (:func:`loss_arguments`): the
:class:`gmpo_jax.PolicyBatch`, the objective reproducing Tunix's loss and aggregation (or GMPO), the
temperature and the loss scale; and every check of what has no gmpo_jax counterpart."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import gmpo_jax
from gmpo_jax._validation import _concrete
from gmpo_jax.objectives import Objective, Sequences

__all__ = ["LossArguments", "loss_arguments", "AGG_MODES"]

AGG_MODES = (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "seq-mean-token-sum",
    "sequence-mean-token-sum-norm",
)


class LossArguments(NamedTuple):
    """What :func:`loss_arguments` maps a Tunix config and ``TrainExample`` onto.

    Attributes:
      batch: the :class:`gmpo_jax.PolicyBatch`: ``completion_ids``, ``completion_mask``, ``advantages``,
        ``old_logps`` (``old_per_token_logps``), ``ref_logps`` (``ref_per_token_logps`` when the KL folds into
        the objective, else None: the caller computes it), ``rollout_is_ratio`` (``sampler_is_weights``),
        ``segment_ids`` (None padded) and ``num_items_in_batch``.
      objective: the ``GRPO`` reproducing Tunix's loss, or the ``GMPO`` given, with the config's ``beta`` when
        the KL folds in (else 0).
      temperature: the config's ``temperature`` (0 and 1 mean none, as in Tunix).
      scale: a float32 scalar (no gradient) by which the fused loss is multiplied (``n / n+`` for
        ``sequence-mean-token-mean`` and GMPO, else 1).
    """

    batch: gmpo_jax.PolicyBatch
    objective: Objective
    temperature: float
    scale: jax.Array


def loss_arguments(
    algo_config: Any,
    train_example: Any,
    objective: gmpo_jax.GMPO | None = None,
    *,
    max_completion_length: int | None = None,
) -> LossArguments:
    """Map a Tunix GRPO-family config and ``TrainExample`` onto :func:`gmpo_jax.fused_linear_policy_loss`'s
    batch, objective and temperature (:class:`LossArguments`).

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
      train_example: a Tunix ``TrainExample``: ``completion_ids`` and ``completion_mask [B, T]``,
        ``advantages [B]`` or ``[B, T]``, ``old_per_token_logps``, ``ref_per_token_logps``,
        ``sampler_is_weights`` and, packed, ``segment_ids [B, T]`` (then ``T`` is the packed row length).
      objective: None (Tunix's loss) or a ``gmpo_jax.GMPO`` (its loss shaping kept).
      max_completion_length: ``norm`` of ``sequence-mean-token-scale``; None: ``T`` (Tunix's default).

    Returns:
      :class:`LossArguments` ``(batch, objective, temperature, scale)``.

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
    batch = gmpo_jax.PolicyBatch(
        train_example.completion_ids,
        mask,
        train_example.advantages,
        old_logps=train_example.old_per_token_logps,
        ref_logps=ref if fold_kl else None,
        rollout_is_ratio=sampler_is,
        segment_ids=segment_ids,
        num_items_in_batch=num_items,
    )
    return LossArguments(batch, objective, temperature, jax.lax.stop_gradient(jnp.asarray(scale, jnp.float32)))


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
    if agg not in AGG_MODES:
        raise ValueError(f"unknown Tunix {agg=}; expected one of {AGG_MODES}")
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
    return dataclasses.replace(objective, beta=beta), n / jnp.maximum(nonempty, 1.0), None


def _live(mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """The tokens that count, bool ``[B, T]``: ``mask != 0``, and packed also ``segment_ids > 0``."""
    live = jnp.asarray(mask) != 0
    return live if segment_ids is None else live & (jnp.asarray(segment_ids) > 0)


def _sequence_counts(live: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(n, n+)`` float32: the sequences gmpo_jax's per-sequence normalisers count (``B`` padded, the
    positive-id runs packed, at least 1) and those with at least one live token."""
    seqs = Sequences.of(live, segment_ids)
    return seqs.count(), jnp.sum(seqs.lengths(live) > 0).astype(jnp.float32)
