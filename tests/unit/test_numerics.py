"""Numerics of the fused implementations (and the dense reference) against the float64 oracle.

Every test is parametrised over the implementations of ``conftest.IMPLEMENTATIONS`` (the ``implementation``
fixture); tolerances come from the one table ``conftest.TOLERANCES``. Parameter lists are curated, not
cartesian products: each axis of SPEC.md (objective, token / sequence level, beta and its bias correction,
delta, rollout IS ratio, num_items_in_batch, bias, temperature, weight layout, dtype, chunking, masks,
boundaries, extreme values) is covered next to a few others.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import (
    DTYPES,
    REFERENCE,
    Obj,
    assert_grad_close,
    check_against_spec,
    fast_jit,
    lib_logprobs,
    lib_loss,
    lib_loss_fn,
    lib_value_and_grad,
    make_case,
    spec_for,
    tol_for,
)

import gmpo_jax
import gmpo_jax.reference

EPS32 = float(np.finfo(np.float32).eps)
LOSS_TYPES = ("gmpo", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


def base_obj(loss_type, **kw) -> Obj:
    extra = {"max_completion_length": 9} if loss_type == "dr_grpo" else {}
    if loss_type == "cispo":
        extra["epsilon_high"] = 1.3  # bounds the ratio itself; 1.3 lets some tokens through, clips others
    extra.update(kw)
    return Obj(loss_type, **extra)


# Curated objectives: every loss type, both IS levels, beta with and without bias correction, delta,
# non-default epsilons and SAPO temperatures.
OBJECTIVES = [
    Obj("gmpo"),
    Obj("gmpo", beta=0.04),
    Obj("gmpo", beta=0.04, bias_kl=True),
    Obj("gmpo", epsilon_low=0.25, epsilon_high=0.5),
    Obj("grpo"),
    Obj("grpo", beta=0.04),
    Obj("grpo", delta=1.5),
    Obj("grpo", level="sequence"),
    Obj("grpo", level="sequence", beta=0.04, bias_kl=True),
    Obj("bnpo"),
    Obj("bnpo", beta=0.1, bias_kl=True),
    Obj("bnpo", level="sequence"),
    Obj("dr_grpo", max_completion_length=9),
    Obj("dr_grpo", level="sequence", max_completion_length=7, beta=0.04),
    Obj("dapo"),
    Obj("dapo", delta=1.5),
    Obj("dapo", epsilon_low=0.2, epsilon_high=0.28),
    Obj("dapo", level="sequence", delta=1.5, beta=0.04),
    Obj("cispo", epsilon_high=1.3),
    Obj("cispo", epsilon_high=1.3, beta=0.04, bias_kl=True),
    Obj("sapo"),
    Obj("sapo", tau_pos=0.5, tau_neg=2.0, beta=0.04),
]
OBJ_IDS = [str(o) for o in OBJECTIVES]


def run_and_check(case, obj, implementation, *, check_grads=True, **kw):
    ref = spec_for(case, obj, **{k: v for k, v in kw.items() if k in ("temperature", "num_items_in_batch")})
    assert ref.margin > 1e-4, "test setup: a ratio sits within 1e-4 of a bound; pick another seed"
    (loss, aux), grads = lib_value_and_grad(case, obj.lib(), implementation=implementation, **kw)
    check_against_spec(loss, aux, grads, ref, case, obj, check_grads=check_grads)
    return (loss, aux), grads, ref


# --------------------------------------------------------------------------------------------------
# Objectives x policy mode
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("obj", OBJECTIVES, ids=OBJ_IDS)
def test_objective_off_policy(obj, implementation):
    case = make_case(1)
    run_and_check(case, obj, implementation)


@pytest.mark.parametrize(
    "obj",
    [
        Obj("gmpo"),
        Obj("gmpo", beta=0.04, bias_kl=True),
        Obj("grpo", level="sequence", beta=0.04, bias_kl=True),
        Obj("bnpo"),
        Obj("dr_grpo", max_completion_length=9),
        Obj("dapo", delta=1.5, beta=0.04),
        Obj("cispo", epsilon_high=1.3, beta=0.04, bias_kl=True),
        Obj("sapo", beta=0.04, bias_kl=True),
    ],
    ids=str,
)
def test_objective_on_policy(obj, implementation):
    """old = stop_gradient(logp): r = 0 but d r / d logp = 1 (bias-corrected KL has an exp(r) slope)."""
    case = make_case(2, off_policy=False)
    run_and_check(case, obj, implementation)


# --------------------------------------------------------------------------------------------------
# Head variants: dtype x layout x bias x temperature (curated pairs with objectives)
# --------------------------------------------------------------------------------------------------
VARIANTS = [
    # dtype, layout, bias, temperature, objective
    ("float32", "vh", True, 0.7, Obj("gmpo", beta=0.04)),
    ("float32", "hv", True, 1.0, Obj("dapo", level="sequence", delta=1.5)),
    ("float32", "vh", False, 2.0, Obj("cispo", epsilon_high=1.3)),
    ("float32", "hv", False, 0.5, Obj("sapo", beta=0.04, bias_kl=True)),
    ("bfloat16", "hv", False, 1.0, Obj("gmpo")),
    ("bfloat16", "vh", True, 0.7, Obj("grpo", beta=0.04)),
    ("bfloat16", "hv", True, 1.3, Obj("bnpo", level="sequence")),
    ("bfloat16", "vh", False, 1.0, Obj("cispo", epsilon_high=1.3, beta=0.04)),
    ("float16", "hv", True, 1.0, Obj("gmpo", beta=0.04, bias_kl=True)),
    ("float16", "vh", False, 0.7, Obj("dr_grpo", max_completion_length=9)),
]


@pytest.mark.parametrize(
    "dtype, layout, with_bias, temperature, obj",
    VARIANTS,
    ids=[f"{d}-{l}-{'bias' if b else 'nobias'}-T{t}-{o}" for d, l, b, t, o in VARIANTS],
)
def test_head_variants(dtype, layout, with_bias, temperature, obj, implementation):
    """bf16 / f16 cases compare against the oracle run on the ROUNDED inputs (the case holds them)."""
    case = make_case(3, dtype=DTYPES[dtype], layout=layout, with_bias=with_bias, temperature=temperature)
    (_, _), (dh, dw, db), _ = run_and_check(case, obj, implementation, temperature=temperature)
    # cotangents come back in each primal's dtype
    assert dh.dtype == case.hidden.dtype and dw.dtype == case.weight.dtype
    if with_bias:
        assert db.dtype == case.bias.dtype


# --------------------------------------------------------------------------------------------------
# rollout_is_ratio and num_items_in_batch
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj, ris",
    [
        (Obj("grpo", beta=0.04), "bt"),
        (Obj("dapo", level="sequence"), "b1"),
        (Obj("bnpo", delta=1.5), "b"),
        (Obj("cispo", epsilon_high=1.3), "bt"),
        (Obj("sapo", beta=0.04), "b"),
        (Obj("dr_grpo", max_completion_length=9, level="sequence"), "bt"),
    ],
    ids=lambda x: str(x),
)
def test_rollout_is_ratio(obj, ris, implementation):
    """ptl *= rollout_is_ratio (the KL term is not scaled); shapes [B, T], [B, 1], [B]."""
    case = make_case(4, ris=ris)
    run_and_check(case, obj, implementation)


@pytest.mark.parametrize("ris", ["bt", "b1"])
def test_rollout_is_ratio_gmpo(ris, implementation):
    """GMPO: each sequence's term times the geometric mean of its tokens' ratios (SPEC.md "Rollout
    correction"); a ``[B, 1]`` ratio is the sequence's weight. No warning any more (it used to be ignored)."""
    case = make_case(4, ris=ris)
    run_and_check(case, Obj("gmpo", beta=0.04), implementation)


@pytest.mark.parametrize(
    "obj",
    [Obj("dapo", beta=0.04), Obj("cispo", epsilon_high=1.3), Obj("dapo", level="sequence", delta=1.5), Obj("bnpo")],
    ids=str,
)  # bnpo: the override does not apply (oracle ignores it)
@pytest.mark.parametrize("num_items", [60, 0.5])  # 0.5 < 1: the normaliser is max(N, 1)
def test_num_items_in_batch(obj, num_items, implementation):
    case = make_case(5)
    run_and_check(case, obj, implementation, num_items_in_batch=num_items)


# --------------------------------------------------------------------------------------------------
# Chunking: chunk_size 1, 2, B and non-divisors of B; the loss never depends on the chunk.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj",
    [Obj("gmpo", beta=0.04), Obj("grpo", level="sequence", beta=0.04, bias_kl=True), Obj("dapo", delta=1.5)],
    ids=str,
)
def test_chunk_sizes(obj, implementation):
    case = make_case(6, with_bias=True)
    results = {}
    for chunk in (1, 2, 3, 5, 8):  # B = 5: 2 and 3 do not divide it, 8 exceeds it
        (loss, aux), grads, _ = run_and_check(case, obj, implementation, chunk_size=chunk)
        results[chunk] = (float(loss), [np.asarray(g, np.float64) for g in grads])
    base_loss, base_grads = results[5]
    for chunk, (loss, grads) in results.items():
        assert loss == pytest.approx(base_loss, rel=1e-6, abs=1e-7), f"chunk_size={chunk}"
        for g, g0 in zip(grads, base_grads):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-6 * np.max(np.abs(g0)), err_msg=f"chunk_size={chunk}")


