"""Issue 16: numerics that do not depend on the vocabulary's order, on ``jax_enable_x64`` or on luck.

(a) Permuting the vocabulary (weight columns, bias, logits, ids) leaves loss, metrics and gradients
    unchanged up to rounding, for every implementation class (``XlaChunkedBackend``,
    ``XlaLogitsBackend``, the Mosaic kernels in the interpreter) and objective; hypothesis picks the
    permutation, the dominant logit's position and margin, the dtype and the shapes.
(b) Extreme rows against the float64 oracle: one logit dominating by 10-100 at many positions of a
    row, near-equal logits, ``p(target)`` within 1e-7 of 1.
(c) The core cases once more with ``jax_enable_x64`` on: documented dtypes out, no 64-bit arithmetic
    in the traced program.

Tolerances (reasoned once, here; the constants are in ``conftest.py``). A permutation changes no logit
value, only the order in which the log-sum-exp and the matmuls' vocabulary sums add terms. A correct float32 summation of ``n``
positive terms in a tree or in windows of ``k`` has relative error ``<= (log2 n + k) * 2^-24``
whatever the order (``k = 128`` for ``XlaLogitsBackend``'s windows, ``<= ~2e-5`` even at
``V = 151936``, and measured ~1 ulp); a left-to-right sum has ``(n - 1) * 2^-24``, and loses every
term below ``2^-24`` of a dominant early one. So both orders must agree with the float64 oracle
within the suite's one tolerance table (``conftest.TOLERANCES``: f32 loss 1e-5 relative, gradients
1e-4 of the largest entry; bf16 as SPEC), and with each other within twice that. The extreme rows'
per-element gradient bound is absolute: a float32 log-sum-exp of a row with maximum ``|z|`` is
exact to a few ulps of ``1 + |z|``, so each ``p_v = exp(z_v - lse)`` to ``8 * 2^-24 * (1 + |z|) *
p_v`` plus the rounding of ``1 - p`` at the target (``2^-24``); the dropped tail of the bug is
~100x larger than that bound at these shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import (
    DLOGITS_SLACK,
    FAST_COMPILE,
    LSE_ULPS,
    ORDER_SLACK,
    U32,
    X64_LOGP_ATOL,
    Obj,
    assert_fraction_close,
    assert_grad_close,
    assert_loss_close,
    check_against_spec,
    jaxpr_ops,
    lib_value_and_grad,
    make_case,
    spec_for,
    tol_for,
)
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from test_logits_loss import oracle

import gmpo_jax
import gmpo_jax.reference
from gmpo_jax import kernels as K
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend
from gmpo_jax.logits.xla import XlaLogitsBackend

HYP = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

OBJECTIVES = [
    Obj("gmpo"),
    Obj("gmpo", beta=0.1, bias_kl=True),
    Obj("grpo"),
    Obj("dapo", beta=0.05),
    Obj("bnpo", level="sequence"),
    Obj("cispo"),
    Obj("sapo"),
]
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# Interpreter kernels with the device's 128-column blocks so that small vocabularies still span blocks.
MOSAIC_LOGITS = MosaicGpuLogitsBackend(
    interpret=True,
    fwd=K.LogitsBlocks(block_v=128, stages=2),
    bwd=K.LogitsBlocks(block_v=128, stages=2, tiles_per_cta=2),
    num_splits=2,
    fused=False,
)
MOSAIC_LOGITS_FUSED = MosaicGpuLogitsBackend(interpret=True, fwd=K.LogitsBlocks(block_v=128, stages=2), num_splits=2)
MOSAIC_HEAD = MosaicGpuBackend(interpret=True)


# --------------------------------------------------------------------------------------------------
# Inputs with a dominant logit, and their vocabulary permutation
# --------------------------------------------------------------------------------------------------
def _logits_case(rng, *, B, T, V, dtype, dominant_at, margin, scale=1.0):
    """[B, T + 1, V] logits whose row (b, t) has logit ``dominant_at[b, t]`` ``margin`` above the rest;
    half the targets are the dominant logit (its 1 - p is the tail mass the bug dropped)."""
    z = rng.normal(size=(B, T + 1, V)) * scale
    np.put_along_axis(z, dominant_at[..., None], margin + np.max(z, axis=-1, keepdims=True), axis=-1)
    z -= np.max(z, axis=-1, keepdims=True)  # the dominant logit at 0: lse ~ its tail, resolvable in float32
    logits = z.astype(dtype)
    mask = np.ones((B, T), bool)
    mask[-1, T // 2 + 1 :] = False
    ids = np.where(rng.random((B, T)) < 0.5, dominant_at[:, :T], rng.integers(0, V, (B, T))).astype(np.int32)
    ids = np.where(mask, ids, -100).astype(np.int32)
    adv = np.where(np.arange(B) % 2 == 0, 0.8, -0.6).astype(np.float32)
    case = dict(logits=logits, ids=ids, mask=mask, adv=adv, old=None, ref=None, ris=None)
    from test_logits_loss import oracle_logp

    logp = np.nan_to_num(oracle_logp(logits, ids, mask, T, 1.0))
    case["old"] = np.where(mask, logp - rng.choice([-0.3, -0.05, 0.0, 0.1, 0.28], size=(B, T)), 0.0).astype(np.float32)
    case["ref"] = np.where(mask, logp + rng.uniform(-0.5, 0.5, size=(B, T)), 0.0).astype(np.float32)
    return case


def _permute_logits_case(case, perm):
    """New vocabulary index ``v`` holds old index ``perm[v]``."""
    inv = np.argsort(perm)
    ids = case["ids"]
    new_ids = np.where((ids >= 0) & (ids < len(perm)), inv[np.clip(ids, 0, len(perm) - 1)], ids).astype(np.int32)
    return dict(case, logits=case["logits"][..., perm], ids=new_ids)


def _loss_from_logits(implementation, objective):
    def f(logits, ids, mask, adv, old, ref):
        return gmpo_jax.policy_loss_from_logits(
            logits,
            gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old, ref_logps=ref),
            objective=objective,
            implementation=implementation,
        )

    return jax.jit(jax.value_and_grad(f, has_aux=True), compiler_options=FAST_COMPILE)


_LOGITS_FNS: dict = {}


def _run_logits(implementation, obj: Obj, case):
    key = (implementation, obj)
    if key not in _LOGITS_FNS:
        _LOGITS_FNS[key] = _loss_from_logits(implementation, obj.lib())
    (loss, aux), g = _LOGITS_FNS[key](*(jnp.asarray(case[k]) for k in ("logits", "ids", "mask", "adv", "old", "ref")))
    return loss, aux, np.asarray(g)


def _check_logits_against_oracle(loss, aux, g, case, obj: Obj):
    """Loss and metrics with the suite's table; ``dlogits`` ELEMENTWISE (a row whose target dominates has
    a gradient ~1e-7 of the others': a bound relative to the largest entry would hide it). Per element:
    ``p`` is exact to ``8 u (1 + |lse|)`` relative (f32 log-sum-exp; the rows' maximum is 0 so ``|lse|``
    is small and ``1 - p`` of a dominant target is resolvable), the objective's ``c = d loss / d logp``
    to ``8 u (1 + max|z|)`` (it sees ``logp``), x4 slack; ``1 - p`` rounds by ``u``, and the gradient
    is finally rounded to its dtype."""
    sl, dz = oracle(case, obj)
    dtype = case["logits"].dtype
    assert_loss_close(loss, sl.loss, sl.scale, dtype)
    assert_fraction_close(aux.clip_fraction, sl.metrics["clip_fraction"], "clip_fraction")
    T = case["ids"].shape[1]
    z = np.asarray(case["logits"], np.float64)
    zm = z.max(-1, keepdims=True)
    zmax = np.abs(z).max(-1, keepdims=True)  # c = d loss / d logp: relative error ~ u |logp| <= u max|z|
    lse = np.abs(zm + np.log(np.exp(z - zm).sum(-1, keepdims=True)))
    c = np.zeros(z.shape[:2] + (1,))
    c[:, :T, 0] = np.where(case["mask"], np.abs(sl.dlogp), 0.0)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    rnd = 2.0**-8 if dtype != np.float32 else U32
    tol = (
        DLOGITS_SLACK * LSE_ULPS * U32 * ((1 + zmax) * np.abs(dz) + (1 + lse) * c * p) + 4 * U32 * c + rnd * np.abs(dz)
    )
    err = np.abs(np.asarray(g, np.float64) - dz)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), (
        f"dlogits err {err[worst]:.3e} > tol {tol[worst]:.3e} at {worst}: got "
        f"{float(np.asarray(g, np.float64)[worst]):.6e}, want {dz[worst]:.6e} (p = {p[worst]:.3e})"
    )


def _check_invariant(a, b, perm, dtype, what):
    """Loss and metrics of the original and of the permuted problem agree (gradients: each against the
    oracle elementwise, see ``_check_logits_against_oracle``)."""
    (la, auxa, _), (lb, auxb, _) = a, b  # gradients: checked against the oracle by the callers
    tol = tol_for(dtype)
    scale = max(abs(float(la)), 1e-2)  # a GRPO sum of +/- terms may cancel: its terms are O(|A|) ~ 1
    assert abs(float(la) - float(lb)) <= ORDER_SLACK * tol.loss_rtol * scale, (
        f"{what}: loss {float(la)!r} != {float(lb)!r}"
    )
    for name in ("clip_fraction", "kl", "loss_denominator"):
        assert abs(float(getattr(auxa, name)) - float(getattr(auxb, name))) <= ORDER_SLACK * tol.loss_rtol * max(
            1.0, abs(float(getattr(auxa, name)))
        ), f"{what}: aux.{name}"


# --------------------------------------------------------------------------------------------------
# (a) vocabulary-permutation invariance
# --------------------------------------------------------------------------------------------------
def _dominant_positions(where, V, shape, rng):
    return {"first": np.zeros(shape, int), "last": np.full(shape, V - 1), "random": rng.integers(0, V, shape)}[where]


@HYP
@given(
    obj=st.sampled_from(OBJECTIVES),
    dtype=st.sampled_from(sorted(DTYPES)),
    V=st.sampled_from([37, 300, 1031]),
    margin=st.sampled_from([0.0, 10.0, 17.0, 30.0, 100.0]) | st.floats(0.0, 120.0),
    where=st.sampled_from(["first", "last", "random"]),
    seed=st.integers(0, 2**16),
)
@example(obj=Obj("grpo"), dtype="float32", V=1031, margin=17.0, where="first", seed=0)
def test_logits_xla_permutation_invariant(obj, dtype, V, margin, where, seed):
    """The dominant logit first / last / anywhere, then a random permutation of the vocabulary."""
    B, T = 2, 3
    rng = np.random.default_rng(seed)
    case = _logits_case(
        rng,
        B=B,
        T=T,
        V=V,
        dtype=DTYPES[dtype],
        dominant_at=_dominant_positions(where, V, (B, T + 1), rng),
        margin=margin,
    )
    perm = rng.permutation(V)
    be = XlaLogitsBackend()
    a = _run_logits(be, obj, case)
    b = _run_logits(be, obj, _permute_logits_case(case, perm))
    _check_logits_against_oracle(*a, case, obj)
    _check_logits_against_oracle(*b, _permute_logits_case(case, perm), obj)
    _check_invariant(a, b, perm, case["logits"].dtype, "xla")


def _head_case(rng, *, B, T, H, V, dtype, layout, with_bias, dominant_cols, margin):
    """make_case with ``dominant_cols`` given a bias ``margin`` above the rest (each row's dominant logit
    is one of them), so the LM head has the same extreme rows as the logits path."""
    case = make_case(int(rng.integers(1 << 30)), B=B, T=T, H=H, V=V, dtype=dtype, layout=layout, with_bias=True)
    bias = np.asarray(case.bias, np.float64)
    bias[dominant_cols] += margin
    if not with_bias and margin == 0:
        bias[:] = 0.0
    case.bias = bias.astype(dtype)
    return _recompute_oracle_inputs(case, rng)


def _recompute_oracle_inputs(case, rng):
    import spec_numpy as spec

    case.logp64 = spec.spec_logprobs(
        case.hidden, case.weight, case.ids, case.mask, bias=case.bias, weight_layout=case.layout
    )
    r = rng.choice([-0.3, -0.05, 0.0, 0.1, 0.28], size=case.ids.shape)
    case.old = np.where(case.mask, case.logp64 - r, 0.0).astype(np.float32)
    case.ref = np.where(case.mask, case.logp64 + rng.uniform(-0.5, 0.5, size=case.ids.shape), 0.0).astype(np.float32)
    return case


def _permute_head_case(case, perm):
    inv = np.argsort(perm)
    V = len(perm)
    ids = np.where((case.ids >= 0) & (case.ids < V), inv[np.clip(case.ids, 0, V - 1)], case.ids).astype(np.int32)
    weight = case.weight[:, perm] if case.layout == "hv" else case.weight[perm]
    new = dataclasses.replace(
        case, weight=np.ascontiguousarray(weight), ids=ids, bias=None if case.bias is None else case.bias[perm]
    )
    return new


def _head_invariance(implementation, obj, case, perm):
    (la, auxa), (dha, dwa, dba) = lib_value_and_grad(case, obj.lib(), implementation=implementation, ris=False)
    pcase = _permute_head_case(case, perm)
    (lb, auxb), (dhb, dwb, dbb) = lib_value_and_grad(pcase, obj.lib(), implementation=implementation, ris=False)
    ref = spec_for(case, obj, ris=False)
    check_against_spec(la, auxa, (dha, dwa, dba), ref, case, obj)
    check_against_spec(lb, auxb, (dhb, dwb, dbb), spec_for(pcase, obj, ris=False), pcase, obj)
    inv = np.argsort(perm)
    dtype = case.dtype
    assert_grad_close(np.asarray(dhb), np.asarray(dha).astype(np.float64), dtype, "dhidden across orders")
    dwb_back = np.asarray(dwb)[:, inv] if case.layout == "hv" else np.asarray(dwb)[inv]
    assert_grad_close(dwb_back, np.asarray(dwa).astype(np.float64), dtype, "dweight across orders")
    if case.bias is not None:
        assert_grad_close(np.asarray(dbb)[inv], np.asarray(dba).astype(np.float64), dtype, "dbias across orders")
    tol = tol_for(dtype)
    assert abs(float(la) - float(lb)) <= ORDER_SLACK * tol.loss_rtol * max(abs(float(la)), 1e-2), (float(la), float(lb))


@HYP
@given(
    data=st.data(),
    obj=st.sampled_from(OBJECTIVES),
    dtype=st.sampled_from(sorted(DTYPES)),
    layout=st.sampled_from(["hv", "vh"]),
    V=st.sampled_from([37, 300]),
    block=st.sampled_from([16, 64, None]),
    margin=st.sampled_from([0.0, 10.0, 17.0, 40.0]),
)
def test_lm_head_xla_chunked_permutation_invariant(data, obj, dtype, layout, V, block, margin):
    rng = np.random.default_rng(V + int(margin))
    dom = np.asarray(data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=3), label="dominant"))
    case = _head_case(
        rng, B=3, T=4, H=8, V=V, dtype=DTYPES[dtype], layout=layout, with_bias=True, dominant_cols=dom, margin=margin
    )
    perm = np.asarray(data.draw(st.permutations(range(V)), label="perm"))
    _head_invariance(XlaChunkedBackend(vocab_block=block), obj, case, perm)


# Interpreter kernels: seconds per call, so a curated subset (fixed examples, both orders of the
# dominant logit: first and last column of the vocabulary).
@pytest.mark.parametrize(
    "implementation, obj, V, fused",
    [(MOSAIC_LOGITS, Obj("gmpo"), 320, False), (MOSAIC_LOGITS_FUSED, Obj("grpo", beta=0.05), 2048, True)],
    ids=["mosaic-gmpo-three-pass", "mosaic_fused-grpo-beta0.05"],
)
def test_logits_mosaic_interpret_permutation_invariant(implementation, obj, V, fused):
    """Each backend once, each objective once, each kernel once: ``MOSAIC_LOGITS`` (GMPO: the three passes, two tiles
    per CTA in the backward) at V = 320, 2.5 blocks of 128 columns; ``MOSAIC_LOGITS_FUSED`` (GRPO, token-local) at
    V = 2048 float32, the smallest vocabulary that views as the fused kernel's slabs, so its one kernel runs (checked:
    ``_fused``). 64 rows (one row block of the kernels)."""
    from gmpo_jax.logits.vjp import LogitsConfig, _fused

    B, T = 2, 31
    rng = np.random.default_rng(1)
    case = _logits_case(rng, B=B, T=T, V=V, dtype=np.float32, dominant_at=np.zeros((B, T + 1), int), margin=17.0)
    assert _fused(LogitsConfig(implementation, T), obj.lib(), jnp.asarray(case["logits"])) == fused
    perm = np.roll(np.arange(V), -1)[::-1].copy()  # the dominant column 0 moves to the last position
    a = _run_logits(implementation, obj, case)
    b = _run_logits(implementation, obj, _permute_logits_case(case, perm))
    _check_logits_against_oracle(*a, case, obj)
    _check_invariant(a, b, perm, np.float32, "mosaic")


def test_lm_head_mosaic_interpret_permutation_invariant():
    """The ``[V, H]`` layout with a bias (both layouts meet the float64 oracle in ``tests/kernels``; the order of the
    vocabulary is the property here, and each of these runs is two interpreter passes)."""
    layout = "vh"
    rng = np.random.default_rng(2)
    V = 300
    case = _head_case(
        rng,
        B=3,
        T=4,
        H=64,
        V=V,
        dtype=ml_dtypes.bfloat16,
        layout=layout,
        with_bias=True,
        dominant_cols=np.array([0]),
        margin=17.0,
    )  # the Mosaic LM head takes 16-bit inputs
    perm = np.roll(np.arange(V), -1)[::-1].copy()
    _head_invariance(MOSAIC_HEAD, Obj("gmpo"), case, perm)


# --------------------------------------------------------------------------------------------------
# (b) extreme rows against the float64 oracle
# --------------------------------------------------------------------------------------------------
def _extreme_rows(kind, V, n_rows, rng):
    """``[n_rows, V]`` float32 rows and their targets."""
    if kind == "dominant":  # one logit 10..100 above N(0, 1) noise, at positions spread over the row
        pos = np.unique(np.concatenate([[0, 1, 2, V // 2, V - 2, V - 1], rng.integers(0, V, n_rows)]))[:n_rows]
        margins = np.resize([10.0, 17.0, 25.0, 50.0, 100.0], len(pos))
        z = rng.normal(size=(len(pos), V))
        z[np.arange(len(pos)), pos] = margins + 3.0
        return z.astype(np.float32), pos.astype(np.int32)
    if kind == "near_equal":  # logits within a few ulps of each other at |z| ~ 7
        z = 7.0 + rng.integers(-3, 4, size=(n_rows, V)) * np.spacing(np.float32(7.0))
        return z.astype(np.float32), rng.integers(0, V, n_rows).astype(np.int32)
    # p(target) within 1e-7 of 1: the tail's total mass (V - 1) e^-d = 1e-7, target first / mid / last
    d = np.log((V - 1) / 1e-7)
    z = np.zeros((n_rows, V)) - d + rng.uniform(-1e-3, 1e-3, size=(n_rows, V))
    pos = np.resize([0, V // 3, V - 1], n_rows)
    z[np.arange(n_rows), pos] = 0.0
    return z.astype(np.float32), pos.astype(np.int32)


def _oracle_rows(z, ids, c):
    z64 = z.astype(np.float64)
    m = z64.max(-1, keepdims=True)
    lse = m + np.log(np.exp(z64 - m).sum(-1, keepdims=True))
    p = np.exp(z64 - lse)
    logp = np.take_along_axis(z64 - lse, ids[:, None], -1)[:, 0]
    onehot = np.arange(z.shape[-1])[None] == ids[:, None]
    return logp, c * (onehot - p), p, lse


def _assert_rows(logp, dz, z, ids, c, what):
    """logp to ``8 u (1 + |lse| + |logp|)``; each ``dz = c (onehot - p)`` to
    ``|c| (8 u (1 + |lse| + |z - lse|) p + u)``: the float32 lse and ``z - lse`` round, ``1 - p`` by ``u``."""
    ref_logp, ref_dz, p, lse = _oracle_rows(z, ids, c)
    logp_tol = LSE_ULPS * U32 * (1 + np.abs(lse[:, 0]) + np.abs(ref_logp))
    err = np.abs(np.asarray(logp, np.float64) - ref_logp)
    assert np.all(err <= logp_tol), (
        f"{what}: logp err {err.max():.3e} at row {err.argmax()} > {logp_tol[err.argmax()]:.3e}"
    )
    g_tol = np.abs(c) * (LSE_ULPS * U32 * (1 + np.abs(lse) + np.abs(z.astype(np.float64) - lse)) * p + U32)
    gerr = np.abs(np.asarray(dz, np.float64) - ref_dz)
    worst = np.unravel_index(np.argmax(gerr - g_tol), gerr.shape)
    assert np.all(gerr <= g_tol), (
        f"{what}: dlogits err {gerr[worst]:.3e} > {g_tol[worst]:.3e} at {worst} "
        f"(target {ids[worst[0]]}, ref {ref_dz[worst]:.3e}, got {np.asarray(dz)[worst]:.3e})"
    )


KINDS = ["dominant", "near_equal", "p_target_near_1"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("implementation", [XlaLogitsBackend(), "mosaic_interpret"])
def test_extreme_rows_logits(kind, implementation):
    if implementation == "mosaic_interpret":
        implementation, V, n = MOSAIC_LOGITS, 320, 64
    else:
        V, n = 4099, 24
    rng = np.random.default_rng(3)
    z, ids = _extreme_rows(kind, V, n, rng)
    logits = jnp.asarray(z[None])  # [1, T, V] (aligned)
    adv = jnp.asarray([1.0], jnp.float32)
    c = -1.0 / n  # on-policy GRPO: d loss / d logp = -A / n per token

    def f(lg):
        return gmpo_jax.policy_loss_from_logits(
            lg,
            gmpo_jax.PolicyBatch(jnp.asarray(ids[None]), jnp.ones((1, n), bool), adv),
            objective=gmpo_jax.GRPO(),
            implementation=implementation,
        )[0]

    dz = np.asarray(jax.jit(jax.grad(f))(logits))[0]
    _assert_rows(_lib_logits_logp(implementation, z, ids), dz, z, ids, c, f"logits/{kind}")


def _lib_logits_logp(implementation, z, ids):
    """The backend's own log-probs of rows ``z`` (via its ``logprobs`` seam)."""
    logp, _ = implementation.logprobs(
        jnp.asarray(z[None]), jnp.asarray(ids[None]), T=z.shape[0], temperature=jnp.float32(1.0)
    )
    return np.asarray(logp)[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "implementation", [XlaChunkedBackend(vocab_block=256), XlaChunkedBackend()], ids=["xla_chunked_256", "xla_chunked"]
)  # Mosaic head: bf16 only, see the permutation test
def test_extreme_rows_lm_head(kind, implementation):
    """hidden = the rows, weight = identity (exact in float32): the LM head's logits are the rows."""
    V, n = 1031, 24
    rng = np.random.default_rng(4)
    z, ids = _extreme_rows(kind, V, n, rng)
    eye = jnp.eye(V, dtype=jnp.float32)
    cot = jnp.ones((1, n), jnp.float32)

    def f(h):
        return gmpo_jax.fused_linear_logprobs(
            h, eye, jnp.asarray(ids[None]), head=gmpo_jax.HeadOptions(implementation=implementation)
        )

    logp, vjp = jax.vjp(f, jnp.asarray(z[None]))
    (dz,) = vjp(cot)  # d sum(logp) / d z = onehot - p  (c = 1)
    _assert_rows(np.asarray(logp)[0], np.asarray(dz)[0], z, ids, 1.0, f"lm_head/{kind}")


