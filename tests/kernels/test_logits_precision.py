"""A float32-accurate LM head (``logits_precision``): split-bfloat16 products in the Mosaic kernels (run in the
Pallas interpreter), a float32 ``dz`` for the gradient GEMMs, and the portable path's float32 gradients, against
the float64 oracle (``spec_numpy``).

Tolerances, stated from the arithmetic (``S_r = sum_k |h_rk W_kv|`` maximised over a row's logits):

* ``"float32"`` (three parts, six products): each part holds 8 more significand bits, so a product misses at
  most ``~2**-24`` of ``|h_k W_kv|``; the float32 accumulation over ``P H`` terms adds ``H 2**-24 S`` at worst.
  Log-probs within ``4 (H + 6) 2**-24 S + LOGP_TOL`` (twice the logits' error, in the log-sum-exp and the
  target's logit), gradients (relative norm) within
  ``PREC_GRAD["float32"] = 1e-5``: what the portable float32 path at ``Precision.HIGHEST`` reaches (4e-7 here);
  on the GPU ``PREC_GRAD_GPU`` (tensor-core accumulation, measured).
* ``"bf16x3"`` (two parts, three products): a product misses up to ``3 2**-16`` of ``|h_k W_kv|`` (each
  operand's two parts hold it to ``2**-16``, and ``h_1 W_1`` is dropped); log-probs within
  ``4 * 3 2**-16 S + LOGP_TOL``, gradients within ``1e-4``.
* Without it, 16-bit inputs round every logit's operands to 8 bits: ~3e-2 on these log-probs (asserted, so the
  precision tests cannot pass on a path that ignores the option).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import LOGP_TOL, Obj, check_against_spec, make_case, rel_err

import gmpo_jax
from gmpo_jax._dispatch import UnsupportedConfigError
from gmpo_jax.kernels._lm_head_pipeline import split_terms
from gmpo_jax.lm_head.backend import bf16_parts, with_settings
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend

# The interpreter's time grows with the kernels' CTAs (the dz kernel runs one per vocabulary tile): V = 250 is two
# 128-column tiles, the last partial, and a multiple of neither 64 nor 8 (the weight's zero-padded copy in both
# layouts); the 120 rows pad to one 128-row CTA block.
B, T, H, V = 3, 40, 128, 250
PREC_GRAD = {"float32": 1e-5, "bf16x3": 1e-4}
# On the H200 the split products' float32 accumulation is the tensor cores' (wgmma in the kernels, cuBLAS in
# the gradient GEMMs), not the interpreter's: test_gpu_float32_head_against_float64 measured dh 1.14e-5 there
# (2026-12-01, 24a9a31), above the interpreter's bound; the GPU bound leaves 2.6x over that and is still 100x
# below what bfloat16 rounding gives (~3e-3).
PREC_GRAD_GPU = {"float32": 3e-5, "bf16x3": 1e-4}


def _logp_tol(precision, hidden, weight, layout):
    w = np.asarray(weight, np.float64)
    w = w if layout == "hv" else w.T
    s = np.max(np.abs(np.asarray(hidden, np.float64)) @ np.abs(w))
    per = (H + 6) * 2.0**-24 if precision == "float32" else 3 * 2.0**-16
    return 4 * per * s + LOGP_TOL


def _case(seed, layout="hv", with_bias=False, dtype=np.float32, **shape):
    """``shape``: overrides of the module's ``B, T, H, V``."""
    shape = dict(B=B, T=T, H=H, V=V) | shape
    return make_case(seed, **shape, dtype=dtype, layout=layout, with_bias=with_bias, logit_scale=3.0)


def _grads(case, obj, implementation, precision, softcap=None, chunk_size=None, **shaping):
    """``shaping``: the objective's loss shaping."""
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref)
    head = gmpo_jax.HeadOptions(
        weight_layout=case.layout,
        softcap=softcap,
        logits_precision=precision,
        chunk_size=chunk_size,
        implementation=implementation,
    )

    def f(h, w, b):
        return gmpo_jax.fused_linear_policy_loss(
            h, w, batch, objective=obj.lib(**shaping), bias=b, temperature=0.9, head=head
        )

    argnums = (0, 1) if case.bias is None else (0, 1, 2)
    b = None if case.bias is None else jnp.asarray(case.bias)
    (loss, aux), grads = jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))(
        jnp.asarray(case.hidden), jnp.asarray(case.weight), b
    )
    return loss, aux, tuple(grads) + (None,) * (3 - len(grads))


