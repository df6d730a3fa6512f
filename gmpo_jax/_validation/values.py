"""Value checks of concrete data at trace time (ids in range, finite values at a counted token, a {0, 1} mask,
non-negative segment ids): each runs when the values are known (not traced) and names the first bad position;
traced values cannot be checked (the public docstrings say what happens then)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax._validation.arguments import _concrete, _dtype, concrete_array, require_shape

__all__ = [
    "counted_tokens",
    "check_ids_in_range",
    "check_finite_unmasked",
    "check_log_probs",
    "check_logits_values",
    "check_finite_parameter",
    "check_bias_at_targets",
    "check_row_or_token_values",
    "check_mask",
    "check_segment_ids",
]

# A log-softmax value is <= 0; rounding (a bfloat16 z_y - lse with |lse| < 128 is off by <= 0.25) keeps it below this.
# A counted value above it is a negated log-prob (an NLL, a per-token loss), which would silently flip every ratio.
LOG_PROB_MAX = 0.5


def counted_tokens(mask, segment_ids=None):
    """The tokens a loss counts, ``[B, T]`` bool NumPy, when the mask (and ``segment_ids``) are concrete:
    ``mask != 0``, and with packed rows also ``segment_ids > 0`` (id 0 is padding whatever the mask says).
    None when either is traced: the value checks then have nothing to check against."""
    mask_v = _concrete(mask)
    if mask_v is None:
        return None
    counted = mask_v != 0
    if segment_ids is not None:
        seg = _concrete(segment_ids)
        counted = None if seg is None else counted & (seg > 0)
    return counted


def check_ids_in_range(ids, mask, V: int, name: str = "completion_ids", mask_name: str = "completion_mask") -> None:
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
            f"{name} must lie in [0, {V}) wherever {mask_name} is 1 (masked positions may hold any "
            f"id, e.g. -100), got {name}[{', '.join(map(str, pos))}] = {int(ids_v[pos])} "
            f"({int(bad.sum())} such position(s))"
        )


def check_finite_unmasked(name: str, x, mask, mask_name: str = "batch.completion_mask"):
    """``x`` (``[B, T]``, or ``[B, T, ...]`` such as hidden states) is finite (no NaN, no ``+-inf``: an infinite
    log-prob makes a ratio or the KL term infinite) at every token the mask counts, when both are concrete; the
    error names the first such position ``(b, t)``. Masked positions may hold anything (nothing reads them).
    Traced, it cannot be checked: a NaN there makes the loss NaN. Returns ``x`` as float32 NumPy when it was
    checked (for further checks of the same values), else None."""
    xv, mv = _concrete(x), _concrete(mask)
    if xv is None or mv is None:
        return None
    xv = xv.astype(np.float32)
    bad = ~np.isfinite(xv)
    bad = bad.reshape(bad.shape[:2] + (-1,)).any(axis=-1) & (mv != 0)
    if bad.any():
        b, t = (int(i) for i in np.argwhere(bad)[0])
        if xv.ndim == 2:
            where, value = f"{name}[{b}, {t}]", xv[b, t]
        else:  # the token's first non-finite element
            k = np.unravel_index(int(np.flatnonzero(~np.isfinite(xv[b, t]))[0]), xv.shape[2:])
            where, value = f"{name}[{', '.join(str(int(i)) for i in (b, t, *k))}]", xv[(b, t, *k)]
        raise ValueError(
            f"{name} must be finite at an unmasked token ({mask_name} 1), got {float(value)!r} in {where} "
            f"({int(bad.sum())} such token(s))"
        )
    return xv


def _bad(z, banned_ok: bool):
    """Entries of ``z`` that are NaN or ``+inf`` in float32, or ``-inf`` too unless ``banned_ok`` (a banned token)."""
    z = z.astype(jnp.float32)
    bad = jnp.isnan(z) | (z == jnp.inf)
    return bad if banned_ok else bad | (z == -jnp.inf)


@functools.partial(jax.jit, static_argnums=2)
def _bad_logits(logits, ids, T: int):
    """``[B, T]`` bool pair: rows of ``logits[:, :T]`` (as float32, as the loss computes) holding NaN / ``+inf``; rows
    whose own id's logit is ``-inf`` (one fused read of the logits: no copy or bool temporary of their size)."""
    z = logits[:, :T].astype(jnp.float32)
    own = jnp.take_along_axis(z, jnp.clip(ids.astype(jnp.int32), 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return jnp.any(_bad(z, banned_ok=True), axis=-1), own == -jnp.inf


def check_logits_values(logits, ids, counted, T: int) -> None:
    """At every counted token (``counted`` ``[B, T]`` bool NumPy; None: not checked) the logits row ``logits[b, t]``
    holds no NaN and no ``+inf`` in float32 (its log-softmax would be NaN) and its own id's logit is not ``-inf``
    (log-prob ``-inf``); a ``-inf`` elsewhere is a banned token and fine. When the logits and ids are known (not
    under ``jit``; an eager ``jax.grad`` is): the reduction runs on the logits' device, one ``[B, T]`` result and at
    most one bad row are copied to the host."""
    z, ids = concrete_array(logits), concrete_array(ids)
    if counted is None or z is None or ids is None:
        return
    with jax.ensure_compile_time_eval():  # concrete logits inside someone's jit (a closed-over constant) too
        nan_or_inf, own_neg_inf = (np.asarray(x) & counted for x in _bad_logits(z, jnp.asarray(ids), T))
        if nan_or_inf.any():
            b, t = (int(i) for i in np.argwhere(nan_or_inf)[0])
            row = np.asarray(jnp.asarray(z[b, t], jnp.float32))
            v = int(np.flatnonzero(np.isnan(row) | (row == np.inf))[0])
            raise ValueError(
                f"logits must be finite or -inf at a counted token (completion_mask 1, segment id > 0), got "
                f"logits[{b}, {t}, {v}] = {float(row[v])!r} (in float32; {int(nan_or_inf.sum())} such token(s); "
                "masked tokens may hold anything)"
            )
    if own_neg_inf.any():
        b, t = (int(i) for i in np.argwhere(own_neg_inf)[0])
        y = int(np.asarray(ids)[b, t])
        raise ValueError(
            f"logits at a counted token's own id must not be -inf (log-prob -inf), got logits[{b}, {t}, {y}] = -inf "
            f"with completion_ids[{b}, {t}] = {y} ({int(own_neg_inf.sum())} such token(s))"
        )


@functools.partial(jax.jit, static_argnums=(1, 2))
def _any_bad(x, banned_ok: bool, n: int):
    """Whether the first ``n`` rows of ``x`` hold a NaN or ``+inf`` in float32, or ``-inf`` too unless ``banned_ok``
    (one fused read: no copy of ``x``)."""
    return jnp.any(_bad(x[:n], banned_ok))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _first_bad(x, banned_ok: bool, n: int):
    """``(count, first flat index)`` of :func:`_any_bad`'s entries (run only when there is one)."""
    bad = _bad(x[:n], banned_ok).reshape(-1)
    return jnp.sum(bad), jnp.argmax(bad)


def check_finite_parameter(name: str, x, *, banned_ok: bool = False, n: int | None = None) -> None:
    """The LM head's ``weight`` (or ``bias``) holds no NaN and no infinity in float32 (``banned_ok``: a ``-inf``
    bias entry bans a token and is allowed) in its first ``n`` rows (a bias past ``vocab_size`` is replaced by
    ``-inf``; None: all), when it is known (not under ``jit``; an eager
    ``jax.grad`` is): a non-finite weight entry makes every token's log-sum-exp, and so the loss, NaN. The reduction
    runs on the array's device; a bool (and, when one is bad, two integers) come to the host."""
    z = concrete_array(x)
    if z is None:
        return
    n = np.shape(z)[0] if n is None else min(n, np.shape(z)[0])
    with jax.ensure_compile_time_eval():  # concrete parameters inside someone's jit (a closed-over constant) too
        if not bool(_any_bad(z, banned_ok, n)):
            return
        count, first = (int(v) for v in _first_bad(z, banned_ok, n))
        pos = np.unravel_index(first, (n, *np.shape(z)[1:]))
        value = float(np.asarray(jnp.asarray(z[pos], jnp.float32)))
        raise ValueError(
            f"{name} must be finite{' or -inf' if banned_ok else ''}, got {name}[{', '.join(map(str, pos))}] = "
            f"{value!r} ({count} such entr{'y' if count == 1 else 'ies'}; every token's log-sum-exp would be NaN)"
        )


def check_bias_at_targets(bias, ids, counted, name: str = "bias") -> None:
    """No counted token's own id has a ``-inf`` bias (its log-prob would be ``-inf``: a NaN or meaningless loss; a
    ``-inf`` elsewhere bans a token), when the bias and ids are known (``counted``: ``[B, T]`` bool NumPy)."""
    b, y = _concrete(bias), _concrete(ids)
    if b is None or y is None or counted is None:
        return
    yv = np.clip(y.astype(np.int64), 0, b.shape[0] - 1)
    bad = counted & (b.astype(np.float32)[yv] == -np.inf)
    if bad.any():
        i, t = (int(k) for k in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} at a counted token's own id must not be -inf (log-prob -inf), got {name}[{int(yv[i, t])}] = -inf "
            f"with completion_ids[{i}, {t}] = {int(y[i, t])} ({int(bad.sum())} such token(s))"
        )


def check_log_probs(name: str, x, mask, mask_name: str = "batch.completion_mask") -> None:
    """``x`` (``[B, T]`` log-probs) is finite and at most ``LOG_PROB_MAX`` at every token the mask counts, when both
    are concrete (:func:`check_finite_unmasked` first): a larger value is not a log-probability (a negated one, an
    NLL, is the usual mistake). Traced, it cannot be checked."""
    xv = check_finite_unmasked(name, x, mask, mask_name)  # the values, converted once
    if xv is None:
        return
    bad = (xv > LOG_PROB_MAX) & (_concrete(mask) != 0)
    if bad.any():
        b, t = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be log-probabilities (<= 0; up to {LOG_PROB_MAX} is taken as rounding) at an unmasked "
            f"token ({mask_name} 1), got {float(xv[b, t])!r} in {name}[{b}, {t}] ({int(bad.sum())} such token(s)): "
            "a negated log-prob (an NLL) flips every ratio"
        )


