"""Property tests: random small shapes, masks, configurations and values against the float64 oracle.

Derandomised (the same examples every run, for CI stability) and few examples: each one compiles a fresh
program, which dominates the cost on CPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import spec_numpy as spec
from conftest import (
    Case,
    Obj,
    assert_grad_close,
    check_against_spec,
    lib_logprobs,
    lib_loss,
    lib_value_and_grad,
    spec_for,
    tol_for,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

SETTINGS = dict(
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

RATIO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@st.composite
def objectives(draw) -> Obj:
    loss_type = draw(st.sampled_from(RATIO_TYPES + ("gmpo", "cispo", "sapo")))
    beta = draw(st.sampled_from([0.0, 0.0, 0.05]))
    kw = dict(beta=beta, bias_kl=beta != 0 and draw(st.booleans()))
    if loss_type in RATIO_TYPES:
        kw["level"] = draw(st.sampled_from(["token", "sequence"]))
        kw["delta"] = draw(st.sampled_from([None, None, 1.6]))
        kw["epsilon_low"] = draw(st.sampled_from([0.2, 0.1]))
        kw["epsilon_high"] = draw(st.sampled_from([0.2, 0.28]))
        if loss_type == "dr_grpo":
            kw["max_completion_length"] = draw(st.integers(1, 9))
    elif loss_type == "gmpo":
        kw["epsilon_low"] = draw(st.sampled_from([0.4, 0.3]))
        kw["epsilon_high"] = draw(st.sampled_from([0.4, 0.5]))
    elif loss_type == "cispo":
        kw["epsilon_high"] = draw(st.sampled_from([0.9, 1.3, 3.0]))
    else:
        kw["tau_pos"] = draw(st.sampled_from([1.0, 0.6]))
        kw["tau_neg"] = draw(st.sampled_from([1.05, 2.0]))
    return Obj(loss_type, **kw)


@st.composite
def cases(draw, *, max_b=5):
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, 7))
    H = draw(st.integers(1, 12))
    V = draw(st.integers(2, 37))
    layout = draw(st.sampled_from(["hv", "vh"]))
    with_bias = draw(st.booleans())
    temperature = draw(st.sampled_from([1.0, 0.6, 1.7]))
    off_policy = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    w = (rng.normal(size=(H, V)) * rng.uniform(0.3, 3.0) / np.sqrt(H)).astype(np.float32)
    weight = w if layout == "hv" else np.ascontiguousarray(w.T)
    bias = rng.normal(size=(V,)).astype(np.float32) if with_bias else None
    mask = rng.random((B, T)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    ids = np.where(mask, rng.integers(0, V, size=(B, T)), np.where(rng.random((B, T)) < 0.5, -100, V + 3))
    ids = ids.astype(np.int32)
    adv = rng.normal(size=(B,)) * np.where(rng.random(B) < 0.15, 0.0, 1.0)
    logp = spec.spec_logprobs(hidden, weight, ids, mask, bias=bias, temperature=temperature, weight_layout=layout)
    case = Case(hidden, weight, ids, mask, adv.astype(np.float32), bias, layout, logp)
    if off_policy:
        case.old = np.where(mask, logp - rng.uniform(-1.2, 1.2, size=(B, T)), 0.0).astype(np.float32)
    case.ref = np.where(mask, logp + rng.uniform(-0.8, 0.8, size=(B, T)), 0.0).astype(np.float32)
    return case, temperature


@settings(max_examples=30, **SETTINGS)
@given(data=cases(), obj=objectives(), chunk=st.integers(0, 6), extras=st.data())
def test_loss_and_gradients_match_oracle(data, obj, chunk, extras):
    case, temperature = data
    B = case.mask.shape[0]
    chunk_size = None if chunk == 0 else chunk
    if obj.loss_type != "gmpo" and extras.draw(st.booleans(), label="rollout_is_ratio"):
        shape = extras.draw(st.sampled_from([case.mask.shape, (B, 1), (B,)]), label="ris shape")
        case.ris = np.random.default_rng(B).uniform(0.3, 2.0, size=shape).astype(np.float32)
    num_items = None
    if obj.loss_type in ("dapo", "cispo"):
        num_items = extras.draw(st.sampled_from([None, 1, 17, 100]), label="num_items_in_batch")
    ref = spec_for(case, obj, temperature=temperature, num_items_in_batch=num_items)
    assume(ref.margin > 1e-4)  # f32 rounding must not be able to flip a clip decision
    (loss, aux), grads = lib_value_and_grad(
        case,
        obj.lib(),
        implementation="xla_chunked",
        chunk_size=chunk_size,
        temperature=temperature,
        num_items_in_batch=num_items,
    )
    check_against_spec(loss, aux, grads, ref, case, obj)
    r = (ref.logp - (case.old if case.old is not None else ref.logp))[case.mask]
    if r.size:
        assert float(aux.log_ratio_min) == pytest.approx(r.min(), abs=1e-5)
        assert float(aux.log_ratio_max) == pytest.approx(r.max(), abs=1e-5)


@settings(max_examples=20, **SETTINGS)
@given(data=cases(), chunk=st.integers(0, 6), use_mask=st.booleans())
def test_logprobs_match_oracle(data, chunk, use_mask):
    case, temperature = data
    ids = case.ids if use_mask else np.where(case.mask, case.ids, 0).astype(np.int32)
    mask = case.mask if use_mask else None
    cot = np.random.default_rng(0).normal(size=ids.shape).astype(np.float32)
    got, (dh, dw, db) = lib_logprobs(
        case.hidden,
        case.weight,
        ids,
        mask,
        bias=case.bias,
        temperature=temperature,
        weight_layout=case.layout,
        chunk_size=None if chunk == 0 else chunk,
        implementation="xla_chunked",
        cotangent=cot,
    )
    want = spec.spec_logprobs(
        case.hidden, case.weight, ids, mask, bias=case.bias, temperature=temperature, weight_layout=case.layout
    )
    zmax = np.max(np.abs(spec._logits(case.hidden, case.weight, case.bias, temperature, case.layout)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tol_for(np.float32).logp_rtol * (1 + zmax))
    wdh, wdw, wdb = spec.spec_head_vjp(
        case.hidden, case.weight, ids, mask, cot, bias=case.bias, temperature=temperature, weight_layout=case.layout
    )
    assert_grad_close(np.asarray(dh), wdh, np.float32, "dhidden")
    assert_grad_close(np.asarray(dw), wdw, np.float32, "dweight")
    if case.bias is not None:
        assert_grad_close(np.asarray(db), wdb, np.float32, "dbias")


def _split(case: Case, k: int) -> tuple[Case, Case]:
    def part(sl):
        pick = lambda x: None if x is None else x[sl]
        return dataclasses.replace(
            case,
            hidden=case.hidden[sl],
            ids=case.ids[sl],
            mask=case.mask[sl],
            adv=case.adv[sl],
            logp64=case.logp64[sl],
            old=pick(case.old),
            ref=pick(case.ref),
            ris=pick(case.ris),
        )

    return part(slice(0, k)), part(slice(k, None))


@settings(max_examples=12, **SETTINGS)
@given(data=cases(), obj=objectives(), split=st.integers(1, 4))
def test_micro_batch_numerators_and_denominators_add_up(data, obj, split):
    """LossAux contract: summing loss_numerator and loss_denominator over micro-batches re-normalises exactly
    (every SPEC reduction is a sum over sequences over an additive normaliser), when every micro-batch has an
    active token (max(., 1) is not additive)."""
    case, temperature = data
    B = case.mask.shape[0]
    assume(B >= 2 and split < B)
    a, b = _split(case, split)
    assume(a.mask.any() and b.mask.any())
    assume(spec_for(case, obj, temperature=temperature).margin > 1e-4)
    outs = [lib_loss(c, obj.lib(), implementation="xla_chunked", temperature=temperature) for c in (case, a, b)]
    (loss, aux), (_, aux_a), (_, aux_b) = outs
    assert float(aux_a.loss_denominator) + float(aux_b.loss_denominator) == pytest.approx(
        float(aux.loss_denominator), rel=1e-6
    )
    scale = abs(float(aux_a.loss_numerator)) + abs(float(aux_b.loss_numerator)) + 1e-6
    assert abs(float(aux_a.loss_numerator) + float(aux_b.loss_numerator) - float(aux.loss_numerator)) <= 1e-5 * scale
    assert float(loss) == pytest.approx(float(aux.loss_numerator) / float(aux.loss_denominator), rel=1e-6, abs=1e-7)
