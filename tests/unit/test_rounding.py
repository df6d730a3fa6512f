"""The cancellation of dz's 16-bit rounding in the hidden-state gradient (``backend.cancel_rounding``).

``dh = sum_v dz_v W_v`` and the exact ``dz`` row sums to 0, so ``dh = sum_v dz_v (W_v - W_id)``. The
backends store ``dz`` in 16 bits; each rounding error multiplies a whole column ``W_v``, and on an LM head
whose columns share a large direction that error dominates. ``rowsum`` (the sum of the stored ``dz``,
i.e. of the rounding errors) cancels it. These tests pin the two things that can silently break it: the
row sum must be taken over the *stored* values (XLA folds ``f32 -> bf16 -> f32`` on GPUs), and the
corrected gradient must be closer to float64 on a head with a shared direction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import make_case

import gmpo_jax
from gmpo_jax.lm_head.backend import stored_rowsum
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_stored_rowsum_sums_the_stored_values(dtype):
    x = jax.random.normal(jax.random.key(0), (4, 999)) * 1e-3
    stored = x.astype(dtype)
    want = np.asarray(stored, np.float64).sum(axis=1)
    np.testing.assert_allclose(np.asarray(jax.jit(stored_rowsum)(stored)), want, rtol=1e-5, atol=1e-9)


def test_stored_rowsum_leaves_no_conversion_chain_to_fold():
    """Under jit with the rounding in the same program: no bf16 -> f32 float conversion feeds the sum
    (XLA's SimplifyFPConversions would fold ``f32 -> bf16 -> f32`` into the unrounded value)."""
    text = jax.jit(lambda x: stored_rowsum(x.astype(jnp.bfloat16))).lower(jnp.ones((4, 8))).as_text()
    widening = [
        line
        for line in text.splitlines()
        if "convert" in line and "bf16>) -> tensor" in line and "xf32>" in line.split("->")[-1]
    ]
    assert widening == [], widening


def test_cancellation_helps_on_a_head_with_a_shared_direction():
    """bf16 inputs, every column of W shifted by one large common vector: the hidden-state gradient with the
    cancellation is closer to the float64 oracle (of the same bf16 inputs) than without it."""
    case = make_case(7, B=4, T=16, H=64, V=512, dtype=jnp.bfloat16, logit_scale=1.0, off_policy=False, with_ref=False)
    w = np.asarray(case.weight, np.float32)
    case.weight = (w + 4.0 * np.random.default_rng(0).normal(size=(64, 1))).astype(case.weight.dtype)
    obj = gmpo_jax.GMPO()
    want = spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, loss_type="gmpo", epsilon_low=0.4, epsilon_high=0.4
    )
    errs = {}
    for cancel in (False, True):
        f = lambda h: gmpo_jax.fused_linear_policy_loss(
            h,
            jnp.asarray(case.weight),
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv),
            objective=obj,
            head=gmpo_jax.HeadOptions(implementation=XlaChunkedBackend(cancel_rounding=cancel)),
        )[0]
        dh = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(case.hidden)), np.float64)
        errs[cancel] = np.linalg.norm(dh - want.dhidden) / np.linalg.norm(want.dhidden)
    assert errs[True] < errs[False] / 1.5, errs
