"""Concrete NaN (or an infinity) in ``batch.old_logps`` / ``batch.ref_logps`` (both ops) or ``reference.hidden`` (LM
head) at an unmasked token raises ValueError naming the field and the first position ``(b, t)``, like NaN advantages and
``rollout_logps``; NaN under the mask is allowed and changes nothing (the loss equals the float64 oracle's
on the clean inputs, ``conftest.TOLERANCES``). A counted log-prob above 0.5 (a negated log-prob) raises too."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Obj, assert_loss_close, make_case, spec_for

import gmpo_jax

B, T, H, V = 3, 5, 16, 29
CASE = make_case(4, B=B, T=T, H=H, V=V)  # row 0 full, the others ragged
LOGITS = np.concatenate([CASE.hidden @ CASE.weight, CASE.hidden[:, :1] @ CASE.weight], axis=1).astype(np.float32)
OBJ = Obj("gmpo", beta=0.05)
FIRST = (1, 0)  # the first NaN position (row-major) of every case below
MASKED = tuple(int(i) for i in np.argwhere(~CASE.mask)[0])


def _loss(op, *, old=CASE.old, ref=CASE.ref, ref_hidden=None):
    batch = gmpo_jax.PolicyBatch(CASE.ids, CASE.mask, CASE.adv, old_logps=old, ref_logps=ref)
    if op == "logits":
        return gmpo_jax.policy_loss_from_logits(LOGITS, batch, objective=OBJ.lib(), implementation="xla")
    reference = None
    if ref_hidden is not None:
        batch, reference = batch._replace(ref_logps=None), gmpo_jax.ReferenceHead(ref_hidden, CASE.weight)
    head = gmpo_jax.HeadOptions(implementation="xla_chunked")
    return gmpo_jax.fused_linear_policy_loss(
        CASE.hidden, CASE.weight, batch, objective=OBJ.lib(), reference=reference, head=head
    )


def _with_nan(x, *positions):
    x = np.array(x, np.float32)
    for p in positions:
        x[p] = np.nan
    return x


CASES = [
    ("lm_head", "old_logps"),
    ("lm_head", "ref_logps"),
    ("lm_head", "ref_hidden"),
    ("logits", "old_logps"),
    ("logits", "ref_logps"),
]


SHOWN = {"old_logps": r"batch\.old_logps", "ref_logps": r"batch\.ref_logps", "ref_hidden": r"reference\.hidden"}


def _kwargs(name, *positions):
    if name == "ref_hidden":
        return dict(ref_hidden=_with_nan(CASE.hidden, *positions))
    return {name[:3]: _with_nan(getattr(CASE, name[:3]), *positions)}


@pytest.mark.parametrize("op,name", CASES)
def test_unmasked_nan_raises(op, name):
    later = (2, 0)
    assert CASE.mask[FIRST] and CASE.mask[later]
    pos = FIRST + ((1,) if name == "ref_hidden" else ())  # one hidden unit of the token
    shown = SHOWN[name]  # the error names the field
    with pytest.raises(ValueError, match=rf"{shown} must be finite at an unmasked token.*nan in {shown}\[1, 0"):
        _loss(op, **_kwargs(name, later, pos))
    with pytest.raises(ValueError, match=shown):  # a jax array too
        kw = {k: jnp.asarray(v) for k, v in _kwargs(name, pos).items()}
        _loss(op, **kw)


@pytest.mark.parametrize("value", [-np.inf, np.inf])
@pytest.mark.parametrize("op,name", [c for c in CASES if c[1] != "ref_hidden"])
def test_unmasked_infinite_logps_raise(op, name, value):
    """An infinite log-prob at a counted token (a sampled token's is finite) would make a ratio or the KL term
    infinite: it raises as NaN does, naming the field, the value and the position."""
    x = np.array(getattr(CASE, name[:3]), np.float32)
    x[FIRST] = value
    with pytest.raises(ValueError, match=rf"{SHOWN[name]} must be finite .*got {value!r} in {SHOWN[name]}\[1, 0\]"):
        _loss(op, **{name[:3]: x})


@pytest.mark.parametrize("op,name", CASES)
def test_masked_nan_is_allowed(op, name):
    pos = MASKED + ((slice(None),) if name == "ref_hidden" else ())
    loss, aux = _loss(op, **_kwargs(name, pos))
    case = CASE
    if name == "ref_hidden":  # the reference is the policy's own head (its float64 log-probs)
        case = dataclasses.replace(CASE, ref=np.where(CASE.mask, CASE.logp64, 0.0))
    want = spec_for(case, OBJ, ris=False)
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    kl = want.metrics["kl"]
    assert abs(float(aux.kl) - kl) <= 1e-5 * max(abs(kl), 1e-2), (float(aux.kl), kl)


@pytest.mark.parametrize("op,name", [c for c in CASES if c[1] != "ref_hidden"])
def test_positive_logps_raise(op, name):
    """A counted log-prob above ``LOG_PROB_MAX`` (0.5: log-probs are <= 0, the slack is a bfloat16 log-softmax's
    rounding) is not one; the usual mistake, a negated log-prob (an NLL), raises naming the field, the value and
    the position. At the limit, or above it under the mask, it passes; traced (under jit) it cannot be checked."""
    from gmpo_jax._validation.values import LOG_PROB_MAX

    x = np.array(getattr(CASE, name[:3]), np.float32)
    shown = SHOWN[name]
    with pytest.raises(ValueError, match=rf"{shown} must be log-probabilities .*in {shown}\[0, 0\]"):
        _loss(op, **{name[:3]: np.where(CASE.mask, -x, 0.0)})  # the NLL
    x[FIRST] = 0.75
    with pytest.raises(ValueError, match=rf"{shown} must be log-probabilities .*got 0\.75 in {shown}\[1, 0\]"):
        _loss(op, **{name[:3]: jnp.asarray(x)})
    x[FIRST], x[MASKED] = LOG_PROB_MAX, 3.0
    assert np.isfinite(float(_loss(op, **{name[:3]: x})[0]))
    x[FIRST] = 0.75
    traced = jax.jit(lambda v: _loss(op, **{name[:3]: v})[0])(x)
    assert np.isfinite(float(traced))
