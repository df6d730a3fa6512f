"""Golden values computed by hand, and a finite-difference check of the float64 oracle.

The golden micro-batch (B=2, T=2, H=1, V=2) is built so every log-prob is -ln 2 exactly:
hidden = 0 and weight = [[0, 1]] give logits z = (0, 0).  Then for a token with id 0,
d logp / d z = onehot - softmax = (1/2, -1/2) and, as z = h * (0, 1), d logp / d h = -1/2
(for id 1: +1/2).

    ids  = [[0, 1], [0, 9]]      9 >= V is padding under the mask
    mask = [[1, 1], [1, 0]]      L = (2, 1), 3 active tokens
    A    = [1, -0.5]
    r    = logp - old = [[0.1, 0.5], [-0.6, (masked)]]

Constants used below: e^0.1 = 1.1051709180756477, e^0.5 = 1.6487212707001282,
e^-0.6 = 0.5488116360940264, e^0.25 = 1.2840254166877414, e^-0.4 = 0.6703200460356393,
ln 2 = 0.6931471805599453.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import spec_numpy as spec
from conftest import Case, Obj, lib_value_and_grad

LN2 = math.log(2.0)
R = np.array([[0.1, 0.5], [-0.6, 0.0]])
MASK = np.array([[True, True], [True, False]])
IDS = np.array([[0, 1], [0, 9]], np.int32)
ADV = np.array([1.0, -0.5], np.float32)
D_KL = np.array([[0.5, -0.3], [0.5, 0.0]])  # ref - logp


def golden_case(*, off_policy=True, with_ref=False) -> Case:
    hidden = np.zeros((2, 2, 1), np.float32)
    weight = np.array([[0.0, 1.0]], np.float32)
    bias = np.zeros((2,), np.float32)
    logp = np.where(MASK, -LN2, 0.0)
    case = Case(hidden, weight, IDS, MASK, ADV, bias, "hv", logp)
    if off_policy:
        case.old = np.where(MASK, logp - R, 0.0).astype(np.float32)
    if with_ref:
        case.ref = np.where(MASK, logp + D_KL, 0.0).astype(np.float32)
    return case


# Each entry: objective, loss, d loss / d logp at [0,0], [0,1], [1,0], clip_fraction, and (off-policy) kwargs.
GOLDEN = [
    # GMPO (eps 0.4): c = [[0.1, min(0.5, 0.4)], [max(-0.6, -0.4)]]; s = (0.25, -0.4)
    # loss = 1/2 (-1 e^0.25 + 0.5 e^-0.4) = -0.47443269683496087
    # dlogp[0,0] = -(A/B) e^s / L = -(1/2) e^0.25 / 2; [0,1] high-clipped (A>0), [1,0] low-clipped (A<0)
    pytest.param(Obj("gmpo"), True, {}, -0.47443269683496087, (-0.32100635417193535, 0.0, 0.0), 2 / 3, id="gmpo"),
    # GRPO token (eps 0.2): ptl = [-e^0.1, -min(e^0.5, 1.2) = -1.2, -min(-0.5 e^-0.6, -0.5 * 0.8) = 0.4]
    # loss = 1/2 ((-e^0.1 - 1.2) / 2 + 0.4) = -0.37629272951891196; dlogp[0,0] = -e^0.1 / (B L0) = -e^0.1 / 4
    pytest.param(Obj("grpo"), True, {}, -0.37629272951891196, (-0.27629272951891193, 0.0, 0.0), 2 / 3, id="grpo"),
    # BNPO: sum ptl / 3 = (-e^0.1 - 1.2 + 0.4) / 3; dlogp[0,0] = -e^0.1 / 3
    pytest.param(Obj("bnpo"), True, {}, -0.6350569726918827, (-1.1051709180756477 / 3, 0.0, 0.0), 2 / 3, id="bnpo"),
    # Dr. GRPO, max_completion_length 4: sum ptl / (B * 4) = -1.9051709180756477 / 8
    pytest.param(
        Obj("dr_grpo", max_completion_length=4),
        True,
        {},
        -0.238146364759456,
        (-1.1051709180756477 / 8, 0.0, 0.0),
        2 / 3,
        id="dr_grpo",
    ),
    # DAPO: sum ptl / N, N = 3 active tokens
    pytest.param(Obj("dapo"), True, {}, -0.6350569726918827, (-1.1051709180756477 / 3, 0.0, 0.0), 2 / 3, id="dapo"),
    # DAPO with num_items_in_batch = 10: sum ptl / 10
    pytest.param(
        Obj("dapo"),
        True,
        {"num_items_in_batch": 10},
        -0.1905170918075648,
        (-1.1051709180756477 / 10, 0.0, 0.0),
        2 / 3,
        id="dapo-num_items",
    ),
    # GRPO sequence level: w = (0.3, -0.6); e^0.3 = 1.3499 > 1.2 with A>0 -> clipped: ptl = -1.2;
    # e^-0.6 < 0.8 with A<0 -> clipped: ptl = 0.4.  loss = 1/2 (-1.2 + 0.4) = -0.4, every gradient 0.
    pytest.param(Obj("grpo", level="sequence"), True, {}, -0.4, (0.0, 0.0, 0.0), 1.0, id="grpo-sequence"),
    # CISPO eps_high 1.3: ptl = -min(coef, 1.3) A logp, logp = -ln2:
    #   [e^0.1 ln2, 1.3 ln2, -0.5 e^-0.6 ln2] = [0.7660461059009814, 0.9010913347279289, -0.19020361910853253]
    # loss = sum / 3 = 0.4923112738401259; dlogp = -min(coef, 1.3) A / 3; clipped: only [0,1] (1.65 > 1.3, A>0)
    pytest.param(
        Obj("cispo", epsilon_high=1.3),
        True,
        {},
        0.4923112738401259,
        (-0.3683903060252159, -0.43333333333333335, 0.09146860601567107),
        1 / 3,
        id="cispo",
    ),
    # SAPO (tau+ 1, tau- 1.05): ptl = -A sigmoid(tau (coef - 1)) 4 / tau
    #   = [-2.105074084570819, -2.6268889844843373, 0.7309134824936615]
    # loss = 1/2 ((ptl0 + ptl1) / 2 + ptl2) = -0.8175340260169583
    # dlogp = -A 4 sig (1 - sig) coef / (B L)
    pytest.param(
        Obj("sapo"),
        True,
        {},
        -0.8175340260169583,
        (-0.2755301226800806, -0.3716846526399375, 0.12978362826241374),
        0.0,
        id="sapo",
    ),
    # On-policy (old = stop_gradient(logp), r = 0, coef = 1):
    # GRPO: loss = 1/2 (-1 + 0.5) = -0.25; dlogp = -A / (B L) = [-1/4, -1/4, 0.25]
    pytest.param(Obj("grpo"), False, {}, -0.25, (-0.25, -0.25, 0.25), 0.0, id="grpo-on-policy"),
    # GMPO: s = 0, same numbers as GRPO on-policy.
    pytest.param(Obj("gmpo"), False, {}, -0.25, (-0.25, -0.25, 0.25), 0.0, id="gmpo-on-policy"),
    # SAPO: sigmoid(0) = 1/2 -> ptl = -2 A / tau = [-2, -2, 0.5 * 2 / 1.05]; loss = 1/2 (-2 + 1/1.05)
    # dlogp = -A 4 (1/4) / (B L) = -A / (B L)
    pytest.param(Obj("sapo"), False, {}, -0.5238095238095238, (-0.25, -0.25, 0.25), 0.0, id="sapo-on-policy"),
    # CISPO: coef = 1 <= 1.3: ptl = -A logp = [ln2, ln2, -0.5 ln2]; loss = 1.5 ln2 / 3 = ln2 / 2
    # dlogp = -A / 3
    pytest.param(
        Obj("cispo", epsilon_high=1.3),
        False,
        {},
        0.34657359027997264,
        (-1 / 3, -1 / 3, 0.5 / 3),
        0.0,
        id="cispo-on-policy",
    ),
]


def _dlogp_grid(d):
    return np.array([[d[0], d[1]], [d[2], 0.0]])


def _golden_dh(dlogp):
    # d logp / d h = -1/2 for id 0, +1/2 for id 1 (ids [[0, 1], [0, pad]])
    sign = np.array([[-0.5, 0.5], [-0.5, 0.0]])
    return (dlogp * sign)[..., None]


@pytest.mark.parametrize("obj, off_policy, kw, loss, dlogp, clip_fraction", GOLDEN)
def test_oracle_matches_golden(obj, off_policy, kw, loss, dlogp, clip_fraction):
    case = golden_case(off_policy=off_policy)
    res = spec.spec_policy_loss(
        case.hidden,
        case.weight,
        case.ids,
        case.mask,
        case.adv,
        bias=case.bias,
        old_logps=None if not off_policy else np.where(MASK, -LN2 - R, 0.0),
        **kw,
        **obj.spec_kwargs(),
    )
    assert res.loss == pytest.approx(loss, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(res.dlogp, _dlogp_grid(dlogp), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(res.dhidden, _golden_dh(_dlogp_grid(dlogp)), rtol=1e-12, atol=1e-15)
    assert res.metrics["clip_fraction"] == pytest.approx(clip_fraction, abs=1e-15)


@pytest.mark.parametrize("obj, off_policy, kw, loss, dlogp, clip_fraction", GOLDEN)
def test_library_matches_golden(obj, off_policy, kw, loss, dlogp, clip_fraction, implementation):
    case = golden_case(off_policy=off_policy)
    (got, aux), (dh, dw, db) = lib_value_and_grad(case, obj.lib(), implementation=implementation, **kw)
    # f32 inputs: old = -ln2 - r is rounded to f32, so r is exact to ~1e-7; SPEC's f32 bounds apply.
    assert float(got) == pytest.approx(loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(np.asarray(dh), _golden_dh(_dlogp_grid(dlogp)), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dw), 0.0)  # hidden = 0 -> d W = h^T dz = 0 exactly
    # db = sum_t dlogp (onehot - 1/2): db[0] = sum dlogp * (+1/2 for id 0, -1/2 for id 1), db[1] = -db[0]
    d = _dlogp_grid(dlogp)
    db0 = 0.5 * (d[0, 0] - d[0, 1] + d[1, 0])
    np.testing.assert_allclose(np.asarray(db), [db0, -db0], rtol=1e-4, atol=1e-6)
    assert float(aux.clip_fraction) == pytest.approx(clip_fraction, abs=1e-6)


def test_gmpo_kl_golden(implementation):
    """GMPO with beta = 0.1 and ref - logp = [[0.5, -0.3], [0.5]].

    k3: kl = e^d - d - 1 = [0.1487212707001282, 0.04081822068171781, 0.1487212707001282]
    per-sequence mean: (0.0947697456909230, 0.1487212707001282)
    loss = -0.47443269683496087 + 0.1 * 1/2 * (0.0947697456909230 + 0.1487212707001282) = -0.4622581460154083
    kl metric = sum / 3 = 0.11275358736065806
    dlogp = policy part + beta / (B L) (1 - e^d):
      [0,0] = -0.32100635417193535 + 0.1/4 (1 - e^0.5) = -0.33722438593943854
      [0,1] = 0.1/4 (1 - e^-0.3) = 0.006479544482957053      (policy part clipped)
      [1,0] = 0.1/2 (1 - e^0.5) = -0.03243606353500641       (policy part clipped)
    """
    obj = Obj("gmpo", beta=0.1)
    dlogp = _dlogp_grid((-0.33722438593943854, 0.006479544482957053, -0.03243606353500641))
    case = golden_case(with_ref=True)
    res = spec.spec_policy_loss(
        case.hidden,
        case.weight,
        case.ids,
        case.mask,
        case.adv,
        bias=case.bias,
        old_logps=np.where(MASK, -LN2 - R, 0.0),
        ref_logps=np.where(MASK, -LN2 + D_KL, 0.0),
        **obj.spec_kwargs(),
    )
    assert res.loss == pytest.approx(-0.4622581460154083, rel=1e-12)
    assert res.metrics["kl"] == pytest.approx(0.11275358736065806, rel=1e-12)
    np.testing.assert_allclose(res.dlogp, dlogp, rtol=1e-12, atol=1e-15)

    (got, aux), (dh, _, _) = lib_value_and_grad(case, obj.lib(), implementation=implementation)
    assert float(got) == pytest.approx(-0.4622581460154083, rel=1e-5)
    assert float(aux.kl) == pytest.approx(0.11275358736065806, rel=1e-5)
    assert float(aux.clip_fraction_low) == pytest.approx(1 / 3, abs=1e-6)
    assert float(aux.clip_fraction_high) == pytest.approx(1 / 3, abs=1e-6)
    np.testing.assert_allclose(np.asarray(dh), _golden_dh(dlogp), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# The oracle's hand-derived gradients against central finite differences (float64), away from every
# clip / delta bound (the oracle reports the margin; a step of 1e-6 cannot cross a bound 1e-3 away).
# --------------------------------------------------------------------------------------------------
FD_OBJS = [
    Obj("gmpo"),
    Obj("gmpo", beta=0.07, bias_kl=True),
    Obj("grpo", beta=0.05),
    Obj("grpo", level="sequence", beta=0.05, bias_kl=True),
    Obj("bnpo", delta=1.5),
    Obj("dr_grpo", max_completion_length=9, level="sequence"),
    Obj("dapo", beta=0.05, bias_kl=True),
    Obj("cispo", epsilon_high=1.3, beta=0.05),
    Obj("sapo", tau_pos=0.7, tau_neg=1.6, beta=0.05, bias_kl=True),
]


def _fd_case(seed, B=3, T=4, H=5, V=7):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H))
    weight = rng.normal(size=(V, H)) * 0.7  # "vh" layout
    bias = rng.normal(size=(V,)) * 0.3
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], bool)[:B, :T]
    ids = np.where(mask, rng.integers(0, V, size=(B, T)), -100)
    adv = np.array([0.8, -1.3, 0.5])[:B]
    return hidden, weight, bias, mask, ids, adv, rng


@pytest.mark.parametrize("obj", FD_OBJS, ids=str)
@pytest.mark.parametrize("off_policy", [True, False], ids=["off", "on"])
def test_oracle_gradients_match_finite_differences(obj, off_policy):
    hidden, weight, bias, mask, ids, adv, rng = _fd_case(0)
    temperature = 0.8
    kw = dict(bias=bias, temperature=temperature, weight_layout="vh")
    logp0 = spec.spec_logprobs(hidden, weight, ids, mask, **kw)
    r = rng.choice([-0.9, -0.35, -0.1, 0.05, 0.12, 0.6], size=mask.shape)
    old = logp0 - r if off_policy else logp0  # on-policy: old is logp, held fixed (stop_gradient)
    ref = logp0 + rng.uniform(-0.5, 0.5, size=mask.shape)
    ris = rng.uniform(0.5, 1.5, size=mask.shape) if obj.loss_type != "gmpo" else None
    lk = dict(ref_logps=ref, rollout_is_ratio=ris, **obj.spec_kwargs())

    res = spec.spec_policy_loss(hidden, weight, ids, mask, adv, old_logps=old if off_policy else None, **kw, **lk)
    assert res.margin > 1e-3, "test setup: a ratio sits too close to a bound"
    assert np.any(res.dhidden != 0)

    def f(h=hidden, w=weight, b=bias):
        o = old
        if obj.loss_type == "cispo":
            # CISPO's clipped ratio is a stop-gradient: hold r (hence the coefficient) at its value.
            o = spec.spec_logprobs(h, w, ids, mask, **{**kw, "bias": b}) - (logp0 - old)
        return spec.spec_policy_loss(h, w, ids, mask, adv, old_logps=o, **{**kw, "bias": b}, **lk).loss

    def fd(x, fn, step=1e-6):
        g = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[i] += step
            xm[i] -= step
            g[i] = (fn(xp) - fn(xm)) / (2 * step)
        return g

    np.testing.assert_allclose(res.dhidden, fd(hidden, lambda h: f(h=h)), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(res.dweight, fd(weight, lambda w: f(w=w)), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(res.dbias, fd(bias, lambda b: f(b=b)), rtol=1e-6, atol=1e-8)
