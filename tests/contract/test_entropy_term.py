"""The entropy term of the loss (``entropy_coef``): ``loss += -c * sum_{b,t} w H / denominator``, ``w`` the
objective's KL aggregation (per-sequence mean for gmpo / grpo / sapo, token sum for the others), with the
exact gradient ``dH/dz = -p (log p + H) / T``, on every path, against the float64 oracle (``spec_numpy``:
the term and its gradient by hand). Zero-advantage sequences are in every case, so row skipping must keep
the rows whose only gradient is the entropy's. Tolerances: ``conftest.TOLERANCES``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import (
    DTYPES,
    SAVED_REL,
    Obj,
    assert_grad_close,
    assert_loss_close,
    check_against_spec,
    make_case,
    rel_err,
)

import gmpo_jax
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

B, T, H, V = 5, 7, 64, 200
C = 0.07  # the coefficient: large enough that the term moves the gradient by tens of percent


def _case(seed, dtype="float32", V=V):
    adv = np.array([0.9, 0.0, -0.6, 0.0, 1.3], np.float32)  # two zero-advantage sequences
    return make_case(seed, B=B, T=T, H=H, V=V, dtype=DTYPES[dtype], adv=adv)


def _spec(case, obj: Obj, temperature=0.8, c=C):
    return spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref,
        temperature=temperature, entropy_coef=c, **obj.spec_kwargs(),
    )  # fmt: skip


OBJECTIVES = [
    Obj("gmpo", beta=0.04),
    Obj("grpo"),
    Obj("dapo", level="sequence"),
    Obj("cispo", epsilon_high=1.3),
    Obj("sapo"),
]
IMPLS = {
    "xla_chunked": lambda: "xla_chunked",
    "mosaic_gpu": lambda: MosaicGpuBackend(interpret=True),
    "mosaic_gpu_skip": lambda: MosaicGpuBackend(interpret=True, row_buckets=4),
    "mosaic_gpu_keep": lambda: MosaicGpuBackend(interpret=True, save_min_hidden=0),  # kept logits at any H
    "mosaic_gpu_keep_skip": lambda: MosaicGpuBackend(interpret=True, save_min_hidden=0, row_buckets=4),
}


@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
@pytest.mark.parametrize("impl", ["xla_chunked", "reference"])
def test_lm_head(obj, impl):
    case = _case(OBJECTIVES.index(obj))
    want = _spec(case, obj)
    assert want.margin > 1e-4
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref)
    kw = dict(objective=obj.lib(entropy_coef=C), temperature=0.8)
    if impl == "reference":
        f = lambda h, w: gmpo_jax.reference.policy_loss(h, w, batch, **kw)  # noqa: E731
    else:
        head = gmpo_jax.HeadOptions(implementation=IMPLS[impl](), chunk_size=2)
        f = lambda h, w: gmpo_jax.fused_linear_policy_loss(h, w, batch, head=head, **kw)  # noqa: E731
    (loss, aux), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(case.hidden, case.weight)
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


@pytest.mark.parametrize(
    "obj, impl",
    [
        (Obj("grpo", beta=0.04), "mosaic_gpu"),
        (Obj("gmpo"), "mosaic_gpu_skip"),
        (Obj("grpo", beta=0.04), "mosaic_gpu_keep"),
        (Obj("gmpo"), "mosaic_gpu_keep_skip"),
    ],
    ids=lambda x: str(x),
)
def test_kernels_in_the_interpreter(obj, impl):
    """The kernels (dz kernel's entropy epilogue; with ``mosaic_gpu_keep*`` the log-prob kernel keeps every
    logits tile and dz is built from them with the entropy term, ``_skip``: on the live rows' prefix)
    against the float64 spec. The kernels see per-row coefficients only (the objective is evaluated
    outside them), so each backend runs once: the skipping ones with GMPO without a KL term, where the
    zero-advantage sequences' only gradient is the entropy's (rows the skip must keep), the others with
    GRPO and its KL term (every row live)."""
    case = _case(11, "bfloat16")
    if impl.startswith("mosaic_gpu_keep"):
        be = IMPLS[impl]()
        assert be.keeps_logits(rows=B * T, H=H, V=V, weight_dtype=jnp.bfloat16, budget_bytes=2**30)
    want = _spec(case, obj)
    f = lambda h, w: gmpo_jax.fused_linear_policy_loss(
        h,
        w,
        gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
        objective=obj.lib(entropy_coef=C),
        temperature=0.8,
        head=gmpo_jax.HeadOptions(implementation=IMPLS[impl]()),
    )
    (loss, aux), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(case.hidden, case.weight)
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


def test_traced_coefficient_and_zero():
    """A traced coefficient does not recompile; 0 gives the loss without the term."""
    case = _case(3)
    obj = Obj("grpo")
    f = jax.jit(
        lambda c: gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
            objective=obj.lib(entropy_coef=c),
            temperature=0.8,
        )[0]
    )
    assert_loss_close(f(jnp.float32(C)), _spec(case, obj).loss, _spec(case, obj).scale, np.float32)
    assert_loss_close(f(jnp.float32(0.0)), _spec(case, obj, c=0.0).loss, _spec(case, obj).scale, np.float32)


@pytest.mark.parametrize(
    "obj,impl",
    [(o, "xla") for o in (Obj("gmpo"), Obj("grpo"), Obj("dapo"))]
    + [(Obj("grpo"), "mosaic_gpu_fused"), (Obj("gmpo"), "mosaic_gpu")],
    ids=str,
)
def test_logits(obj, impl):
    Vl = 2048
    case = _case(5, V=Vl)
    z = np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)
    logits = np.concatenate([z, z[:, :1]], axis=1).astype(np.float32)
    want = _spec(case, obj)
    # the oracle's dz from its head VJP: hidden = I (logits = hidden @ I) is too large; rebuild dz directly
    zt = z / 0.8
    ls = zt - zt.max(-1, keepdims=True)
    ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
    p = np.exp(ls)
    onehot = np.arange(Vl) == np.where(case.mask, case.ids, -1)[..., None]
    mf = case.mask.astype(np.float64)
    w = mf / np.maximum(mf.sum(1, keepdims=True), 1.0) if obj.loss_type in ("grpo", "gmpo") else mf
    ent = -(p * ls).sum(-1, keepdims=True)
    ge = (-C * w / want.metrics["loss_denominator"])[..., None]
    dz = np.where(case.mask[..., None], want.dlogp[..., None] * (onehot - p) + ge * (-p * (ls + ent)), 0.0) / 0.8
    dwant = np.zeros(logits.shape)
    dwant[:, :T] = dz
    implementation = {
        "xla": "xla",
        "mosaic_gpu": MosaicGpuLogitsBackend(interpret=True, fused=False),
        "mosaic_gpu_fused": MosaicGpuLogitsBackend(interpret=True),
    }[impl]
    f = lambda x: gmpo_jax.policy_loss_from_logits(
        x,
        gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
        objective=obj.lib(entropy_coef=C),
        temperature=0.8,
        implementation=implementation,
    )
    (loss, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logits))
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    assert_loss_close(
        aux.loss_numerator, want.metrics["loss_numerator"], want.scale * want.metrics["loss_denominator"], np.float32
    )
    assert_grad_close(np.asarray(g), dwant, np.float32, "dlogits")


def test_kept_logits_match_the_recompute():
    """``grads(saved=..., entropy=...)``: the entropy term's ``dz`` built from kept (float16) logits tiles, for
    the leading tile kept and the rest recomputed, and for every tile kept, against the dz kernel's recompute
    (``SAVED_REL``: float16 logits put ``p`` off by at most ``p |ln p| 2**-11``) and the float64 oracle."""
    rng = np.random.default_rng(5)
    R, Hk, Vk, t = 128, 64, 300, jnp.float32(0.8)
    h = jnp.asarray(rng.normal(size=(R, Hk)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(Vk, Hk)) * 0.3, jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, Vk, R), jnp.int32)
    dlogp = jnp.asarray(rng.normal(size=R) * (rng.random(R) < 0.7), jnp.float32)
    gamma = jnp.asarray(rng.normal(size=R) * 0.1, jnp.float32)
    be = MosaicGpuBackend(interpret=True, save_min_hidden=0)
    logp, lse, ent = be.logprobs(h, w, None, ids, t, weight_layout="vh", with_entropy=True)
    kw = dict(weight_layout="vh", dw_acc=None, db_acc=None, entropy=(gamma, ent))
    dh, dw, _ = be.grads(h, w, None, ids, dlogp, lse, t, **kw)
    want_dh, want_dw, _ = spec.spec_head_vjp(
        h[None], w, ids[None], None, dlogp[None], temperature=0.8, weight_layout="vh", dentropy=gamma[None]
    )
    want_dh = want_dh[0]
    assert rel_err(dh, want_dh) < 1e-2 and rel_err(dw, want_dw) < 1e-2  # bf16 outputs and dz
    for save_tiles in (1, None):  # the leading tile kept, the rest recomputed; every tile kept
        if save_tiles is None:
            *stats, saved = be.logprobs_for_grads(
                h, w, None, ids, t, weight_layout="vh", budget_bytes=2**30, with_entropy=True
            )
            assert saved is not None and saved.d.shape[1] >= Vk
        else:
            stats, saved, _ = be._logprobs(h, w, None, ids, t, weight_layout="vh", with_entropy=True, save_tiles=1)
            assert saved.m.shape[0] == 1 and saved.d.shape[1] < Vk
        for a, b in zip(stats, (logp, lse, ent)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        dh_s, dw_s, _ = be.grads(h, w, None, ids, dlogp, lse, t, saved=saved, **kw)
        assert rel_err(dh_s, dh) < SAVED_REL and rel_err(dw_s, dw) < SAVED_REL, (rel_err(dh_s, dh), rel_err(dw_s, dw))
        assert rel_err(dh_s, want_dh) < 1e-2 and rel_err(dw_s, want_dw) < 1e-2


@pytest.mark.parametrize(
    "c,err", [(float("nan"), ValueError), (True, TypeError), (np.ones(2), TypeError), ("0.1", TypeError)]
)
def test_bad_coefficient_raises(c, err):
    case = _case(0)
    with pytest.raises(err, match="entropy_coef"):
        gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv),
            objective=gmpo_jax.GMPO(entropy_coef=c),
        )


def _abstract_head(R, H, V):
    """Shapes of ``R`` rows of bf16 hidden states, an ``[H, V]`` bf16 weight, int32 ids and a float32 row vector."""
    return (
        jax.ShapeDtypeStruct((R, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
        jax.ShapeDtypeStruct((R,), jnp.int32),
        jax.ShapeDtypeStruct((R,), jnp.float32),
    )


def test_kernel_lowers_for_cuda(monkeypatch):
    """The dz kernel with the entropy term (two more row inputs, ``p (log p + H)`` in the epilogue) lowers to
    Mosaic GPU for CUDA at Qwen2.5-0.5B's head (jax.export on the CPU)."""
    from gmpo_jax.lm_head import mosaic_gpu

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    be = MosaicGpuBackend()
    h, w, i, f = _abstract_head(4096, 896, 151936)
    acc = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    bwd = jax.jit(
        lambda h, w, i, d, l, g, e, a: be.grads(
            h, w, None, i, d, l, jnp.float32(0.9), weight_layout="hv", dw_acc=a, db_acc=None, entropy=(g, e)
        )
    )
    jax.export.export(bwd, platforms=["cuda"])(h, w, i, f, f, f, f, acc)


def test_kept_logits_lower_for_cuda(monkeypatch):
    """At Llama-3-8B's head (H 4096, V 128256; 8192 rows), where a single chunk keeps its logits: the log-prob
    kernel with the entropy statistic and the kept tiles together, and the gradient pass building dz with the
    entropy term from them, lower to Mosaic GPU for CUDA (jax.export on the CPU)."""
    from gmpo_jax.lm_head import mosaic_gpu, vjp

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    R, Hl, Vl = 8192, 4096, 128256
    be = MosaicGpuBackend()
    h, w, i, f = _abstract_head(R, Hl, Vl)
    budget = vjp._saved_budget(jnp.zeros((1,), jnp.bfloat16)) + 4 * Hl * Vl
    assert be.save_plan(rows=R, H=Hl, V=Vl, budget_bytes=budget) > 0

    def step(h, w, i, d, g):
        t = jnp.float32(0.9)
        logp, lse, ent, saved = be.logprobs_for_grads(
            h, w, None, i, t, weight_layout="hv", budget_bytes=budget, with_entropy=True
        )
        assert saved is not None
        return be.grads(h, w, None, i, d, lse, t, weight_layout="hv", dw_acc=None, db_acc=None, saved=saved,
                        entropy=(g, ent))  # fmt: skip

    jax.export.export(jax.jit(step), platforms=["cuda"])(h, w, i, f, f)


@pytest.mark.gpu
@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a Hopper GPU")
def test_gpu_qwen_head():
    """Compiled kernels with the entropy term at Qwen2.5-0.5B's head (H 896, V 151936; 2048 rows, half of
    the sequences with advantage 0, row skipping on) against the portable path on the same GPU: loss within
    1e-5 relative, gradients within ``GRAD_REL_XLA`` (relative norm)."""
    from conftest import GRAD_REL_XLA

    Bq, Tq, Hq, Vq = 4, 512, 896, 151936
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(Bq, Tq, Hq)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(Hq, Vq)) * (3.0 / np.sqrt(Hq)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, Vq, (Bq, Tq)), jnp.int32)
    mask = jnp.asarray(np.arange(Tq)[None] < np.array([512, 300, 512, 100])[:, None])
    adv = jnp.asarray([0.8, 0.0, -0.5, 0.0], jnp.float32)

    def run(implementation):
        f = lambda h, w: gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, mask, adv),
            objective=gmpo_jax.GMPO(entropy_coef=0.01),
            head=gmpo_jax.HeadOptions(implementation=implementation),
        )
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)

    (loss, _), (dh, dw) = run(MosaicGpuBackend(row_buckets=4))
    (loss_x, _), (dh_x, dw_x) = run("xla_chunked")
    rel = lambda a, b: float(  # noqa: E731
        np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
        / np.linalg.norm(np.asarray(b, np.float32))
    )
    assert abs(float(loss) - float(loss_x)) <= 1e-5 * abs(float(loss_x))
    assert rel(dh, dh_x) < GRAD_REL_XLA and rel(dw, dw_x) < GRAD_REL_XLA, (rel(dh, dh_x), rel(dw, dw_x))
