"""Trace-time input checks (every error names the argument and what was expected), and the checked
arguments normalised into the one pytree the custom VJPs take (:func:`policy_inputs`)."""

from __future__ import annotations

import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax.objectives import Objective, PolicyInputs, RolloutCorrection

WEIGHT_LAYOUTS = ("hv", "vh")


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _dtype(x, name: str = "argument"):
    if not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}: {x!r:.80}")
    try:
        return jnp.result_type(x)
    except TypeError:  # strings, objects: not a JAX dtype
        raise TypeError(f"{name} must hold numbers, got {name}.dtype={x.dtype}") from None


def _concrete(x):
    """``x`` as a NumPy array if its value is known at trace time (not a tracer), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def require_float(name: str, x) -> None:
    if not jnp.issubdtype(_dtype(x, name), jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (bf16 / f16 / f32), got {name}.dtype={_dtype(x)}")


def require_shape(name: str, x, expected: tuple, what: str) -> None:
    if _shape(x) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {tuple(expected)}, got {name}.shape={_shape(x)}")


def require_rank(name: str, x, rank: int, what: str) -> None:
    if len(_shape(x)) != rank:
        raise ValueError(f"{name} must be {what} (rank {rank}), got {name}.shape={_shape(x)}")


def check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not (isinstance(temperature, numbers.Real) or hasattr(temperature, "shape")):
        raise TypeError(f"temperature must be a positive float or a float scalar array, got {temperature!r}")
    if hasattr(temperature, "shape") and _shape(temperature) != ():
        raise ValueError(f"temperature must be a scalar, got temperature.shape={_shape(temperature)}")
    value = _concrete(temperature)
    if value is not None and not 0 < float(value) < float("inf"):  # NaN fails too
        raise ValueError(f"temperature must be finite and > 0, got temperature={float(value)!r}")


def check_entropy_coef(entropy_coef) -> None:
    """``entropy_coef``: None, or a real scalar (Python or a scalar array, traced allowed; finite when
    concrete; either sign: positive rewards entropy)."""
    if entropy_coef is None:
        return
    if isinstance(entropy_coef, (bool, np.bool_, str, bytes)) or not (
        isinstance(entropy_coef, numbers.Real) or (hasattr(entropy_coef, "dtype") and _shape(entropy_coef) == ())
    ):
        raise TypeError(f"entropy_coef must be None or a real scalar, got entropy_coef={entropy_coef!r}")
    value = _concrete(entropy_coef)
    if value is not None and not np.isfinite(float(value)):
        raise ValueError(f"entropy_coef must be finite, got entropy_coef={float(value)!r}")


def check_softcap(softcap) -> None:
    """``softcap``: None or a finite Python real ``> 0`` (static: it is compiled into the kernels)."""
    if softcap is None:
        return
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a Python float > 0, got softcap={softcap!r}")
    if not 0.0 < float(softcap) < float("inf"):
        raise ValueError(f"softcap must be finite and > 0, got softcap={softcap!r}")


def grad_filter_threshold(grad_filter) -> float | None:
    """``grad_filter``: None (exact), ``"auto"`` (``tuning.GRAD_FILTER_AUTO``) or a Python real in ``[0, 1)``
    (static: it is compiled into the gradient pass); returns the threshold, or None."""
    from gmpo_jax import tuning

    if grad_filter is None:
        return None
    if isinstance(grad_filter, str):
        if grad_filter != "auto":
            raise ValueError(f"grad_filter must be None, 'auto' or a float in [0, 1), got grad_filter={grad_filter!r}")
        return float(tuning.GRAD_FILTER_AUTO)
    if isinstance(grad_filter, (bool, np.bool_)) or not isinstance(grad_filter, numbers.Real):
        raise TypeError(
            "grad_filter must be None, 'auto' or a real number in [0, 1) (a Python or NumPy scalar: it is static, "
            f"not traced), got grad_filter={grad_filter!r}"
        )
    if not 0.0 <= float(grad_filter) < 1.0:
        raise ValueError(f"grad_filter must be in [0, 1), got grad_filter={grad_filter!r}")
    return float(grad_filter)


def check_logits_precision(logits_precision) -> None:
    """``logits_precision``: None, ``"float32"`` or ``"bf16x3"`` (static: it selects the kernels' products)."""
    from gmpo_jax.lm_head.backend import LOGITS_PRECISIONS

    if logits_precision is None:
        return
    if not isinstance(logits_precision, str):
        raise TypeError(
            f"logits_precision must be None or one of {tuple(LOGITS_PRECISIONS)}, got logits_precision={logits_precision!r}"
        )
    if logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(
            f"logits_precision must be None or one of {tuple(LOGITS_PRECISIONS)}, got logits_precision={logits_precision!r}"
        )


def check_top_entropy_quantile(q) -> None:
    """``top_entropy_quantile``: a Python real in ``(0, 1]`` (static: 1 skips the entropy pass)."""
    if isinstance(q, (bool, np.bool_)) or not isinstance(q, numbers.Real):
        raise TypeError(f"top_entropy_quantile must be a Python float in (0, 1], got top_entropy_quantile={q!r}")
    if not 0.0 < float(q) <= 1.0:
        raise ValueError(f"top_entropy_quantile must lie in (0, 1], got top_entropy_quantile={q!r}")


def check_chunk_size(chunk_size) -> None:
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be None or an int >= 1, got chunk_size={chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got chunk_size={chunk_size!r}")


def check_vocab_size(vocab_size, V: int) -> None:
    """``vocab_size``: None or an int in ``[1, V]`` (the real vocabulary of an LM head padded to ``V``)."""
    if vocab_size is None:
        return
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be None or an int, got vocab_size={vocab_size!r}")
    if not 1 <= vocab_size <= V:
        raise ValueError(
            f"vocab_size must be in [1, V={V}] (the LM head's vocabulary axis), got vocab_size={vocab_size}"
        )


def check_lm_head(hidden, weight, bias, weight_layout, *, prefix: str = "") -> tuple[int, int, int, int]:
    """Checks ``hidden [B, T, H]``, ``weight`` ([H, V] or [V, H]) and ``bias [V]``; returns (B, T, H, V)."""
    hn, wn, bn = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got weight_layout={weight_layout!r}")
    require_rank(hn, hidden, 3, "[B, T, H]")
    require_float(hn, hidden)
    require_rank(wn, weight, 2, "[H, V]" if weight_layout == "hv" else "[V, H]")
    require_float(wn, weight)
    B, T, H = _shape(hidden)
    if B < 1 or T < 1 or H < 1:
        raise ValueError(f"{hn} must be non-empty [B, T, H], got {hn}.shape={_shape(hidden)}")
    if weight_layout == "hv":
        if _shape(weight)[0] != H:
            raise ValueError(
                f"{wn} must be [H, V] with H={H} (hidden's last axis) for weight_layout='hv', got "
                f"{wn}.shape={_shape(weight)} (a tied embedding table [V, H] needs weight_layout='vh')"
            )
        V = _shape(weight)[1]
    else:
        if _shape(weight)[1] != H:
            raise ValueError(
                f"{wn} must be [V, H] with H={H} (hidden's last axis) for weight_layout='vh', got "
                f"{wn}.shape={_shape(weight)} (a Flax Linear kernel [H, V] needs weight_layout='hv')"
            )
        V = _shape(weight)[0]
    if V < 1:
        raise ValueError(f"{wn} must have a non-empty vocabulary axis, got {wn}.shape={_shape(weight)}")
    if bias is not None:
        require_shape(bn, bias, (V,), "[V]")
        require_float(bn, bias)
    return B, T, H, V


def check_ids(ids, B: int, T: int, name: str = "completion_ids") -> None:
    require_shape(name, ids, (B, T), "[B, T]")
    if not jnp.issubdtype(_dtype(ids, name), jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {name}.dtype={_dtype(ids)}")


def check_ids_in_range(ids, mask, V: int, name: str = "completion_ids") -> None:
    """Every id the mask counts (all of them without a mask) lies in ``[0, V)``, when the ids and the mask
    are concrete. Traced (under jit) they cannot be checked: such an id gives a NaN log-prob (documented)."""
    ids_v = _concrete(ids)
    if ids_v is None:
        return
    if mask is None:
        active = np.ones(ids_v.shape, bool)
    else:
        mask_v = _concrete(mask)
        if mask_v is None:
            return
        active = mask_v != 0
    bad = active & ((ids_v < 0) | (ids_v >= V))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must lie in [0, {V}) wherever completion_mask is 1 (masked positions may hold any "
            f"id, e.g. -100), got {name}[{', '.join(map(str, pos))}] = {int(ids_v[pos])} "
            f"({int(bad.sum())} such position(s))"
        )


def check_not_nan_unmasked(name: str, x, mask) -> None:
    """``x`` (``[B, T]``, or ``[B, T, ...]`` such as hidden states) holds no NaN at a token the mask counts,
    when both are concrete; the error names the first such position ``(b, t)``. Masked positions may hold
    NaN (nothing reads them). Traced, it cannot be checked: a NaN there makes the loss NaN."""
    xv, mv = _concrete(x), _concrete(mask)
    if xv is None or mv is None:
        return
    nan = np.isnan(xv.astype(np.float32))
    nan = nan.reshape(nan.shape[:2] + (-1,)).any(axis=-1) & (mv != 0)
    if nan.any():
        b, t = (int(i) for i in np.argwhere(nan)[0])
        where = f"{name}[{b}, {t}]" if xv.ndim == 2 else f"{name}[{b}, {t}, :]"
        raise ValueError(
            f"{name} must not be NaN at an unmasked token (completion_mask 1), got NaN in {where} "
            f"({int(nan.sum())} such token(s))"
        )


def check_mask(mask, B: int, T: int) -> None:
    require_shape("completion_mask", mask, (B, T), "[B, T]")
    dt = _dtype(mask, "completion_mask")
    if not (dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)):
        raise TypeError(f"completion_mask must be bool or {{0, 1}} numbers, got completion_mask.dtype={dt}")
    if dt != jnp.bool_:
        # a weighted mask (e.g. 0.5) would silently count as 1; a traced mask cannot be checked (documented)
        value = _concrete(mask)
        if value is not None and not np.all((value == 0) | (value == 1)):
            bad = value[(value != 0) & (value != 1)].ravel()[:3].tolist()
            raise ValueError(
                f"completion_mask must hold only 0 and 1 (it selects tokens, it does not weight "
                f"them), got values such as {bad}"
            )


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
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool) or not (
            isinstance(num_items_in_batch, numbers.Real) or _shape(num_items_in_batch) == ()
        ):
            raise ValueError(f"num_items_in_batch must be a scalar, got {num_items_in_batch!r}")
        check_num_items(num_items_in_batch, objective)
    check_temperature(temperature)
    check_ids_in_range(completion_ids, completion_mask, V)


NUM_ITEMS_LOSS_TYPES = ("dapo", "cispo")  # the loss types whose normaliser num_items_in_batch overrides
_warned_ignored_num_items: set[str] = set()  # loss types already warned about (once per process each)


def check_num_items(num_items_in_batch, objective) -> None:
    """A concrete ``num_items_in_batch`` must be ``>= 1`` (NaN fails too): it counts the unmasked tokens of an
    accumulation window that holds this call's, so 0 (or 0.5) would silently become the normaliser 1. Any
    real ``>= 1`` is accepted (TRL passes an int count; a per-process share ``count / processes`` is not
    integral). Traced it cannot be checked: the normaliser is ``max(n, 1)``. Given to a loss type that
    ignores it (gmpo, grpo, bnpo, dr_grpo, sapo) it warns once per loss type and process: generic
    trainers pass it for every loss type (the Hugging Face ``Trainer`` hands ``num_items_in_batch`` to
    every ``compute_loss``; TRL's GRPO trainer then uses it for dapo only), and it changes nothing there."""
    value = _concrete(num_items_in_batch)
    if value is not None and not float(value) >= 1:
        raise ValueError(
            "num_items_in_batch must be >= 1 (the number of unmasked completion tokens in the optimizer step's "
            "accumulation window; None: this call's own count), got "
            f"num_items_in_batch={float(value)!r}"
        )
    loss_type = objective.loss_type
    if loss_type not in NUM_ITEMS_LOSS_TYPES and loss_type not in _warned_ignored_num_items:
        _warned_ignored_num_items.add(loss_type)
        warnings.warn(
            f"num_items_in_batch is ignored by loss_type={loss_type!r}: only {NUM_ITEMS_LOSS_TYPES} normalise by "
            f"it ({loss_type!r} has its own normaliser, see LossAux.loss_denominator); warned once per loss type",
            UserWarning,
            stacklevel=4,
        )


def check_segment_ids(segment_ids, B: int, T: int) -> None:
    """``segment_ids``: None, or a ``[B, T]`` integer array of non-negative ids (checked when concrete)."""
    if segment_ids is None:
        return
    require_shape("segment_ids", segment_ids, (B, T), "[B, T]")
    dt = _dtype(segment_ids, "segment_ids")
    if not (jnp.issubdtype(dt, jnp.integer) and not jnp.issubdtype(dt, jnp.bool_)):
        raise TypeError(f"segment_ids must be an integer array, got dtype {dt}")
    seg = _concrete(segment_ids)
    if seg is not None and seg.size and seg.min() < 0:
        bad = tuple(int(i) for i in np.argwhere(seg < 0)[0])
        raise ValueError(
            f"segment_ids must be >= 0 (0 marks padding), got segment_ids[{bad[0]}, {bad[1]}] = {int(seg[bad])}"
        )


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
    has_ref = ref_logps is not None or ref_hidden is not None
    if objective.requires_reference and not has_ref:
        raise ValueError(reference_error(objective, "ref_logps, or ref_hidden and ref_weight"))
    check_chunk_size(chunk_size)
    return B, T, H, V


def reference_error(objective, what: str) -> str:
    """The message for an objective with a KL term (:attr:`Objective.has_kl`) called without a reference."""
    return (
        f"objective.beta={objective.beta!r} gives the loss a KL term (objective.has_kl: beta was non-zero, or "
        f"traced, when the objective was built), which needs a reference: pass {what} (or build the objective "
        "with beta=0.0 as a number for no KL term)"
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
        ref_logps=_f32(ref_logps),
        rollout_is_ratio=ris,
        ids=jnp.where(mask, as_ids(completion_ids), 0),
        num_items=_f32(num_items_in_batch),
        temperature=jnp.asarray(temperature, jnp.float32),
        segment_ids=segment_ids,
        rollout_logps=_f32(rollout_logps),
        rollout_correction=None if rollout_logps is None else rollout_correction(rollout_is_mode, rollout_is_cap),
        entropy_coef=_f32(entropy_coef),
    )
