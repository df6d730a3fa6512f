"""Hyper-parameters of the objectives: concrete values, the construction checks, the pytree registration.

A numeric hyper-parameter (epsilon, beta, delta, a temperature, a cap) is a pytree leaf: a Python / NumPy
number or a JAX scalar, possibly traced. Its checks run on concrete values only (a tracer is never
inspected); the variant choices are static aux data.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Union

import jax
import numpy as np

Scalar = Union[float, jax.Array]

_DERIVED = ("_has_kl",)  # an objective's static attributes set by Objective.__post_init__


def _concrete_value(x: Any) -> float | None:
    """The value of a concrete scalar hyper-parameter (Python / NumPy number, or a JAX scalar that is not
    being traced); None for tracers and anything else (e.g. the None leaves of a ``jax.tree.map``)."""
    if isinstance(x, bool) or isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, (np.ndarray, np.generic, jax.Array)) and np.shape(x) == ():
        try:
            return float(x)
        except (TypeError, jax.errors.ConcretizationTypeError):
            return None
    return None


def _check_type(name: str, value: Any) -> None:
    if isinstance(value, (str, bytes, bool, np.bool_)) or (hasattr(value, "shape") and np.shape(value) != ()):
        raise TypeError(f"{name} must be a real scalar (Python float or a JAX / NumPy scalar), got {name}={value!r}")


def _check_nonneg(name: str, value: Any, *, finite: bool = False) -> None:
    """``value >= 0`` when concrete (and finite with ``finite``: a coefficient such as ``beta``; a clipping
    range may be infinite, no clipping)."""
    _check_type(name, value)
    v = _concrete_value(value)
    if v is not None and not (v >= 0 and (not finite or v <= float(np.finfo(np.float32).max))):  # finite in float32
        raise ValueError(f"{name} must be {'finite and ' if finite else ''}>= 0, got {name}={value!r}")


def read(value: Any, *, positive: bool = False, finite: bool = False) -> jax.Array:
    """A numeric hyper-parameter as the loss reads it, float32. A concrete value passed its check at construction
    and is returned as it is; a traced one cannot be checked, so it comes back NaN where it breaks the check (``< 0``;
    ``<= 0`` with ``positive``; infinite with ``finite``): an invalid traced value gives a NaN loss, not a silently
    different one (with :func:`poisoned` where it only enters comparisons)."""
    import jax.numpy as jnp

    concrete = _concrete_value(value)
    if concrete is not None:  # a NumPy scalar: no operation in a traced loss (the fused kernels trace one)
        return np.float32(concrete)
    v = jnp.asarray(value, jnp.float32)
    ok = v > 0 if positive else v >= 0
    if finite:
        ok = ok & jnp.isfinite(v)
    return jnp.where(ok, v, jnp.float32(jnp.nan))  # float32 constants: no float64 operation under x64


def poisoned(x: jax.Array, *bounds: jax.Array) -> jax.Array:
    """``x``, times NaN if a traced one of ``bounds`` (as :func:`read` gives them) is NaN: a traced invalid bound that
    only enters comparisons (a clip range, a cap) still makes the loss and its gradient NaN (a product, not a select,
    whose gradient would be a silent 0). Concrete bounds add nothing (the kernels that trace a loss take no extra
    operation); otherwise ``x`` times 1, exactly."""
    import jax.numpy as jnp

    traced = [jnp.isnan(b) for b in bounds if isinstance(b, jax.core.Tracer)]
    if not traced:
        return x
    bad = traced[0]
    for b in traced[1:]:
        bad = bad | b
    return x * jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(1.0))


def _check_pos(name: str, value: Any) -> None:
    _check_type(name, value)
    v = _concrete_value(value)
    if v is not None and not v > 0:
        raise ValueError(f"{name} must be > 0, got {name}={value!r}")


def _check_optional_real(name: str, value: Any, *, strict: bool) -> None:
    """None, or a real scalar (Python / NumPy number or a scalar array, traced allowed), finite when concrete.
    ``strict`` (at construction) also rejects what is neither a number nor an array; JAX rebuilding the
    objective may pass placeholders (``object()``) that only the lenient check lets through."""
    if value is None:
        return
    _check_type(name, value)
    if strict and not (isinstance(value, numbers.Real) or hasattr(value, "dtype")):
        raise TypeError(f"{name} must be None or a real scalar, got {name}={value!r}")
    v = _concrete_value(value)
    if v is not None and not np.isfinite(v):
        raise ValueError(f"{name} must be finite, got {name}={v!r}")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def _check_token_level(cls_name: str, level: Any) -> None:
    if level != "token":
        raise ValueError(
            f"{cls_name} is defined at token level only (sequence-level importance sampling with "
            f"{cls_name} is a configuration error), got importance_sampling_level={level!r}"
        )


def shared_field(default: Any, *, static: bool) -> Any:
    """A keyword-only dataclass field that every subclass of a base declares once (the objectives' loss shaping,
    ``Objective``): :func:`_register` adds it to the leaves (``static=False``) or to the aux data."""
    return dataclasses.field(default=default, kw_only=True, metadata={"pytree": "static" if static else "data"})


def _check_kl_flag(x) -> None:
    """An objective rebuilt from its leaves keeps its static ``_has_kl``; one built without a KL term must not
    come back with a concrete non-zero ``beta`` (e.g. ``jax.tree.map(lambda b: b + 0.3, GMPO(beta=0.0))``):
    its KL term would be silently missing. A concrete zero and a traced ``beta`` (``jit`` / ``vmap`` of an
    objective passed as an argument) stay allowed."""
    if getattr(x, "_has_kl", True):
        return
    beta = _concrete_value(getattr(x, "beta", None))
    if beta is not None and beta != 0:
        raise ValueError(
            f"{type(x).__name__} rebuilt from its leaves (e.g. by jax.tree.map) with beta={beta!r}, but it was "
            "built without a KL term (beta a concrete 0 at construction; objective.has_kl is static and kept "
            "when JAX rebuilds the objective), so the non-zero beta would be silently ignored: build a new "
            "objective instead (dataclasses.replace(objective, beta=...) re-derives the flag)"
        )


def _register(cls, data_fields, meta_fields, derived=()):
    """``cls`` as a frozen dataclass registered as a pytree: ``data_fields`` are leaves, ``meta_fields`` and
    the ``derived`` attributes (set by ``__post_init__``, e.g. ``_has_kl``) static aux data; the fields of a
    base class declared with :func:`shared_field` join the one or the other.

    Unlike ``jax.tree_util.register_dataclass`` (whose unflatten calls ``cls(**fields)``, i.e. reruns
    ``__post_init__`` on whatever the leaves are: tracers under ``jit``), unflattening restores the derived
    attributes from the aux data and reruns only the checks (``_check``), so a static decision made from
    concrete values at construction survives ``jit`` / ``vmap`` / ``shard_map`` / ``jax.tree.map``; a
    concrete non-zero ``beta`` in an objective built without a KL term raises (:func:`_check_kl_flag`)."""
    own_repr = any("__repr__" in c.__dict__ for c in cls.__mro__[:-1])  # e.g. Objective's
    cls = dataclasses.dataclass(frozen=True, repr=not own_repr)(cls)
    shared = {f.name: f.metadata["pytree"] for f in dataclasses.fields(cls) if "pytree" in f.metadata}
    data_fields = tuple(data_fields) + tuple(n for n, kind in shared.items() if kind == "data")
    meta_fields = tuple(meta_fields) + tuple(n for n, kind in shared.items() if kind == "static")
    static = meta_fields + tuple(derived)
    init_fields = {f.name for f in dataclasses.fields(cls) if f.init}
    assert init_fields == set(data_fields) | set(meta_fields), (cls, init_fields)

    def flatten(x):
        return tuple(getattr(x, n) for n in data_fields), tuple(getattr(x, n) for n in static)

    def flatten_with_keys(x):
        leaves, aux = flatten(x)
        return tuple(zip((jax.tree_util.GetAttrKey(n) for n in data_fields), leaves)), aux

    def unflatten(aux, leaves):
        x = object.__new__(cls)
        for name, value in (*zip(static, aux), *zip(data_fields, leaves)):
            object.__setattr__(x, name, value)
        getattr(x, "_recheck", x._check)()
        _check_kl_flag(x)
        return x

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls
