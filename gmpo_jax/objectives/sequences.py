"""The sequence algebra: where a batch's sequences lie, per-sequence reductions, each loss type's aggregation.

Every reduction of SPEC.md is a sum over sequences divided by a global normaliser that depends on the whole
call's mask only (:func:`_denominator`), so the numerator of a chunk of whole sequences adds up over chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from gmpo_jax.objectives.inputs import PolicyInputs

_SEQUENCE_MEAN_LOSS_TYPES = ("grpo", "sapo", "gmpo")  # per-sequence means; the others sum tokens


def _masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


class Sequences(NamedTuple):
    """The sequences of a ``[B, T]`` batch, for the objectives' per-sequence reductions.

    Padded layout (``segment_ids`` None): row ``b`` is sequence ``b`` (``B`` of them, empty rows counted).
    Packed layout: each maximal run of equal positive ``segment_ids`` within a row is a sequence; the
    runs get slots ``0 .. B*T - 1`` in row-major order (runs of id 0, padding, get slots with no
    unmasked token). Per-sequence vectors have one entry per slot; a slot without an unmasked token
    contributes nothing to any objective.

    Attributes:
      index: ``[B, T]`` int32 slot of each token, or None (padded: the row).
      heads: ``[B, T]`` bool, the first token of each sequence (positive id), or None (padded).
      slots: number of slots (static): ``B`` padded, ``B * T`` packed.
    """

    index: jax.Array | None
    heads: jax.Array | None
    slots: int

    @staticmethod
    def of(mask: jax.Array, segment_ids: jax.Array | None) -> Sequences:
        """The sequences of a ``[B, T]`` mask and its ``[B, T]`` int ``segment_ids`` (None: padded)."""
        if segment_ids is None:
            return Sequences(None, None, mask.shape[0])
        seg = segment_ids
        start = seg != jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # t = 0 starts a run
        index = (jnp.cumsum(start.reshape(-1), dtype=jnp.int32) - 1).reshape(seg.shape)
        return Sequences(index, start & (seg > 0), seg.size)

    def sum(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """Per-sequence sums ``[slots]`` of ``x`` over the unmasked tokens (float32)."""
        x = jnp.where(mask, x, 0.0)
        if self.index is None:
            return jnp.sum(x, axis=1)
        return jax.ops.segment_sum(x.reshape(-1), self.index.reshape(-1), self.slots, indices_are_sorted=True)

    def lengths(self, mask: jax.Array) -> jax.Array:
        """Unmasked tokens per sequence ``[slots]`` (float32, counted in int32)."""
        if self.index is None:
            return jnp.sum(mask, axis=1, dtype=jnp.int32).astype(jnp.float32)
        m = mask.reshape(-1).astype(jnp.int32)
        return jax.ops.segment_sum(m, self.index.reshape(-1), self.slots, indices_are_sorted=True).astype(jnp.float32)

    def mean(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """Per-sequence means ``[slots]``: ``sum_t m x / max(sum_t m, 1)`` (0 for an empty sequence)."""
        return self.sum(x, mask) / jnp.maximum(self.lengths(mask), 1.0)

    def tokens(self, v: jax.Array, shape) -> jax.Array:
        """A per-sequence vector ``[slots]`` spread over the tokens: ``[B, T]``."""
        return jnp.broadcast_to(v[:, None], shape) if self.index is None else v[self.index]

    def count(self) -> jax.Array:
        """The number of sequences (float32): ``B`` padded, the positive-id runs packed (at least 1, so
        that a packed batch of padding only has loss 0, not 0 / 0)."""
        if self.heads is None:
            return jnp.asarray(self.slots, jnp.float32)
        return jnp.maximum(jnp.sum(self.heads, dtype=jnp.int32), 1).astype(jnp.float32)

    def mean_advantages(self, inputs: PolicyInputs) -> jax.Array:
        """One advantage per sequence ``[slots]``: a ``[B]`` advantage as given (padded layout), else the
        mean of the sequence's unmasked tokens' advantages (0 for an empty sequence)."""
        if self.index is None and inputs.advantages.ndim == 1:
            return inputs.advantages.astype(jnp.float32)
        return self.mean(inputs.token_advantages(), inputs.mask)


def _sequence_log_weight(r, mask, seqs: Sequences):
    """GSPO: the sequence-mean log ratio spread over its tokens ``[B, T]``."""
    return seqs.tokens(seqs.mean(r, mask), r.shape)


def _reduce(loss_type, x, mask, seqs: Sequences):
    """The numerator of ``loss_type``'s aggregation of the per-token ``x`` (SPEC.md "Reductions"): the sum
    of the per-sequence means (grpo, sapo, gmpo) or the masked token sum (the others)."""
    if loss_type in _SEQUENCE_MEAN_LOSS_TYPES:
        return jnp.sum(seqs.mean(x, mask))
    return _masked_sum(x, mask)


def _denominator(loss_type, mask, num_items_in_batch, max_completion_length, segment_ids=None):
    """The global normaliser of ``loss_type`` (float32 scalar) from the whole call's ``[B, T]`` mask: the
    number of sequences (grpo, sapo, gmpo), the token count (bnpo), sequences times
    ``max_completion_length`` (dr_grpo), ``num_items_in_batch`` or the token count (dapo, cispo); at least 1."""
    if loss_type in _SEQUENCE_MEAN_LOSS_TYPES:
        return Sequences.of(mask, segment_ids).count()
    if loss_type == "bnpo":
        return jnp.maximum(jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32), 1.0)
    if loss_type == "dr_grpo":
        return Sequences.of(mask, segment_ids).count() * max_completion_length
    # dapo, cispo
    n = jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32) if num_items_in_batch is None else num_items_in_batch
    return jnp.maximum(jnp.asarray(n, jnp.float32), 1.0)


def _aggregation_weights(loss_type, w, mask, segment_ids=None):
    """``w`` (``[B, T]`` float32, 0 where masked) divided by each token's sequence length where
    ``loss_type`` takes per-sequence means: ``sum w x`` is then :func:`_reduce` of ``x`` (times ``w``)."""
    if loss_type not in _SEQUENCE_MEAN_LOSS_TYPES:
        return w
    seqs = Sequences.of(mask, segment_ids)
    return w / seqs.tokens(jnp.maximum(seqs.lengths(mask), 1.0), mask.shape)