# --------------------------------------------------------------------------------------------------
# Masks: ragged, a fully masked sequence, an all-masked batch, padding ids
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fully_masked_sequence_contributes_nothing(loss_type, implementation):
    mask = np.ones((5, 7), bool)
    mask[2] = False
    mask[4, 3:] = False
    obj = base_obj(loss_type, beta=0.04)
    case = make_case(7, mask=mask)
    _, (dh, dw, db), _ = run_and_check(case, obj, implementation)
    assert np.all(np.asarray(dh)[2] == 0), "a fully masked sequence must get exactly zero gradient"


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_all_masked_batch(loss_type, beta, implementation):
    """Loss 0, exactly zero gradients, finite metrics; padding ids everywhere."""
    case = make_case(8, mask=np.zeros((5, 7), bool), with_bias=True)
    obj = base_obj(loss_type, beta=beta)
    (loss, aux), (dh, dw, db) = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    assert float(loss) == 0.0
    for name, g in (("dhidden", dh), ("dweight", dw), ("dbias", db)):
        assert np.all(np.asarray(g) == 0), name
    for name, v in aux._asdict().items():
        assert np.isfinite(float(v)), name
    assert float(aux.clip_fraction) == 0.0 and float(aux.kl) == 0.0
    assert float(aux.log_ratio_min) == 0.0 and float(aux.log_ratio_max) == 0.0


@pytest.mark.parametrize(
    "obj",
    [
        Obj("gmpo", beta=0.04, bias_kl=True),
        Obj("grpo", level="sequence", beta=0.04),
        Obj("cispo", epsilon_high=1.3),
        Obj("sapo"),
    ],
    ids=str,
)
def test_masked_positions_influence_nothing(obj, implementation):
    """Whatever masked positions hold (ids -100 / V + 5 / valid, any hidden row, NaN / inf old and ref
    log-probs and IS ratios), the loss, metrics and gradients are bitwise the same, and masked hidden rows
    get exactly 0."""
    case = make_case(9, with_bias=True, ris=None if obj.loss_type == "gmpo" else "bt")
    (loss0, aux0), grads0 = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    m = case.mask
    other = dataclasses.replace(
        case,
        ids=np.where(m, case.ids, np.where(case.ids == -100, 37 + 5, 3)).astype(np.int32),
        hidden=np.where(m[..., None], case.hidden, 1e3).astype(case.hidden.dtype),
        old=np.where(m, case.old, np.nan).astype(np.float32),
        ref=np.where(m, case.ref, -np.inf).astype(np.float32),
        ris=None if case.ris is None else np.where(m, case.ris, np.inf).astype(np.float32),
    )
    (loss1, aux1), grads1 = lib_value_and_grad(other, obj.lib(), implementation=implementation)
    assert np.array_equal(np.asarray(loss0), np.asarray(loss1))
    for a, b in zip(aux0, aux1):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(grads0, grads1):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(grads0[0])[~m] == 0)