# --------------------------------------------------------------------------------------------------
# (c) jax_enable_x64
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def x64():
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


_WIDE = {np.dtype(t) for t in ("float64", "int64", "uint64", "complex128")}


def _wide_ops(closed):
    """(primitive, aval, source) of every equation of the jaxpr (and sub-jaxprs) with a 64-bit output."""
    return jaxpr_ops(closed, lambda e, aval: getattr(aval, "dtype", None) in _WIDE)


X64_OBJECTIVES = [
    Obj("gmpo", beta=0.1, bias_kl=True),
    Obj("dapo", beta=0.05, delta=1.5),
    Obj("dr_grpo", max_completion_length=9),
    Obj("grpo", level="sequence"),
    Obj("cispo"),
    Obj("sapo"),
]


@pytest.mark.parametrize("obj", X64_OBJECTIVES, ids=str)
def test_x64_lm_head(x64, obj):
    case = make_case(5, dtype=np.float32, with_bias=True, ris="bt")
    batch = gmpo_jax.PolicyBatch(
        case.ids,
        case.mask,
        case.adv,
        old_logps=case.old,
        ref_logps=case.ref,
        rollout_is_ratio=case.ris,
        num_items_in_batch=20.0,
    )
    for impl in ("reference", "xla_chunked"):
        if impl == "reference":
            f = lambda h, w, b: gmpo_jax.reference.policy_loss(h, w, batch, objective=obj.lib(), bias=b)
        else:
            f = lambda h, w, b: gmpo_jax.fused_linear_policy_loss(
                h, w, batch, objective=obj.lib(), bias=b, head=gmpo_jax.HeadOptions(implementation=impl)
            )
        vg = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
        args = (jnp.asarray(case.hidden), jnp.asarray(case.weight), jnp.asarray(case.bias))
        wide = _wide_ops(jax.make_jaxpr(vg)(*args))
        (loss, aux), grads = jax.jit(vg)(*args)
        assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(aux)), impl
        check_against_spec(loss, aux, grads, spec_for(case, obj, num_items_in_batch=20.0), case, obj)
        _assert_no_wide(wide, impl)


