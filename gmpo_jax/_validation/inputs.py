"""The checks of each op's per-token arguments as a whole (:func:`check_token_inputs`,
:func:`check_policy_inputs`), and the checked arguments normalised into the one
:class:`~gmpo_jax.objectives.PolicyInputs` pytree the custom VJPs take (:func:`policy_inputs`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax._validation.arguments import (
    _concrete,
    _dtype,
    _shape,
    check_chunk_size,
    check_entropy_coef,
    check_ids,
    check_lm_head,
    check_temperature,
    check_vocab_size,
    require_float,
    require_shape,
)
from gmpo_jax._validation.values import check_ids_in_range, check_mask, check_not_nan_unmasked, check_segment_ids
from gmpo_jax.objectives import Objective, PolicyInputs, RolloutCorrection
from gmpo_jax.objectives.params import _concrete_value

TOKEN_ARGS = (
    "completion_ids",
    "completion_mask",
    "advantages",
    "objective",
    "old_logps",
    "ref_logps",
    "rollout_is_ratio",
    "num_items_in_batch",
    "temperature",
    "segment_ids",
    "rollout_logps",
    "rollout_is_mode",
    "rollout_is_cap",
    "entropy_coef",
)


def token_args(arguments: dict) -> dict:
    """The per-token arguments both ops share (``TOKEN_ARGS``), picked from a public function's arguments
    (its ``locals()``): what :func:`check_token_inputs` and
    :func:`policy_inputs` take."""
    return {name: arguments[name] for name in TOKEN_ARGS}


def rollout_correction(mode, cap) -> RolloutCorrection:
    """The :class:`~gmpo_jax.objectives.RolloutCorrection` of ``rollout_is_mode`` / ``rollout_is_cap`` (None:
    ``"token_truncate"`` / 2.0); raises for an unknown mode or a concrete cap ``<= 0``."""
    return RolloutCorrection("token_truncate" if mode is None else mode, 2.0 if cap is None else cap)


def check_token_inputs(
    *,
    B: int,
    T: int,
    V: int,
    completion_ids,
    completion_mask,
    advantages,
    objective,
    old_logps,
    ref_logps,
    rollout_is_ratio,
    num_items_in_batch,
    temperature,
    segment_ids=None,
    rollout_logps=None,
    rollout_is_mode=None,
    rollout_is_cap=None,
    entropy_coef=None,
) -> None:
    """The checks both ops share: the objective, the ``[B, T]`` / ``[B]`` per-token inputs, the scalars, and
    (when concrete) that every unmasked id lies in ``[0, V)``."""
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be a GMPO, GRPO, CISPO or SAPO instance, got objective={objective!r}")
    check_ids(completion_ids, B, T)
    check_mask(completion_mask, B, T)
    _dtype(advantages, "advantages")
    if _shape(advantages) not in ((B,), (B, T)):
        raise ValueError(
            f"advantages must have shape [B] = {(B,)} or [B, T] = {(B, T)}, got advantages.shape={_shape(advantages)}"
        )
    require_float("advantages", advantages)
    adv = _concrete(advantages)
    if adv is not None and not np.all(np.isfinite(adv.astype(np.float64))):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(adv.astype(np.float64)))[0])
        where = bad[0] if len(bad) == 1 else bad
        raise ValueError(f"advantages must be finite, got advantages[{where}] = {float(adv[bad])!r}")
    check_segment_ids(segment_ids, B, T)
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None:
            require_shape(name, x, (B, T), "[B, T]")
            require_float(name, x)
            check_not_nan_unmasked(name, x, completion_mask)
    if rollout_is_ratio is not None:
        if _shape(rollout_is_ratio) not in ((B, T), (B, 1), (B,)):
            raise ValueError(
                f"rollout_is_ratio must have shape [B, T], [B, 1] or [B] = {(B, T)}, {(B, 1)} or {(B,)}, "
                f"got rollout_is_ratio.shape={_shape(rollout_is_ratio)}"
            )
        require_float("rollout_is_ratio", rollout_is_ratio)
        ris = _concrete(rollout_is_ratio)
        if ris is not None and not np.all(np.isfinite(ris.astype(np.float64)) & (ris.astype(np.float64) >= 0)):
            bad = tuple(int(i) for i in np.argwhere(~(np.isfinite(ris.astype(np.float64)) & (ris >= 0)))[0])
            raise ValueError(
                f"rollout_is_ratio must be finite and >= 0 (a weight), got rollout_is_ratio{list(bad)} = "
                f"{float(ris[bad])!r}"
            )
    if rollout_logps is None:
        if rollout_is_mode is not None or rollout_is_cap is not None:
            raise ValueError(
                "rollout_is_mode / rollout_is_cap configure the correction computed from the sampler's log-probs: "
                "pass rollout_logps too (precomputed weights go in rollout_is_ratio)"
            )
    else:
        require_shape("rollout_logps", rollout_logps, (B, T), "[B, T]")
        require_float("rollout_logps", rollout_logps)
        check_not_nan_unmasked("rollout_logps", rollout_logps, completion_mask)
        rollout_correction(rollout_is_mode, rollout_is_cap)  # checks the mode and the cap
    check_entropy_coef(entropy_coef)
    from gmpo_jax import _validation  # the warn-once state lives on the package

    if num_items_in_batch is not None:
        _validation.check_num_items(num_items_in_batch, objective)
    if ref_logps is not None and not objective.has_kl:
        _validation.warn_ignored_reference("ref_logps", objective)
    check_temperature(temperature)
    check_ids_in_range(completion_ids, completion_mask, V)


def check_policy_inputs(
    *,
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    objective,
    old_logps,
    ref_logps,
    ref_hidden,
    ref_weight,
    bias,
    ref_bias,
    rollout_is_ratio,
    num_items_in_batch,
    temperature,
    weight_layout,
    chunk_size,
    vocab_size=None,
    segment_ids=None,
    rollout_logps=None,
    rollout_is_mode=None,
    rollout_is_cap=None,
    entropy_coef=None,
) -> tuple[int, int, int, int]:
    """All checks of ``fused_linear_policy_loss``; returns (B, T, H, V)."""
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be a GMPO, GRPO, CISPO or SAPO instance, got objective={objective!r}")
    B, T, H, V = check_lm_head(hidden, weight, bias, weight_layout)
    check_vocab_size(vocab_size, V)
    check_token_inputs(
        B=B,
        T=T,
        V=vocab_size or V,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=advantages,
        objective=objective,
        old_logps=old_logps,
        ref_logps=ref_logps,
        rollout_is_ratio=rollout_is_ratio,
        num_items_in_batch=num_items_in_batch,
        temperature=temperature,
        segment_ids=segment_ids,
        rollout_logps=rollout_logps,
        rollout_is_mode=rollout_is_mode,
        rollout_is_cap=rollout_is_cap,
        entropy_coef=entropy_coef,
    )
    if ref_logps is not None and ref_hidden is not None:
        raise ValueError("give either ref_logps or ref_hidden (+ ref_weight), not both")
    if ref_hidden is None and (ref_weight is not None or ref_bias is not None):
        raise ValueError("ref_weight / ref_bias need ref_hidden (the reference model's hidden states)")
    if ref_hidden is not None:
        if ref_weight is None:
            raise ValueError("ref_hidden needs ref_weight, the reference model's LM head")
        rB, rT, _, rV = check_lm_head(ref_hidden, ref_weight, ref_bias, weight_layout, prefix="ref_")
        if (rB, rT) != (B, T):
            raise ValueError(
                f"ref_hidden must be [B, T, H_ref] with B, T = {(B, T)}, got ref_hidden.shape={_shape(ref_hidden)}"
            )
        if rV != V:
            raise ValueError(
                f"ref_weight must have the policy's vocabulary size V={V}, got ref_weight.shape={_shape(ref_weight)}"
            )
        check_not_nan_unmasked("ref_hidden", ref_hidden, completion_mask)
        if not objective.has_kl:
            from gmpo_jax import _validation  # the warn-once state lives on the package

            _validation.warn_ignored_reference("ref_hidden", objective)
    has_ref = ref_logps is not None or ref_hidden is not None
    if objective.requires_reference and not has_ref:
        raise ValueError(reference_error(objective, "ref_logps, or ref_hidden and ref_weight"))
    check_chunk_size(chunk_size)
    return B, T, H, V


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
    if jnp.iinfo(ids.dtype).bits > 32:
        info = jnp.iinfo(jnp.int32)
        ids = jnp.where((ids < info.min) | (ids > info.max), -1, ids)
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


def policy_inputs(
    objective,
    completion_ids,
    completion_mask,
    advantages,
    *,
    old_logps=None,
    ref_logps=None,
    rollout_is_ratio=None,
    num_items_in_batch=None,
    temperature=1.0,
    segment_ids=None,
    rollout_logps=None,
    rollout_is_mode=None,
    rollout_is_cap=None,
    entropy_coef=None,
):
    """The checked per-token arguments as one :class:`~gmpo_jax.objectives.PolicyInputs`: bool mask, int32
    ids (0 under the mask), float32 advantages / log-probs / ratio / scalars. ``rollout_is_ratio`` ``[B]``
    becomes ``[B, 1]``. ``segment_ids`` become int32, and their padding (id 0) is masked. With
    ``rollout_logps``, ``rollout_is_mode`` / ``rollout_is_cap`` become a ``RolloutCorrection``."""
    mask = as_mask(completion_mask)
    if segment_ids is not None:
        segment_ids = as_segments(segment_ids)
        mask = mask & (segment_ids > 0)
    ris = None
    if rollout_is_ratio is not None:
        ris = _f32(rollout_is_ratio)
        ris = ris[:, None] if ris.ndim == 1 else ris
    return PolicyInputs(
        mask=mask,
        advantages=_f32(advantages),
        old_logps=_f32(old_logps),
        ref_logps=_f32(ref_logps) if objective.has_kl else None,  # without a KL term: ignored (warned)
        rollout_is_ratio=ris,
        ids=jnp.where(mask, as_ids(completion_ids), 0),
        num_items=_f32(num_items_in_batch),
        temperature=jnp.asarray(temperature, jnp.float32),
        segment_ids=segment_ids,
        rollout_logps=_f32(rollout_logps),
        rollout_correction=None if rollout_logps is None else rollout_correction(rollout_is_mode, rollout_is_cap),
        entropy_coef=_f32(entropy_coef),
    )