def check_row_or_token_values(name: str, x, counted, *, nonneg: bool = False, what: str = "") -> None:
    """``x`` (``[B]``, ``[B, 1]`` or ``[B, T]``: one value per row or per token) is finite (and ``>= 0`` with
    ``nonneg``) where it is read: at a counted token, or for a row with one (``counted``, from
    :func:`counted_tokens`); everywhere when ``counted`` is None (a traced mask: which tokens count is unknown).
    Nothing is checked when ``x`` is traced. The error names the first bad position as ``x[b]`` or ``x[b, t]``."""
    value = _concrete(x)
    if value is None:
        return
    B = value.shape[0]
    v = value.astype(np.float64).reshape(B, -1)
    ok = np.isfinite(v) & (v >= 0) if nonneg else np.isfinite(v)
    if counted is not None:
        ok |= ~(counted if v.shape[1] == counted.shape[1] else counted.any(axis=1, keepdims=True))
    if not ok.all():
        b, t = (int(i) for i in np.argwhere(~ok)[0])
        pos = f"[{b}]" if value.ndim == 1 else f"[{b}, {t}]"
        where = "" if counted is None else " where a token counts"
        raise ValueError(
            f"{name} must be finite{' and >= 0' if nonneg else ''}{what}{where}, got {name}{pos} = {float(v[b, t])!r}"
        )


