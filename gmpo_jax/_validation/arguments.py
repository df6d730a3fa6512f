"""Argument checks at trace time: types, shapes, dtypes and static options (every error names the argument and
what was expected). Checks of values that need the data itself (concrete arrays) are in ``values.py``."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

WEIGHT_LAYOUTS = ("hv", "vh")

# logits_precision -> the order of the split-bfloat16 products kept (gmpo_jax.kernels._lm_head_pipeline.split_terms):
# "float32": three parts, i + j <= 2 (six products, float32-accurate); "bf16x3": two parts, i + j <= 1.
LOGITS_PRECISIONS = {"float32": 2, "bf16x3": 1}


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _dtype(x, name: str = "argument"):
    if not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}: {x!r:.80}")
    try:
        return jnp.result_type(x)
    except TypeError:  # strings, objects: not a JAX dtype
        raise TypeError(f"{name} must hold numbers, got {name}.dtype={x.dtype}") from None


def concrete_array(x):
    """``x`` itself, or the array behind a tracer whose value is known (an eager ``jax.grad`` / ``value_and_grad``
    traces its argument with a concrete primal), else None (under ``jit``, ``vmap``, ...)."""
    if not isinstance(x, jax.core.Tracer):
        return x
    try:
        from jax._src import core  # JAX has no public way to ask a tracer for a known value

        return core.to_concrete_value(x)
    except Exception:  # noqa: BLE001 - any failure means: not known
        return None


def _concrete(x):
    """``x`` as a NumPy array if its value is known at trace time (:func:`concrete_array`), else None."""
    x = concrete_array(x)
    if x is None:
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
    is_bool = isinstance(temperature, (bool, np.bool_)) or getattr(temperature, "dtype", None) == np.bool_
    if is_bool or not (isinstance(temperature, numbers.Real) or hasattr(temperature, "shape")):
        raise TypeError(f"temperature must be a positive float or a real scalar array (not bool), got {temperature!r}")
    if hasattr(temperature, "shape") and _shape(temperature) != ():
        raise ValueError(f"temperature must be a scalar, got temperature.shape={_shape(temperature)}")
    value = _concrete(temperature)
    if value is not None and not 0 < float(value) < float("inf"):  # NaN fails too
        raise ValueError(f"temperature must be finite and > 0, got temperature={float(value)!r}")


def as_temperature(temperature):
    """``temperature`` as a float32 scalar for the ops; a traced one that is not finite and positive (which
    :func:`check_temperature` cannot see) becomes NaN, so the loss and log-probs are NaN instead of silently those of
    a negated or infinite temperature."""
    t = jnp.asarray(temperature, jnp.float32)
    return jnp.where((t > 0) & jnp.isfinite(t), t, jnp.nan)


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
    if not 0 <= grad_filter < 1:  # compared as given: a huge int is out of range, not an OverflowError
        raise ValueError(f"grad_filter must be in [0, 1), got grad_filter={grad_filter!r}")
    return float(grad_filter)


def check_logits_precision(logits_precision) -> None:
    """``logits_precision``: None, ``"float32"`` or ``"bf16x3"`` (static: it selects the kernels' products)."""
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
    if ids is None:
        raise TypeError(f"{name} is required (a [B, T] = {(B, T)} integer array), got None")
    require_shape(name, ids, (B, T), "[B, T]")
    if not jnp.issubdtype(_dtype(ids, name), jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {name}.dtype={_dtype(ids)}")