@pytest.mark.parametrize("mask_dtype", [np.int32, np.float32, np.uint8])
def test_numeric_masks_equal_bool(mask_dtype, implementation):
    """completion_mask may be bool or {0, 1} numbers: same results bitwise."""
    case = make_case(28)
    obj = Obj("grpo", level="sequence", beta=0.04).lib()
    (l0, a0), g0 = lib_value_and_grad(case, obj, implementation=implementation)
    (l1, a1), g1 = lib_value_and_grad(
        dataclasses.replace(case, mask=case.mask.astype(mask_dtype)), obj, implementation=implementation
    )
    for x, y in zip(jax.tree.leaves(((l0, a0), g0)), jax.tree.leaves(((l1, a1), g1))):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bad_id", [-1, 37, -100])
def test_unmasked_out_of_range_id_gives_nan(bad_id, implementation):
    case = make_case(10)
    ids = case.ids.copy()
    ids[1, 0] = bad_id
    assert case.mask[1, 0]
    case = dataclasses.replace(case, ids=ids)
    loss, _ = lib_loss(case, Obj("gmpo").lib(), implementation=implementation)
    assert np.isnan(float(loss))
    logp = lib_logprobs(case.hidden, case.weight, ids, implementation=implementation)
    assert np.isnan(float(logp[1, 0])) and np.all(np.isfinite(np.asarray(logp)[case.mask & (ids >= 0) & (ids < 37)]))


# --------------------------------------------------------------------------------------------------
# Advantages == 0, extreme log ratios, extreme logits
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj",
    [
        Obj("gmpo"),
        Obj("grpo"),
        Obj("bnpo", level="sequence"),
        Obj("dapo", delta=1.5),
        Obj("dr_grpo", max_completion_length=9),
        Obj("cispo", epsilon_high=1.3),
        Obj("sapo"),
    ],
    ids=str,
)
def test_zero_advantage_is_exactly_zero_even_when_ratio_overflows(obj, implementation):
    """A = 0 sequences contribute exactly 0 (loss and gradient), even with r = 100 (exp(r) = inf in f32)."""
    case = make_case(11, adv=np.array([0.0, 1.2, 0.0, -0.8, 0.0], np.float32))
    old = case.old.copy()
    old[0] = np.where(case.mask[0], case.logp64[0] - 100.0, 0.0)  # r = +100 on sequence 0
    old[2] = np.where(case.mask[2], case.logp64[2] + 100.0, 0.0)  # r = -100 on sequence 2
    case = dataclasses.replace(case, old=old.astype(np.float32))
    _, (dh, dw, db), _ = run_and_check(case, obj, implementation)
    dh = np.asarray(dh)
    assert np.all(dh[[0, 2, 4]] == 0), "zero-advantage sequences must get exactly zero gradient"


@pytest.mark.parametrize(
    "obj",
    [
        Obj("gmpo"),
        Obj("grpo"),
        Obj("grpo", level="sequence"),
        Obj("dapo", delta=1.5),
        Obj("bnpo"),
        Obj("dr_grpo", max_completion_length=9),
        Obj("cispo", epsilon_high=1.3),
        Obj("sapo"),
    ],
    ids=str,
)
def test_extreme_log_ratios(obj, implementation):
    """|r| = 100 where the float64 value stays representable: A > 0 with r = +100 and A < 0 with r = -100
    are clipped (ratio types, GMPO); CISPO and SAPO saturate for either sign. The clipped branch must
    give exactly zero gradient (select, not 0 * inf) and finite loss / gradients."""
    case = make_case(12, adv=np.array([1.0, -0.7, 0.4, -1.5, 0.9], np.float32))
    rng = np.random.default_rng(0)
    ext = rng.random(case.mask.shape) < 0.4
    saturating = obj.loss_type in ("cispo", "sapo")
    sign = np.where(rng.random(case.mask.shape) < 0.5, 1.0, -1.0) if saturating else np.sign(case.adv)[:, None]
    r_old = case.logp64 - case.old
    r = np.where(ext, 100.0 * sign, r_old)
    case = dataclasses.replace(case, old=np.where(case.mask, case.logp64 - r, 0.0).astype(np.float32))
    (loss, aux), grads, _ = run_and_check(case, obj, implementation)
    assert np.isfinite(float(loss))
    assert float(aux.log_ratio_max) == pytest.approx(np.max(r[case.mask]), rel=1e-5)
    assert float(aux.log_ratio_min) == pytest.approx(np.min(r[case.mask]), rel=1e-5)


def _extreme_logits_case(seed, implementation, *, chunk_size=None, dtype=np.float32):
    """|z| ~ 1e4. The float64 oracle's log-probs differ from any float32 evaluation by ~|z| eps32 ~ 1e-3, so
    off-policy ratios are built on the implementation's own f32 log-probs and the oracle evaluates the loss
    at those log-probs (``logp_for_loss``); its head backward still uses float64 softmax."""
    case = make_case(seed, logit_scale=3000.0, with_bias=True, off_policy=False, with_ref=False, dtype=dtype)
    logp32 = lib_logprobs(
        case.hidden,
        case.weight,
        case.ids,
        case.mask,
        bias=case.bias,
        implementation=implementation,
        chunk_size=chunk_size,
    )
    zmax = np.max(np.abs(np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)))
    assert 3e3 < zmax < 3e4
    return case, logp32, zmax


EXTREME = [
    (o, p, "float32")
    for o in (
        Obj("gmpo", beta=0.04),
        Obj("grpo", level="sequence"),
        Obj("dapo", beta=0.04),
        Obj("cispo", epsilon_high=1.3),
        Obj("sapo"),
    )
    for p in (False, True)
]
EXTREME += [
    (Obj("gmpo", beta=0.04, bias_kl=True), True, "bfloat16"),
    (Obj("bnpo", delta=1.5), False, "bfloat16"),
    (Obj("sapo", beta=0.04), True, "bfloat16"),
]