def _spec(case, obj, **kw):
    return spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, bias=case.bias, weight_layout=case.layout,
        old_logps=case.old, ref_logps=case.ref, temperature=0.9, **obj.spec_kwargs(), **kw,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The split: parts and products
# ------------------------------------------------------------------------------------------------
def test_bf16_parts_hold_the_value():
    """``n`` parts hold ``x`` to ``2**(-8 n)`` relative (round to nearest at each part: half a bfloat16 ulp),
    over float32's normal range; each part is a bfloat16; a bfloat16 input is its own part; ties to even."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=4096) * np.exp2(rng.integers(-60, 60, size=4096))).astype(np.float32)
    x[:4] = [0.0, -0.0, 1.0, -3.5]
    for n in (1, 2, 3):
        parts = bf16_parts(jnp.asarray(x), n)
        assert len(parts) == n and all(p.dtype == jnp.bfloat16 for p in parts)
        total = sum(np.asarray(p, np.float64) for p in parts)
        err = np.abs(total - x.astype(np.float64))
        assert np.all(err <= 2.0 ** (-8 * n) * np.abs(x)), n
    # three parts: float32 exactly (24 significand bits)
    np.testing.assert_array_equal(sum(np.asarray(p, np.float64) for p in bf16_parts(jnp.asarray(x), 3)), x)
    xb = jnp.asarray(x[:8], jnp.bfloat16)
    assert bf16_parts(xb, 3)[0] is xb
    # 1 + 2**-8 is halfway between two bfloat16 values: to even (1.0); 1 + 3 * 2**-8 rounds up
    ties = np.asarray(bf16_parts(jnp.asarray([1 + 2.0**-8, 1 + 3 * 2.0**-8], jnp.float32), 1)[0], np.float64)
    np.testing.assert_array_equal(ties, [1.0, 1 + 2.0**-6])


def test_bf16_parts_keep_nan_and_inf():
    """Every NaN bit pattern stays NaN in every part (CUDA's 0x7FFFFFFF and the sign-set 0xFFFFFFFF would round
    into 0 on the bits); ``+-inf`` keeps its sign in the first part; float16 is exact in two parts."""
    bits = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFF800000, 0x7F800000], np.uint32)
    x = jnp.asarray(bits.view(np.float32))
    parts = [np.asarray(p, np.float32) for p in bf16_parts(x, 3)]
    for p in parts:
        assert np.all(np.isnan(p[:4])), p
    assert parts[0][4] == -np.inf and parts[0][5] == np.inf
    h = np.random.default_rng(1).normal(size=512).astype(np.float16)
    p16 = bf16_parts(jnp.asarray(h), 2)
    np.testing.assert_array_equal(sum(np.asarray(p, np.float64) for p in p16), h.astype(np.float64))


def test_nan_input_gives_nan_not_a_number():
    """A NaN in ``hidden`` (CUDA's bit pattern) gives that token a NaN log-prob and the loss NaN gradients, as
    the portable path does: the split must not turn it into 0."""
    rng = np.random.default_rng(2)
    h = rng.normal(size=(1, 2, 64)).astype(np.float32)
    h[0, 0, 0] = np.array([0x7FFFFFFF], np.uint32).view(np.float32)[0]
    w = (rng.normal(size=(64, 100)) * 0.3).astype(np.float32)  # one vocabulary tile: one CTA per kernel
    ids = np.array([[5, 7]], np.int32)
    be = MosaicGpuBackend(interpret=True)
    lp = np.asarray(
        jax.jit(
            lambda h, w: gmpo_jax.fused_linear_logprobs(
                h, w, ids, head=gmpo_jax.HeadOptions(logits_precision="float32", implementation=be)
            )
        )(h, w)
    )
    assert np.isnan(lp[0, 0]) and np.isfinite(lp[0, 1]), lp

    def loss(h, w):
        return gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, np.ones((1, 2)), np.ones(1, np.float32)),
            objective=gmpo_jax.GRPO(),
            head=gmpo_jax.HeadOptions(logits_precision="bf16x3", implementation=be),
        )[0]

    dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
    assert np.isnan(np.asarray(dw)).any() and np.isnan(np.asarray(dh)[0, 0]).any()


def test_split_terms():
    """The kept products, largest first: six of three parts each (``i + j <= 2``), three of two, one per part of
    a float32 operand against a bfloat16 one."""
    assert split_terms(3, 3, 2) == ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))
    assert split_terms(2, 2, 1) == ((0, 0), (0, 1), (1, 0))
    assert split_terms(1, 3, 2) == ((0, 0), (0, 1), (0, 2))
    assert split_terms(1, 1, 2) == ((0, 0),)
    assert split_terms(2, 2, 2) == ((0, 0), (0, 1), (1, 0), (1, 1))  # float16 operands: exact


# ------------------------------------------------------------------------------------------------
# The public API against the float64 oracle
# ------------------------------------------------------------------------------------------------
# (implementation, precision, layout, bias, objective). The Mosaic cases and test_kernel_logprobs_and_entropy's
# take the four (precision, layout) pairs between them: float32-hv and bf16x3-vh here, float32-vh and bf16x3-hv
# there (test_softcap_and_entropy_term: float32-vh through the policy loss).
CASES = [
    ("mosaic_gpu", "float32", "hv", True, Obj("gmpo", beta=0.04)),
    ("mosaic_gpu", "bf16x3", "vh", False, Obj("grpo")),
    ("xla_chunked", "float32", "vh", True, Obj("dapo")),
]
IMPLS = {"mosaic_gpu": lambda: MosaicGpuBackend(interpret=True), "xla_chunked": lambda: "xla_chunked"}


@pytest.mark.parametrize("impl,precision,layout,with_bias,obj", CASES, ids=str)
def test_float32_head_against_spec(impl, precision, layout, with_bias, obj):
    """float32 hidden and weight: loss, metrics and gradients against float64 within the float32 tolerances
    (``conftest.TOLERANCES``), and the gradients' relative error within ``PREC_GRAD``."""
    case = _case(CASES.index((impl, precision, layout, with_bias, obj)), layout, with_bias)
    want = _spec(case, obj)
    assert want.margin > 1e-4, "test setup: a ratio sits within 1e-4 of a bound"
    loss, aux, grads = _grads(case, obj, IMPLS[impl](), precision)
    check_against_spec(loss, aux, grads, want, case, obj)
    for g, w in zip(grads, (want.dhidden, want.dweight, want.dbias)):
        if w is not None and g is not None:
            assert rel_err(g, w) <= PREC_GRAD[precision], (precision, rel_err(g, w))


@pytest.mark.parametrize("precision,layout", [("float32", "vh"), ("bf16x3", "hv")])
def test_kernel_logprobs_and_entropy(precision, layout):
    """Log-probs and entropies of float32 inputs from the kernels within the stated (worst-case) bound of
    float64; the same inputs rounded to bfloat16 (the kernels' only path without ``logits_precision``: exact
    products of the rounded inputs, float64 here) are 20 times further off than the split products."""
    case = _case(10 + (layout == "vh") + 2 * (precision == "bf16x3"), layout)
    kw = dict(bias=None, temperature=0.9, weight_layout=layout)
    want_lp = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, **kw)
    want_h = spec.spec_entropy(case.hidden, case.weight, case.mask, **kw)
    be = MosaicGpuBackend(interpret=True)
    lp, ent = gmpo_jax.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.ids,
        completion_mask=case.mask,
        temperature=0.9,
        return_entropy=True,
        head=gmpo_jax.HeadOptions(weight_layout=layout, logits_precision=precision, implementation=be),
    )
    tol = _logp_tol(precision, case.hidden, case.weight, layout) / 0.9
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(ent), want_h, rtol=0, atol=tol)
    rounded = spec.spec_logprobs(
        np.asarray(case.hidden, jnp.bfloat16), np.asarray(case.weight, jnp.bfloat16), case.ids, case.mask, **kw
    )
    err = np.max(np.abs(np.asarray(lp) - want_lp))
    assert np.max(np.abs(np.asarray(rounded) - want_lp)) > 20 * max(err, 1e-6), err


