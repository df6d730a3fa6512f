"""Workspace memory of the fused path, from XLA's compiled memory analysis (CPU, so CI checks it).

The dense reference materialises [N, V] float32 logits (and their gradient); the fused path must stay
far below ``N * V * 4`` bytes of temporaries at a shape where the dense one does not.
"""

import jax
import jax.numpy as jnp
import pytest

import gmpo_jax
from gmpo_jax import reference

B, T, H, V = 8, 256, 64, 32000  # N * V * 4 = 250 MiB
N_V_BYTES = B * T * V * 4


def _temp_bytes(fn):
    hs = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    ws = jax.ShapeDtypeStruct((H, V), jnp.float32)
    compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hs, ws).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this jaxlib reports no memory analysis")
    return analysis.temp_size_in_bytes


def _inputs():
    ids = jnp.zeros((B, T), jnp.int32)
    mask = jnp.ones((B, T), bool)
    adv = jnp.linspace(-1.0, 1.0, B)
    return ids, mask, adv


@pytest.mark.parametrize("objective", [gmpo_jax.GMPO(), gmpo_jax.GRPO(loss_type="grpo")], ids=["gmpo", "grpo"])
def test_fused_temporaries_far_below_logits(objective):
    ids, mask, adv = _inputs()
    fused = _temp_bytes(
        lambda h, w: gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, mask, adv),
            objective=objective,
            head=gmpo_jax.HeadOptions(chunk_size=2, implementation="xla_chunked"),
        )[0]
    )
    dense = _temp_bytes(
        lambda h, w: reference.policy_loss(h, w, gmpo_jax.PolicyBatch(ids, mask, adv), objective=objective)[0]
    )
    # the dense oracle needs at least the logits; the fused path a small fraction of them
    assert dense >= N_V_BYTES, (dense, N_V_BYTES)
    assert fused <= N_V_BYTES / 4, (fused, N_V_BYTES)


def test_logprobs_temporaries_far_below_logits():
    ids, mask, _ = _inputs()
    fused = _temp_bytes(
        lambda h, w: jnp.sum(gmpo_jax.fused_linear_logprobs(h, w, ids, head=gmpo_jax.HeadOptions(chunk_size=2)))
    )
    assert fused <= N_V_BYTES / 4, (fused, N_V_BYTES)