@pytest.mark.parametrize(
    "obj, off_policy, dtype", EXTREME, ids=[f"{o}-{'off' if p else 'on'}-{d}" for o, p, d in EXTREME]
)
def test_extreme_logits(obj, off_policy, dtype, implementation):
    case, logp32, zmax = _extreme_logits_case(13, implementation, dtype=DTYPES[dtype])
    tol = tol_for(case.dtype)
    # 1) log-probs: float32 log-sum-exp of |z| ~ 1e4 is exact to a few ulps of |z|
    assert np.all(np.isfinite(logp32))
    np.testing.assert_allclose(logp32, case.logp64, rtol=0, atol=tol.logp_rtol * (1 + zmax))
    # 2) loss and gradients, with ratios built on the implementation's own log-probs
    rng = np.random.default_rng(1)
    r = rng.choice([-0.9, -0.3, -0.05, 0.0, 0.1, 0.55], size=case.mask.shape)
    case.old = np.where(case.mask, logp32 - r, 0.0).astype(np.float32) if off_policy else None
    case.ref = np.where(case.mask, logp32 + rng.uniform(-0.5, 0.5, case.mask.shape), 0.0).astype(np.float32)
    ref = spec_for(case, obj, logp_for_loss=logp32)
    assert ref.margin > 1e-4
    (loss, aux), grads = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    # softmax p = exp(z - lse) inherits the absolute rounding of the float32 lse (half an ulp of |z| ~ 1e4,
    # ~5e-4): gradients are exact to that relative error, not to 1e-4.
    # (low precision: the dtype's cosine / norm rule already covers it)
    grad_rtol = None if tol.grad_rtol is None else tol.grad_rtol + 8 * EPS32 * zmax
    check_against_spec(loss, aux, grads, ref, case, obj, grad_rtol=grad_rtol)


def test_vocab_tail_block(implementation):
    """V = 8192 + 37 spans more than one vocabulary block of the XLA path (its largest block is 8192), so
    the last block is partial: its tail must be masked with -inf (0 would add exp(0 - lse) mass)."""
    obj = Obj("gmpo", beta=0.04)
    case = make_case(14, B=2, T=3, H=8, V=8192 + 37, with_bias=True)
    ids = case.ids.copy()
    ids[0, 0] = 8192 + 36  # the last id, inside the tail block
    ids[1, 0] = 8191  # the last id of the first block
    assert case.mask[:, 0].all()
    case = dataclasses.replace(case, ids=ids)
    case.logp64 = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, bias=case.bias)
    case.old = np.where(case.mask, case.logp64 - 0.1, 0.0).astype(np.float32)  # r = 0.1
    case.ref = np.where(case.mask, case.logp64 + 0.3, 0.0).astype(np.float32)
    run_and_check(case, obj, implementation)
    got = lib_logprobs(case.hidden, case.weight, case.ids, case.mask, bias=case.bias, implementation=implementation)
    np.testing.assert_allclose(got, case.logp64, rtol=0, atol=1e-5)


@pytest.mark.parametrize("obj", [Obj("gmpo"), Obj("grpo"), Obj("sapo")], ids=str)
def test_beta_zero_ignores_the_reference(obj, implementation):
    """SPEC: "KL (only if beta != 0)". A reference passed with beta = 0 (a Python float) changes nothing, even
    where ref - logp = 100 (exp overflows float32)."""
    case = make_case(27)
    case.ref = np.where(case.mask & (np.arange(7)[None, :] % 3 == 0), case.logp64 + 100.0, case.ref).astype(np.float32)
    (loss0, _), grads0 = lib_value_and_grad(case, obj.lib(), implementation=implementation, ref=False)
    (loss1, _), grads1 = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    assert float(loss1) == float(loss0)
    for a, b in zip(grads0, grads1):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


# --------------------------------------------------------------------------------------------------
# Clip boundaries: exactly at the bound the gradient passes; one step past, the token is clipped.
# --------------------------------------------------------------------------------------------------
def _lib_logp32(case, implementation):
    return lib_logprobs(case.hidden, case.weight, case.ids, case.mask, implementation=implementation)


def _exact_old(logp32, r):
    """f32 ``old`` with ``logp32 - old == r`` exactly (in f32 and in f64); NaN where impossible."""
    old = (logp32.astype(np.float64) - r).astype(np.float32)
    ok = (logp32.astype(np.float64) - old.astype(np.float64) == r) & ((logp32 - old) == np.float32(r))
    return np.where(ok, old, np.nan).astype(np.float32)


def _check_boundary(case, obj, implementation, logp32, expect_clipped):
    (loss, aux), grads = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    # precondition: the loss sees exactly the ratios built here (same f32 log-probs as fused_linear_logprobs)
    r = (logp32.astype(np.float64) - (case.old.astype(np.float64) if case.old is not None else logp32))[case.mask]
    assert float(aux.log_ratio_min) == r.min() and float(aux.log_ratio_max) == r.max(), (
        "test precondition: the loss's internal log-probs differ from fused_linear_logprobs' bits"
    )
    ref = spec_for(case, obj, logp_for_loss=logp32)
    check_against_spec(loss, aux, grads, ref, case, obj)
    # exact: clipped tokens (and only they) get a zero hidden-state gradient row
    dh = np.asarray(grads[0])
    row_zero = np.all(dh == 0, axis=-1)
    np.testing.assert_array_equal(row_zero[case.mask], expect_clipped[case.mask])


