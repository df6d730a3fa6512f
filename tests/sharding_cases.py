"""Sharded fused losses on 8 simulated CPU devices: each mesh equals the single-device call.

Run by ``tests/integration/test_sharding.py`` in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(the flag must be set before jax initialises its CPU backend, and the main test process already has).
Directly: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q tests/sharding_cases.py``.

Every case: ``B = 8`` sequences with a ragged mask (one fully masked row), padding ids under the mask,
``V = 40`` = the real vocabulary 35 padded to a multiple of the shard counts (8 and 4) and masked with
``vocab_size=35`` (so on the 1x8 mesh the last vocabulary shard holds only padding). The single-device
call is itself checked against the float64 oracle of SPEC.md on the *unpadded* LM head.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import Obj, check_against_spec, make_case, spec_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gmpo_jax

if jax.device_count() < 8:  # collected without the flag: nothing to run here
    pytest.skip(
        "needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (see tests/integration/test_sharding.py)",
        allow_module_level=True,
    )

B, T, H, V_REAL, V = 8, 6, 16, 35, 40
CHUNK = 3  # does not divide the local batch of the 1x8 mesh: exercises the overlapping last chunk

# Sharded vs single-device, both float32: only summation order differs (psum of per-device partial
# sums, log-sum-exp combined over shards, dW summed over data shards). 1e-5 of the largest gradient
# entry is ~80 float32 ulps (eps = 1.2e-7), well inside SPEC's 1e-4; loss and metrics within 2e-6 of
# max(|value|, 1).
GRAD_RTOL = 1e-5
LOSS_RTOL = 2e-6

# LLVM -O0: compile time dominates on CPU; no IEEE semantics change (XLA:CPU has no fast-math).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

OBJECTIVES = {
    "gmpo": (Obj("gmpo", beta=0.04), "hv", False),
    "dapo": (Obj("dapo"), "vh", True),  # token-count normaliser: must be the global count
    "gspo": (Obj("grpo", level="sequence"), "hv", False),  # per-sequence ratio and mean
}
MESHES = {  # name: (shape, data_axis, vocab_axis)
    "8x1": ((8, 1), "data", None),
    "1x8": ((1, 8), None, "model"),
    "2x4": ((2, 4), "data", "model"),
}
# an axis may be a tuple of mesh axes (here the vocabulary over all 8 devices of a 2-D mesh)
MESHES_AND_TUPLE = {**MESHES, "2x4-vocab-over-both": ((2, 4), None, ("data", "model"))}


def _mesh(shape, types=AxisType.Auto):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(types, types))


def _pad_vocab(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, V - V_REAL)
    return np.pad(x, pad)


_CASES = {}


def case_for(name):
    """(case on the real vocabulary, padded weight, padded bias | None)."""
    if name not in _CASES:
        obj, layout, with_bias = OBJECTIVES[name]
        c = make_case(
            sorted(OBJECTIVES).index(name),
            B=B,
            T=T,
            H=H,
            V=V_REAL,
            layout=layout,
            with_bias=with_bias,
            mask=_ragged_mask(),
            with_ref=obj.beta != 0,
        )
        w = _pad_vocab(c.weight, 1 if layout == "hv" else 0)
        b = None if c.bias is None else _pad_vocab(c.bias, 0)
        _CASES[name] = (c, w, b)
    return _CASES[name]


def _ragged_mask():
    lengths = np.array([T, 3, 0, 5, 1, T, 2, 4])  # row 2 fully masked
    return np.arange(T)[None, :] < lengths[:, None]


def _loss_fn(name, *, sharding=None, shaping=None, **head):
    """``(h, w, b) -> (loss, aux)`` of case ``name``; ``shaping``: the objective's loss shaping, ``head``: more
    of the ``HeadOptions``'."""
    obj, layout, _ = OBJECTIVES[name]
    c, _, _ = case_for(name)
    j = lambda x: None if x is None else jnp.asarray(x)
    batch = gmpo_jax.PolicyBatch(j(c.ids), j(c.mask), j(c.adv), old_logps=j(c.old), ref_logps=j(c.ref))
    options = gmpo_jax.HeadOptions(weight_layout=layout, chunk_size=CHUNK, vocab_size=V_REAL, **head)
    objective = obj.lib(**(shaping or {}))

    def f(h, w, b):
        return gmpo_jax.fused_linear_policy_loss(
            h, w, batch, objective=objective, bias=b, head=options, sharding=sharding
        )

    return f


