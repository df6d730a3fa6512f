"""The objectives alone, optax-style: loss, metrics and d loss / d logp on per-token log-probs.

No LM head and no logits: each objective's ``chunk_numerator`` / ``denominator`` and
``gmpo_jax.objectives.evaluate`` (``jax.grad`` of the numerator over the global denominator) are called
directly on ``[B, T]`` float32 log-probs and compared with the float64 NumPy spec
(``spec_numpy.spec_loss_from_logp``) under the suite's float32 tolerances (``conftest.TOLERANCES``),
then with golden values computed by hand, the strict boundary rule and the no-NaN cases.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import R_GRID, Obj, assert_fraction_close, assert_grad_close, assert_loss_close

from gmpo_jax import CISPO, GMPO, GRPO, SAPO
from gmpo_jax.objectives import PolicyInputs, evaluate, loss_and_aux


def _objective_loss(objective, logp, mask, adv, *, old=None, ref=None, ris=None, num_items=None):
    """``(loss, aux, dlogp)`` of ``objective`` on float32 log-probs (one chunk: the whole batch)."""
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
    inputs = PolicyInputs(
        mask=jnp.asarray(mask, bool),
        advantages=f32(adv),
        old_logps=f32(old),
        ref_logps=f32(ref),
        rollout_is_ratio=f32(ris),
        num_items=f32(num_items),
    )
    den = objective.denominator(inputs.mask, inputs.num_items)
    num, sums, dlogp = evaluate(objective, f32(logp), inputs, den, with_grads=True)
    loss, aux = loss_and_aux(num, den, sums, inputs.mask)
    return float(loss), aux, np.asarray(dlogp)


# --------------------------------------------------------------------------------------------------
# Every objective against the float64 spec
# --------------------------------------------------------------------------------------------------
B, T = 4, 6
SPEC_CASES = [
    Obj("gmpo"),
    Obj("gmpo", beta=0.1, bias_kl=True),
    Obj("grpo"),
    Obj("bnpo", beta=0.05),
    Obj("dr_grpo", max_completion_length=T),
    Obj("dapo"),
    Obj("dapo", delta=1.5, beta=0.05, bias_kl=True),
    Obj("grpo", level="sequence"),
    Obj("cispo", beta=0.05),
    Obj("sapo"),
]


def _random_case(seed):
    rng = np.random.default_rng(seed)
    mask = np.arange(T)[None] < np.array([T, 4, 1, 0])[:, None]  # full, ragged, one token, empty
    logp = np.where(mask, -rng.uniform(0.05, 4.0, (B, T)), 0.0).astype(np.float32)
    old = np.where(mask, logp - rng.choice(R_GRID, (B, T)), 0.0).astype(np.float32)
    ref = np.where(mask, logp + rng.uniform(-0.7, 0.7, (B, T)), 0.0).astype(np.float32)
    ris = rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)
    adv = np.array([0.9, -0.7, 1.3, 0.5], np.float32)
    return logp, mask, adv, old, ref, ris


@pytest.mark.parametrize("obj", SPEC_CASES, ids=str)
@pytest.mark.parametrize("num_items", [None, 7.0], ids=["own-count", "num_items7"])
def test_objective_matches_spec(obj, num_items):
    """Loss, ``loss_numerator / loss_denominator``, metrics and d loss / d logp against float64."""
    logp, mask, adv, old, ref, ris = _random_case(0)
    ris = None if obj.loss_type == "gmpo" else ris  # GMPO has no rollout correction
    want = spec.spec_loss_from_logp(
        logp,
        mask,
        adv,
        old_logps=old,
        ref_logps=ref if obj.beta else None,
        rollout_is_ratio=ris,
        num_items_in_batch=num_items,
        **obj.spec_kwargs(),
    )
    assert want.margin > 1e-3  # no token within rounding of a clip bound: the same side in float32
    loss, aux, dlogp = _objective_loss(
        obj.lib(), logp, mask, adv, old=old, ref=ref if obj.beta else None, ris=ris, num_items=num_items
    )
    m = want.metrics
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    assert float(aux.loss_denominator) == pytest.approx(m["loss_denominator"], rel=1e-6)
    assert_loss_close(
        aux.loss_numerator, m["loss_numerator"], want.scale * m["loss_denominator"], np.float32, what="loss_numerator"
    )
    for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high"):
        assert_fraction_close(getattr(aux, k), m[k], k)
    for k in ("log_ratio_min", "log_ratio_max"):
        assert float(getattr(aux, k)) == pytest.approx(m[k], abs=1e-6), k
    if obj.beta:
        assert_loss_close(aux.kl, m["kl"], max(abs(m["kl"]), abs(m["kl_uncorrected"])), np.float32, what="kl")
    assert_grad_close(dlogp, want.dlogp, np.float32, "dlogp")
    assert np.all(dlogp[~mask] == 0.0)


# --------------------------------------------------------------------------------------------------
# Golden values, computed by hand
# --------------------------------------------------------------------------------------------------
def test_golden_gmpo_one_sequence():
    """GMPO(0.4, 0.4), B = 1, two tokens, A = +1, log ratios r = logp - old = (0.2, 0.6).

    A > 0 clips above only: c = (min(0.2, 0.4), min(0.6, 0.4)) = (0.2, 0.4); s = (0.2 + 0.4) / 2 = 0.3.
    loss = -A e^s / B = -e^0.3 = -1.3498588.
    d loss / d logp: the clipped token 0; the other -A e^s / (B L) = -e^0.3 / 2 = -0.6749294.
    clip fraction 1 / 2 (high), log ratio range [0.2, 0.6].
    """
    loss, aux, dlogp = _objective_loss(GMPO(), [[-1.0, -0.5]], [[True, True]], [1.0], old=[[-1.2, -1.1]])
    assert loss == pytest.approx(-math.exp(0.3), rel=1e-6)
    np.testing.assert_allclose(dlogp, [[-math.exp(0.3) / 2, 0.0]], rtol=1e-6)
    assert float(aux.clip_fraction) == float(aux.clip_fraction_high) == 0.5 and float(aux.clip_fraction_low) == 0.0
    assert (float(aux.log_ratio_min), float(aux.log_ratio_max)) == pytest.approx((0.2, 0.6), abs=1e-6)


def test_golden_grpo_two_sequences():
    """GRPO("grpo", 0.2, 0.2), B = 2, T = 2. Sequence 0: A = +1, ratios (1, 1.5); sequence 1: A = -1,
    ratio 0.5 on its one unmasked token.

    per-token loss -min(rho A, clip(rho, 0.8, 1.2) A):
      (0, 0): rho = 1 -> -1 (unclipped, d/d logp = -A rho = -1)
      (0, 1): rho = 1.5 -> -min(1.5, 1.2) = -1.2 (clipped high: no gradient)
      (1, 0): rho = 0.5 -> -min(-0.5, -0.8) = 0.8 (clipped low: no gradient)
    "grpo" reduction: sequence means (-1 - 1.2) / 2 = -1.1 and 0.8 / 1 = 0.8, over B:
    loss = (-1.1 + 0.8) / 2 = -0.15; d loss / d logp at (0, 0) = -1 / (B L_0) = -1 / 4.
    clip fraction 2 / 3 (one low, one high), log ratio range [log 0.5, log 1.5].
    """
    logp = [[-1.0, -1.0 + math.log(1.5)], [-2.0, 0.0]]
    old = [[-1.0, -1.0], [-2.0 - math.log(0.5), 0.0]]
    mask = [[True, True], [True, False]]
    loss, aux, dlogp = _objective_loss(GRPO(loss_type="grpo"), logp, mask, [1.0, -1.0], old=old)
    assert loss == pytest.approx(-0.15, abs=1e-6)
    np.testing.assert_allclose(dlogp, [[-0.25, 0.0], [0.0, 0.0]], atol=1e-7)
    assert float(aux.clip_fraction) == pytest.approx(2 / 3, abs=1e-7)
    assert float(aux.clip_fraction_low) == pytest.approx(1 / 3, abs=1e-7)
    assert float(aux.clip_fraction_high) == pytest.approx(1 / 3, abs=1e-7)
    assert float(aux.loss_denominator) == 2.0
    assert (float(aux.log_ratio_min), float(aux.log_ratio_max)) == pytest.approx(
        (math.log(0.5), math.log(1.5)), abs=1e-6
    )


def test_golden_dapo_on_policy_kl():
    """GRPO("dapo", beta=0.5), on-policy (rho = 1 exactly, slope 1), one token, A = 2, ref - logp = d = 0.1.

    k3 KL = e^d - d - 1 = 0.00517092; loss = (-rho A + beta kl) / N = -2 + 0.5 * 0.00517092 = -1.99741454.
    d loss / d logp = -A rho + beta (1 - e^d) = -2 + 0.5 * (1 - 1.10517092) = -2.05258546.
    """
    d = 0.1
    loss, aux, dlogp = _objective_loss(GRPO(loss_type="dapo", beta=0.5), [[-1.0]], [[True]], [2.0], ref=[[-1.0 + d]])
    kl = math.exp(d) - d - 1
    assert float(aux.kl) == pytest.approx(kl, rel=1e-5)
    assert loss == pytest.approx(-2 + 0.5 * kl, rel=1e-6)
    np.testing.assert_allclose(dlogp, [[-2 + 0.5 * (1 - math.exp(d))]], rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# Boundaries and non-finite ratios
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj,adv,r_at,r_past",
    [
        (GMPO(epsilon_low=0.5, epsilon_high=0.5), 1.0, 0.5, float(np.nextafter(np.float32(0.5), np.float32(1)))),
        (GMPO(epsilon_low=0.5, epsilon_high=0.5), -1.0, -0.5, float(np.nextafter(np.float32(-0.5), np.float32(-1)))),
        (GRPO(epsilon_low=0.0, epsilon_high=0.0), 1.0, 0.0, 1e-3),  # ratio 1 = 1 + epsilon_high
        (GRPO(epsilon_low=0.0, epsilon_high=0.0), -1.0, 0.0, -1e-3),  # ratio 1 = 1 - epsilon_low
        (CISPO(epsilon_high=1.0), 1.0, 0.0, 1e-3),  # IS weight 1 = epsilon_high
    ],
    ids=["gmpo-high", "gmpo-low", "grpo-high", "grpo-low", "cispo-high"],
)
def test_strict_boundary(obj, adv, r_at, r_past):
    """A ratio exactly at its bound is not clipped (the gradient passes, clip fraction 0), as in the
    spec; one float32 step past the bound it is (no gradient, clip fraction 1). Log ratios exactly
    representable: ``logp = r``, ``old = 0``."""
    for r, clipped in ((r_at, False), (r_past, True)):
        loss, aux, dlogp = _objective_loss(obj, [[r]], [[True]], [adv], old=[[0.0]])
        want = spec.spec_loss_from_logp(
            np.float32([[r]]),
            [[True]],
            [adv],
            old_logps=[[0.0]],
            loss_type=obj.loss_type,
            epsilon_low=getattr(obj, "epsilon_low", None),
            epsilon_high=obj.epsilon_high,
        )
        assert float(aux.clip_fraction) == float(clipped) == want.metrics["clip_fraction"], r
        if obj.loss_type == "cispo":  # the clipped IS weight still scales d logp: the gradient never stops
            assert dlogp[0, 0] != 0.0
        else:
            assert (dlogp[0, 0] == 0.0) == clipped, (r, dlogp)
        np.testing.assert_allclose(dlogp, want.dlogp, rtol=1e-5)


ALL = [
    GMPO(),
    GRPO(loss_type="grpo"),
    GRPO(loss_type="dapo", delta=2.0),
    GRPO(importance_sampling_level="sequence"),
    GRPO(loss_type="bnpo", beta=0.1),
    CISPO(),
    SAPO(),
]


@pytest.mark.parametrize("obj", ALL, ids=lambda o: f"{type(o).__name__}-{o.loss_type}-{o.importance_sampling_level}")
def test_zero_advantage_and_inf_ratio_give_no_nan(obj):
    """Log ratios of +-100 (e^100 overflows float32 to inf; e^-100 underflows to 0) with A = 0 (no
    policy gradient at all) or with A on the clipped side (A > 0 with a huge ratio, A < 0 with a
    vanishing one): loss, metrics and d loss / d logp are finite; a zero-advantage sequence has no
    policy gradient (the double-``where``: no ``0 * inf``)."""
    logp = np.array([[0.0, -1.0], [0.0, -1.0], [-100.0, -1.0]], np.float32)
    old = np.array([[-100.0, -1.0], [-100.0, -1.0], [0.0, -1.0]], np.float32)
    ref = logp + 0.1
    adv = np.array([0.0, 1.0, -1.0], np.float32)
    mask = np.ones((3, 2), bool)
    loss, aux, dlogp = _objective_loss(obj, logp, mask, adv, old=old, ref=ref)
    assert np.isfinite(loss)
    assert all(np.isfinite(float(x)) for x in aux), aux
    assert np.all(np.isfinite(dlogp)), dlogp
    if obj.beta == 0.0:
        assert np.all(dlogp[0] == 0.0), dlogp  # zero advantage: no gradient, whatever the ratio
