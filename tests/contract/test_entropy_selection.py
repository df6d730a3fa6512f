"""High-entropy token selection (``top_entropy_quantile``): only the tokens whose entropy is at or above
the ``1 - q`` quantile of the unmasked tokens' entropies receive policy gradient (token-level objectives:
their policy term times 0, as TRL; GMPO: they stay in the geometric mean without gradient).

Against the float64 oracle (``spec_numpy.spec_policy_loss(top_entropy_quantile=...)``: float64 entropies,
``np.quantile``), both ops, the Mosaic kernels in the interpreter, and the threshold metric. ``q`` is
chosen so that the quantile falls between two tokens' entropies (the oracle's margin covers it), so float32
entropies select the same tokens. Tolerances: ``conftest.TOLERANCES``; the threshold: float32 entropies
(``conftest.ENTROPY_TOL`` times ``1 + max|z|``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import DTYPES, ENTROPY_TOL, Obj, assert_grad_close, assert_loss_close, check_against_spec, make_case

import gmpo_jax
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

B, T, H, V = 5, 7, 64, 200
Q = 0.37  # a quantile position between two tokens for every case here (the oracle's margin checks it)


def _spec(case, obj: Obj, q=Q, **kw):
    return spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, weight_layout=case.layout, old_logps=case.old,
        ref_logps=case.ref, top_entropy_quantile=q, **kw, **obj.spec_kwargs(),
    )  # fmt: skip


def _lm_head(case, obj: Obj, implementation, q=Q, **fields):
    """``fields``: more of the batch's (``PolicyBatch``)."""

    def f(h, w):
        batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, **fields)
        head = gmpo_jax.HeadOptions(weight_layout=case.layout, implementation=implementation)
        return gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=obj.lib(top_entropy_quantile=q), head=head)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        jnp.asarray(case.hidden), jnp.asarray(case.weight)
    )


def _check_threshold(aux, want, case):
    z = np.abs(np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)).max()
    assert abs(float(aux.entropy_threshold) - want.metrics["entropy_threshold"]) <= ENTROPY_TOL * (1 + z)


OBJECTIVES = [
    Obj("gmpo", beta=0.04),
    Obj("grpo"),
    Obj("dapo", level="sequence"),
    Obj("cispo", epsilon_high=1.3),
    Obj("sapo"),
]


@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
@pytest.mark.parametrize("implementation", ["xla_chunked", "reference"])
def test_lm_head(obj, implementation):
    case = make_case(OBJECTIVES.index(obj), B=B, T=T, H=H, V=V)
    want = _spec(case, obj)
    assert want.margin > 1e-4, "test setup: an entropy or a ratio sits within 1e-4 of its threshold"
    if implementation == "reference":
        f = lambda h, w: gmpo_jax.reference.policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
            objective=obj.lib(top_entropy_quantile=Q),
        )
        (loss, aux), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(case.hidden, case.weight)
    else:
        (loss, aux), grads = _lm_head(case, obj, implementation)
    check_against_spec(loss, aux, (*grads, None), want, case, obj)
    _check_threshold(aux, want, case)


def test_kernels_in_the_interpreter():
    """The LM-head kernels' entropy output selects the tokens (GMPO; the kernels see per-row coefficients
    only, every objective runs on the portable paths above)."""
    obj = Obj("gmpo")
    case = make_case(9, B=B, T=T, H=H, V=V, dtype=DTYPES["bfloat16"])
    want = _spec(case, obj)
    (loss, aux), grads = _lm_head(case, obj, MosaicGpuBackend(interpret=True))
    check_against_spec(loss, aux, (*grads, None), want, case, obj)
    _check_threshold(aux, want, case)


def test_quantile_one_is_off():
    """``q = 1``: every unmasked token (no entropy pass); the threshold metric is 0."""
    case = make_case(1, B=B, T=T, H=H, V=V)
    obj = Obj("gmpo")
    (loss, aux), grads = _lm_head(case, obj, "xla_chunked", q=1.0)
    check_against_spec(loss, aux, (*grads, None), spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref,
        **obj.spec_kwargs()), case, obj)  # fmt: skip
    assert float(aux.entropy_threshold) == 0.0


@pytest.mark.parametrize(
    "obj,impl",
    [(Obj("gmpo"), "xla"), (Obj("grpo"), "xla"), (Obj("grpo"), "mosaic_gpu_fused"), (Obj("gmpo"), "mosaic_gpu")],
    ids=str,
)
def test_logits(obj, impl):
    Vl = 2048  # the logits kernels' smallest view
    case = make_case(4, B=B, T=T, H=H, V=Vl)
    z = np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)
    logits = np.concatenate([z, z[:, :1]], axis=1).astype(np.float32)
    want = _spec(case, obj)
    assert want.margin > 1e-4
    onehot = np.arange(Vl) == np.where(case.mask, case.ids, -1)[..., None]
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dwant = np.zeros(logits.shape)
    dwant[:, :T] = np.where(case.mask[..., None], want.dlogp[..., None] * (onehot - p), 0.0)
    implementation = {
        "xla": "xla",
        "mosaic_gpu": MosaicGpuLogitsBackend(interpret=True, fused=False),
        "mosaic_gpu_fused": MosaicGpuLogitsBackend(interpret=True),
    }[impl]
    f = lambda x: gmpo_jax.policy_loss_from_logits(
        x,
        gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
        objective=obj.lib(top_entropy_quantile=Q),
        implementation=implementation,
    )
    (loss, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logits))
    assert_loss_close(loss, want.loss, want.scale, np.float32)
    assert_grad_close(np.asarray(g), dwant, np.float32, "dlogits")
    _check_threshold(aux, want, case)


@pytest.mark.parametrize(
    "q,err", [(0.0, ValueError), (1.5, ValueError), (True, TypeError), (jnp.float32(0.5), TypeError)]
)
def test_bad_quantile_raises(q, err):
    case = make_case(0, B=B, T=T, H=H, V=V)
    with pytest.raises(err, match="top_entropy_quantile"):
        gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv),
            objective=gmpo_jax.GMPO(top_entropy_quantile=q),
        )


def test_all_masked_threshold_is_zero():
    case = make_case(2, B=B, T=T, H=H, V=V)
    mask = np.zeros((B, T), bool)
    (loss, aux), _ = jax.value_and_grad(
        lambda h: gmpo_jax.fused_linear_policy_loss(
            h,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, mask, case.adv),
            objective=gmpo_jax.GMPO(top_entropy_quantile=Q),
        ),
        has_aux=True,
    )(case.hidden)
    assert float(loss) == 0.0 and float(aux.entropy_threshold) == 0.0