def _value_and_grad(f, h, w, b, compiler_options=FAST):
    argnums = (0, 1) if b is None else (0, 1, 2)
    g = jax.jit(
        jax.value_and_grad(lambda h, w, b: f(h, w, b), argnums=argnums, has_aux=True), compiler_options=compiler_options
    )
    (loss, aux), grads = g(h, w, b)
    return loss, aux, tuple(grads) + (None,) * (3 - len(grads))


_SINGLE = {}


def single_device(name):
    """The unsharded call on the padded head with ``vocab_size`` (checked against the oracle once)."""
    if name not in _SINGLE:
        c, w, b = case_for(name)
        _SINGLE[name] = _value_and_grad(
            _loss_fn(name), jnp.asarray(c.hidden), jnp.asarray(w), None if b is None else jnp.asarray(b)
        )
    return _SINGLE[name]


def _close(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)) if want.size else 0.0, 1.0 if want.ndim == 0 else 0.0)
    err = np.max(np.abs(got - want)) if want.size else 0.0
    assert err <= rtol * max(scale, 1e-30), f"{what}: max|err| {err:.3e} > {rtol} * {scale:.3e}"


def _assert_same(got, want, what=""):
    loss, aux, grads = got
    loss0, aux0, grads0 = want
    _close(loss, loss0, LOSS_RTOL, f"{what} loss")
    for field in aux0._fields:
        _close(getattr(aux, field), getattr(aux0, field), LOSS_RTOL, f"{what} aux.{field}")
    for name, g, g0 in zip(("dhidden", "dweight", "dbias"), grads, grads0):
        if g0 is not None:
            assert g.dtype == g0.dtype and g.shape == g0.shape, f"{what} {name}: {g.dtype}{g.shape}"
            _close(g, g0, GRAD_RTOL, f"{what} {name}")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_single_device_padded_vocab_matches_oracle(name):
    """``vocab_size`` on the unsharded path: the padded head equals the oracle on the real head, and
    the padded columns get exactly zero gradient."""
    obj, layout, _ = OBJECTIVES[name]
    c, _, _ = case_for(name)
    loss, aux, (dh, dw, db) = single_device(name)
    v_axis = 1 if layout == "hv" else 0
    assert np.all(np.take(np.asarray(dw), np.arange(V_REAL, V), axis=v_axis) == 0.0)
    if db is not None:
        assert np.all(np.asarray(db)[V_REAL:] == 0.0)
    real = lambda x: None if x is None else np.take(np.asarray(x), np.arange(V_REAL), axis=v_axis)
    check_against_spec(
        loss, aux, (dh, real(dw), None if db is None else np.asarray(db)[:V_REAL]), spec_for(c, obj), c, obj
    )


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_sharded_equals_single_device(name, mesh_name):
    shape, data_axis, vocab_axis = MESHES[mesh_name]
    mesh = _mesh(shape)
    _, layout, _ = OBJECTIVES[name]
    c, w, b = case_for(name)
    w_spec = P(None, vocab_axis) if layout == "hv" else P(vocab_axis, None)
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P(data_axis)))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    bs = None if b is None else jax.device_put(b, NamedSharding(mesh, P(vocab_axis)))
    got = _value_and_grad(
        _loss_fn(name, sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis)), hs, ws, bs
    )
    _assert_same(got, single_device(name), f"{name}@{mesh_name}")
    dh, dw, db = got[2]
    # gradients come back sharded like the primals
    assert dh.sharding.is_equivalent_to(hs.sharding, dh.ndim), (dh.sharding, hs.sharding)
    assert dw.sharding.is_equivalent_to(ws.sharding, dw.ndim), (dw.sharding, ws.sharding)
    if bs is not None:
        assert db.sharding.is_equivalent_to(bs.sharding, 1), (db.sharding, bs.sharding)