@pytest.mark.parametrize("adv_sign", [1.0, -1.0], ids=["A>0", "A<0"])
def test_gmpo_log_space_bounds(adv_sign, implementation):
    """GMPO, eps_low = eps_high = 0.25 (exact in binary). Per token r is exactly +-0.25 or one f32 step
    (ulp of old) either side: clipped only strictly past (A > 0: r > eps_high; A < 0: r < -eps_low)."""
    eps = 0.25
    case = make_case(15, adv=np.full(5, 0.8 * adv_sign, np.float32), off_policy=False, with_ref=False)
    logp32 = _lib_logp32(case, implementation)
    bound = eps if adv_sign > 0 else -eps
    old_at = _exact_old(logp32, bound)
    assert np.mean(np.isfinite(old_at[case.mask])) > 0.5, "test setup: too few exact constructions"
    step = np.random.default_rng(0).choice([-1, 0, 1], size=case.mask.shape)
    old = np.where(
        step > 0,
        np.nextafter(old_at, np.float32(-np.inf)),  # r one step above the bound
        np.where(step < 0, np.nextafter(old_at, np.float32(np.inf)), old_at),
    )  # one below
    old = np.where(np.isfinite(old_at), old, logp32)  # fallback: r = 0 (inside the clip range)
    old = np.where(case.mask, old, 0.0).astype(np.float32)
    case.old = old
    r = logp32.astype(np.float64) - old.astype(np.float64)
    expect = (r > eps) if adv_sign > 0 else (r < -eps)
    assert np.any(expect & case.mask) and np.any((r == bound) & case.mask)
    _check_boundary(case, Obj("gmpo", epsilon_low=eps, epsilon_high=eps), implementation, logp32, expect & case.mask)


@pytest.mark.parametrize(
    "obj",
    [
        Obj("grpo", epsilon_low=0.0, epsilon_high=0.0),
        Obj("dapo", epsilon_low=0.0, epsilon_high=0.0, level="sequence"),
        Obj("bnpo", epsilon_low=0.0, epsilon_high=0.0, delta=1.0),
        Obj("gmpo", epsilon_low=0.0, epsilon_high=0.0),
    ],
    ids=str,
)
def test_ratio_at_bound(obj, implementation):
    """eps_low = eps_high = 0 puts the clip bounds at ratio 1 == exp(0): a token with r = 0 exactly sits ON
    both bounds (and on delta = 1). The gradient must pass in full (jnp.minimum / jnp.clip would give 0.5 or
    0.75). Tokens with r = +-2^-21 (exp rounds away from 1 in f32) are strictly past and clipped for the
    matching advantage sign. Per sequence r has one value, so the GSPO mean is exact too."""
    case = make_case(16, adv=np.array([1.0, -0.6, 0.8, -1.1, 0.5], np.float32), off_policy=False, with_ref=False)
    logp32 = _lib_logp32(case, implementation)
    r_seq = np.array([0.0, 0.0, 2.0**-21, 2.0**-21, -(2.0**-21)])[:, None]
    old = _exact_old(logp32, np.broadcast_to(r_seq, case.mask.shape))
    keep = np.isfinite(old)
    case.mask = case.mask & keep
    assert case.mask.sum(axis=1).min() >= 1, "test setup: a sequence lost all tokens"
    case.old = np.where(case.mask, old, 0.0).astype(np.float32)
    A = case.adv[:, None]
    r = np.broadcast_to(r_seq, case.mask.shape)
    if obj.delta is not None:
        # delta = 1 caps coef at 1 = the clip bounds: for r > 0 both branches of min() are the constant A
        # (zero gradient for either sign of A); for r < 0, A > 0 takes the unclipped coef, A < 0 the clip.
        expect = (r > 0) | ((r < 0) & (A < 0))
    else:
        expect = ((r > 0) & (A > 0)) | ((r < 0) & (A < 0))
    _check_boundary(case, obj, implementation, logp32, expect & case.mask)


def test_delta_below_upper_clip_bound(implementation):
    """SPEC: coef2 = clip(coef, 1 - eps_low, 1 + eps_high) is formed first, then coef = min(coef, delta),
    ptl = -min(coef A, coef2 A). With delta = 1.1 < 1 + eps_high = 1.2 and a ratio in (1.1, 1.2] under A < 0:
    -min(1.1 A, coef A) = -coef A, the unclipped coef2 branch, so the gradient is -A coef (not 0)."""
    obj = Obj("grpo", delta=1.1)
    case = make_case(17, adv=np.array([-1.0, -0.5, 0.7, -0.9, 1.3], np.float32))
    r = np.where(np.arange(7)[None, :] % 2 == 0, np.log(1.15), np.log(0.95))
    case.old = np.where(case.mask, case.logp64 - r, 0.0).astype(np.float32)
    run_and_check(case, obj, implementation)


# --------------------------------------------------------------------------------------------------
# Contracts of the call: determinism, jit, value_and_grad, traced hyper-parameters
# --------------------------------------------------------------------------------------------------
def test_deterministic_bitwise(implementation):
    case = make_case(18, with_bias=True, dtype=DTYPES["bfloat16"])
    obj = Obj("gmpo", beta=0.04, bias_kl=True).lib()
    outs = []
    for _ in range(2):
        f = lib_loss_fn(case, obj, implementation=implementation, chunk_size=2)
        g = fast_jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))  # a fresh compilation each time
        outs.append(jax.tree.leaves(g(jnp.asarray(case.hidden), jnp.asarray(case.weight), jnp.asarray(case.bias))))
    for a, b in zip(*outs):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_jit_does_not_retrace(implementation):
    case = make_case(19)
    obj = Obj("grpo", beta=0.04).lib()
    ids, mask, adv, old, ref = (jnp.asarray(x) for x in (case.ids, case.mask, case.adv, case.old, case.ref))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(h, w, adv):
        def f(h, w):
            return gmpo_jax.fused_linear_policy_loss(
                h,
                w,
                gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old, ref_logps=ref),
                objective=obj,
                head=gmpo_jax.HeadOptions(implementation=implementation),
            )

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)

    h, w = jnp.asarray(case.hidden), jnp.asarray(case.weight)
    (l1, _), _ = step(h, w, adv)
    (l2, _), (dh, _) = step(h * 1.5, w, -adv)  # new values, same shapes: no retrace
    assert float(l1) != float(l2) and np.all(np.isfinite(np.asarray(dh)))


