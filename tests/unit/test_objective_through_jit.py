"""Objectives are pytrees: passed through ``jax.jit`` / ``vmap`` as arguments (alone or inside a train
state) their hyper-parameters are tracers, while whether a KL term exists (``Objective.has_kl``) is static,
fixed at construction from a concrete ``beta``. A traced ``beta`` keeps its value in the math (checked
against the float64 oracle of ``spec_numpy``) and a new value does not retrace.

Both ops (``fused_linear_policy_loss`` on ``xla_chunked``, ``policy_loss_from_logits`` on ``xla``), every
objective and loss type; one small case each of the Mosaic kernels in the Pallas interpreter. Tolerances:
``conftest.TOLERANCES`` (float32 / bfloat16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPES,
    Obj,
    assert_grad_close,
    assert_loss_close,
    check_against_spec,
    fast_jit,
    make_case,
    spec_for,
)

import gmpo_jax
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

B, T, H, V = 3, 5, 16, 29
BETA = 0.05
OBJECTIVES = [
    Obj("gmpo"),
    Obj("grpo"),
    Obj("bnpo"),
    Obj("dr_grpo", max_completion_length=T + 2),
    Obj("dapo"),
    Obj("dapo", level="sequence"),
    Obj("cispo", epsilon_high=1.3),
    Obj("sapo"),
]


def _logits(case):
    """``[B, T + 1, V]`` float32 logits of the case (the last position is dropped by the op)."""
    z = np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)
    return np.concatenate([z, z[:, :1]], axis=1).astype(np.float32)


def _op(name, case, implementation):
    """``f(objective, x, ref) -> (loss, aux)``: ``x`` the hidden states (LM head) or the logits."""
    if name == "lm_head":
        w = jnp.asarray(case.weight)
        return lambda obj, x, ref: gmpo_jax.fused_linear_policy_loss(
            x,
            w,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=ref),
            objective=obj,
            head=gmpo_jax.HeadOptions(implementation=implementation),
        )
    return lambda obj, x, ref: gmpo_jax.policy_loss_from_logits(
        x,
        gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=ref),
        objective=obj,
        implementation=implementation,
    )


def _x(name, case):
    return jnp.asarray(case.hidden if name == "lm_head" else _logits(case))


def _check(name, case, obj: Obj, loss, aux, g):
    """Loss, metrics and the gradient in ``x`` against the float64 oracle."""
    want = spec_for(case, obj, ref=obj.beta != 0, ris=False)
    if name == "lm_head":
        check_against_spec(loss, aux, None, want, case, obj, check_grads=False)
        assert_grad_close(np.asarray(g), want.dhidden, case.dtype, "dhidden")
        return
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    if obj.beta:
        assert_loss_close(aux.kl, want.metrics["kl"], abs(want.metrics["kl"]), np.float32, what="aux.kl")
    z = _logits(case)[:, :T].astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.arange(V) == np.where(case.mask, case.ids, -1)[..., None]
    dwant = np.zeros((B, T + 1, V))
    dwant[:, :T] = np.where(case.mask[..., None], want.dlogp[..., None] * (onehot - p), 0.0)
    assert_grad_close(np.asarray(g), dwant, np.float32, "dlogits")


OPS = [("lm_head", "xla_chunked"), ("logits", "xla")]


@pytest.mark.parametrize("op,implementation", OPS, ids=[o for o, _ in OPS])
@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
def test_objective_as_jit_argument(obj, op, implementation):
    """beta = 0 without a reference; then a traced non-zero beta with one, two values, one trace."""
    case = make_case(OBJECTIVES.index(obj), B=B, T=T, H=H, V=V)
    f = _op(op, case, implementation)
    traces = []

    def step(objective, x, ref):
        traces.append(jax.tree.leaves(objective))
        return jax.value_and_grad(lambda x: f(objective, x, ref), has_aux=True)(x)

    step = fast_jit(step)
    x = _x(op, case)
    (loss, aux), g = step(obj.lib(), x, None)
    _check(op, case, obj, loss, aux, g)
    for beta in (BETA, 2 * BETA):
        o = dataclasses.replace(obj, beta=beta)
        (loss, aux), g = step(o.lib(), x, jnp.asarray(case.ref))
        _check(op, case, o, loss, aux, g)
    assert len(traces) == 2, "a new beta value retraced"
    assert all(isinstance(b, jax.core.Tracer) for leaves in traces for b in leaves), "hyper-parameters not traced"


@pytest.mark.parametrize("op,implementation", OPS, ids=[o for o, _ in OPS])
def test_objective_in_a_train_state(op, implementation):
    """A train state (params, objective, step) through jit: KL-free GMPO, then dapo with a traced beta."""
    case = make_case(11, B=B, T=T, H=H, V=V)
    f = _op(op, case, implementation)

    @fast_jit
    def train_step(state, ref):
        (loss, aux), g = jax.value_and_grad(lambda x: f(state["objective"], x, ref), has_aux=True)(state["params"])
        return dict(state, params=state["params"] - 0.0 * g, step=state["step"] + 1), (loss, aux, g)

    for obj, ref in ((Obj("gmpo"), None), (Obj("dapo", beta=BETA), jnp.asarray(case.ref))):
        state = dict(params=_x(op, case), objective=obj.lib(), step=jnp.int32(0))
        state, (loss, aux, g) = train_step(state, ref)
        _check(op, case, obj, loss, aux, g)
        assert int(state["step"]) == 1 and state["objective"].has_kl == (obj.beta != 0)


@pytest.mark.parametrize("op,implementation", OPS, ids=[o for o, _ in OPS])
@pytest.mark.parametrize("obj", [Obj("gmpo"), Obj("grpo"), Obj("cispo", epsilon_high=1.3), Obj("sapo")], ids=str)
def test_vmap_over_beta(obj, op, implementation):
    """``vmap`` over a batch of beta values (a 0 among them: the objective is built from a traced beta, so it
    has a KL term whose value is 0 there), and the KL-free objective as a jit argument of a vmapped function."""
    case = make_case(21, B=B, T=T, H=H, V=V)
    f = _op(op, case, implementation)
    betas = np.array([0.0, BETA, 0.3], np.float32)
    x, ref = _x(op, case), jnp.asarray(case.ref)

    def one(beta):
        return jax.value_and_grad(lambda x: f(obj.lib(beta=beta), x, ref), has_aux=True)(x)

    (loss, aux), g = fast_jit(jax.vmap(one))(jnp.asarray(betas))
    for i, beta in enumerate(betas):
        o = dataclasses.replace(obj, beta=float(beta))
        _check(op, case, o, loss[i], jax.tree.map(lambda a: a[i], aux), g[i])
    loss, aux = fast_jit(jax.vmap(lambda o, x: f(o, x, None), in_axes=(None, 0)))(obj.lib(), jnp.stack([x, x]))
    want = spec_for(case, obj, ref=False, ris=False)
    assert_loss_close(loss[1], want.loss, want.scale, np.float32)


def test_mosaic_lm_head_in_the_interpreter():
    """The LM-head kernels with a KL-free GMPO as a jit argument (its beta traced, no reference)."""
    case = make_case(3, B=B, T=T, H=64, V=200, dtype=DTYPES["bfloat16"])
    obj = Obj("gmpo")
    f = _op("lm_head", case, MosaicGpuBackend(interpret=True))
    step = jax.jit(lambda o, x: jax.value_and_grad(lambda x: f(o, x, None), has_aux=True)(x))
    (loss, aux), g = step(obj.lib(), jnp.asarray(case.hidden))
    want = spec_for(case, obj, ref=False, ris=False)
    check_against_spec(loss, aux, None, want, case, obj, check_grads=False)
    assert_grad_close(np.asarray(g), want.dhidden, case.dtype, "dhidden")


def test_mosaic_logits_in_the_interpreter():
    """The logits kernels with a KL-free dapo objective as a jit argument (traced: the three-pass path)."""
    case = make_case(5, B=2, T=3, H=16, V=2048)  # the logits kernels' smallest view
    obj = Obj("dapo")
    f = _op("logits", case, MosaicGpuLogitsBackend(interpret=True))
    step = jax.jit(lambda o, x: jax.value_and_grad(lambda x: f(o, x, None), has_aux=True)(x))
    (loss, aux), g = step(obj.lib(), jnp.asarray(_logits(case)))
    want = spec_for(case, obj, ref=False, ris=False)
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    assert float(aux.loss_denominator) == want.metrics["loss_denominator"]


def test_has_kl_is_static():
    """The flag: fixed at construction, part of the tree structure, kept through tree maps and jit (a concrete
    non-zero beta mapped into a KL-free objective raises), re-derived by ``dataclasses.replace``; a traced beta
    at construction needs a reference."""
    a, b, off = gmpo_jax.GMPO(beta=0.01), gmpo_jax.GMPO(beta=0.02), gmpo_jax.GMPO(beta=np.float32(0.0))
    assert a.has_kl and not off.has_kl and not gmpo_jax.GRPO().has_kl and gmpo_jax.SAPO(beta=0.1).requires_reference
    assert jax.tree.structure(a) == jax.tree.structure(b) != jax.tree.structure(off)
    assert not jax.tree.map(lambda x: x * 2.0, off).has_kl  # rebuilt from its leaves: the flag is kept
    with pytest.raises(ValueError, match="built without a KL term"):
        jax.tree.map(lambda x: x + 1.0, off)  # a concrete non-zero beta would silently lack the KL term
    assert dataclasses.replace(off, beta=0.1).has_kl and not dataclasses.replace(a, beta=0.0).has_kl
    assert jax.jit(lambda o: o)(off) == off and not jax.jit(lambda o: o)(off).has_kl
    with pytest.raises(ValueError, match="must be >= 0"):
        jax.tree.map(lambda x: -1.0, a)  # rebuilding reruns the checks
    case = make_case(1, B=B, T=T, H=H, V=V)
    for op, impl in OPS:
        f = _op(op, case, impl)
        with pytest.raises(ValueError, match="needs a reference"):
            jax.jit(lambda beta, x: f(gmpo_jax.GMPO(beta=beta), x, None)[0])(0.0, _x(op, case))


def test_loss_shaping_is_traced_or_static_as_declared():
    """The loss-shaping fields every objective takes: ``entropy_coef`` and ``rollout_is_cap`` are leaves (new
    values, one program), ``top_entropy_quantile`` and ``rollout_is_mode`` aux data (a new value, a new program);
    whether the entropy term exists (``entropy_coef`` None or not) is structure, as ``has_kl`` is."""
    kw = dict(top_entropy_quantile=0.5, rollout_is_mode="token_mask")
    for cls in (gmpo_jax.GMPO, gmpo_jax.GRPO, gmpo_jax.CISPO, gmpo_jax.SAPO):
        a = cls(entropy_coef=0.01, rollout_is_cap=1.5, **kw)
        b = cls(entropy_coef=jnp.float32(0.02), rollout_is_cap=3.0, **kw)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for change in (dict(top_entropy_quantile=0.4), dict(rollout_is_mode="sequence_mask"), dict(entropy_coef=None)):
            assert jax.tree.structure(dataclasses.replace(a, **change)) != jax.tree.structure(a), change
        assert {0.01, 1.5} <= set(jax.tree.leaves(a))
        rebuilt = jax.jit(lambda o: o)(a)
        assert (rebuilt.top_entropy_quantile, rebuilt.rollout_is_mode) == (0.5, "token_mask")
        assert float(rebuilt.entropy_coef) == pytest.approx(0.01) and float(rebuilt.rollout_is_cap) == 1.5


@pytest.mark.parametrize("op,implementation", OPS, ids=[o for o, _ in OPS])
def test_traced_entropy_coef_and_rollout_cap(op, implementation):
    """An objective with an entropy term and a rollout correction through ``jit`` as an argument: two values of
    ``entropy_coef`` / ``rollout_is_cap``, one trace, each equal to the eager call with Python floats."""
    case = make_case(13, B=B, T=T, H=H, V=V)
    rollout = jnp.asarray(case.old + np.random.default_rng(13).uniform(-0.5, 0.5, case.old.shape), jnp.float32)
    x, w = _x(op, case), jnp.asarray(case.weight)
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, rollout_logps=rollout)
    traces = []

    def loss(objective, x):
        traces.append(1)
        if op == "lm_head":
            head = gmpo_jax.HeadOptions(implementation=implementation)
            return gmpo_jax.fused_linear_policy_loss(x, w, batch, objective=objective, head=head)[0]
        return gmpo_jax.policy_loss_from_logits(x, batch, objective=objective, implementation=implementation)[0]

    step = fast_jit(loss)
    values = []
    for c, cap in ((0.02, 1.2), (0.05, 2.5)):
        objective = gmpo_jax.GRPO(loss_type="grpo", entropy_coef=c, rollout_is_cap=cap)
        got = float(step(objective, x))
        np.testing.assert_allclose(got, float(loss(objective, x)), rtol=2e-6)
        values.append(got)
    assert traces.count(1) == 1 + 2 and values[0] != values[1]  # one trace (plus the eager calls)
