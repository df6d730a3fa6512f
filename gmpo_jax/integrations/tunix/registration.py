"""Registering the fused policy loss with Tunix (:func:`register`): the checks that can run before the learner's
first step, then Tunix's public registry."""

from __future__ import annotations

from typing import Any

import gmpo_jax
from gmpo_jax.integrations.tunix.loss import make_policy_loss_fn
from gmpo_jax.integrations.tunix.mapping import _check_config

__all__ = ["DEFAULT_NAME", "register"]

DEFAULT_NAME = "gmpo_jax"
_TUNIX_BUILTIN_LOSSES = ("grpo", "ppo")


def register(
    name: str = DEFAULT_NAME,
    objective: gmpo_jax.GMPO | None = None,
    *,
    replace: bool = False,
    algo_config: Any | None = None,
    compute_entropy: bool = False,
    head: gmpo_jax.HeadOptions | None = None,
    max_completion_length: int | None = None,
) -> str:
    """Register the fused policy loss with Tunix under ``name`` and return ``name``.

    Pass the result as ``policy_loss_fn=`` of ``GRPOConfig`` / ``DAPOConfig`` / ``DrGRPOConfig`` (they do
    not validate the name) before building the learner, which looks the function up in its ``__init__``.

    Everything that can be checked before the learner's first step is checked here, so that a mistake
    raises now rather than inside the learner's loss after the first rollout: the objective (a GMPO's own
    ``beta`` must be 0: the learner passes the KL coefficient in its config's ``beta`` and computes the
    reference log-probs only when that ``beta`` is non-zero), the name and, when given, the learner's config
    (what :func:`~gmpo_jax.integrations.tunix.loss_arguments` would raise on its first call for the config alone).

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
      head: a :class:`gmpo_jax.HeadOptions` for the fused calls (``chunk_size``, ``implementation``,
        ``logits_precision``, ``grad_filter``, ...); its ``weight_layout`` and ``softcap`` are replaced by the
        model's (:func:`~gmpo_jax.integrations.tunix.lm_head`, :func:`~gmpo_jax.integrations.tunix.logit_softcap`). With a ``logits_precision`` (``"float32"``) the head
        weight keeps its own dtype (a float32 weight with bfloat16 activations runs in the kernels,
        float32-accurate), else it is cast to the activations' dtype as Tunix's heads compute.
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
      TypeError: ``name`` not a non-empty string; ``objective`` is neither None nor a ``gmpo_jax.GMPO``;
        ``head`` not a ``gmpo_jax.HeadOptions``.

    Nothing is registered when it raises.
    """
    from tunix.rl import function_registry

    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if name in _TUNIX_BUILTIN_LOSSES:
        raise ValueError(f"{name=} is a Tunix built-in loss; choose another name (default {DEFAULT_NAME!r})")
    fn = make_policy_loss_fn(
        objective, compute_entropy=compute_entropy, head=head, max_completion_length=max_completion_length
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
