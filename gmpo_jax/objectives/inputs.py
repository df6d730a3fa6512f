"""The batch data model: the per-token inputs of one policy-loss call as one pytree."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.sequences import Sequences

if TYPE_CHECKING:
    from gmpo_jax.objectives.rollout import RolloutCorrection


class PolicyInputs(NamedTuple):
    """The per-token inputs of one policy-loss call, built once by the public function (a pytree).

    The objectives read ``mask``, ``advantages``, ``old_logps``, ``ref_logps``, ``rollout_is_ratio`` and
    ``segment_ids``; the LM-head and logits passes read ``ids`` and ``temperature``; ``num_items`` feeds
    the normaliser. A chunk of whole rows is the same pytree over ``C`` rows (:meth:`rows`).

    Attributes:
      mask: ``[B, T]`` bool; False for padding, masked tokens and sequences outside a chunk.
      advantages: ``[B]`` (one per row) or ``[B, T]`` (per token) float32.
      old_logps: ``[B, T]`` float32 or None (on-policy: ``old = stop_gradient(logp)``).
      ref_logps: ``[B, T]`` float32 or None (no KL term).
      rollout_is_ratio: ``[B, T]`` or ``[B, 1]`` float32 or None.
      ids: ``[B, T]`` int32 target ids, 0 at masked positions (any id may sit under the mask); None
        where only the objective is evaluated.
      num_items: float32 scalar or None: the dapo / cispo normaliser override.
      temperature: float32 scalar (``> 0``) dividing the logits, or None where only the objective runs.
      segment_ids: ``[B, T]`` int32 or None. None: row ``b`` is sequence ``b`` (the padded layout).
        Otherwise a packed batch: each maximal run of equal positive ids in a row is one sequence, id 0
        is padding (its tokens are masked).
      rollout_logps: ``[B, T]`` float32 sampler log-probs or None (no mismatch correction).
      rollout_correction: a :class:`RolloutCorrection` (with ``rollout_logps``) or None.
      token_select: ``[B, T]`` bool or None: the tokens that receive policy gradient
        (``top_entropy_quantile``, :func:`high_entropy_tokens`); None: all.
      entropy_coef: float32 scalar or None: the entropy term ``-entropy_coef * agg(H)`` of the loss
        (:meth:`Objective.entropy_weights`); None: no term.
    """

    mask: jax.Array
    advantages: jax.Array
    old_logps: jax.Array | None = None
    ref_logps: jax.Array | None = None
    rollout_is_ratio: jax.Array | None = None
    ids: jax.Array | None = None
    num_items: jax.Array | None = None
    temperature: jax.Array | None = None
    segment_ids: jax.Array | None = None
    rollout_logps: jax.Array | None = None
    rollout_correction: RolloutCorrection | None = None
    token_select: jax.Array | None = None
    entropy_coef: jax.Array | None = None

    def rows(self, start, size: int, live=None) -> PolicyInputs:
        """Rows ``[start, start + size)`` (``start`` may be traced); ``live`` (``[size]`` bool) masks rows
        out of the slice (those another chunk owns). A sequence never spans rows, so a chunk of rows
        holds whole sequences."""

        def cut(x):
            return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)

        mask = cut(self.mask) if live is None else cut(self.mask) & live[:, None]
        return self._replace(
            mask=mask,
            advantages=cut(self.advantages),
            old_logps=cut(self.old_logps),
            ref_logps=cut(self.ref_logps),
            rollout_is_ratio=cut(self.rollout_is_ratio),
            ids=cut(self.ids),
            segment_ids=cut(self.segment_ids),
            rollout_logps=cut(self.rollout_logps),
            token_select=cut(self.token_select),
        )

    def specs(self, rows, scalar) -> PolicyInputs:
        """The same pytree holding ``rows`` for every per-sequence field and ``scalar`` for the scalars
        (e.g. the ``jax.shard_map`` partition specs of a data-parallel call)."""
        return PolicyInputs(rows, rows, rows, rows, rows, rows, scalar, scalar, rows, rows, scalar, rows, scalar)

    def token_advantages(self) -> jax.Array:
        """``[B, T]`` float32: each token's advantage (a ``[B]`` advantage broadcast over its row)."""
        a = self.advantages.astype(jnp.float32)
        return a if a.ndim == 2 else jnp.broadcast_to(a[:, None], self.mask.shape)

    def token_policy_weights(self) -> jax.Array | None:
        """``[B, T]`` (or ``[B, 1]``) weight of each token's policy term known before the log-probs:
        ``rollout_is_ratio`` times the entropy selection ``token_select``; None without either."""
        w, sel = self.rollout_is_ratio, self.token_select
        if sel is None:
            return w
        sel = sel.astype(jnp.float32)
        return sel if w is None else w * sel

    def sequences(self) -> Sequences:
        """Where this batch's sequences lie (:class:`Sequences`)."""
        return Sequences.of(self.mask, self.segment_ids)