def test_num_items_in_batch_and_reference_model_on_2x4():
    """CISPO with the ``num_items_in_batch`` override, and the KL reference computed from
    a ``ReferenceHead`` through the same sharded path."""
    obj = Obj("cispo", epsilon_high=1.1, beta=0.1)
    c = make_case(7, B=B, T=T, H=H, V=V, mask=_ragged_mask(), with_ref=False)
    rng = np.random.default_rng(7)
    ref_h = (c.hidden + 0.1 * rng.normal(size=c.hidden.shape)).astype(np.float32)
    mesh = _mesh((2, 4))
    j = jnp.asarray

    batch = gmpo_jax.PolicyBatch(j(c.ids), j(c.mask), j(c.adv), old_logps=j(c.old), num_items_in_batch=100.0)
    reference = gmpo_jax.ReferenceHead(j(ref_h), j(c.weight))

    def f(h, w, b, sharding=None):
        return gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            batch,
            objective=obj.lib(),
            reference=reference,
            head=gmpo_jax.HeadOptions(chunk_size=CHUNK),
            sharding=sharding,
        )

    want = _value_and_grad(f, j(c.hidden), j(c.weight), None)
    axes = gmpo_jax.MeshAxes(mesh, data_axis="data", vocab_axis="model")
    got = _value_and_grad(lambda h, w, b: f(h, w, b, axes), j(c.hidden), j(c.weight), None)
    _assert_same(got, want, "cispo@2x4")


def test_bf16_vocab_parallel_rounds_like_single_device():
    """bf16 on 2x4: the hidden gradient is a float32 psum of per-shard partials already rounded to bf16,
    so it may differ from the single-device one by about one bf16 ulp (2^-8 relative); the loss is
    float32 math on the same exact bf16 products."""
    c, w, _ = case_for("gmpo")
    h16, w16 = jnp.asarray(c.hidden, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    mesh = _mesh((2, 4))
    loss0, _, (dh0, dw0, _) = _value_and_grad(_loss_fn("gmpo"), h16, w16, None)
    loss, _, (dh, dw, _) = _value_and_grad(
        _loss_fn("gmpo", sharding=gmpo_jax.MeshAxes(mesh, data_axis="data", vocab_axis="model")), h16, w16, None
    )
    assert dh.dtype == dw.dtype == jnp.bfloat16
    _close(loss, loss0, 1e-5, "bf16 loss")
    for what, g, g0 in (("dhidden", dh, dh0), ("dweight", dw, dw0)):
        _close(np.asarray(g, np.float32), np.asarray(g0, np.float32), 2.0**-7, f"bf16 {what}")


@pytest.mark.parametrize("mesh_name", sorted(MESHES_AND_TUPLE))
def test_logprobs_sharded(mesh_name):
    shape, data_axis, vocab_axis = MESHES_AND_TUPLE[mesh_name]
    mesh = _mesh(shape)
    c, w, _ = case_for("gmpo")
    g = jnp.asarray(np.random.default_rng(1).normal(size=(B, T)), jnp.float32)

    def vjp(sharding=None):
        def f(h, w):
            return gmpo_jax.fused_linear_logprobs(
                h,
                w,
                jnp.asarray(c.ids),
                completion_mask=jnp.asarray(c.mask),
                head=gmpo_jax.HeadOptions(chunk_size=CHUNK, vocab_size=V_REAL),
                sharding=sharding,
            )

        logp, pullback = jax.vjp(f, jnp.asarray(c.hidden), jnp.asarray(w))
        return (logp,) + pullback(g)

    want = jax.jit(vjp, compiler_options=FAST)()
    got = jax.jit(
        lambda: vjp(sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis)), compiler_options=FAST
    )()
    np.testing.assert_allclose(np.asarray(want[0])[c.mask], c.logp64[c.mask], rtol=0, atol=2e-5)
    for what, x, x0 in zip(("logp", "dhidden", "dweight"), got, want):
        _close(x, x0, GRAD_RTOL, f"{what}@{mesh_name}")
    assert np.all(np.asarray(got[2])[:, V_REAL:] == 0.0)


