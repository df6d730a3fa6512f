"""``LossAux.kl_term`` is the KL term exactly as the loss aggregates it (``loss(beta) - loss(0) == beta *
kl_term`` for every objective and loss type, and equal to the float64 oracle's ``(loss(beta) - loss(0)) /
beta``), while ``aux.kl`` stays TRL's token mean; ``LossAux.entropy`` is the token-mean entropy wherever the
loss computes entropies (``entropy_coef`` or ``top_entropy_quantile < 1``), else 0. Both ops, the dense
reference, the row-skipping paths and one Mosaic case in the interpreter.

Tolerances: ``conftest.TOLERANCES`` (float32: 1e-5 of the oracle's scale, the sum of the absolute terms);
entropies as ``conftest.ENTROPY_TOL`` times ``1 + max|z|``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import DTYPES, ENTROPY_TOL, Obj, assert_loss_close, make_case, spec_for

import gmpo_jax
import gmpo_jax.reference
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend

B, T, H, V = 4, 6, 16, 29
BETA = 0.3
OBJECTIVES = [
    Obj("gmpo"),
    Obj("gmpo", bias_kl=True),
    Obj("grpo"),
    Obj("bnpo"),
    Obj("dr_grpo", max_completion_length=T + 3),
    Obj("dapo"),
    Obj("dapo", level="sequence", bias_kl=True),
    Obj("cispo", epsilon_high=1.3),
    Obj("sapo"),
]
NUM_ITEMS = {"dapo": 40.0}  # dapo with the normaliser override (the others: their own)


def _logits(case):
    z = np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)
    return np.concatenate([z, z[:, :1]], axis=1).astype(np.float32)


def _call(op, case, objective, *, ref=True, implementation=None, **fields):
    """``op``'s ``(loss, aux)``; ``fields``: more of the batch's (``PolicyBatch``)."""
    ref_logps = case.ref if ref else None
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=ref_logps, **fields)
    if op == "logits":
        impl = implementation or "xla"
        return gmpo_jax.policy_loss_from_logits(_logits(case), batch, objective=objective, implementation=impl)
    if op == "reference":
        return gmpo_jax.reference.policy_loss(case.hidden, case.weight, batch, objective=objective)
    head = gmpo_jax.HeadOptions(implementation=implementation or "xla_chunked")
    return gmpo_jax.fused_linear_policy_loss(case.hidden, case.weight, batch, objective=objective, head=head)


@pytest.mark.parametrize("op", ["lm_head", "logits"])
@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
def test_kl_term_adds_up(obj, op):
    case = make_case(OBJECTIVES.index(obj), B=B, T=T, H=H, V=V, ris="bt")
    n = NUM_ITEMS.get(obj.loss_type)
    on = dataclasses.replace(obj, beta=BETA)
    kw = dict(num_items_in_batch=n, rollout_is_ratio=case.ris)
    loss0, aux0 = _call(op, case, obj.lib(), ref=False, **kw)
    loss1, aux1 = _call(op, case, on.lib(), **kw)
    want0 = spec_for(case, obj, ref=False, num_items_in_batch=n)
    want1 = spec_for(case, on, num_items_in_batch=n)
    want_term = (want1.loss - want0.loss) / BETA  # float64
    scale = want1.scale + want0.scale
    assert float(aux0.kl_term) == 0.0 and float(aux0.kl) == 0.0
    assert_loss_close(float(loss1) - float(loss0), BETA * float(aux1.kl_term), scale, np.float32, what="loss diff")
    assert_loss_close(aux1.kl_term, want_term, scale / BETA, np.float32, what="aux.kl_term")
    kl = want1.metrics["kl"]  # TRL's token mean, unchanged
    assert_loss_close(aux1.kl, kl, abs(kl), np.float32, what="aux.kl")
    if obj.loss_type in ("gmpo", "grpo", "sapo", "dr_grpo") or n is not None:
        assert abs(want_term - kl) > 1e-3 * kl, "test setup: kl_term and kl coincide here"


def _entropy_mean(case):
    ent = spec.spec_entropy(case.hidden, case.weight, case.mask, weight_layout=case.layout)
    zmax = np.abs(np.asarray(case.hidden, np.float64) @ np.asarray(case.weight, np.float64)).max()
    return ent.sum() / max(case.mask.sum(), 1), ENTROPY_TOL * (1 + zmax)


ENTROPY_CALLS = {
    "lm_head": ("lm_head", None),
    "lm_head_skip": ("lm_head", XlaChunkedBackend(row_buckets=4)),
    "logits": ("logits", None),
    "reference": ("reference", None),
}


@pytest.mark.parametrize("how", ["entropy_coef", "quantile", "both", "neither"])
@pytest.mark.parametrize("call", list(ENTROPY_CALLS))
def test_entropy_mean(call, how):
    case = make_case(7, B=B, T=T, H=H, V=V)
    op, impl = ENTROPY_CALLS[call]
    shaping = {}  # the objective's loss shaping
    if how in ("entropy_coef", "both"):
        shaping["entropy_coef"] = 0.01
    if how in ("quantile", "both"):
        shaping["top_entropy_quantile"] = 0.5
    f = lambda h: _call(op, case, Obj("grpo").lib(**shaping), ref=False, implementation=impl)[1]  # noqa: E731
    aux = jax.jit(f)(0)
    if how == "neither":
        assert float(aux.entropy) == 0.0
        return
    want, tol = _entropy_mean(case)
    assert abs(float(aux.entropy) - want) <= tol, (float(aux.entropy), want)


def test_entropy_mosaic_lm_head_in_the_interpreter():
    """The kept-logits, row-skipping kernel path with an entropy term, and its KL term."""
    case = make_case(8, B=B, T=T, H=64, V=200, dtype=DTYPES["bfloat16"])
    be = MosaicGpuBackend(interpret=True, save_min_hidden=0, row_buckets=4)
    obj = Obj("gmpo", beta=BETA)

    def f(h):
        return gmpo_jax.fused_linear_policy_loss(
            h,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
            objective=obj.lib(entropy_coef=0.01),
            head=gmpo_jax.HeadOptions(implementation=be),
        )

    (loss, aux), _ = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(case.hidden))
    want, tol = _entropy_mean(case)
    assert abs(float(aux.entropy) - want) <= tol, (float(aux.entropy), want)
    term = (spec_for(case, obj, ris=False).loss - spec_for(case, Obj("gmpo"), ref=False, ris=False).loss) / BETA
    assert_loss_close(aux.kl_term, term, abs(term), np.float32, what="aux.kl_term")