@pytest.mark.parametrize(
    "obj",
    [
        Obj("gmpo", epsilon_low=0.3, epsilon_high=0.35, beta=0.05),
        Obj("dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.05, delta=1.5),
        Obj("sapo", tau_pos=0.8, tau_neg=1.3, beta=0.05),
    ],
    ids=str,
)
def test_traced_hyperparameters_match_python_floats(obj, implementation):
    """Epsilons, beta, delta, SAPO temperatures and temperature as jnp scalars through jit (a schedule)."""
    case = make_case(20)
    h, w = jnp.asarray(case.hidden), jnp.asarray(case.weight)
    ids, mask, adv, old, ref = (jnp.asarray(x) for x in (case.ids, case.mask, case.adv, case.old, case.ref))

    def run(hp, temperature):
        if obj.loss_type == "gmpo":
            o = gmpo_jax.GMPO(epsilon_low=hp["el"], epsilon_high=hp["eh"], beta=hp["beta"])
        elif obj.loss_type == "sapo":
            o = gmpo_jax.SAPO(temperature_pos=hp["tp"], temperature_neg=hp["tn"], beta=hp["beta"])
        else:
            o = gmpo_jax.GRPO(
                loss_type=obj.loss_type, epsilon_low=hp["el"], epsilon_high=hp["eh"], beta=hp["beta"], delta=hp["delta"]
            )
        f = lambda h, w: gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old, ref_logps=ref),
            objective=o,
            temperature=temperature,
            head=gmpo_jax.HeadOptions(implementation=implementation),
        )
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)

    hp = dict(el=obj.epsilon_low, eh=obj.epsilon_high, beta=obj.beta, delta=obj.delta, tp=obj.tau_pos, tn=obj.tau_neg)
    hp = {k: v for k, v in hp.items() if v is not None}
    temperature = 0.9
    want = jax.jit(lambda h, w: run(hp, temperature))(h, w)
    traced = jax.jit(run)({k: jnp.float32(v) for k, v in hp.items()}, jnp.float32(temperature))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(traced)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    # and both agree with the oracle
    ref_ = spec_for(case, obj, temperature=temperature)
    (loss, aux), (dh, dw) = traced
    check_against_spec(loss, aux, (dh, dw, None), ref_, case, obj)


def test_gradient_only_to_hidden_weight_bias(implementation):
    """advantages, old / ref log-probs and the IS ratio are data: zero cotangents."""
    case = make_case(21, ris="bt")
    obj = Obj("grpo", beta=0.04).lib()

    def f(adv, old, ref, ris):
        loss, _ = gmpo_jax.fused_linear_policy_loss(
            jnp.asarray(case.hidden),
            jnp.asarray(case.weight),
            gmpo_jax.PolicyBatch(
                jnp.asarray(case.ids), jnp.asarray(case.mask), adv, old_logps=old, ref_logps=ref, rollout_is_ratio=ris
            ),
            objective=obj,
            head=gmpo_jax.HeadOptions(implementation=implementation),
        )
        return loss

    grads = fast_jit(jax.grad(f, argnums=(0, 1, 2, 3)))(
        *(jnp.asarray(x) for x in (case.adv, case.old, case.ref, case.ris))
    )
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_cotangent_scaling(implementation):
    """The backward multiplies the stashed gradients by the cotangent: grad of 3 * loss = 3 * grad."""
    case = make_case(22, with_bias=True)
    f = lib_loss_fn(case, Obj("gmpo").lib(), implementation=implementation)
    args = (jnp.asarray(case.hidden), jnp.asarray(case.weight), jnp.asarray(case.bias))
    g1, g3 = fast_jit(
        lambda *a: (
            jax.grad(lambda *a: f(*a)[0], argnums=(0, 1, 2))(*a),
            jax.grad(lambda *a: -3.0 * f(*a)[0], argnums=(0, 1, 2))(*a),
        )
    )(*args)
    for a, b in zip(g1, g3):
        np.testing.assert_allclose(np.asarray(b), -3.0 * np.asarray(a), rtol=1e-6, atol=1e-9)


def test_ref_hidden_path(implementation):
    """``reference=ReferenceHead(hidden, weight, bias)``: reference log-probs computed by the same fused path, no
    gradient."""
    case = make_case(23, with_bias=True, with_ref=False, layout="vh")
    rng = np.random.default_rng(5)
    ref_hidden = (np.asarray(case.hidden) + 0.3 * rng.normal(size=case.hidden.shape)).astype(np.float32)
    ref_weight = (np.asarray(case.weight) * 0.9).astype(np.float32)
    ref_bias = (rng.normal(size=case.bias.shape) * 0.2).astype(np.float32)
    obj = Obj("gmpo", beta=0.1)
    case.ref = spec.spec_logprobs(ref_hidden, ref_weight, case.ids, case.mask, bias=ref_bias, weight_layout="vh")
    ref = spec_for(case, obj)

    def f(h, w, b, rh, rw):
        return gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(
                jnp.asarray(case.ids), jnp.asarray(case.mask), jnp.asarray(case.adv), old_logps=jnp.asarray(case.old)
            ),
            objective=obj.lib(),
            bias=b,
            reference=gmpo_jax.ReferenceHead(rh, rw, jnp.asarray(ref_bias)),
            head=gmpo_jax.HeadOptions(weight_layout="vh", implementation=implementation),
        )

    args = tuple(jnp.asarray(x) for x in (case.hidden, case.weight, case.bias, ref_hidden, ref_weight))
    (loss, aux), (dh, dw, db, drh, drw) = fast_jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)
    check_against_spec(loss, aux, (dh, dw, db), ref, case, obj)
    assert np.all(np.asarray(drh) == 0) and np.all(np.asarray(drw) == 0)