@pytest.mark.parametrize("mesh_name", sorted(MESHES_AND_TUPLE))
def test_logprobs_entropy_sharded(mesh_name):
    """return_entropy=True on every mesh (vocabulary shards combine their entropies by mass) equals the
    single-device entropy, which equals float64 over the real vocabulary (padded columns excluded)."""
    shape, data_axis, vocab_axis = MESHES_AND_TUPLE[mesh_name]
    mesh = _mesh(shape)
    c, w, _ = case_for("gmpo")

    def run(sharding=None):
        return gmpo_jax.fused_linear_logprobs(
            jnp.asarray(c.hidden),
            jnp.asarray(w),
            jnp.asarray(c.ids),
            completion_mask=jnp.asarray(c.mask),
            return_entropy=True,
            head=gmpo_jax.HeadOptions(chunk_size=CHUNK, vocab_size=V_REAL),
            sharding=sharding,
        )

    logp0, ent0 = jax.jit(run, compiler_options=FAST)()
    logp, ent = jax.jit(
        lambda: run(sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis)), compiler_options=FAST
    )()
    want = spec.spec_entropy(c.hidden, w, c.mask, vocab_size=V_REAL)
    np.testing.assert_allclose(np.asarray(ent0), want, rtol=0, atol=2e-5)
    _close(ent, ent0, 1e-5, f"entropy@{mesh_name}")
    _close(logp, logp0, 1e-5, f"logp@{mesh_name}")


# --------------------------------------------------------------------------------------------------
# The compiled program of the vocabulary-parallel case never gathers the weight or the [N, V] logits
# --------------------------------------------------------------------------------------------------
_SHAPE = re.compile(r"\b(?:bf16|f16|f32|f64|s32|pred)\[([0-9,]*)\]")


def gathered_full_vocab(hlo: str, full_sizes) -> list[str]:
    """The all-gather lines of ``hlo`` with an operand or result of a full-vocabulary shape: an axis of
    length ``V`` or ``len(full_sizes)`` element counts (``H * V``, ``N * V``)."""
    bad = []
    for line in hlo.splitlines():
        if "all-gather" not in line:
            continue
        for dims in _SHAPE.findall(line):
            d = [int(x) for x in dims.split(",") if x]
            if V in d or (d and int(np.prod(d)) in full_sizes):
                bad.append(line.strip())
                break
    return bad


def test_hlo_checker_detects_a_weight_gather():
    """Negative control: replicating a vocabulary-sharded weight does show up as an all-gather."""
    mesh = _mesh((1, 8))
    w = jax.device_put(np.zeros((H, V), np.float32), NamedSharding(mesh, P(None, "model")))
    hlo = jax.jit(lambda w: w * 2, out_shardings=NamedSharding(mesh, P())).lower(w).compile().as_text()
    assert gathered_full_vocab(hlo, {H * V, B * T * V})


@pytest.mark.parametrize("mesh_name", ["1x8", "2x4"])
def test_vocab_parallel_never_gathers_weight_or_logits(mesh_name):
    shape, data_axis, vocab_axis = MESHES[mesh_name]
    mesh = _mesh(shape)
    c, w, _ = case_for("gmpo")
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P(data_axis)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, vocab_axis)))
    f = _loss_fn("gmpo", sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis))
    g = jax.jit(jax.value_and_grad(lambda h, w: f(h, w, None), argnums=(0, 1), has_aux=True))
    hlo = g.lower(hs, ws).compile().as_text()
    assert "all-reduce" in hlo  # the collectives are there ...
    bad = gathered_full_vocab(hlo, {H * V, B * T * V})
    assert not bad, "\n".join(bad[:5])  # ... and none of them moves a full-vocabulary array


