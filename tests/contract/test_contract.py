"""One contract, every implementation of both ops: loss, metrics and gradients against the float64 oracle.

The cases are a curated product (objective x mask x dtype x layout, not every combination) run through
each implementation of each op:

* LM head (``fused_linear_policy_loss``): ``xla_chunked``, and ``mosaic_gpu`` in the Pallas GPU
  interpreter (``MosaicGpuBackend(interpret=True)``; the kernels take 16-bit inputs only, so their cases
  are the bf16 / f16 ones);
* logits (``policy_loss_from_logits``): ``xla``, and ``mosaic_gpu`` in the interpreter, three-pass and
  fused (token-local objectives write ``dlogits`` in the forward kernel).

JAX's Pallas GPU tests share one test class between the device and the interpreter through an
``INTERPRET`` class attribute; this file does the same: ``TestContract`` runs on CPU with the kernels
interpreted, ``TestContractGpu`` (marked ``gpu``) reruns the same cases with the compiled kernels on a
Hopper GPU. The kernels' code does not depend on the objective (the LM-head kernels and the three-pass
logits kernels take per-row coefficients computed outside; the fused kernel's per-objective code is
``test_logits_loss.test_fused_interpret``'s), so on CPU the interpreter runs on a covering subset of the
cases (``Contract.interpret``: every pair of dtype x layout x mask values that the kernels' cases hold, the
fused kernel's cases included, at least once; ``test_interpreted_cases_cover_every_pair`` checks it); the
portable paths and the GPU class run every case.
Tolerances: the one table of ``conftest.TOLERANCES`` (with its reasons); the logits of the
logits-op cases are the LM-head case's logits rounded to the case's dtype, and its oracle is float64 on
those rounded logits (``test_logits_loss.oracle``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DTYPES, Obj, check_against_spec, make_case, spec_for
from test_logits_loss import check as check_logits
from test_logits_loss import needs_hopper

import gmpo_jax
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend
from gmpo_jax.logits.vjp import LogitsConfig, _fused


@dataclasses.dataclass(frozen=True)
class Contract:
    """One curated case: objective, dtype, weight layout, mask kind."""

    obj: Obj
    dtype: str
    layout: str = "hv"
    mask: str = "ragged"  # "ragged" (an empty row too), "full"
    # the ops whose Mosaic kernels run in the interpreter on CPU ("lm_head", "logits"); the GPU class: all
    interpret: tuple[str, ...] = ()

    def __str__(self):
        return f"{self.obj}-{self.dtype}-{self.layout}-{self.mask}"


LM, LG = "lm_head", "logits"
CASES = [
    Contract(Obj("gmpo"), "bfloat16", interpret=(LM,)),
    Contract(Obj("gmpo", beta=0.04, bias_kl=True), "bfloat16", "vh", interpret=(LM,)),
    Contract(Obj("gmpo", epsilon_low=0.25, epsilon_high=0.5), "float32", mask="full", interpret=(LG,)),
    Contract(Obj("grpo", beta=0.04), "bfloat16", "vh", "full", interpret=(LM, LG)),
    Contract(Obj("grpo", level="sequence"), "float16", interpret=(LM, LG)),
    Contract(Obj("dapo", epsilon_low=0.2, epsilon_high=0.28, delta=1.5), "bfloat16", interpret=(LG,)),
    Contract(Obj("dr_grpo", max_completion_length=11), "float32", "vh", interpret=(LG,)),
    Contract(Obj("cispo", epsilon_high=1.3, beta=0.04), "bfloat16"),
    Contract(Obj("sapo", tau_pos=0.5, tau_neg=2.0), "bfloat16", "vh"),
]
# The interpreter's share, pairwise: LM head (16-bit only) bf16-hv-ragged, bf16-vh-ragged, bf16-vh-full,
# f16-hv-ragged; logits three-pass bf16-ragged, bf16-full, f16-ragged, f32-full, f32-ragged, of which the
# fused kernel (token-local objectives) bf16-full (grpo), bf16-ragged (dapo) and f32-ragged (dr_grpo).

B, T, H = 4, 9, 64
V_LM_HEAD = 200  # a partial last tile of the LM-head kernels' 128 vocabulary columns
V_LOGITS = 2048  # the fused logits kernel's smallest slab view (64 rows of 32 columns); the three-pass
# kernels view [B (T + 1), V] as [8 B (T + 1), V / 8]: 128-column tiles, 64-row blocks


def _pairs(cases, axes):
    return {((a, getattr(c, a)), (b, getattr(c, b))) for c in cases for i, a in enumerate(axes) for b in axes[i + 1 :]}


def test_interpreted_cases_cover_every_pair():
    """Every pair of kernel-relevant values the contract's cases hold is among the interpreted ones."""
    lm = [c for c in CASES if c.dtype != "float32"]
    assert _pairs([c for c in lm if LM in c.interpret], ("dtype", "layout", "mask")) == _pairs(
        lm, ("dtype", "layout", "mask")
    )
    assert _pairs([c for c in CASES if LG in c.interpret], ("dtype", "mask")) == _pairs(CASES, ("dtype", "mask"))
    fused = [c for c in CASES if c.obj.lib().token_local and c.dtype != "float16"]
    assert _pairs([c for c in fused if LG in c.interpret], ("dtype", "mask")) == _pairs(fused, ("dtype", "mask"))


