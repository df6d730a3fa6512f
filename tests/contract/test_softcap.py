"""Gemma's final-logit soft cap (``softcap``): ``z = c tanh((h W + b) / c) / temperature`` on every LM-head
path (portable XLA, the Mosaic kernels in the interpreter, the kept-logits gradient path, vocabulary
parallel), against the float64 oracle (``spec_numpy``: the cap and its chain rule by hand).

Inputs are scaled so that many logits sit in the cap's curved part (``|h W| ~ c``), where an
implementation that forgot the cap in either pass would be far off. Tolerances: ``conftest.TOLERANCES``;
log-probs and entropies ``conftest.LOGP_TOL`` / ``ENTROPY_TOL`` times ``1 + max|z|`` (the in-kernel tanh is
exact to an ulp of 1, ``c * 1e-7`` on a logit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import DTYPES, ENTROPY_TOL, LOGP_TOL, Obj, check_against_spec, make_case

import gmpo_jax
from gmpo_jax.lm_head.backend import with_settings
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend

CAP = 3.0
B, T, H, V = 4, 6, 64, 200


def _case(seed, dtype="float32", layout="hv", with_bias=False):
    # logit scale 6 (~2 c): the cap bends most logits
    return make_case(seed, B=B, T=T, H=H, V=V, dtype=DTYPES[dtype], layout=layout, with_bias=with_bias, logit_scale=6.0)


def _spec(case, obj: Obj, temperature=1.0):
    return spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, bias=case.bias, weight_layout=case.layout,
        old_logps=case.old, ref_logps=case.ref, temperature=temperature, softcap=CAP, **obj.spec_kwargs(),
    )  # fmt: skip


def _loss(case, obj: Obj, implementation, temperature=1.0):
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref)
    head = gmpo_jax.HeadOptions(weight_layout=case.layout, softcap=CAP, implementation=implementation)

    def f(h, w, b):
        return gmpo_jax.fused_linear_policy_loss(
            h, w, batch, objective=obj.lib(), bias=b, temperature=temperature, head=head
        )

    argnums = (0, 1) if case.bias is None else (0, 1, 2)
    (loss, aux), grads = jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))(
        jnp.asarray(case.hidden), jnp.asarray(case.weight), None if case.bias is None else jnp.asarray(case.bias)
    )
    return loss, aux, tuple(grads) + (None,) * (3 - len(grads))


IMPLS = {
    "xla_chunked": lambda: "xla_chunked",
    "reference": None,
    "mosaic_gpu": lambda: MosaicGpuBackend(interpret=True),
    "mosaic_gpu_kept": lambda: MosaicGpuBackend(interpret=True, save_min_hidden=0),  # dz from the kept logits
}
CASES = [
    ("xla_chunked", "float32", "hv", True, Obj("gmpo", beta=0.04)),
    ("xla_chunked", "bfloat16", "vh", False, Obj("grpo")),
    ("reference", "float32", "vh", True, Obj("dapo", level="sequence")),
    ("mosaic_gpu", "bfloat16", "hv", True, Obj("gmpo")),
    ("mosaic_gpu", "bfloat16", "vh", False, Obj("grpo", beta=0.04)),
    ("mosaic_gpu_kept", "bfloat16", "hv", False, Obj("gmpo")),
    ("mosaic_gpu_kept", "bfloat16", "vh", True, Obj("sapo")),
]


@pytest.mark.parametrize("impl,dtype,layout,with_bias,obj", CASES, ids=lambda x: str(x))
def test_policy_loss_against_spec(impl, dtype, layout, with_bias, obj):
    case = _case(CASES.index((impl, dtype, layout, with_bias, obj)), dtype, layout, with_bias)
    want = _spec(case, obj, temperature=0.8)
    assert want.margin > 1e-4, "test setup: a ratio sits within 1e-4 of a bound"
    if impl == "reference":
        f = lambda h, w, b: gmpo_jax.reference.policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
            objective=obj.lib(),
            bias=b,
            temperature=0.8,
            head=gmpo_jax.HeadOptions(weight_layout=layout, softcap=CAP),
        )
        (loss, aux), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(case.hidden, case.weight, case.bias)
    else:
        loss, aux, grads = _loss(case, obj, IMPLS[impl](), temperature=0.8)
    check_against_spec(loss, aux, grads, want, case, obj)


@pytest.mark.parametrize("impl", ["xla_chunked", "mosaic_gpu"])
def test_logprobs_and_entropy(impl):
    case = _case(20, "bfloat16" if impl == "mosaic_gpu" else "float32")
    kw = dict(bias=None, temperature=0.7, weight_layout="hv", softcap=CAP)
    want_lp = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, **kw)
    want_h = spec.spec_entropy(case.hidden, case.weight, case.mask, **kw)
    lp, ent = gmpo_jax.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.ids,
        completion_mask=case.mask,
        temperature=0.7,
        return_entropy=True,
        head=gmpo_jax.HeadOptions(softcap=CAP, implementation=IMPLS[impl]()),
    )
    zmax = CAP / 0.7
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=0, atol=LOGP_TOL * (1 + zmax))
    np.testing.assert_allclose(np.asarray(ent), want_h, rtol=0, atol=ENTROPY_TOL * (1 + zmax))
    # the cap changes the answer (the test would pass an implementation that ignored it otherwise)
    plain = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, bias=None, temperature=0.7)
    assert np.max(np.abs(plain - want_lp)) > 100 * LOGP_TOL * (1 + zmax)


@pytest.mark.parametrize("cap", [1e-3, 1e6])
def test_kernel_cap_far_from_the_logits(cap):
    """A cap far below or far above the logits (``|x| ~ 16``): the kernels' tanh stays float32-accurate
    (the exp2 form alone lost ``cap * 1e-7`` absolutely: 0.1 nats at ``cap = 1e6``)."""
    case = _case(21, "bfloat16")
    kw = dict(bias=None, temperature=0.7, weight_layout="hv", softcap=cap)
    want = spec.spec_logprobs(case.hidden, case.weight, case.ids, case.mask, **kw)
    lp = gmpo_jax.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.ids,
        completion_mask=case.mask,
        temperature=0.7,
        head=gmpo_jax.HeadOptions(softcap=cap, implementation=MosaicGpuBackend(interpret=True)),
    )
    zmax = min(cap, 20.0) / 0.7
    np.testing.assert_allclose(np.asarray(lp), want, rtol=0, atol=LOGP_TOL * (1 + zmax))


def test_kernels_lower_for_cuda(monkeypatch):
    """Both kernels with the cap (tanh from exp2 in the epilogue, the kept-logits path's derivative) lower
    to Mosaic GPU for CUDA (jax.export on the CPU), at the Gemma-2-2B head (H 2304, V 256000)."""
    from gmpo_jax.lm_head import mosaic_gpu
    from gmpo_jax.lm_head.vjp import SAVED_LOGITS_SLACK

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    R, Hg, Vg = 4096, 2304, 256000
    be = with_settings(MosaicGpuBackend(save_min_hidden=0), softcap=30.0)
    h = jax.ShapeDtypeStruct((R, Hg), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((Vg, Hg), jnp.bfloat16)
    i = jax.ShapeDtypeStruct((R,), jnp.int32)
    f = jax.ShapeDtypeStruct((R,), jnp.float32)
    acc = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    t = jnp.float32(0.9)
    fwd = jax.jit(lambda h, w, i: be.logprobs(h, w, None, i, t, weight_layout="vh", with_entropy=True))
    jax.export.export(fwd, platforms=["cuda"])(h, w, i)
    bwd = jax.jit(lambda h, w, i, d, l, a: be.grads(h, w, None, i, d, l, t, weight_layout="vh", dw_acc=a, db_acc=None))
    jax.export.export(bwd, platforms=["cuda"])(h, w, i, f, f, acc)

    def kept(h, w, i, d):
        _, lse, saved = be.logprobs_for_grads(
            h, w, None, i, t, weight_layout="vh", budget_bytes=4 * Hg * Vg + SAVED_LOGITS_SLACK
        )
        assert saved is not None
        return be.grads(h, w, None, i, d, lse, t, weight_layout="vh", dw_acc=None, db_acc=None, saved=saved)

    jax.export.export(jax.jit(kept), platforms=["cuda"])(h, w, i, f)


@pytest.mark.parametrize(
    "cap,err", [(0.0, ValueError), (float("inf"), ValueError), (True, TypeError), (jnp.float32(30.0), TypeError)]
)
def test_bad_softcap_raises(cap, err):
    case = _case(0)
    with pytest.raises(err, match="softcap"):
        gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv),
            objective=gmpo_jax.GMPO(),
            head=gmpo_jax.HeadOptions(softcap=cap),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a Hopper GPU")
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_gpu_gemma2_head(kept):
    """Compiled kernels at Gemma-2-2B's head (H 2304, V 256000, tied ``[V, H]``, cap 30) against the
    portable path on the same GPU: log-probs within ``LSE_VS_XLA`` (times ``1 + max|z|``), the policy loss's
    gradients within ``GRAD_REL_XLA`` (relative norm), with the gradient pass recomputing the logits or
    reading the kept ones."""
    from conftest import GRAD_REL_XLA, LSE_VS_XLA

    R, Hg, Vg, cap = 2048, 2304, 256000, 30.0
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(1, R, Hg)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(Vg, Hg)) * (25.0 / np.sqrt(Hg)), jnp.bfloat16)  # |x| ~ 25: the cap bends
    ids = jnp.asarray(rng.integers(0, Vg, (1, R)), jnp.int32)
    mask = jnp.ones((1, R), bool)
    adv = jnp.asarray([0.7], jnp.float32)
    impl = MosaicGpuBackend(save_min_hidden=0 if kept else 10**9)

    def run(implementation):
        f = lambda h, w: gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, mask, adv),
            objective=gmpo_jax.GMPO(),
            head=gmpo_jax.HeadOptions(weight_layout="vh", softcap=cap, implementation=implementation),
        )
        lp = gmpo_jax.fused_linear_logprobs(
            h, w, ids, head=gmpo_jax.HeadOptions(weight_layout="vh", softcap=cap, implementation=implementation)
        )
        return lp, jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)

    lp, ((loss, _), (dh, dw)) = run(impl)
    lp_x, ((loss_x, _), (dh_x, dw_x)) = run("xla_chunked")
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp_x), rtol=0, atol=LSE_VS_XLA * (1.0 + cap))
    rel = lambda a, b: float(  # noqa: E731
        np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
        / np.linalg.norm(np.asarray(b, np.float32))
    )
    assert abs(float(loss) - float(loss_x)) <= 1e-5 * abs(float(loss_x))
    assert rel(dh, dh_x) < GRAD_REL_XLA and rel(dw, dw_x) < GRAD_REL_XLA, (rel(dh, dh_x), rel(dw, dw_x))