def test_bf16_hidden_float32_weight():
    """Mixed inputs (bfloat16 activations, a float32 master weight): the kernels split only the weight (three
    products); the float32 weight gradient is float32-accurate and the bfloat16 hidden gradient is the float64
    one rounded (relative error within bfloat16's rounding)."""
    case = _case(20)
    case.hidden = case.hidden.astype(jnp.bfloat16)
    obj = Obj("gmpo")
    want = _spec(case, obj)
    _, _, (dh, dw, _) = _grads(case, obj, MosaicGpuBackend(interpret=True), "float32")
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert rel_err(dw, want.dweight) <= PREC_GRAD["float32"], rel_err(dw, want.dweight)
    assert rel_err(dh, want.dhidden) <= 2.0**-8, rel_err(dh, want.dhidden)


def test_bf16_inputs_float32_dz():
    """bfloat16 inputs with ``"float32"``: the products are the same exact ones, but ``dz`` stays float32 for the
    GEMMs, so the float32 weight-gradient accumulator (several chunks) is float32-accurate before its last
    rounding: the bfloat16 gradients come back within bfloat16's own rounding of float64 (relative 2**-8), and
    closer than the default path's."""
    # two chunks of one sequence; one vocabulary tile (one CTA per kernel: the accumulation is over the chunks)
    case = _case(21, dtype=jnp.bfloat16, B=2, V=120)
    obj = Obj("grpo")
    want = _spec(case, obj)
    be = MosaicGpuBackend(interpret=True)
    errs = {}
    for precision in (None, "float32"):
        _, _, (dh, dw, _) = _grads(case, obj, be, precision, chunk_size=1)
        assert dh.dtype == dw.dtype == jnp.bfloat16
        errs[precision] = (rel_err(dh, want.dhidden), rel_err(dw, want.dweight))
    assert max(errs["float32"]) <= 2.0**-8, errs
    assert sum(errs["float32"]) < sum(errs[None]), errs


