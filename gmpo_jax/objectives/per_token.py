"""The objectives whose loss aggregates one term per token: the GRPO family (GSPO included), CISPO, SAPO.

Each such objective states its math once, in :meth:`PerTokenObjective.policy_term` (the policy part of a
token's loss from its log importance weight); :meth:`PerTokenObjective.token_terms` adds the weight and
the KL part, and both the chunk numerator (``jax.grad`` of it is the gradient of the XLA paths) and the
per-token loss of the fused logits kernel (:meth:`PerTokenObjective.token_loss`) are that one function::

    loss_{b,t} = policy_term(logp, w, A, m) * weight + beta * kl
    chunk_numerator = reduce_{loss_type}(loss)          (w: r, or GSPO's sequence-mean r)
    token_loss      = loss                              (w = r; token-local objectives only)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.base import Objective
from gmpo_jax.objectives.inputs import PolicyInputs
from gmpo_jax.objectives.metrics import _objective_sums
from gmpo_jax.objectives.params import read
from gmpo_jax.objectives.ratios import _token_log_ratio
from gmpo_jax.objectives.rollout import _rollout_token_weights
from gmpo_jax.objectives.sequences import _aggregation_weights, _masked_sum, _reduce


class TokenTerms(NamedTuple):
    """A token's loss and its parts, elementwise (any one shape).

    Attributes:
      loss: float32, the token's loss ``policy term * weight + beta * kl``.
      kl: float32 per-token KL (bias-corrected where the loss is), or None (no KL term).
      clipped_low: bool, where the lower clip bound acted on the policy term, or None (never).
      clipped_high: bool, where the upper clip bound acted, or None (never).
    """

    loss: jax.Array
    kl: jax.Array | None
    clipped_low: jax.Array | None
    clipped_high: jax.Array | None


class PerTokenObjective(Objective):
    """An objective whose loss is ``loss_type``'s aggregation of one term per token (see the module docstring).

    A subclass provides :meth:`policy_term`; it is :attr:`token_local` unless its log weight is not the
    token's own log ratio (:meth:`log_weight`).
    """

    # --- to be provided by subclasses -------------------------------------------------------
    def policy_term(self, logp, log_weight, advantages, mask):
        """The policy part of each token's loss and where its clip bounds acted, elementwise.

        Args:
          logp: the token's log-prob (differentiable).
          log_weight: its log importance weight (``logp - old``, 0 where masked; GSPO: the sequence mean).
          advantages: its advantage.
          mask: bool, or the scalar True.

        Returns:
          ``(term float32, clipped_low bool or None, clipped_high bool or None)``; the bounds' flags before
          the advantage's side is taken into account (the metrics count low with ``A < 0``, high with
          ``A > 0``). Branches are chosen on stop-gradient values, so a token's term has exactly zero
          gradient where its selected branch is constant.
        """
        raise NotImplementedError

    def log_weight(self, r, data: PolicyInputs):
        """The per-token log importance weight from the log ratios ``r`` ``[B, T]``: ``r`` itself."""
        return r

    # --- derived ---------------------------------------------------------------------------
    @property
    def token_local(self) -> bool:
        return True

    def token_terms(self, logp, log_weight, advantages, weight, ref_logps, mask) -> TokenTerms:
        """Each token's loss (:class:`TokenTerms`): ``policy_term * weight + beta * kl``, elementwise.
        ``weight`` (the rollout IS ratio, entropy selection, mismatch correction) and ``ref_logps`` may be
        None; the KL is bias-corrected by ``exp(log_weight)`` with ``use_bias_correction_kl``."""
        term, low, high = self.policy_term(logp, log_weight, advantages, mask)
        if weight is not None:
            term = term * weight.astype(jnp.float32)
        kl = self._kl_values(logp, ref_logps, mask, log_weight)
        if kl is not None:
            term = term + read(self.beta, finite=True) * kl
        return TokenTerms(term, kl, low, high)

    def token_loss(self, logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask=True):
        if not self.token_local:
            return super().token_loss(logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask)
        r = _token_log_ratio(logp, old_logps, mask)
        return self.token_terms(logp, r, advantages, rollout_is_ratio, ref_logps, mask).loss

    def token_weights(self, mask, num_items_in_batch, segment_ids=None):
        w = mask.astype(jnp.float32) / self.denominator(mask, num_items_in_batch, segment_ids)
        return _aggregation_weights(self.loss_type, w, mask, segment_ids)

    def chunk_numerator(self, logp, data):
        m = data.mask
        a = data.token_advantages()
        r = _token_log_ratio(logp, data.old_logps, m)
        w = self.log_weight(r, data)
        t = self.token_terms(logp, w, a, _rollout_token_weights(logp, data), data.ref_logps, m)
        seqs = data.sequences()
        kl_sum = kl_term = None
        if t.kl is not None:
            kl_sum = jax.lax.stop_gradient(_masked_sum(t.kl, m))
            kl_term = jax.lax.stop_gradient(_reduce(self.loss_type, t.kl, m, seqs))
        numerator = _reduce(self.loss_type, t.loss, m, seqs)
        return numerator, _objective_sums(r, a, m, t.clipped_low, t.clipped_high, kl_sum, kl_term)