def check_mask(mask, B: int, T: int, name: str = "completion_mask") -> None:
    require_shape(name, mask, (B, T), "[B, T]")
    dt = _dtype(mask, name)
    if not (dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)):
        raise TypeError(f"{name} must be bool or {{0, 1}} numbers, got {name}.dtype={dt}")
    if dt != jnp.bool_:
        # a weighted mask (e.g. 0.5) would silently count as 1; a traced mask cannot be checked (documented)
        value = _concrete(mask)
        if value is not None and not np.all((value == 0) | (value == 1)):
            bad = value[(value != 0) & (value != 1)].ravel()[:3].tolist()
            raise ValueError(
                f"{name} must hold only 0 and 1 (it selects tokens, it does not weight them), got values such as {bad}"
            )


def check_segment_ids(segment_ids, B: int, T: int, name: str = "segment_ids") -> None:
    """``segment_ids``: None, or a ``[B, T]`` integer array of non-negative ids (checked when concrete)."""
    if segment_ids is None:
        return
    require_shape(name, segment_ids, (B, T), "[B, T]")
    dt = _dtype(segment_ids, name)
    if not (jnp.issubdtype(dt, jnp.integer) and not jnp.issubdtype(dt, jnp.bool_)):
        raise TypeError(f"{name} must be an integer array, got {name}.dtype={dt}")
    seg = _concrete(segment_ids)
    if seg is not None and seg.size and seg.min() < 0:
        bad = tuple(int(i) for i in np.argwhere(seg < 0)[0])
        raise ValueError(f"{name} must be >= 0 (0 marks padding), got {name}[{bad[0]}, {bad[1]}] = {int(seg[bad])}")