# --------------------------------------------------------------------------------------------------
# Where the layout comes from
# --------------------------------------------------------------------------------------------------
def test_explicit_axes_are_read_from_input_types_and_context_mesh():
    """On ``Explicit`` mesh axes the shardings are part of the types: no axis arguments are needed.
    ``mesh=None`` with axes takes the mesh of ``jax.set_mesh``."""
    mesh = _mesh((2, 4), AxisType.Explicit)
    c, w, _ = case_for("gmpo")
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    got = _value_and_grad(_loss_fn("gmpo"), hs, ws, None)
    _assert_same(got, single_device("gmpo"), "inferred@2x4")
    assert got[2][1].sharding.spec == P(None, "model")
    with jax.set_mesh(mesh):
        got = _value_and_grad(
            _loss_fn("gmpo", sharding=gmpo_jax.MeshAxes(data_axis="data", vocab_axis="model")), hs, ws, None
        )
    _assert_same(got, single_device("gmpo"), "set_mesh@2x4")


def test_auto_sharded_inputs_without_axes_stay_correct():
    """Without axis arguments XLA's partitioner handles inputs on ``Auto`` axes: same numbers."""
    mesh = _mesh((2, 4))
    c, w, _ = case_for("gmpo")
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    _assert_same(_value_and_grad(_loss_fn("gmpo"), hs, ws, None), single_device("gmpo"), "auto")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(data_axis="batch"), "not in the mesh"),
        (dict(data_axis="data", vocab_axis="data"), "one array axis only"),
        (dict(), "needs data_axis"),
        (dict(vocab_axis=("data", "model")), "multiple of the 8 shards"),
    ],
)
def test_invalid_layouts_raise(kw, match):
    mesh = _mesh((2, 4))
    c, _, _ = case_for("gmpo")
    batch = gmpo_jax.PolicyBatch(jnp.asarray(c.ids), jnp.asarray(c.mask), jnp.asarray(c.adv))
    with pytest.raises(ValueError, match=match):  # MeshAxes checks what it can alone, the call the rest
        gmpo_jax.fused_linear_policy_loss(
            jnp.asarray(c.hidden),
            jnp.zeros((H, 36)),
            batch,
            objective=gmpo_jax.GMPO(),
            sharding=gmpo_jax.MeshAxes(mesh, **kw),
        )


def test_batch_not_divisible_and_no_mesh_raise():
    mesh = _mesh((8, 1))
    h, w = jnp.zeros((6, T, H)), jnp.zeros((H, V))
    batch = gmpo_jax.PolicyBatch(jnp.zeros((6, T), jnp.int32), jnp.ones((6, T)), jnp.zeros((6,)))
    with pytest.raises(ValueError, match="multiple of the 8 data shards"):
        gmpo_jax.fused_linear_policy_loss(
            h, w, batch, objective=gmpo_jax.GMPO(), sharding=gmpo_jax.MeshAxes(mesh, data_axis="data")
        )
    with pytest.raises(ValueError, match="need mesh="):
        gmpo_jax.fused_linear_logprobs(h, w, batch.completion_ids, sharding=gmpo_jax.MeshAxes(data_axis="data"))


def test_explicit_sharding_along_hidden_raises():
    mesh = _mesh((2, 4), AxisType.Explicit)
    c, w, _ = case_for("gmpo")
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P(None, None, "model")))
    with pytest.raises(ValueError, match="batch axis and weight's vocabulary axis"):
        gmpo_jax.fused_linear_logprobs(hs, jnp.asarray(w), jnp.asarray(c.ids), completion_mask=jnp.asarray(c.mask))


# packed rows (segment_ids): several sequences per row, padding runs (id 0), one all-padding row
SEGMENTS = np.array(
    [
        [1, 1, 2, 2, 2, 0],
        [3, 3, 3, 3, 3, 3],
        [0, 0, 0, 0, 0, 0],
        [4, 5, 5, 0, 6, 6],
        [7, 7, 7, 8, 8, 8],
        [9, 9, 0, 0, 10, 10],
        [11, 11, 11, 11, 12, 12],
        [13, 0, 14, 14, 14, 14],
    ],
    np.int32,
)