def _case(c: Contract, seed: int, V: int):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), bool) if c.mask == "full" else (np.arange(T)[None] < rng.integers(1, T + 1, B)[:, None])
    if c.mask != "full":
        mask[0], mask[2] = True, False  # one full row, one empty row
    return make_case(seed, B=B, T=T, H=H, V=V, dtype=DTYPES[c.dtype], layout=c.layout, mask=mask)


def _logits_case(case, c: Contract):
    """The logits op's case: the LM head's ``[B, T + 1, V]`` logits rounded to the case's dtype."""
    w = np.asarray(case.weight, np.float64)
    z = np.asarray(case.hidden, np.float64) @ (w if c.layout == "hv" else w.T)
    z = np.concatenate([z, z[:, :1]], axis=1).astype(DTYPES[c.dtype])
    return dict(logits=z, ids=case.ids, mask=case.mask, adv=case.adv, old=case.old, ref=case.ref, ris=None)


class TestContract:
    INTERPRET = True

    def lm_head_impls(self, c: Contract):
        impls = {"xla_chunked": "xla_chunked"} if self.INTERPRET else {}
        if c.dtype != "float32" and (LM in c.interpret or not self.INTERPRET):  # the kernels take 16-bit inputs
            impls["mosaic_gpu"] = MosaicGpuBackend(interpret=True) if self.INTERPRET else "mosaic_gpu"
        return impls

    def logits_impls(self, c: Contract):
        impls = {"xla": "xla"} if self.INTERPRET else {}
        if LG not in c.interpret and self.INTERPRET:
            return impls
        obj = c.obj
        impls["mosaic_gpu"] = MosaicGpuLogitsBackend(interpret=self.INTERPRET, fused=False)
        if obj.lib().token_local:
            impls["mosaic_gpu_fused"] = MosaicGpuLogitsBackend(interpret=self.INTERPRET)
        return impls

    @pytest.mark.parametrize("c", CASES, ids=str)
    def test_lm_head(self, c: Contract):
        case = _case(c, CASES.index(c), V_LM_HEAD)
        want = spec_for(case, c.obj)
        for name, impl in self.lm_head_impls(c).items():
            f = lambda h, w: gmpo_jax.fused_linear_policy_loss(
                h,
                w,
                gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
                objective=c.obj.lib(),
                head=gmpo_jax.HeadOptions(weight_layout=c.layout, implementation=impl),
            )
            (loss, aux), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
                jnp.asarray(case.hidden), jnp.asarray(case.weight)
            )
            try:
                check_against_spec(loss, aux, (dh, dw, None), want, case, c.obj)
            except AssertionError as e:
                raise AssertionError(f"implementation {name}: {e}") from e

    @pytest.mark.parametrize("c", CASES, ids=str)
    def test_logits(self, c: Contract):
        case = _logits_case(_case(c, CASES.index(c), V_LOGITS), c)
        for name, impl in self.logits_impls(c).items():
            fused = _fused(LogitsConfig(impl, T), c.obj.lib(), jnp.asarray(case["logits"])) if name != "xla" else False
            assert fused == name.endswith("fused"), f"{name}: the fused kernel {'did not run' if not fused else 'ran'}"
            try:
                check_logits(case, c.obj, impl)
            except AssertionError as e:
                raise AssertionError(f"implementation {name}: {e}") from e


@pytest.mark.gpu
@needs_hopper
class TestContractGpu(TestContract):
    INTERPRET = False
