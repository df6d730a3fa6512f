"""Sharded fused losses (``gmpo_jax.lm_head.sharding``): the 8-device suite in a subprocess, plus the
single-device parts of the contract (``vocab_size``) in this process.

The meshes need 8 CPU devices, i.e. ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before
jax initialises its CPU backend, which this process has already done with one device. So the cases live
in ``tests/sharding_cases.py`` (not collected by name) and run in a child pytest with the flag set.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmpo_jax

HERE = pathlib.Path(__file__).parent.parent


def test_sharded_cases_on_8_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(HERE / "sharding_cases.py"),
        ],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tests/sharding_cases.py failed (rc={proc.returncode}):\n{out[-8000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]


def test_docstring_example():
    import doctest

    import gmpo_jax.lm_head.sharding

    result = doctest.testmod(gmpo_jax.lm_head.sharding, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------------------------------
# vocab_size on one device
# --------------------------------------------------------------------------------------------------
def _inputs(V=8, H=4, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(2, 3, H)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(H, V)), jnp.float32)
    ids = jnp.asarray([[0, 4, 5], [2, 5, 1]], jnp.int32)
    return h, w, ids


def test_vocab_size_equals_the_unpadded_head():
    h, w, ids = _inputs()
    w_pad = jnp.concatenate([w[:, :6], jnp.zeros((4, 2))], axis=1)  # real vocabulary 6, padded to 8
    want = gmpo_jax.fused_linear_logprobs(h, w[:, :6], ids)
    got = gmpo_jax.fused_linear_logprobs(h, w_pad, ids, head=gmpo_jax.HeadOptions(vocab_size=6))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    dw = jax.grad(lambda w: gmpo_jax.fused_linear_logprobs(h, w, ids, head=gmpo_jax.HeadOptions(vocab_size=6)).sum())(
        w_pad
    )
    assert np.all(np.asarray(dw)[:, 6:] == 0.0)


def test_unmasked_id_in_the_padding_is_nan_masked_one_is_ignored():
    h, w, ids = _inputs()
    ids = ids.at[0, 1].set(7)  # in [vocab_size, V)
    with pytest.raises(ValueError, match=r"completion_ids\[0, 1\] = 7"):  # concrete: checked
        gmpo_jax.fused_linear_logprobs(h, w, ids, head=gmpo_jax.HeadOptions(vocab_size=6))
    logp = jax.jit(lambda ids: gmpo_jax.fused_linear_logprobs(h, w, ids, head=gmpo_jax.HeadOptions(vocab_size=6)))(
        ids
    )  # traced: NaN
    assert np.isnan(logp[0, 1]) and np.all(np.isfinite(np.delete(np.asarray(logp).ravel(), 1)))
    mask = jnp.ones((2, 3), bool).at[0, 1].set(False)
    loss, _ = gmpo_jax.fused_linear_policy_loss(
        h,
        w,
        gmpo_jax.PolicyBatch(ids, mask, jnp.array([1.0, -1.0])),
        objective=gmpo_jax.GMPO(),
        head=gmpo_jax.HeadOptions(vocab_size=6),
    )
    assert np.isfinite(loss)


@pytest.mark.parametrize("vocab_size, err", [(0, ValueError), (9, ValueError), (6.0, TypeError), (True, TypeError)])
def test_invalid_vocab_size_raises(vocab_size, err):
    h, w, ids = _inputs()
    with pytest.raises(err, match="vocab_size"):
        gmpo_jax.fused_linear_logprobs(h, w, ids, head=gmpo_jax.HeadOptions(vocab_size=vocab_size))
