"""``num_items_in_batch``: a concrete value below 1 raises (it would silently become the normaliser 1); any
real ``>= 1`` is the dapo / cispo normaliser (float64 oracle, ``conftest.TOLERANCES``); traced, ``max(n, 1)``
(defined, not checkable); the loss types that ignore it warn once each. Both ops."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Obj, assert_loss_close, make_case, spec_for

import gmpo_jax
from gmpo_jax import _validation

B, T, H, V = 3, 5, 16, 29
CASE = make_case(2, B=B, T=T, H=H, V=V, with_ref=False)
LOGITS = np.concatenate([CASE.hidden @ CASE.weight] * 2, axis=1)[:, : T + 1].astype(np.float32)
OPS = ["lm_head", "logits"]


def _loss(op, objective, num_items):
    batch = gmpo_jax.PolicyBatch(CASE.ids, CASE.mask, CASE.adv, old_logps=CASE.old, num_items_in_batch=num_items)
    if op == "lm_head":
        head = gmpo_jax.HeadOptions(implementation="xla_chunked")
        return gmpo_jax.fused_linear_policy_loss(CASE.hidden, CASE.weight, batch, objective=objective, head=head)
    return gmpo_jax.policy_loss_from_logits(LOGITS, batch, objective=objective, implementation="xla")


def _want(obj, num_items):
    """The oracle from the logits the op sees (the LM head's, rounded to float32 for the logits op)."""
    return spec_for(CASE, obj, ref=False, ris=False, num_items_in_batch=num_items)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_validation, "_warned_ignored_num_items", set(), raising=False)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("obj", [Obj("dapo"), Obj("cispo", epsilon_high=1.3)], ids=str)
@pytest.mark.parametrize("n", [0, 0.5, np.float32(0.999), jnp.int32(0)], ids=["0", "0.5", "np0.999", "jax0"])
def test_below_one_raises(obj, op, n):
    with pytest.raises(ValueError, match=r"batch\.num_items_in_batch must be >= 1.*got batch\.num_items_in_batch="):
        _loss(op, obj.lib(), n)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("obj", [Obj("dapo"), Obj("cispo", epsilon_high=1.3)], ids=str)
def test_real_values_at_least_one_normalise(obj, op):
    """1, a non-integer 2.5 (a per-process share) and an int; no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (1, 2.5, np.int32(40)):
            loss, aux = _loss(op, obj.lib(), n)
            want = _want(obj, float(n))
            assert_loss_close(loss, want.loss, want.scale, np.float32)
            assert float(aux.loss_denominator) == float(n)


@pytest.mark.parametrize("op", OPS)
def test_traced_below_one_is_max_n_1(op):
    """Under jit the value cannot be checked: the normaliser is ``max(n, 1)`` (documented)."""
    obj = Obj("dapo")
    loss, aux = jax.jit(lambda n: _loss(op, obj.lib(), n))(jnp.float32(0.5))
    want = _want(obj, 1.0)
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    assert float(aux.loss_denominator) == 1.0


IGNORING = [Obj("gmpo"), Obj("grpo"), Obj("bnpo"), Obj("dr_grpo", max_completion_length=T), Obj("sapo")]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("obj", IGNORING, ids=str)
def test_ignored_warns_once(obj, op):
    """The loss types with their own normaliser: a warning naming the argument and the loss type, once;
    the loss is the one without it."""
    with pytest.warns(UserWarning, match=f"num_items_in_batch is ignored by loss_type='{obj.loss_type}'"):
        loss, _ = _loss(op, obj.lib(), 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = _loss(op, obj.lib(), 7)
        plain, _ = _loss(op, obj.lib(), None)
    assert float(loss) == float(again) == float(plain)
    want = _want(obj, None)
    assert_loss_close(loss, want.loss, want.scale, np.float32)