def test_float16_inputs():
    """float16 inputs split into two bfloat16 parts (exact; four products): log-probs float32-accurate for
    those inputs."""
    case = _case(23, dtype=np.float16)
    kw = dict(bias=None, temperature=0.9, weight_layout="hv")
    want = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, **kw)
    lp = gmpo_jax.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.ids,
        completion_mask=case.mask,
        temperature=0.9,
        head=gmpo_jax.HeadOptions(logits_precision="float32", implementation=MosaicGpuBackend(interpret=True)),
    )
    np.testing.assert_allclose(np.asarray(lp), want, rtol=0, atol=_logp_tol("float32", case.hidden, case.weight, "hv"))


def test_softcap_and_entropy_term():
    """``logits_precision`` with the other features that change the kernels' epilogues: the soft cap and the
    entropy term (float32 inputs, against float64)."""
    case = _case(22, "vh")
    obj = Obj("grpo", beta=0.02)
    want = _spec(case, obj, softcap=4.0, entropy_coef=0.03)
    loss, aux, grads = _grads(case, obj, MosaicGpuBackend(interpret=True), "float32", softcap=4.0, entropy_coef=0.03)
    check_against_spec(loss, aux, grads, want, case, obj)
    assert rel_err(grads[1], want.dweight) <= PREC_GRAD["float32"]


# ------------------------------------------------------------------------------------------------
# Errors and dispatch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,err", [("fp32", ValueError), ("FLOAT32", ValueError), (32, TypeError), (True, TypeError)]
)
def test_bad_logits_precision_raises(value, err):
    case = _case(30)
    with pytest.raises(err, match="logits_precision"):
        gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv),
            objective=gmpo_jax.GMPO(),
            head=gmpo_jax.HeadOptions(logits_precision=value),
        )
    with pytest.raises(err, match="logits_precision"):
        gmpo_jax.fused_linear_logprobs(
            case.hidden,
            case.weight,
            case.ids,
            completion_mask=case.mask,
            head=gmpo_jax.HeadOptions(logits_precision=value),
        )


def test_float32_kernels_need_the_option():
    """Asked for explicitly, the kernels refuse float32 inputs without ``logits_precision`` (naming it) and take
    them with it."""
    case = _case(31)
    be = MosaicGpuBackend(interpret=True)
    with pytest.raises(UnsupportedConfigError, match="logits_precision"):
        gmpo_jax.fused_linear_logprobs(
            case.hidden, case.weight, case.ids, completion_mask=case.mask, head=gmpo_jax.HeadOptions(implementation=be)
        )
    lp = gmpo_jax.fused_linear_logprobs(
        case.hidden[:1, :4],
        case.weight,
        case.ids[:1, :4] % V,
        head=gmpo_jax.HeadOptions(logits_precision="bf16x3", implementation=be),
    )
    assert lp.shape == (1, 4) and np.all(np.isfinite(np.asarray(lp)))