def test_evaluation_without_grad_matches(implementation):
    """The primal (no differentiation) path gives the same loss and metrics as value_and_grad."""
    case = make_case(24)
    obj = Obj("grpo", level="sequence", beta=0.04)
    loss_p, aux_p = lib_loss(case, obj.lib(), implementation=implementation)
    (loss_g, aux_g), _ = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    np.testing.assert_allclose(float(loss_p), float(loss_g), rtol=1e-6)
    for a, b in zip(aux_p, aux_g):
        np.testing.assert_allclose(float(a), float(b), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# fused_linear_logprobs
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, layout, with_bias, temperature, chunk_size, with_mask",
    [
        ("float32", "hv", False, 1.0, None, True),
        ("float32", "vh", True, 0.7, 2, True),
        ("float32", "hv", True, 1.5, 1, False),
        ("bfloat16", "vh", True, 1.0, 3, True),
        ("bfloat16", "hv", False, 0.8, None, False),
        ("float16", "hv", True, 1.0, 5, True),
    ],
)
def test_logprobs_and_gradient(dtype, layout, with_bias, temperature, chunk_size, with_mask, implementation):
    case = make_case(25, dtype=DTYPES[dtype], layout=layout, with_bias=with_bias, temperature=temperature)
    tol = tol_for(case.dtype)
    ids = case.ids if with_mask else np.where(case.mask, case.ids, 1).astype(np.int32)
    mask = case.mask if with_mask else None
    want = spec.spec_logprobs(
        case.hidden, case.weight, ids, mask, bias=case.bias, temperature=temperature, weight_layout=layout
    )
    cot = np.random.default_rng(1).normal(size=ids.shape).astype(np.float32)
    got, (dh, dw, db) = lib_logprobs(
        case.hidden,
        case.weight,
        ids,
        mask,
        bias=case.bias,
        temperature=temperature,
        weight_layout=layout,
        chunk_size=chunk_size,
        implementation=implementation,
        cotangent=cot,
    )
    assert got.dtype == jnp.float32 and got.shape == ids.shape
    zmax = np.max(np.abs(spec._logits(case.hidden, case.weight, case.bias, temperature, layout)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tol.logp_rtol * (1 + zmax))
    if mask is not None:
        assert np.all(np.asarray(got)[~mask] == 0)
    wdh, wdw, wdb = spec.spec_head_vjp(
        case.hidden, case.weight, ids, mask, cot, bias=case.bias, temperature=temperature, weight_layout=layout
    )
    assert_grad_close(np.asarray(dh), wdh, case.dtype, "dhidden")
    assert_grad_close(np.asarray(dw), wdw, case.dtype, "dweight")
    if with_bias:
        assert_grad_close(np.asarray(db), wdb, case.dtype, "dbias")
    if mask is not None:
        assert np.all(np.asarray(dh)[~mask] == 0)


@pytest.mark.parametrize(
    "dtype, layout, with_bias, temperature, chunk_size, logit_scale, vocab_size",
    [
        ("float32", "hv", False, 1.0, None, 1.0, None),
        ("float32", "vh", True, 0.7, 2, 1.0, None),
        ("bfloat16", "hv", True, 1.0, 1, 1.0, None),
        ("float32", "hv", False, 1.0, 3, 30.0, None),
        ("float32", "vh", False, 1.3, 2, 1.0, 30),
    ],
    ids=["f32-hv", "f32-vh-bias-T0.7", "bf16-hv-bias", "f32-peaky-logits30", "f32-vh-padded-vocab30"],
)
def test_logprobs_entropy(dtype, layout, with_bias, temperature, chunk_size, logit_scale, vocab_size):
    """``return_entropy=True``: the entropy equals float64 ``-sum p log p`` (absolute 2e-5 * (1 + max|z|):
    the online sum of ``p (z - m)`` in float32, several vocabulary blocks), is 0 at masked positions, lies
    in ``[0, log V]``; the log-probs and their gradient are those of ``return_entropy=False``; the entropy
    itself carries no gradient. A padded vocabulary (``vocab_size``) is left out of the softmax."""
    from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend

    case = make_case(27, dtype=DTYPES[dtype], layout=layout, with_bias=with_bias, temperature=temperature)
    w = np.asarray(case.weight) * logit_scale
    backend = XlaChunkedBackend(vocab_block=16)  # several blocks: exercises the rescaled running sums
    kw = dict(
        completion_mask=case.mask,
        bias=case.bias,
        temperature=temperature,
        head=gmpo_jax.HeadOptions(
            weight_layout=layout, chunk_size=chunk_size, implementation=backend, vocab_size=vocab_size
        ),
    )

    ids = case.ids if vocab_size is None else case.ids % vocab_size  # real ids only

    def f(h, w, entropy):
        return gmpo_jax.fused_linear_logprobs(h, w, ids, return_entropy=entropy, **kw)

    logp, ent = jax.jit(lambda h, w: f(h, w, True))(case.hidden, w)
    want = spec.spec_entropy(
        case.hidden, w, case.mask, bias=case.bias, temperature=temperature, weight_layout=layout, vocab_size=vocab_size
    )
    zmax = np.max(np.abs(spec._logits(case.hidden, w, case.bias, temperature, layout)))
    assert ent.dtype == jnp.float32 and ent.shape == case.ids.shape
    np.testing.assert_allclose(np.asarray(ent), want, rtol=0, atol=2e-5 * (1 + zmax))
    V = vocab_size or (w.shape[1] if layout == "hv" else w.shape[0])
    assert np.all(np.asarray(ent) >= 0) and np.all(np.asarray(ent) <= np.log(V) + 1e-6)
    assert np.all(np.asarray(ent)[~case.mask] == 0)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(jax.jit(lambda h, w: f(h, w, False))(case.hidden, w)))
    g_both = jax.grad(lambda h: jnp.sum(f(h, w, True)[0]) + jnp.sum(f(h, w, True)[1]))(case.hidden)
    g_logp = jax.grad(lambda h: jnp.sum(f(h, w, False)))(case.hidden)
    np.testing.assert_array_equal(np.asarray(g_both), np.asarray(g_logp))


def test_return_entropy_must_be_a_bool():
    case = make_case(28)
    with pytest.raises(TypeError, match="return_entropy"):
        gmpo_jax.fused_linear_logprobs(
            case.hidden, case.weight, case.ids, completion_mask=case.mask, return_entropy="yes"
        )


