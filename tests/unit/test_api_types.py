"""The public configuration types: ``PolicyBatch`` and ``ReferenceHead`` (pytrees), ``HeadOptions`` and
``MeshAxes`` (frozen, hashable, checked when built: each bad field raises an error that names it).

Nothing here compiles more than a few tiny programs (``xla_chunked`` / ``xla`` on a ``2 x 3 x 8`` batch)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmpo_jax
from gmpo_jax.lm_head import MosaicGpuBackend, XlaChunkedBackend

B, T, H, V = 2, 3, 8, 11


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (B, T, H))
    w = jax.random.normal(k[1], (H, V)) / 3
    ids = jax.random.randint(k[2], (B, T), 0, V)
    old = jax.random.normal(k[3], (B, T)) * 0.1 - 2.0
    return h, w, ids, old


# --------------------------------------------------------------------------------------------------
# HeadOptions
# --------------------------------------------------------------------------------------------------
class NotHashable(XlaChunkedBackend):
    __hash__ = None


HEAD_ERRORS = [
    (ValueError, "weight_layout", dict(weight_layout="HV")),
    (ValueError, "weight_layout", dict(weight_layout=None)),
    (TypeError, "softcap", dict(softcap="30")),
    (TypeError, "softcap", dict(softcap=True)),
    (ValueError, "softcap", dict(softcap=0.0)),
    (ValueError, "softcap", dict(softcap=float("inf"))),
    (TypeError, "logits_precision", dict(logits_precision=32)),
    (ValueError, "logits_precision", dict(logits_precision="fp32")),
    (ValueError, "grad_filter", dict(grad_filter="fast")),
    (ValueError, "grad_filter", dict(grad_filter=1.0)),
    (TypeError, "grad_filter", dict(grad_filter=jnp.float32(0.1))),  # static: a traced value cannot be compiled in
    (TypeError, "chunk_size", dict(chunk_size=2.0)),
    (ValueError, "chunk_size", dict(chunk_size=0)),
    (TypeError, "vocab_size", dict(vocab_size="11")),
    (ValueError, "vocab_size", dict(vocab_size=0)),
    (TypeError, "implementation", dict(implementation=XlaChunkedBackend)),  # the class
    (TypeError, "implementation", dict(implementation=123)),
    (TypeError, "implementation", dict(implementation=NotHashable())),
]


@pytest.mark.parametrize(
    "error, name, kwargs", HEAD_ERRORS, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(HEAD_ERRORS)]
)
def test_head_options_fields_are_checked_when_built(error, name, kwargs):
    with pytest.raises(error, match=f"{name}="):  # the f"{x=}" style: the field and its value
        gmpo_jax.HeadOptions(**kwargs)


def test_head_options_are_frozen_hashable_and_normalised():
    a = gmpo_jax.HeadOptions(weight_layout="vh", softcap=np.float32(30.0), chunk_size=np.int64(2), grad_filter="auto")
    b = gmpo_jax.HeadOptions(weight_layout="vh", softcap=30.0, chunk_size=2, grad_filter="auto")
    assert a == b and hash(a) == hash(b) and type(a.softcap) is float and type(a.chunk_size) is int
    assert a != dataclasses.replace(b, softcap=20.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.softcap = 1.0
    impl = MosaicGpuBackend(interpret=True)
    assert hash(gmpo_jax.HeadOptions(implementation=impl)) == hash(gmpo_jax.HeadOptions(implementation=impl))


def test_head_options_as_a_static_jit_argument():
    """Equal options (different instances) reuse one trace; other options trace anew."""
    h, w, ids, _ = _inputs()
    traces = []

    def logp(h, w, ids, head):
        traces.append(head)
        return gmpo_jax.fused_linear_logprobs(h, w, ids, head=head)

    logp = jax.jit(logp, static_argnames="head")
    a = logp(h, w, ids, head=gmpo_jax.HeadOptions(chunk_size=1))
    b = logp(h, w, ids, head=gmpo_jax.HeadOptions(chunk_size=1))
    assert len(traces) == 1
    c = logp(h, w, ids, head=gmpo_jax.HeadOptions(chunk_size=2))
    assert len(traces) == 2
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6)


def test_the_call_settings_have_one_home():
    """``softcap``, ``logits_precision`` and ``grad_filter`` are ``HeadOptions`` fields only: not arguments of the
    functions, not constructor fields of the backends."""
    h, w, ids, _ = _inputs()
    with pytest.raises(TypeError, match="softcap"):
        gmpo_jax.fused_linear_logprobs(h, w, ids, softcap=30.0)
    for backend in (XlaChunkedBackend, MosaicGpuBackend):
        for name in ("softcap", "logits_precision", "grad_filter"):
            with pytest.raises(TypeError, match=name):
                backend(**{name: None})
    # given on the options, they reach the backend the call runs (softcap changes the log-probs)
    plain = gmpo_jax.fused_linear_logprobs(h, w, ids)
    capped = gmpo_jax.fused_linear_logprobs(h * 20, w, ids, head=gmpo_jax.HeadOptions(softcap=1.0))
    assert np.all(np.asarray(capped) >= -np.log(V) - 2.0 - 1e-5) and not np.allclose(plain, capped)


# --------------------------------------------------------------------------------------------------
# MeshAxes
# --------------------------------------------------------------------------------------------------
MESH = jax.make_mesh((1, 1), ("data", "model"))

MESH_ERRORS = [
    (TypeError, "data_axis", dict(data_axis=0)),
    (TypeError, "data_axis", dict(data_axis=())),
    (TypeError, "vocab_axis", dict(vocab_axis=("model", 1))),
    (TypeError, "mesh", dict(mesh="data", data_axis="data")),
    (ValueError, "mesh= needs data_axis", dict(mesh=MESH)),
]


@pytest.mark.parametrize(
    "error, name, kwargs", MESH_ERRORS, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(MESH_ERRORS)]
)
def test_mesh_axes_fields_are_checked_when_built(error, name, kwargs):
    with pytest.raises(error, match=name):
        gmpo_jax.MeshAxes(**kwargs)


def test_mesh_axes_are_hashable_and_used():
    a = gmpo_jax.MeshAxes(MESH, data_axis="data", vocab_axis=["model"])  # a list becomes a tuple
    assert a.vocab_axis == ("model",) and hash(a) == hash(gmpo_jax.MeshAxes(MESH, "data", ("model",)))
    h, w, ids, _ = _inputs()
    batch = gmpo_jax.PolicyBatch(ids, jnp.ones((B, T), bool), jnp.array([1.0, -0.5]))
    got = gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=gmpo_jax.GMPO(), sharding=a)[0]
    assert float(got) == pytest.approx(-0.25)  # on-policy: -mean_b A_b


# --------------------------------------------------------------------------------------------------
# PolicyBatch and ReferenceHead
# --------------------------------------------------------------------------------------------------
def test_policy_batch_through_jit_for_both_ops():
    """A ``PolicyBatch`` is one jit argument (its None fields are empty subtrees): a new batch of the same
    structure does not retrace, and the jitted losses equal the eager ones."""
    h, w, ids, old = _inputs()
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
    logits = jnp.concatenate([jnp.einsum("bth,hv->btv", h, w), jnp.zeros((B, 1, V))], axis=1)
    objective = gmpo_jax.GRPO(loss_type="dapo")
    traces = []

    def lm_head(b):
        traces.append("lm_head")
        return gmpo_jax.fused_linear_policy_loss(h, w, b, objective=objective)[0]

    def from_logits(b):
        traces.append("logits")
        return gmpo_jax.policy_loss_from_logits(logits, b, objective=objective)[0]

    jitted = {f: jax.jit(f) for f in (lm_head, from_logits)}
    for seed in (1, 2):
        adv = jax.random.normal(jax.random.key(seed), (B,))
        batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old, num_items_in_batch=jnp.float32(7.0))
        for f, g in jitted.items():
            np.testing.assert_allclose(float(g(batch)), float(f(batch)), rtol=1e-6)
    assert traces.count("lm_head") == 1 + 2 and traces.count("logits") == 1 + 2  # one trace each, plus eager
    sliced = jax.tree.map(lambda x: x[:1] if x.ndim else x, batch)  # a pytree: every field at once
    assert sliced.completion_ids.shape == (1, T) and sliced.old_logps.shape == (1, T) and sliced.ref_logps is None


def test_policy_batch_fields_and_order():
    fields = ("completion_ids", "completion_mask", "advantages", "old_logps", "ref_logps", "rollout_logps")
    assert gmpo_jax.PolicyBatch._fields == fields + ("rollout_is_ratio", "segment_ids", "num_items_in_batch")
    assert gmpo_jax.ReferenceHead._fields == ("hidden", "weight", "bias")


def test_reference_head_and_ref_logps_are_exclusive():
    """A ``ReferenceHead`` gives the KL term the log-probs ``batch.ref_logps`` would (same loss), and both
    together are an error naming both."""
    h, w, ids, old = _inputs()
    mask = jnp.ones((B, T), bool)
    h_ref = h * 0.5
    ref = gmpo_jax.fused_linear_logprobs(h_ref, w, ids)
    batch = gmpo_jax.PolicyBatch(ids, mask, jnp.array([1.0, -0.5]), old_logps=old)
    objective = gmpo_jax.GMPO(beta=0.1)
    by_head = gmpo_jax.fused_linear_policy_loss(
        h, w, batch, objective=objective, reference=gmpo_jax.ReferenceHead(h_ref, w)
    )[0]
    by_logps = gmpo_jax.fused_linear_policy_loss(h, w, batch._replace(ref_logps=ref), objective=objective)[0]
    np.testing.assert_allclose(float(by_head), float(by_logps), rtol=1e-6)
    with pytest.raises(ValueError, match=r"either batch\.ref_logps or reference="):
        gmpo_jax.fused_linear_policy_loss(
            h, w, batch._replace(ref_logps=ref), objective=objective, reference=gmpo_jax.ReferenceHead(h_ref, w)
        )