# ------------------------------------------------------------------------------------------------
# CUDA lowering (no GPU needed) and the GPU check
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,layout,dtypes,precision",
    [
        ((896, 151936), "hv", ("float32", "float32"), "float32"),
        ((4096, 128256), "vh", ("bfloat16", "float32"), "float32"),
        ((896, 151936), "vh", ("float32", "float32"), "bf16x3"),
    ],
    ids=["qwen-f32", "llama-mixed", "qwen-bf16x3"],
)
def test_kernels_lower_for_cuda(monkeypatch, shape, layout, dtypes, precision):
    """Both kernels with split operands and the float32 dz lower to Mosaic GPU for CUDA (jax.export on the CPU):
    shared memory of the ``grad_f32`` blocks, the bulk copies' offsets into the parts, at the Qwen2.5-0.5B and
    Llama-3-8B heads."""
    from gmpo_jax.lm_head import mosaic_gpu

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    Hh, Vv = shape
    R = 4096
    be = with_settings(MosaicGpuBackend(), logits_precision=precision)
    h = jax.ShapeDtypeStruct((R, Hh), jnp.dtype(dtypes[0]))
    w = jax.ShapeDtypeStruct((Hh, Vv) if layout == "hv" else (Vv, Hh), jnp.dtype(dtypes[1]))
    i = jax.ShapeDtypeStruct((R,), jnp.int32)
    f = jax.ShapeDtypeStruct((R,), jnp.float32)
    t = jnp.float32(0.9)
    fwd = jax.jit(lambda h, w, i: be.logprobs(h, w, None, i, t, weight_layout=layout, with_entropy=True))
    jax.export.export(fwd, platforms=["cuda"])(h, w, i)
    bwd = jax.jit(
        lambda h, w, i, d, l: be.grads(h, w, None, i, d, l, t, weight_layout=layout, dw_acc=None, db_acc=None)
    )
    jax.export.export(bwd, platforms=["cuda"])(h, w, i, f, f)


@pytest.mark.gpu
@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a Hopper GPU")
@pytest.mark.parametrize("precision", ["float32", "bf16x3"])
def test_gpu_float32_head_against_float64(precision):
    """Compiled kernels at the Qwen2.5-0.5B head (H 896, V 151936), float32 inputs, 2048 tokens: log-probs and
    gradients against float64 (NumPy) within the stated bounds, and the portable float32 path beside them."""
    rng = np.random.default_rng(0)
    Hq, Vq, R = 896, 151936, 2048
    h = rng.normal(size=(1, R, Hq)).astype(np.float32)
    w = (rng.normal(size=(Hq, Vq)) * (3.0 / np.sqrt(Hq))).astype(np.float32)
    ids = rng.integers(0, Vq, size=(1, R)).astype(np.int32)
    z = h[0].astype(np.float64) @ w.astype(np.float64)
    m = z.max(1, keepdims=True)
    p = np.exp(z - m)
    lse = m[:, 0] + np.log(p.sum(1))
    want = z[np.arange(R), ids[0]] - lse
    s = np.max(np.abs(h[0]).astype(np.float64) @ np.abs(w).astype(np.float64))
    per = (Hq + 6) * 2.0**-24 if precision == "float32" else 3 * 2.0**-16
    lp = gmpo_jax.fused_linear_logprobs(
        h, w, ids, head=gmpo_jax.HeadOptions(logits_precision=precision, implementation="mosaic_gpu")
    )
    np.testing.assert_allclose(np.asarray(lp[0], np.float64), want, rtol=0, atol=4 * per * s + LOGP_TOL)
    # d(sum logp)/dh = W[:, id] - p W^T, d/dW = h^T (onehot - p)
    p /= p.sum(1, keepdims=True)
    dz = -p
    dz[np.arange(R), ids[0]] += 1.0
    want_dh, want_dw = dz @ w.T.astype(np.float64), h[0].T.astype(np.float64) @ dz
    dh, dw = jax.grad(
        lambda h, w: gmpo_jax.fused_linear_logprobs(
            h, w, ids, head=gmpo_jax.HeadOptions(logits_precision=precision, implementation="mosaic_gpu")
        ).sum(),
        argnums=(0, 1),
    )(jnp.asarray(h), jnp.asarray(w))
    assert rel_err(dh[0], want_dh) <= PREC_GRAD_GPU[precision], rel_err(dh[0], want_dh)
    assert rel_err(dw, want_dw) <= PREC_GRAD_GPU[precision], rel_err(dw, want_dw)