@pytest.mark.parametrize("obj", X64_OBJECTIVES[:3], ids=str)
def test_x64_logits(x64, obj):
    rng = np.random.default_rng(6)
    case = _logits_case(rng, B=3, T=5, V=41, dtype=ml_dtypes.bfloat16, dominant_at=np.zeros((3, 6), int), margin=3.0)
    args = [jnp.asarray(case[k]) for k in ("logits", "ids", "mask", "adv", "old", "ref")]

    def f(logits, ids, mask, adv, old, ref):
        return gmpo_jax.policy_loss_from_logits(
            logits,
            gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old, ref_logps=ref),
            objective=obj.lib(),
            implementation="xla",
            temperature=0.9,
        )

    vg = jax.value_and_grad(f, has_aux=True)
    assert _wide_ops(jax.make_jaxpr(vg)(*args)) == []
    (loss, aux), g = jax.jit(vg)(*args)
    assert loss.dtype == jnp.float32 and g.dtype == jnp.bfloat16
    sl, dz = oracle(case, obj, temperature=0.9)
    assert_loss_close(loss, sl.loss, sl.scale, case["logits"].dtype)
    assert_grad_close(np.asarray(g), dz, case["logits"].dtype, "dlogits")


def test_x64_logprobs_and_objectives(x64):
    case = make_case(7, dtype=np.float32, with_bias=True)
    for impl in ("reference", "xla_chunked"):
        if impl == "reference":
            f = lambda h: gmpo_jax.reference.logprobs(
                h, case.weight, case.ids, completion_mask=case.mask, bias=case.bias, temperature=0.7
            )
        else:
            f = lambda h: gmpo_jax.fused_linear_logprobs(
                h,
                case.weight,
                case.ids,
                completion_mask=case.mask,
                bias=case.bias,
                temperature=0.7,
                head=gmpo_jax.HeadOptions(implementation=impl),
            )
        h = jnp.asarray(case.hidden)
        wide = _wide_ops(jax.make_jaxpr(f)(h))
        logp = f(h)
        assert logp.dtype == jnp.float32
        import spec_numpy as spec

        want = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, bias=case.bias, temperature=0.7)
        np.testing.assert_allclose(np.where(case.mask, logp, 0.0), np.where(case.mask, want, 0.0), atol=X64_LOGP_ATOL)
        _assert_no_wide(wide, impl)


def _assert_no_wide(wide, what):
    """No 64-bit operation in the traced program (``wide``: the jaxpr walk's list)."""
    assert wide == [], f"{what}: 64-bit operations under x64: {wide[:3]}"