@pytest.mark.parametrize("mesh_name", ["8x1", "2x4"])
@pytest.mark.parametrize("name", ["gmpo", "gspo"])
def test_packed_sharded_equals_single_device(name, mesh_name):
    """Data parallel over packed rows with a sequence-level rollout correction: the number of sequences
    (the gmpo / grpo normaliser) is global, and the single-device call equals the float64 oracle (the
    sequences unpacked one per row)."""
    obj, layout, _ = OBJECTIVES[name]
    c = make_case(11, B=B, T=T, H=H, V=V, layout=layout, mask=np.ones((B, T), bool), with_ref=obj.beta != 0)
    rng = np.random.default_rng(0)
    c.adv = rng.normal(size=SEGMENTS.max() + 1)[SEGMENTS].astype(np.float32)
    # and the sampler's log-probs: a sequence-level mismatch weight needs whole sequences on a device
    rollout = (c.old + rng.uniform(-0.3, 0.3, size=c.old.shape)).astype(np.float32)
    j = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731

    batch = gmpo_jax.PolicyBatch(
        j(c.ids), j(c.mask), j(c.adv), old_logps=j(c.old), ref_logps=j(c.ref), rollout_logps=j(rollout),
        segment_ids=j(SEGMENTS),
    )  # fmt: skip
    objective = obj.lib(rollout_is_mode="sequence_truncate")
    head = gmpo_jax.HeadOptions(weight_layout=layout, chunk_size=CHUNK)

    def loss_fn(sharding=None):
        return lambda h, w, b: gmpo_jax.fused_linear_policy_loss(
            h, w, batch, objective=objective, head=head, sharding=sharding
        )

    want = _value_and_grad(loss_fn(), jnp.asarray(c.hidden), jnp.asarray(c.weight), None)
    oracle = spec.spec_policy_loss(
        c.hidden, c.weight, c.ids, c.mask, c.adv, weight_layout=layout, old_logps=c.old, ref_logps=c.ref,
        segment_ids=SEGMENTS, rollout_logps=rollout, rollout_is_mode="sequence_truncate", **obj.spec_kwargs(),
    )  # fmt: skip
    check_against_spec(want[0], want[1], want[2], oracle, c, obj)
    shape, data_axis, vocab_axis = MESHES[mesh_name]
    mesh = _mesh(shape)
    w_spec = P(None, vocab_axis) if layout == "hv" else P(vocab_axis, None)
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P(data_axis)))
    ws = jax.device_put(c.weight, NamedSharding(mesh, w_spec))
    got = _value_and_grad(loss_fn(gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis)), hs, ws, None)
    _assert_same(got, want, f"packed {name}@{mesh_name}")


@pytest.mark.parametrize("mesh_name", ["1x8", "2x4"])
def test_softcap_sharded_equals_single_device(mesh_name):
    """Gemma's soft cap under vocabulary parallelism, with the padded vocabulary (``vocab_size``) masked:
    the cap must keep the padding columns at ``-inf`` (``c tanh(-inf / c)`` would be ``-c``); the
    single-device call equals the float64 oracle on the real head."""
    obj, layout, _ = OBJECTIVES["gmpo"]
    c, w, _ = case_for("gmpo")
    fn = _loss_fn("gmpo", softcap=2.0)
    want = _value_and_grad(fn, jnp.asarray(c.hidden), jnp.asarray(w), None)
    oracle = spec.spec_policy_loss(
        c.hidden, c.weight, c.ids, c.mask, c.adv, weight_layout=layout, old_logps=c.old, ref_logps=c.ref,
        softcap=2.0, **obj.spec_kwargs(),
    )  # fmt: skip
    real = np.take(np.asarray(want[2][1]), np.arange(V_REAL), axis=1 if layout == "hv" else 0)
    check_against_spec(want[0], want[1], (want[2][0], real, None), oracle, c, obj)
    shape, data_axis, vocab_axis = MESHES[mesh_name]
    mesh = _mesh(shape)
    w_spec = P(None, vocab_axis) if layout == "hv" else P(vocab_axis, None)
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P(data_axis)))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    got = _value_and_grad(
        _loss_fn("gmpo", softcap=2.0, sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis)),
        hs,
        ws,
        None,
    )
    _assert_same(got, want, f"softcap@{mesh_name}")


