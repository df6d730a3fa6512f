"""Issue 31 (3): under ``jax_enable_x64`` the Mosaic GPU paths of both ops hold no float64 work.

Float32 / bf16 inputs, the Mosaic logits backend (``policy_loss_from_logits``: the three-pass kernels and
the fused kernel) and the Mosaic LM-head backend (``fused_linear_policy_loss``, with a reference model's
hidden states), GMPO / GRPO (beta > 0 with a reference) / CISPO / SAPO, a temperature: the jaxpr of the
forward and of ``jax.value_and_grad`` is walked, kernel bodies included (in interpret mode the kernels
trace to ordinary jaxprs inside the Pallas call; the body is the same trace the GPU lowering sees), and
any equation with a float64 result fails, except a rank-0 ``convert_element_type`` (a scalar
hyper-parameter on its way to float32). Before the fix the kernels' one-hot / tie selects between two
Python floats (``jnp.where(c, 1.0, 0.0)``) were ``float64[64, 128]`` arrays under x64, in both ops'
gradient kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_ops

import gmpo_jax
from gmpo_jax import kernels as K
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

F64 = np.dtype("float64")
OBJECTIVES = {
    "gmpo": lambda: gmpo_jax.GMPO(beta=0.1),
    "grpo": lambda: gmpo_jax.GRPO(beta=0.04),
    "cispo": lambda: gmpo_jax.CISPO(),
    "sapo": lambda: gmpo_jax.SAPO(),
}


@pytest.fixture
def x64():
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


def _float64_ops(closed):
    """``(primitive, aval, source)`` of every equation (sub-jaxprs and kernel bodies included) with a float64
    result, other than a rank-0 conversion."""

    def keep(e, aval):
        dtype = getattr(aval, "dtype", None)
        return dtype == F64 and not (e.primitive.name == "convert_element_type" and aval.ndim == 0)

    return jaxpr_ops(closed, keep)


def _assert_no_float64(fn, *args, what):
    for name, f in (("forward", fn), ("value_and_grad", jax.value_and_grad(fn, has_aux=True))):
        ops = _float64_ops(jax.make_jaxpr(f)(*args))
        assert ops == [], f"{what} {name}: {len(ops)} float64 operations under x64, e.g. {ops[:3]}"


@pytest.mark.parametrize("fused", [False, True], ids=["three_pass", "fused"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("obj", list(OBJECTIVES))
def test_logits_path(x64, obj, dtype, fused):
    B, T, V = 8, 8, 1024  # 72 rows of [T + 1] positions: the kernels' row blocks, slab rows of the fused one
    be = MosaicGpuLogitsBackend(
        interpret=True, fwd=K.LogitsBlocks(block_v=128, stages=2), num_splits=2, fused=fused
    )  # fmt: skip
    ids, mask = jnp.zeros((B, T), jnp.int32), jnp.ones((B, T), bool)
    lp = jnp.full((B, T), -1.0, jnp.float32)

    def f(z):
        return gmpo_jax.policy_loss_from_logits(
            z,
            gmpo_jax.PolicyBatch(ids, mask, jnp.linspace(-1.0, 1.0, B, dtype=jnp.float32), old_logps=lp, ref_logps=lp),
            objective=OBJECTIVES[obj](),
            implementation=be,
            temperature=0.9,
        )

    _assert_no_float64(f, jnp.zeros((B, T + 1, V), dtype), what=f"logits {obj} {jnp.dtype(dtype)} fused={fused}")


@pytest.mark.parametrize("obj", list(OBJECTIVES))
def test_lm_head_path(x64, obj):
    B, T, H, V = 2, 8, 64, 512
    be = MosaicGpuBackend(interpret=True)
    ids, mask = jnp.zeros((B, T), jnp.int32), jnp.ones((B, T), bool)
    h = jnp.zeros((B, T, H), jnp.bfloat16)

    def f(hw):
        hidden, weight = hw
        return gmpo_jax.fused_linear_policy_loss(
            hidden,
            weight,
            gmpo_jax.PolicyBatch(
                ids, mask, jnp.asarray([1.0, -1.0], jnp.float32), old_logps=jnp.full((B, T), -1.0, jnp.float32)
            ),
            objective=OBJECTIVES[obj](),
            temperature=0.9,
            reference=gmpo_jax.ReferenceHead(h, weight),
            head=gmpo_jax.HeadOptions(implementation=be),
        )

    _assert_no_float64(f, (h, jnp.zeros((H, V), jnp.bfloat16)), what=f"lm_head {obj}")
