"""The checks of each op's arguments as a whole (:func:`check_batch` for the :class:`~gmpo_jax.PolicyBatch` both
take, :func:`check_policy_inputs`, :func:`check_logits_inputs`), and the checked batch normalised into the one
:class:`~gmpo_jax.objectives.PolicyInputs` pytree the custom VJPs take (:func:`policy_inputs`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax._validation.arguments import (
    _dtype,
    _shape,
    as_temperature,
    check_ids,
    check_lm_head,
    check_temperature,
    check_vocab_size,
    require_float,
    require_rank,
    require_shape,
)
from gmpo_jax._validation.values import (
    check_bias_at_targets,
    check_finite_parameter,
    check_finite_unmasked,
    check_ids_in_range,
    check_log_probs,
    check_logits_values,
    check_mask,
    check_row_or_token_values,
    check_segment_ids,
    counted_tokens,
)
from gmpo_jax.batch import PolicyBatch, ReferenceHead
from gmpo_jax.objectives import Objective, PolicyInputs
from gmpo_jax.objectives.params import _concrete_value


def check_objective(objective) -> None:
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be a GMPO, GRPO, CISPO or SAPO instance, got objective={objective!r}")


_REQUIRED_FIELDS = {
    "completion_ids": "a [B, T] integer array",
    "completion_mask": "a [B, T] bool or {0, 1} array; jnp.ones((B, T), bool) counts every token",
    "advantages": "a [B] or [B, T] float array",
}


def require_batch(batch) -> None:
    if not isinstance(batch, PolicyBatch):
        raise TypeError(
            "batch must be a gmpo_jax.PolicyBatch(completion_ids, completion_mask, advantages, ...), "
            f"got {type(batch).__name__}: {batch!r:.80}"
        )
    for name, expected in _REQUIRED_FIELDS.items():
        if getattr(batch, name) is None:
            raise TypeError(f"batch.{name} is required ({expected}), got None")


def check_batch(batch, *, B: int, T: int, V: int, objective):
    """The checks of a :class:`~gmpo_jax.PolicyBatch` both ops share, every error naming the field
    (``batch.old_logps``): ``[B, T]`` / ``[B]`` shapes and dtypes, concrete values (finite advantages, a {0, 1}
    mask, finite log-probs at a counted token, ids in ``[0, V)`` where counted), the normaliser override.
    Returns the counted tokens (:func:`~gmpo_jax._validation.values.counted_tokens`) for the callers' own value
    checks, or None when they are traced."""
    require_batch(batch)
    ids, mask, adv = batch.completion_ids, batch.completion_mask, batch.advantages
    check_ids(ids, B, T, "batch.completion_ids")
    check_mask(mask, B, T, "batch.completion_mask")
    name = "batch.advantages"
    _dtype(adv, name)
    if _shape(adv) not in ((B,), (B, T)):
        raise ValueError(f"{name} must have shape [B] = {(B,)} or [B, T] = {(B, T)}, got {name}.shape={_shape(adv)}")
    require_float(name, adv)
    check_segment_ids(batch.segment_ids, B, T, "batch.segment_ids")
    # the value checks look at what is read: the counted tokens (masked or padding ones may hold anything)
    counted = counted_tokens(mask, batch.segment_ids)
    check_row_or_token_values(name, adv, counted)
    mcl = objective.max_completion_length if objective.loss_type == "dr_grpo" else None
    rows = None if mcl is None or batch.segment_ids is not None else counted  # packed: several per row
    longest = None if rows is None else int(rows.sum(axis=1).max())
    if longest is not None and longest > mcl:
        raise ValueError(
            f"loss_type='dr_grpo' normalises by max_completion_length={mcl}, the longest completion the sampler can "
            f"return, but batch.completion_mask counts {longest} tokens in a row: pass the sampler's limit (a traced "
            "mask is not checked)"
        )
    for field in ("old_logps", "ref_logps", "rollout_logps"):
        x = getattr(batch, field)
        if x is not None:
            require_shape(f"batch.{field}", x, (B, T), "[B, T]")
            require_float(f"batch.{field}", x)
            read = field != "ref_logps" or objective.has_kl  # without a KL term ref_logps are ignored (warned)
            if counted is not None and read:
                check_log_probs(f"batch.{field}", x, counted)
    ris, name = batch.rollout_is_ratio, "batch.rollout_is_ratio"
    if ris is not None:
        if _shape(ris) not in ((B, T), (B, 1), (B,)):
            raise ValueError(
                f"{name} must have shape [B, T], [B, 1] or [B] = {(B, T)}, {(B, 1)} or {(B,)}, "
                f"got {name}.shape={_shape(ris)}"
            )
        require_float(name, ris)
        check_row_or_token_values(name, ris, counted, nonneg=True, what=" (a weight)")
    from gmpo_jax import _validation  # the warn-once state lives on the package

    if batch.num_items_in_batch is not None:
        _validation.check_num_items(batch.num_items_in_batch, objective)
    if batch.ref_logps is not None and not objective.has_kl:
        _validation.warn_ignored_reference("batch.ref_logps", objective)
    if counted is not None:
        check_ids_in_range(ids, counted, V, "batch.completion_ids", "batch.completion_mask")
    return counted


def check_reference(reference, *, batch, B: int, T: int, V: int, weight_layout: str, counted, vocab_size=None) -> None:
    """A :class:`~gmpo_jax.ReferenceHead`: its LM head as the policy's (``[B, T, H_ref]`` hidden states, the same
    ``V`` and layout), finite hidden states at the ``counted`` tokens (``[B, T]`` bool; None: not checked, as for
    traced data or an objective without a KL term, which ignores the reference), where a token counts its weight
    finite and its bias finite or ``-inf`` in the first ``vocab_size`` entries (None: all), and not together with
    ``batch.ref_logps``."""
    if not isinstance(reference, ReferenceHead):
        raise TypeError(
            f"reference must be None or a gmpo_jax.ReferenceHead(hidden, weight, bias=None), got {reference!r:.80}"
        )
    if batch.ref_logps is not None:
        raise ValueError(
            "give either batch.ref_logps or reference= (a ReferenceHead, from which they are computed), not both"
        )
    rB, rT, _, rV = check_lm_head(
        reference.hidden, reference.weight, reference.bias, weight_layout, prefix="reference."
    )
    if (rB, rT) != (B, T):
        raise ValueError(
            f"reference.hidden must be [B, T, H_ref] with B, T = {(B, T)}, got reference.hidden.shape="
            f"{_shape(reference.hidden)}"
        )
    if rV != V:
        raise ValueError(
            f"reference.weight must have the policy's vocabulary size V={V}, got reference.weight.shape="
            f"{_shape(reference.weight)}"
        )
    if counted is not None:
        check_finite_unmasked("reference.hidden", reference.hidden, counted)
        if counted.any():
            _check_head_values(reference.weight, reference.bias, vocab_size, prefix="reference.")


def _check_head_values(weight, bias, vocab_size, prefix: str = "") -> None:
    """The head's weight finite (every column: a padding column's logit is masked by adding ``-inf``, which keeps a
    NaN), its bias finite or ``-inf`` (a banned token) in the first ``vocab_size`` entries (None: all; the padding's
    are replaced), when they are known."""
    check_finite_parameter(prefix + "weight", weight)
    if bias is not None:
        check_finite_parameter(prefix + "bias", bias, banned_ok=True, n=vocab_size)


def check_policy_inputs(
    *, hidden, weight, batch, objective, bias, temperature, reference, weight_layout: str, vocab_size=None
) -> tuple[int, int, int, int]:
    """All argument checks of ``fused_linear_policy_loss`` (and its dense oracle); returns (B, T, H, V)."""
    check_objective(objective)
    B, T, H, V = check_lm_head(hidden, weight, bias, weight_layout)
    check_vocab_size(vocab_size, V)
    counted = check_batch(batch, B=B, T=T, V=vocab_size or V, objective=objective)
    if counted is not None:  # a NaN / inf hidden state at a counted token would make the loss NaN
        check_finite_unmasked("hidden", hidden, counted)
        if counted.any():  # a non-finite weight entry makes every token's loss NaN
            _check_head_values(weight, bias, vocab_size)
            if bias is not None:
                check_bias_at_targets(bias, batch.completion_ids, counted)
    check_temperature(temperature)
    if reference is not None:
        read = counted if objective.has_kl else None  # without a KL term the reference is ignored (warned below)
        check_reference(
            reference, batch=batch, B=B, T=T, V=V, weight_layout=weight_layout, counted=read, vocab_size=vocab_size
        )
        if not objective.has_kl:
            from gmpo_jax import _validation  # the warn-once state lives on the package

            _validation.warn_ignored_reference("reference", objective)
    if objective.requires_reference and reference is None and batch.ref_logps is None:
        raise ValueError(reference_error(objective, "batch.ref_logps, or reference=ReferenceHead(hidden, weight)"))
    return B, T, H, V


def check_logits_inputs(logits, batch, objective, temperature) -> tuple[int, int, int, int]:
    """All argument checks of ``policy_loss_from_logits`` (and its dense oracle); returns (B, T, Tl, V) with
    ``Tl`` = T or T + 1."""
    check_objective(objective)
    require_rank("logits", logits, 3, "[B, T + 1, V] or [B, T, V]")
    require_float("logits", logits)
    require_batch(batch)
    ids = batch.completion_ids
    require_rank("batch.completion_ids", ids, 2, "[B, T]")
    B, T = _shape(ids)
    _, Tl, V = _shape(logits)
    if B < 1 or T < 1 or V < 1:
        raise ValueError(
            f"batch.completion_ids [B, T] and logits [B, T(+1), V] must be non-empty, got "
            f"batch.completion_ids.shape={_shape(ids)}, logits.shape={_shape(logits)}"
        )
    if _shape(logits)[0] != B or Tl not in (T, T + 1):
        raise ValueError(
            f"logits must have shape [B, T + 1, V] or [B, T, V] with B, T = {(B, T)} (from "
            f"batch.completion_ids), got logits.shape={_shape(logits)}"
        )
    counted = check_batch(batch, B=B, T=T, V=V, objective=objective)
    check_logits_values(logits, ids, counted, T)
    check_temperature(temperature)
    if objective.requires_reference and batch.ref_logps is None:
        raise ValueError(reference_error(objective, "batch.ref_logps"))
    return B, T, Tl, V


def reference_error(objective, what: str) -> str:
    """The message for an objective with a KL term (:attr:`Objective.has_kl`) called without a reference. The
    flag is static: an objective built with a KL term keeps it when ``jax.tree.map`` maps its ``beta`` to 0."""
    beta = _concrete_value(getattr(objective, "beta", None))
    now = "traced" if beta is None else f"now {beta!r}"
    return (
        f"objective {type(objective).__name__} was built with a KL term (objective.has_kl is static: its beta "
        f"was non-zero, or traced, when it was built; beta is {now}), which needs a reference: pass {what} (or "
        "build a new objective with beta=0.0 as a number for no KL term, e.g. dataclasses.replace(objective, "
        "beta=0.0))"
    )


# ------------------------------------------------------------------------------------------------
# Normalisation: the checked arguments as the one pytree the custom VJPs take
# ------------------------------------------------------------------------------------------------
def as_mask(completion_mask) -> jax.Array:
    """``[B, T]`` bool (a {0, 1} mask compared with 0)."""
    m = jnp.asarray(completion_mask)
    return m if m.dtype == jnp.bool_ else m != 0


def as_ids(completion_ids) -> jax.Array:
    """int32 ids; a wider id outside the int32 range becomes -1 (out of range: NaN if unmasked) rather
    than wrapping around onto a valid id."""
    ids = jnp.asarray(completion_ids)
    if jnp.iinfo(ids.dtype).bits > 32:  # (an unsigned id is never below the int32 range: no wrapping compare)
        info = jnp.iinfo(jnp.int32)
        low = (ids < info.min) if jnp.issubdtype(ids.dtype, jnp.signedinteger) else False
        ids = jnp.where(low | (ids > info.max), -1, ids)
    return ids.astype(jnp.int32)


def as_segments(segment_ids) -> jax.Array:
    """``[B, T]`` int32 labels with the runs of ``segment_ids``: each maximal run of equal positive ids gets
    its run number within the row (from 1), padding (id 0) 0. The runs are found in the ids' own dtype (an
    int64 / uint32 id beyond the int32 range is neither truncated nor merged with another run); concrete
    ids in NumPy, so that a 64-bit array is not cut to 32 bits by JAX first."""
    xp = np if isinstance(segment_ids, np.ndarray) else jnp
    seg = segment_ids if xp is np else jnp.asarray(segment_ids)
    prev = xp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    start = (seg != prev) | (xp.arange(seg.shape[1]) == 0)[None, :]
    labels = xp.where(seg > 0, xp.cumsum(start, axis=1), 0)
    return jnp.asarray(labels.astype(np.int32))


def _f32(x):
    return None if x is None else jnp.asarray(x).astype(jnp.float32)


def policy_inputs(batch, objective, temperature) -> PolicyInputs:
    """The checked :class:`~gmpo_jax.PolicyBatch` as the one :class:`~gmpo_jax.objectives.PolicyInputs` the custom
    VJPs take (built here only): bool mask, int32 ids (0 under the mask), float32 advantages / log-probs / ratio /
    scalars. ``rollout_is_ratio`` ``[B]`` becomes ``[B, 1]``. ``segment_ids`` become int32 run labels, and their
    padding (id 0) is masked; ``ref_logps`` is dropped for an objective without a KL term. The objective's
    ``entropy_coef`` joins the data, and, with ``rollout_logps``, its
    :meth:`~gmpo_jax.objectives.Objective.rollout_correction`."""
    mask = as_mask(batch.completion_mask)
    segment_ids = batch.segment_ids
    if segment_ids is not None:
        segment_ids = as_segments(segment_ids)
        mask = mask & (segment_ids > 0)
    ris = None
    if batch.rollout_is_ratio is not None:
        ris = _f32(batch.rollout_is_ratio)
        ris = ris[:, None] if ris.ndim == 1 else ris
    return PolicyInputs(
        mask=mask,
        advantages=_f32(batch.advantages),
        old_logps=_f32(batch.old_logps),
        ref_logps=_f32(batch.ref_logps) if objective.has_kl else None,  # without a KL term: ignored (warned)
        rollout_is_ratio=ris,
        ids=jnp.where(mask, as_ids(batch.completion_ids), 0),
        num_items=_f32(batch.num_items_in_batch),
        temperature=as_temperature(temperature),
        segment_ids=segment_ids,
        rollout_logps=_f32(batch.rollout_logps),
        rollout_correction=None if batch.rollout_logps is None else objective.rollout_correction(),
        entropy_coef=_f32(objective.entropy_coef),
    )
