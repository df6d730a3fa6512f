"""Edge values of the scalar arguments, both ops: ``num_items_in_batch`` (non-finite, bool, strings, ignored
values; the warning names the caller's line), the objective's static KL flag under ``jax.tree.map`` (a KL
term is never dropped silently), and a reference given to an objective without a KL term (warned)."""

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
CASE = make_case(3, B=B, T=T, H=H, V=V, with_ref=True)
LOGITS = np.concatenate([CASE.hidden @ CASE.weight] * 2, axis=1)[:, : T + 1].astype(np.float32)
OPS = ["lm_head", "logits"]


def _loss(op, objective, reference=None, **fields):
    """``op``'s ``(loss, aux)``; ``fields``: more of the batch's (``PolicyBatch``)."""
    batch = gmpo_jax.PolicyBatch(CASE.ids, CASE.mask, CASE.adv, old_logps=CASE.old, **fields)
    if op == "lm_head":
        head = gmpo_jax.HeadOptions(implementation="xla_chunked")
        return gmpo_jax.fused_linear_policy_loss(
            CASE.hidden, CASE.weight, batch, objective=objective, reference=reference, head=head
        )
    return gmpo_jax.policy_loss_from_logits(LOGITS, batch, objective=objective, implementation="xla")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every once-per-process warning fires again in each test."""
    monkeypatch.setattr(_validation, "_warned_ignored_num_items", set(), raising=False)
    if hasattr(_validation, "_warned_ignored_reference"):
        monkeypatch.setattr(_validation, "_warned_ignored_reference", set())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [float("inf"), -float("inf"), float("nan"), np.float32("inf")], ids=str)
def test_non_finite_num_items_raises(op, n):
    with pytest.raises(ValueError, match=r"num_items_in_batch must be (finite|>= 1)"):
        _loss(op, Obj("dapo").lib(), num_items_in_batch=n)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [True, "22", [3.0], jnp.ones(2)], ids=["bool", "str", "list", "vector"])
@pytest.mark.parametrize("loss_type", ["dapo", "gmpo"])
def test_num_items_of_wrong_type_raises_type_error(op, n, loss_type):
    obj = Obj("dapo").lib() if loss_type == "dapo" else gmpo_jax.GMPO()
    with pytest.raises(TypeError, match=r"num_items_in_batch must be a real scalar"):
        _loss(op, obj, num_items_in_batch=n)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [0, 0.5, float("inf")], ids=str)
def test_num_items_ignored_by_gmpo_warns_not_raises(op, n):
    """A value the loss type ignores is not checked against a normaliser's range: it warns and the loss is the
    loss without it (float64 oracle)."""
    with pytest.warns(UserWarning, match="num_items_in_batch is ignored by loss_type='gmpo'"):
        loss, _ = _loss(op, gmpo_jax.GMPO(), num_items_in_batch=n)
    want = spec_for(CASE, Obj("gmpo"), ref=False, ris=False)
    assert_loss_close(loss, want.loss, want.scale, np.float32)


@pytest.mark.parametrize("op", OPS)
def test_ignored_num_items_warning_names_the_caller(op):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _loss(op, gmpo_jax.GMPO(), num_items_in_batch=7)
        jax.jit(lambda h: _loss(op, gmpo_jax.GMPO(), num_items_in_batch=7)[0])(CASE.hidden)
    ours = [w for w in seen if "num_items_in_batch is ignored" in str(w.message)]
    assert ours, [str(w.message) for w in seen]
    assert all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]


@pytest.mark.parametrize("op", OPS)
def test_traced_num_items_is_max_n_1_and_nan_propagates(op):
    """Traced values cannot be checked (documented): the normaliser is ``max(n, 1)``; a NaN gives a NaN loss."""
    obj = Obj("dapo")
    f = jax.jit(lambda n: _loss(op, obj.lib(), num_items_in_batch=n)[0])
    want = spec_for(CASE, obj, ref=False, ris=False, num_items_in_batch=1.0)
    assert_loss_close(f(jnp.float32(0.0)), want.loss, want.scale, np.float32)
    assert np.isnan(float(f(jnp.float32(np.nan))))


@pytest.mark.parametrize("make", [gmpo_jax.GMPO, lambda **k: gmpo_jax.GRPO(loss_type="grpo", **k), gmpo_jax.SAPO])
def test_tree_map_to_a_non_zero_beta_never_drops_the_kl_term(make):
    """An objective built with ``beta=0.0`` has no KL term; mapping its leaves to a concrete non-zero ``beta``
    raises (it would silently lose the KL term); ``dataclasses.replace`` re-derives the flag instead."""
    obj = make(beta=0.0)
    with pytest.raises(ValueError, match=r"beta=0\.3.*built without a KL term"):
        jax.tree.map(lambda x: x * 0 + 0.3, obj)
    assert jax.tree.map(lambda x: x * 1.0, obj).has_kl is False  # concrete zero stays allowed


@pytest.mark.parametrize("op", OPS)
def test_kl_flag_error_after_tree_map_to_zero_is_not_contradictory(op):
    """``beta`` mapped to 0.0 keeps the KL term of the objective as built (static flag); the error says so."""
    obj = jax.tree.map(lambda x: x * 0, gmpo_jax.GMPO(beta=0.1))
    with pytest.raises(ValueError, match=r"built with a KL term") as err:
        _loss(op, obj)
    assert "beta=0.0 gives the loss a KL term" not in str(err.value)


@pytest.mark.parametrize("op", OPS)
def test_reference_without_kl_term_warns(op):
    """``ref_logps`` given to an objective without a KL term (``beta=0``) changes nothing: warned, once, and the
    loss is the loss without a reference (float64 oracle)."""
    with pytest.warns(UserWarning, match=r"batch\.ref_logps is ignored.*no KL term"):
        loss, _ = _loss(op, gmpo_jax.GMPO(), ref_logps=CASE.ref)
    want = spec_for(CASE, Obj("gmpo"), ref=False, ris=False)
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(op, gmpo_jax.GMPO(), ref_logps=CASE.ref)  # once per process


def test_reference_head_without_kl_term_warns_and_is_not_run():
    """A ``ReferenceHead`` given to an objective without a KL term: warned (naming ``reference``), its log-probs
    not computed (a NaN there would otherwise reach nothing either), and the loss is the loss without it."""
    reference = gmpo_jax.ReferenceHead(jnp.asarray(CASE.hidden), jnp.asarray(CASE.weight))
    with pytest.warns(UserWarning, match=r"reference is ignored.*no KL term.*not computed"):
        loss, _ = _loss("lm_head", gmpo_jax.GMPO(), reference=reference)
    want = spec_for(CASE, Obj("gmpo"), ref=False, ris=False)
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    jaxpr = jax.make_jaxpr(lambda h: _loss("lm_head", gmpo_jax.GMPO(), reference=reference._replace(hidden=h))[0])
    assert "custom_vjp_call" in str(jaxpr(jnp.asarray(CASE.hidden)))  # the policy's own fused call only
    assert str(jaxpr(jnp.asarray(CASE.hidden))).count("custom_vjp_call") == 1


def test_cispo_cap_must_be_positive():
    """CISPO's ``epsilon_high`` caps the ratio itself: 0 would make every gradient 0 (a traced value is not checked)."""
    with pytest.raises(ValueError, match="epsilon_high"):
        gmpo_jax.CISPO(epsilon_high=0.0)
    assert gmpo_jax.CISPO(epsilon_high=jnp.float32(0.5)).epsilon_high == 0.5