@pytest.mark.parametrize("mesh_name", ["8x1", "1x8", "2x4"])
def test_entropy_term_sharded_equals_single_device(mesh_name):
    """The entropy term (``entropy_coef``) data and vocabulary parallel: each vocabulary shard's part of
    ``dH/dz`` uses the global log-sum-exp and entropy; equals the single-device call, which equals the
    float64 oracle on the real head."""
    obj, layout, _ = OBJECTIVES["gspo"]
    c, w, _ = case_for("gspo")
    fn = _loss_fn("gspo", shaping=dict(entropy_coef=0.05))
    want = _value_and_grad(fn, jnp.asarray(c.hidden), jnp.asarray(w), None)
    oracle = spec.spec_policy_loss(
        c.hidden, c.weight, c.ids, c.mask, c.adv, weight_layout=layout, old_logps=c.old, ref_logps=c.ref,
        entropy_coef=0.05, **obj.spec_kwargs(),
    )  # fmt: skip
    real = np.take(np.asarray(want[2][1]), np.arange(V_REAL), axis=1 if layout == "hv" else 0)
    check_against_spec(want[0], want[1], (want[2][0], real, None), oracle, c, obj)
    shape, data_axis, vocab_axis = MESHES[mesh_name]
    mesh = _mesh(shape)
    w_spec = P(None, vocab_axis) if layout == "hv" else P(vocab_axis, None)
    hs = jax.device_put(c.hidden, NamedSharding(mesh, P(data_axis)))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    kw = dict(
        shaping=dict(entropy_coef=0.05), sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis)
    )
    got = _value_and_grad(_loss_fn("gspo", **kw), hs, ws, None)
    _assert_same(got, want, f"entropy@{mesh_name}")


@pytest.mark.parametrize("mesh_name", ["8x1", "2x4"])
def test_logits_precision_sharded_equals_single_device(mesh_name):
    """``logits_precision="float32"`` with bfloat16 inputs (a float32 ``dz`` in each vocabulary shard's gradient
    GEMMs) data and vocabulary parallel: equals the single-device call (test_logits_precision.py checks that one
    against float64) up to the bfloat16 rounding of the gradients (as ``test_bf16_vocab_parallel_rounds_like_
    single_device``: a psum of shard partials rounded to bfloat16 may move an element by one ulp)."""
    obj, layout, _ = OBJECTIVES["gspo"]
    c, w, _ = case_for("gspo")
    h16, w16 = jnp.asarray(c.hidden, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    want = _value_and_grad(_loss_fn("gspo", logits_precision="float32"), h16, w16, None)
    shape, data_axis, vocab_axis = MESHES[mesh_name]
    mesh = _mesh(shape)
    w_spec = P(None, vocab_axis) if layout == "hv" else P(vocab_axis, None)
    hs = jax.device_put(h16, NamedSharding(mesh, P(data_axis)))
    ws = jax.device_put(w16, NamedSharding(mesh, w_spec))
    kw = dict(logits_precision="float32", sharding=gmpo_jax.MeshAxes(mesh, data_axis=data_axis, vocab_axis=vocab_axis))
    loss, _, grads = _value_and_grad(_loss_fn("gspo", **kw), hs, ws, None)
    _close(loss, want[0], 1e-5, "loss")
    for what, g, g0 in zip(("dhidden", "dweight"), grads, want[2]):
        assert g.dtype == g0.dtype == jnp.bfloat16, what
        _close(np.asarray(g, np.float32), np.asarray(g0, np.float32), 2.0**-7, what)