# --------------------------------------------------------------------------------------------------
# gmpo_jax.reference (the dense float32 oracle) against the float64 oracle
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj, kw",
    [
        (Obj("gmpo", beta=0.04, bias_kl=True), dict(with_bias=True, layout="vh")),
        (Obj("grpo", level="sequence", beta=0.04), dict(ris="b1")),
        (Obj("dapo", delta=1.5), dict(temperature=0.7)),
        (Obj("dr_grpo", max_completion_length=9), dict(dtype=DTYPES["bfloat16"])),
        (Obj("cispo", epsilon_high=1.3, beta=0.04), dict(ris="bt")),
        (Obj("sapo", beta=0.04), dict(with_bias=True)),
    ],
    ids=lambda x: str(x) if isinstance(x, Obj) else "-".join(f"{k}={v}" for k, v in x.items()),
)
def test_reference_matches_oracle(obj, kw):
    temperature = kw.get("temperature", 1.0)
    case = make_case(26, **kw)
    ref = spec_for(case, obj, temperature=temperature)
    (loss, aux), grads = lib_value_and_grad(case, obj.lib(), implementation=REFERENCE, temperature=temperature)
    check_against_spec(loss, aux, grads, ref, case, obj)
    logp = lib_logprobs(
        case.hidden,
        case.weight,
        case.ids,
        case.mask,
        bias=case.bias,
        temperature=temperature,
        weight_layout=case.layout,
        implementation=REFERENCE,
    )
    np.testing.assert_allclose(logp, case.logp64, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1e-10, 1e-6, 1e-3])
def test_tiny_temperature_gives_finite_float64_value(temperature):
    """|z| / temperature up to ~1e10: the fused log-probs (under jit) and the logits path equal the float64
    log-softmax (relative 1e-6: float32 rounding of the 1e10-sized logits), never +-inf. Once failed with
    +inf: XLA rounded the max and the sum-exp fusions' logits apart by ~1e3 and exp(z - m) underflowed."""
    rng = np.random.default_rng(5)
    h = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 37)).astype(np.float32)
    ids = rng.integers(0, 37, (2, 5))
    want = spec.spec_logprobs(h, w, ids, temperature=temperature)
    got = jax.jit(lambda h, w, i: gmpo_jax.fused_linear_logprobs(h, w, i, temperature=temperature))(h, w, ids)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # the logits path: logits already computed (float32), divided by the temperature inside
    zl = jnp.asarray(np.einsum("bth,hv->btv", h, w), jnp.float32)
    loss, aux = jax.jit(
        lambda zl: gmpo_jax.policy_loss_from_logits(
            zl,
            gmpo_jax.PolicyBatch(ids, np.ones((2, 5)), np.array([1.0, -1.0])),
            objective=gmpo_jax.GMPO(),
            temperature=temperature,
        )
    )(zl)
    assert np.isfinite(float(loss)) and np.isfinite(float(aux.log_ratio_max))


@pytest.mark.parametrize("temperature", [1e-10, 1e-6, 1e-2])
def test_tiny_temperature_gradients_and_entropy(temperature):
    """Targets at each row's argmax: at tiny temperatures the softmax is one-hot, so d logp / dh, d loss /
    dz and the entropy are ~0 (float64). Compared at absolute 1e-5 of the gradient scale |W| / T. Once
    failed with the full 1 / T (and 1/e nats of entropy): XLA contracted ``x / T - lse`` into a fused
    multiply-add that missed the rounding of ``x / T`` by ~1e3, so the argmax got probability 0."""
    rng = np.random.default_rng(6)
    h = rng.standard_normal((2, 8, 8)).astype(np.float32)
    w = (rng.standard_normal((8, 32)) / 3).astype(np.float32)
    z32 = np.einsum("bth,hv->btv", h, w)
    ids = z32.argmax(-1).astype(np.int32)
    want = spec.spec_head_vjp(h, w, ids, None, np.ones(ids.shape), temperature=temperature)[0]
    scale = np.abs(w).max() / temperature
    f = lambda h: gmpo_jax.fused_linear_logprobs(h, w, ids, temperature=temperature, return_entropy=True)
    g = jax.jit(jax.grad(lambda h: jnp.sum(f(h)[0])))(h)
    np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=1e-5 * scale)
    ent = jax.jit(f)(h)[1]
    np.testing.assert_allclose(np.asarray(ent), spec.spec_entropy(h, w, temperature=temperature), rtol=0, atol=1e-5)
    zl = jnp.asarray(np.concatenate([z32, np.zeros((2, 1, 32), np.float32)], 1))  # [B, T + 1, V]
    gz = jax.jit(
        jax.grad(
            lambda zl: gmpo_jax.policy_loss_from_logits(
                zl,
                gmpo_jax.PolicyBatch(ids, np.ones((2, 8)), np.ones(2)),
                objective=gmpo_jax.CISPO(epsilon_high=5.0),
                temperature=temperature,
            )[0]
        )
    )(zl)
    pz = np.exp(spec._log_softmax(z32 / np.float64(temperature)))
    want_z = -(np.eye(32)[ids] - pz) / temperature / 16  # dapo-style mean over 16 tokens, A = 1, w = 1
    np.testing.assert_allclose(np.asarray(gz)[:, :8], want_z, rtol=0, atol=1e-5 / temperature)


def test_k3_kl_small_differences_to_float32_precision():
    """The k3 KL ``exp(d) - d - 1`` and its gradient ``-(exp(d) - 1)`` (d = ref - logp) against float64
    ``expm1(d) - d`` to 2e-6 relative, at the small |d| of a policy near its reference (1e-7 .. 0.6) and
    beyond (|d| <= 3). The plain float32 form is off by 1 % at d = 3e-3 (cancellation)."""
    from gmpo_jax.objectives import _k3_kl

    d = np.concatenate([np.geomspace(1e-7, 0.6, 200), -np.geomspace(1e-7, 0.6, 200), np.linspace(-3, 3, 61)])
    d32 = jnp.asarray(d, jnp.float32)
    d64 = np.asarray(d32, np.float64)
    got = np.asarray(_k3_kl(jnp.zeros_like(d32), d32, jnp.ones(d.shape, bool)), np.float64)
    want = np.expm1(d64) - d64
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    grad = jax.vmap(jax.grad(lambda lp, r: _k3_kl(lp, r, True)))(jnp.zeros_like(d32), d32)
    np.testing.assert_allclose(np.asarray(grad, np.float64), -np.expm1(d64), rtol=2e-6, atol=0)
