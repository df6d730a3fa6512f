"""The per-token data of one policy-loss call (:class:`PolicyBatch`) and a reference model's LM head
(:class:`ReferenceHead`): pytrees, declared once, taken by both ops and the dense oracles."""

from __future__ import annotations

from typing import NamedTuple, Union

from jaxtyping import Array, Bool, Float, Int, Num

__all__ = ["PolicyBatch", "ReferenceHead"]

ScalarLike = Union[float, Float[Array, ""]]


class PolicyBatch(NamedTuple):
    """The per-token inputs of one micro-batch of ``B`` completions of ``T`` tokens (a pytree).

    A ``NamedTuple``: it passes through ``jax.jit`` / ``vmap`` / ``jax.tree.map`` as one argument (a None field
    is an empty subtree). The ops check it at trace time; every error names the field (``batch.old_logps``)
    and what was expected. Values that are traced cannot be checked (what happens then is said per field).

    Attributes:
      completion_ids: ``[B, T]`` integer sampled tokens; position ``t`` is predicted by ``hidden[:, t]`` (or
        ``logits[:, t]``). Masked positions may hold any value (e.g. -100 or ``>= V``); an unmasked id outside
        ``[0, V)`` raises ValueError when the ids and the mask are concrete; traced (under jit) it has a NaN
        log-prob, which makes the loss NaN unless the objective ignores that token's value (a zero advantage
        and ``beta = 0``); ``aux.log_ratio_min`` / ``log_ratio_max`` are NaN then too.
      completion_mask: ``[B, T]`` bool or {0, 1}; 1 = the token counts. A concrete mask must hold only 0 and 1
        (it selects, it does not weight); a traced one is taken as ``!= 0``.
      advantages: ``[B]`` float, one per row (group-normalised by the caller), or ``[B, T]`` one per token
        (packed rows). GMPO takes a sequence's advantage as the mean over its unmasked tokens (their common
        value when the advantage is per sequence). Concrete values must be finite where read (at a counted token,
        or for a row with one; everywhere when the mask is traced).
      old_logps: ``[B, T]`` float behaviour-policy log-probs; None = on-policy (``old = stop_gradient(logp)``).
        This and the other log-prob fields: concrete values at a counted token must be finite and ``<= 0.5``
        (log-probs are ``<= 0``; the slack is rounding): a larger one, such as a negated log-prob (an NLL),
        raises ValueError; traced, they cannot be checked.
      ref_logps: ``[B, T]`` float reference-model log-probs for the KL term (an objective with ``beta != 0``);
        the LM-head op can compute them instead from a :class:`ReferenceHead` (``reference=``), not both. Given
        to an objective without a KL term (``objective.has_kl`` False) they are ignored: a UserWarning once per
        process, at the caller's line.
      rollout_logps: ``[B, T]`` float log-probs of the sampler (e.g. vLLM) for the mismatch correction computed
        from ``old_logps`` (or the current log-probs, on-policy) and these, as the objective's
        ``rollout_is_mode`` / ``rollout_is_cap`` say; combines with ``rollout_is_ratio``. None: no correction.
      rollout_is_ratio: ``[B, T]``, ``[B, 1]`` or ``[B]`` precomputed importance weights ``>= 0`` (concrete ones
        are checked finite and ``>= 0`` where read, as advantages are; a traced negative or infinite one cannot be
        checked and makes the loss NaN) of the trainer vs
        the sampler (Liger's ``vllm_is_ratio``), no gradient; multiplies each token's policy term (not the KL). GMPO multiplies each sequence's term by the geometric mean of its
        tokens' weights (SPEC.md "Rollout correction").
      segment_ids: ``[B, T]`` integer ``>= 0`` or None: packed rows, several sequences per row (the layout of
        Tunix and MaxText). Each maximal run of equal positive ids within a row is one sequence; id 0 is
        padding (masked whatever ``completion_mask`` says). Every per-sequence reduction (GMPO's geometric
        mean, GSPO's sequence ratio, grpo / sapo's per-sequence mean) runs per sequence, and the ``B`` of the
        normalisers (gmpo, grpo, sapo, dr_grpo) is the number of sequences, so the same sequences padded one
        per row give the same loss and gradients. Pass ``[B, T]`` advantages (and a ``[B, T]``
        ``rollout_is_ratio``) with it. A concrete negative id raises; a traced one cannot be checked and is not
        a sequence (its tokens count as padding). Ids beyond the int32 range keep their runs in an eager call,
        but passed into ``jax.jit`` without ``jax_enable_x64`` JAX itself truncates them to int32 at the jit
        boundary (two runs may merge): relabel them with small positive ids first (0 stays padding).
      num_items_in_batch: scalar, the dapo / cispo normaliser override: the number of active (unmasked)
        completion tokens in ONE optimizer step's accumulation window, i.e. every micro-batch whose gradients
        are accumulated into one update (under data parallelism the global count over all devices, since the
        normalisers are global). Not the token count of a whole generation batch when it spans more
        micro-steps than one optimizer step accumulates: that scales each update by
        ``gas / steps_per_generation`` (TRL #5619). With ``optax.MultiSteps`` (which averages the accumulated
        gradients) multiply each micro-step's loss by the number of accumulation steps. A real scalar
        (TypeError for a bool, a string, a list or a vector, for every loss type). For dapo / cispo a concrete
        value must be finite and ``>= 1`` (any real: a per-process share ``count / processes`` need not be
        integral); a traced one cannot be checked: the normaliser is ``max(n, 1)`` and a NaN propagates (NaN
        loss). The other loss types ignore it, whatever its value, and warn once per loss type at the caller's
        line (trainers pass it for every loss type, as the Hugging Face ``Trainer`` does).
        docs/guide.md: "`num_items_in_batch` under gradient accumulation".

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> batch = gmpo_jax.PolicyBatch(jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool), jnp.ones(2))
      >>> jax.jit(lambda b: b.advantages.sum())(batch)  # a pytree: one jit argument
      Array(2., dtype=float32)
    """

    completion_ids: Int[Array, "B T"]
    completion_mask: Num[Array, "B T"] | Bool[Array, "B T"]
    advantages: Float[Array, " B"] | Float[Array, "B T"]
    old_logps: Float[Array, "B T"] | None = None
    ref_logps: Float[Array, "B T"] | None = None
    rollout_logps: Float[Array, "B T"] | None = None
    rollout_is_ratio: Array | None = None
    segment_ids: Int[Array, "B T"] | None = None
    num_items_in_batch: ScalarLike | None = None


class ReferenceHead(NamedTuple):
    """A reference model's last hidden states and LM head, from which the LM-head op computes the KL term's
    reference log-probs with its own fused path, without gradient (instead of ``PolicyBatch.ref_logps``).

    Attributes:
      hidden: ``[B, T, H_ref]`` float hidden states of the same completion positions (``H_ref`` may differ
        from the policy's ``H``); concrete values must be finite at an unmasked token.
      weight: the reference LM head, laid out as the policy's (``HeadOptions.weight_layout``) with the same
        ``V``: ``[H_ref, V]`` or ``[V, H_ref]``.
      bias: ``[V]`` or None.
    """

    hidden: Float[Array, "B T Hr"]
    weight: Array
    bias: Float[Array, " V"] | None = None
