"""Tunix's GRPO / DAPO / Dr.GRPO learners on gmpo_jax's fused LM-head loss (and GMPO through Tunix).

One call switches a learner: :func:`register` puts a policy loss function into Tunix's public registry
(``tunix.rl.function_registry.register_policy_loss_fn``) and returns its name; pass that name as the
config's ``policy_loss_fn``. The function has the signature Tunix's learners call
(``model, train_example, algo_config, pad_id, eos_id``) and returns ``(loss, aux)`` like Tunix's
``grpo`` loss, but it never materialises the ``[B, T, V]`` logits: it takes the final hidden states
from the model (:func:`final_hidden_states`), the LM-head weight from the model without a copy
(:func:`lm_head`), maps the ``TrainExample`` onto a :class:`gmpo_jax.PolicyBatch` (:func:`loss_arguments`) and
calls :func:`gmpo_jax.fused_linear_policy_loss`.

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
``"sequence-mean-token-scale"``        ``loss_type="dapo"``, ``batch.num_items_in_batch = norm * n+`` (``norm``:
                                       ``max_completion_length=``, default the width of
                                       ``completion_ids`` as in Tunix: ``T`` padded, ``L`` packed)
``"seq-mean-token-sum"``,              ``loss_type="dapo"``, ``batch.num_items_in_batch = n+``
``"sequence-mean-token-sum-norm"``
``beta``, ``kl_loss_mode="low_var_kl"``  ``beta=``, ``batch.ref_logps`` (k3 KL, in the same fused pass)
other ``kl_loss_mode`` / ``kl_clamp_value``  a second fused pass (:func:`gmpo_jax.fused_linear_logprobs`)
                                       feeding Tunix's ``compute_kl_divergence``, aggregated per sequence
``old_per_token_logps``                ``batch.old_logps`` (None: on-policy)
``sampler_is_weights``                 ``batch.rollout_is_ratio``
``temperature`` (from the rollout config)  ``temperature=`` (0 and 1 mean none, as in Tunix)
``segment_ids``, ``segment_positions``     ``batch.segment_ids`` (and the model's positions, see
                                       :func:`final_hidden_states`)
``advantages`` ``[B]`` or ``[B, T]``       ``batch.advantages`` as given (per token in the GRPO family)
=====================================  =============================================================

With ``objective=gmpo_jax.GMPO(...)`` the objective's epsilons and loss shaping are used (Tunix's ``epsilon`` is
ignored);
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
computes itself (a ``kl_loss_mode`` other than ``"low_var_kl"``, or ``kl_clamp_value``) (GMPO takes
``sampler_is_weights`` as ``batch.rollout_is_ratio``: each sequence's term times the geometric mean of its tokens'
weights). ``gspo-token`` with
``[B, T]`` advantages that vary within a sequence gives GSPO-token's loss value but a sequence ratio's
gradient (Tunix's own learners give one advantage per sequence, also when packed). Tunix clamps token
log-ratios to [-20, 20] (and GSPO-token's to 10) before ``exp``; gmpo_jax does not clamp (it is exact
wherever float32 can represent the ratio), so the two differ only for ratios beyond e^20.

Where Tunix 0.1.7's own ``grpo`` loss differs on packed rows (docs/tunix.md): its ``aggregate_loss``
treats a packed row as one sequence (``sequence-mean-token-mean`` becomes a token mean per row, the
``token-scale`` / ``token-sum`` modes divide by packed rows, not sequences), ``gspo-token`` averages the
log-ratio over the whole row, and it calls the model with ``attention_mask=None``, which outside the
splash (flash) attention kernel leaves attention neither causal nor per segment.

Modules, one role each: ``registration`` (:func:`register`), ``loss`` (:func:`make_policy_loss_fn`, the loss
function Tunix calls), ``mapping`` (:func:`loss_arguments`: config and ``TrainExample`` -> ``PolicyBatch``,
objective, temperature, and the checks), ``model`` (:func:`final_hidden_states`, :func:`lm_head`,
:func:`logit_softcap`). Tunix itself is imported lazily.
"""

from __future__ import annotations

from gmpo_jax.integrations.tunix.loss import make_policy_loss_fn
from gmpo_jax.integrations.tunix.mapping import LossArguments, loss_arguments
from gmpo_jax.integrations.tunix.model import final_hidden_states, lm_head, logit_softcap
from gmpo_jax.integrations.tunix.registration import DEFAULT_NAME, register

__all__ = [
    "DEFAULT_NAME",
    "register",
    "make_policy_loss_fn",
    "final_hidden_states",
    "lm_head",
    "logit_softcap",
    "loss_arguments",
    "LossArguments",
]