@pytest.mark.parametrize("op", OPS)
def test_dr_grpo_normaliser_below_a_completion_raises(op):
    """``max_completion_length`` is the sampler's limit: a row counting more tokens than it is a wrong normaliser
    (concrete masks; a padded width T above it is fine)."""
    longest = int(np.asarray(CASE.mask).sum(axis=1).max())
    with pytest.raises(ValueError, match=r"max_completion_length=.*counts"):
        _loss(op, gmpo_jax.GRPO(loss_type="dr_grpo", max_completion_length=longest - 1))
    loss, _ = _loss(op, gmpo_jax.GRPO(loss_type="dr_grpo", max_completion_length=longest))
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("op", ["policy_loss", "logprobs"])
def test_non_finite_hidden_at_masked_positions_is_ignored(op):
    """A hidden state at a masked position may hold anything (NaN, inf): loss, log-probs and every gradient are
    those of the same call with zeros there (the LM-head ops zero the masked rows; a NaN times their zero cotangent
    would otherwise fill the weight gradient with NaN)."""
    rng = np.random.default_rng(0)
    B, T, H, V = 2, 5, 8, 33
    h = rng.normal(size=(B, T, H)).astype(np.float32)
    w = (rng.normal(size=(H, V)) / np.sqrt(H)).astype(np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    mask[0, 3:] = False
    mask[1, 0] = False
    bad = h.copy()
    bad[0, 3] = np.nan
    bad[0, 4] = np.inf
    bad[1, 0] = -np.inf
    adv = jnp.asarray([0.7, -1.2], jnp.float32)

    def f(h, w):
        if op == "logprobs":
            logp = gmpo_jax.fused_linear_logprobs(h, w, ids, completion_mask=mask)
            return jnp.sum(logp * jnp.arange(1.0, B * T + 1).reshape(B, T)), logp
        return gmpo_jax.fused_linear_policy_loss(h, w, gmpo_jax.PolicyBatch(ids, mask, adv), objective=gmpo_jax.GMPO())

    run = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    (v0, a0), g0 = run(jnp.asarray(np.where(mask[..., None], h, 0.0)), jnp.asarray(w))
    (v1, a1), g1 = run(jnp.asarray(bad), jnp.asarray(w))
    for x, y in zip(jax.tree.leaves((v1, a1, g1)), jax.tree.leaves((v0, a0, g0))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.isfinite(np.asarray(g1[1])).all() and not np.asarray(g1[0])[~mask].any()
