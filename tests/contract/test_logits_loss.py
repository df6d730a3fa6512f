"""``policy_loss_from_logits`` against an independent float64 NumPy computation.

The oracle here is written from SPEC.md: float64 log-softmax of the (rounded) logits, the loss, metrics
and ``d loss / d logp`` of ``spec_numpy.spec_loss_from_logp``, and ``dlogits = dlogp * (onehot - softmax)
/ tau`` by hand (zeros at the dropped last position). Tolerances: the one table of ``conftest``.

Three groups:
* the portable ``"xla"`` path: every objective, ``[B, T + 1, V]`` and ``[B, T, V]``, masks (ragged, an
  empty row, padding ids), temperature, f32 / bf16 / f16, extreme and ``-inf`` logits, edge cases,
  determinism, memory (no float32 or sliced copy of the logits), argument errors;
* the Mosaic GPU kernels in the Pallas GPU interpreter on CPU, at tiny shapes whose rows and vocabulary
  do not fill the last block (the interpreter takes seconds per kernel call: a few curated cases);
* ``gpu``-marked tests at the real shape (Llama-3 vocabulary), skipped without a Hopper GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import spec_numpy as spec
from conftest import (
    R_GRID,
    Obj,
    _on_hopper,
    assert_fraction_close,
    assert_grad_close,
    assert_loss_close,
    needs_hopper,
    ragged_mask,
)

import gmpo_jax
from gmpo_jax import kernels as K
from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Interpret-mode kernels: the device's block width (128 columns) and shallow rings, so that tiny shapes
# still have several tiles, two vocabulary splits, partial last blocks and several row blocks.
# (skip_masked_rows is on by default: most cases run the skipping kernels; *_NOSKIP / *_SKIP name it)
INTERPRET = MosaicGpuLogitsBackend(
    interpret=True,
    fwd=K.LogitsBlocks(block_v=128, stages=2),
    bwd=K.LogitsBlocks(block_v=128, stages=2, tiles_per_cta=2),
    num_splits=2,
    fused=False,
)
# The fused forward (token-local objectives write dlogits in the forward of the VJP), cluster-free there.
FUSED = MosaicGpuLogitsBackend(
    interpret=True, fwd=K.LogitsBlocks(block_v=128, stages=2), num_splits=2, skip_masked_rows=False
)
FUSED_SKIP = dataclasses.replace(FUSED, skip_masked_rows=True)  # masked rows not read (2 stages: it applies)
# The second pass fetches each row again (the tests' rows of 2 tiles are otherwise resident in the ring)
FUSED_REREAD = dataclasses.replace(FUSED, resident_rows=False)
FUSED_REREAD_SKIP = dataclasses.replace(FUSED_SKIP, resident_rows=False)
INTERPRET_LEAN = dataclasses.replace(INTERPRET, fwd=K.LogitsBlocks(block_v=128, stages=2, pick_target=False))
INTERPRET_SKIP = dataclasses.replace(INTERPRET, skip_masked_rows=True)  # 64-row blocks without work not read
assert INTERPRET_SKIP == INTERPRET, "skip_masked_rows is the default"


gpu = pytest.mark.gpu


# --------------------------------------------------------------------------------------------------
# Inputs and the float64 oracle
# --------------------------------------------------------------------------------------------------
def _f64(x):
    return np.asarray(x).astype(np.float64)


def oracle_logsoftmax(logits, T, temperature):
    z = _f64(logits)[:, :T] / temperature
    zmax = np.max(z, axis=-1, keepdims=True)
    zmax = np.where(np.isfinite(zmax), zmax, 0.0)
    return z - (zmax + np.log(np.sum(np.exp(z - zmax), axis=-1, keepdims=True)))


def oracle_logp(logits, ids, mask, T, temperature):
    logsm = oracle_logsoftmax(logits, T, temperature)
    V = logsm.shape[-1]
    valid = (ids >= 0) & (ids < V)
    lp = np.take_along_axis(logsm, np.where(valid, ids, 0)[..., None], axis=-1)[..., 0]
    return np.where(mask, np.where(valid, lp, np.nan), 0.0)


def oracle(case, obj: Obj, *, temperature=1.0, num_items=None):
    """(SpecLoss, dlogits [B, Tl, V] float64) of SPEC.md for ``case``."""
    B, T = case["ids"].shape
    logsm = oracle_logsoftmax(case["logits"], T, temperature)
    V = logsm.shape[-1]
    m = case["mask"]
    logp = oracle_logp(case["logits"], case["ids"], m, T, temperature)
    sl = spec.spec_loss_from_logp(
        np.nan_to_num(logp),
        m,
        case["adv"],
        old_logps=case["old"],
        ref_logps=case["ref"],
        rollout_is_ratio=case["ris"],
        num_items_in_batch=num_items,
        **obj.spec_kwargs(),
    )
    onehot = np.arange(V) == np.where(m, case["ids"], -1)[..., None]
    p = np.exp(logsm)
    dz = np.where(m[..., None], sl.dlogp[..., None] * (onehot - p), 0.0) / temperature
    full = np.zeros(case["logits"].shape)
    full[:, :T] = dz
    return sl, full


def make_inputs(
    seed=0,
    *,
    B=4,
    T=9,
    V=37,
    dtype="float32",
    extra=True,
    scale=2.0,
    temperature=1.0,
    off_policy=True,
    with_ref=True,
    ris=None,
    empty_row=None,
    adv=None,
    lengths=None,
):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, T + int(extra), V)) * scale).astype(DTYPES[dtype])
    mask = ragged_mask(B, T, rng, empty_row=empty_row)
    if lengths is not None:  # completion lengths instead of random ones
        mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    ids = np.where(mask, ids, np.where(rng.random((B, T)) < 0.5, -100, V + 5)).astype(np.int32)
    if adv is None:
        adv = rng.normal(size=(B,))
        adv = np.where(np.abs(adv) < 0.1, 0.7, adv)
    case = dict(logits=logits, ids=ids, mask=mask, adv=np.asarray(adv, np.float32), old=None, ref=None, ris=None)
    logp = oracle_logp(logits, ids, mask, T, temperature)
    if off_policy:  # log ratios away from every clip bound of the suite
        case["old"] = np.where(mask, logp - rng.choice(R_GRID, size=(B, T)), 0.0).astype(np.float32)
    if with_ref:
        case["ref"] = np.where(mask, logp + rng.uniform(-0.7, 0.7, size=(B, T)), 0.0).astype(np.float32)
    if ris is not None:
        shape = {"bt": (B, T), "b1": (B, 1), "b": (B,)}[ris]
        case["ris"] = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    return case


# --------------------------------------------------------------------------------------------------
# Calling the library: one jitted program per (objective, implementation), arrays traced
# --------------------------------------------------------------------------------------------------
def _call(objective, implementation, logits, ids, mask, adv, old, ref, ris, num_items, temperature):
    return gmpo_jax.policy_loss_from_logits(
        logits,
        gmpo_jax.PolicyBatch(
            ids, mask, adv, old_logps=old, ref_logps=ref, rollout_is_ratio=ris, num_items_in_batch=num_items
        ),
        objective=objective,
        temperature=temperature,
        implementation=implementation,
    )


def _vg(objective, implementation, logits, *rest):
    return jax.value_and_grad(lambda z: _call(objective, implementation, z, *rest), has_aux=True)(logits)


_VG = jax.jit(_vg, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
_LOSS = jax.jit(_call, static_argnums=(0, 1), compiler_options=FAST_COMPILE)


def _args(case, temperature, num_items):
    j = lambda x: None if x is None else jnp.asarray(x)
    return (
        j(case["logits"]),
        j(case["ids"]),
        j(case["mask"]),
        j(case["adv"]),
        j(case["old"]),
        j(case["ref"]),
        j(case["ris"]),
        None if num_items is None else jnp.float32(num_items),
        jnp.float32(temperature),
    )


def value_and_grad(case, obj: Obj, implementation="xla", *, temperature=1.0, num_items=None):
    return _VG(obj.lib(), implementation, *_args(case, temperature, num_items))


def check(case, obj: Obj, implementation="xla", *, temperature=1.0, num_items=None):
    """Loss, metrics and dlogits of the library against the float64 oracle; returns the library's output."""
    want, dwant = oracle(case, obj, temperature=temperature, num_items=num_items)
    assert want.margin > 1e-4, "test setup: a ratio sits within 1e-4 of a bound"
    (loss, aux), g = value_and_grad(case, obj, implementation, temperature=temperature, num_items=num_items)
    dtype = case["logits"].dtype
    assert loss.dtype == jnp.float32
    assert_loss_close(loss, want.loss, want.scale, dtype)
    m = want.metrics
    for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high"):
        if k == "clip_fraction" or obj.loss_type == "gmpo":
            assert_fraction_close(getattr(aux, k), m[k], k)
    if obj.beta:
        assert_loss_close(aux.kl, m["kl"], max(abs(m["kl"]), abs(m["kl_uncorrected"])), dtype, what="aux.kl")
    assert float(aux.loss_denominator) == pytest.approx(m["loss_denominator"], rel=1e-6)
    assert_loss_close(
        aux.loss_numerator, m["loss_numerator"], want.scale * m["loss_denominator"], dtype, what="loss_numerator"
    )
    assert g.shape == case["logits"].shape
    assert_grad_close(np.asarray(g), dwant, dtype, "dlogits")
    T = case["ids"].shape[1]
    assert np.all(np.asarray(g)[:, T:] == 0), "the dropped last position must get an exactly zero gradient"
    return (loss, aux), g


OBJECTIVES = [
    Obj("gmpo"),
    Obj("gmpo", beta=0.04, bias_kl=True),
    Obj("gmpo", epsilon_low=0.25, epsilon_high=0.5),
    Obj("grpo", beta=0.04),
    Obj("grpo", level="sequence", beta=0.04, bias_kl=True),
    Obj("bnpo", delta=1.5),
    Obj("dr_grpo", max_completion_length=11),
    Obj("dapo", epsilon_low=0.2, epsilon_high=0.28),
    Obj("dapo", level="sequence", delta=1.5, beta=0.04),
    Obj("cispo", epsilon_high=1.3, beta=0.04, bias_kl=True),
    Obj("sapo", tau_pos=0.5, tau_neg=2.0, beta=0.04),
]


# --------------------------------------------------------------------------------------------------
# The portable path
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
def test_objectives_xla(obj):
    """Every objective; [B, T+1, V] and [B, T, V] alternate, an empty row, padding ids, temperature 0.7."""
    i = OBJECTIVES.index(obj)
    ris = (None, "bt", "b1", "b")[i % 4] if obj.loss_type != "gmpo" else None
    case = make_inputs(10 + i, extra=bool(i % 2 == 0), empty_row=2, ris=ris, temperature=0.7)
    check(case, obj, temperature=0.7, num_items=23 if obj.loss_type in ("dapo", "cispo") else None)


@pytest.mark.parametrize("obj", [Obj("gmpo"), Obj("gmpo", beta=0.04, bias_kl=True), Obj("dapo"), Obj("sapo")], ids=str)
def test_on_policy_xla(obj):
    """old = stop_gradient(logp): r = 0 exactly, d r / d logp = 1."""
    check(make_inputs(3, off_policy=False), obj)


VARIANTS = [  # dtype, [B, T+1, V]?, temperature, scale, objective
    ("bfloat16", True, 1.0, 2.0, Obj("gmpo")),
    ("bfloat16", False, 0.7, 3.0, Obj("grpo", beta=0.04)),
    ("float16", True, 1.3, 2.0, Obj("dapo", delta=1.5)),
    ("float32", False, 2.0, 30.0, Obj("cispo", epsilon_high=1.3)),
    ("bfloat16", True, 0.5, 1000.0, Obj("gmpo", beta=0.04)),  # large bf16 logits (levanter's scale sweep)
]


@pytest.mark.parametrize(
    "dtype, extra, temperature, scale, obj",
    VARIANTS,
    ids=[f"{d}-{'T+1' if e else 'T'}-tau{t}-x{s}-{o}" for d, e, t, s, o in VARIANTS],
)
def test_dtypes_xla(dtype, extra, temperature, scale, obj):
    """Gradients come back in the logits' dtype; bf16 / f16 judged against the oracle on the ROUNDED logits."""
    case = make_inputs(4, dtype=dtype, extra=extra, temperature=temperature, scale=scale)
    _, g = check(case, obj, temperature=temperature)
    assert g.dtype == case["logits"].dtype


def test_extreme_and_masked_vocab_logits_xla():
    """|z| up to 1e4 / tau and -inf columns (a vocabulary mask): finite, and the float64 value up to the
    float32 rounding of the log-sum-exp of such logits (conftest's logp rule: 2e-6 * (1 + max|z|))."""
    tau = 0.5
    case = make_inputs(5, scale=1.0, temperature=tau)
    z = case["logits"]
    z[0, :, :5] = 1e4
    z[0, :, 5] = -1e4
    z[1, :, ::3] = -np.inf
    case["ids"][1] = np.where(case["mask"][1], 1, case["ids"][1])  # targets stay on finite columns
    logp = oracle_logp(z, case["ids"], case["mask"], 9, tau)
    case["old"] = np.where(case["mask"], logp - 0.05, 0.0).astype(np.float32)
    case["ref"] = None
    obj = Obj("gmpo")
    want, dwant = oracle(case, obj, temperature=tau)
    (loss, aux), g = value_and_grad(case, obj, temperature=tau)
    g = np.asarray(g)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
    dlogp_err = 2e-6 * (1 + 1e4 / tau)  # f32 ulps of a log-sum-exp near 2e4
    assert abs(float(loss) - want.loss) <= dlogp_err * np.abs(want.dlogp).sum() + 1e-5 * want.scale
    assert np.max(np.abs(g - dwant)) <= dlogp_err * np.abs(dwant).max()
    assert float(aux.clip_fraction) == want.metrics["clip_fraction"]


def test_all_masked_and_zero_advantage_xla():
    case = make_inputs(6)
    case["mask"][:] = False
    (loss, aux), g = value_and_grad(case, Obj("gmpo"))
    assert float(loss) == 0.0 and float(aux.clip_fraction) == 0.0
    assert np.all(np.asarray(g) == 0)
    case = make_inputs(7, adv=[0.0, 1.0, 0.0, -1.0])
    case["old"][0] = np.where(case["mask"][0], -1e4, 0.0)  # ratio overflows f32 on a zero-advantage row
    (loss, _), g = value_and_grad(case, Obj("grpo"))
    assert np.isfinite(float(loss))
    g = np.asarray(g)
    assert np.all(g[0] == 0) and np.all(g[2] == 0) and np.any(g[1] != 0)


def test_unmasked_out_of_range_id_is_nan_xla():
    case = make_inputs(8)
    case["ids"][0, 0] = 37  # == V, unmasked (row 0 is full)
    (loss, _), _ = value_and_grad(case, Obj("gmpo"))
    assert np.isnan(float(loss))


def test_primal_and_jit_agree_and_deterministic_xla():
    case = make_inputs(9, dtype="bfloat16")
    obj = Obj("dapo", beta=0.04)
    (l1, a1), g1 = value_and_grad(case, obj)
    (l2, a2), g2 = value_and_grad(case, obj)
    assert np.array_equal(np.asarray(g1), np.asarray(g2)) and float(l1) == float(l2)
    l3, a3 = _LOSS(obj.lib(), "xla", *_args(case, 1.0, None))  # plain evaluation: no gradient work
    assert float(l3) == float(l1) and float(a3.kl) == float(a1.kl)
    l4, _ = gmpo_jax.policy_loss_from_logits(
        jnp.asarray(case["logits"]),
        gmpo_jax.PolicyBatch(case["ids"], case["mask"], case["adv"], old_logps=case["old"], ref_logps=case["ref"]),
        objective=obj.lib(),
    )
    assert float(l4) == pytest.approx(float(l1), rel=1e-6)


def test_memory_no_logits_copy_xla():
    """The compiled value-and-grad allocates no [B, T, V] temporary (no f32 upcast, no sliced copy)."""
    B, T, V = 4, 64, 4096
    logits = jax.ShapeDtypeStruct((B, T + 1, V), jnp.bfloat16)
    small = jax.ShapeDtypeStruct((B, T), jnp.float32)
    f = jax.jit(
        lambda z, ids, m, a, old: jax.value_and_grad(
            lambda z: gmpo_jax.policy_loss_from_logits(
                z, gmpo_jax.PolicyBatch(ids, m, a, old_logps=old), objective=gmpo_jax.GMPO(), implementation="xla"
            )[0]
        )(z)
    )
    mem = (
        f.lower(
            logits,
            jax.ShapeDtypeStruct((B, T), jnp.int32),
            jax.ShapeDtypeStruct((B, T), jnp.bool_),
            jax.ShapeDtypeStruct((B,), jnp.float32),
            small,
        )
        .compile()
        .memory_analysis()
    )
    slice_bf16 = B * T * V * 2
    assert mem.temp_size_in_bytes < slice_bf16 // 4, mem


def test_argument_errors():
    case = make_inputs(0)
    z, ids, m, a = (jnp.asarray(case[k]) for k in ("logits", "ids", "mask", "adv"))
    obj = gmpo_jax.GMPO()
    with pytest.raises(ValueError, match="logits must have shape"):
        gmpo_jax.policy_loss_from_logits(z[:, :-3], gmpo_jax.PolicyBatch(ids, m, a), objective=obj)
    with pytest.raises(ValueError, match="advantages"):
        gmpo_jax.policy_loss_from_logits(z, gmpo_jax.PolicyBatch(ids, m, a[:2]), objective=obj)
    with pytest.raises(TypeError, match="logits"):
        gmpo_jax.policy_loss_from_logits(z.astype(jnp.int32), gmpo_jax.PolicyBatch(ids, m, a), objective=obj)
    with pytest.raises(ValueError, match="needs a reference"):
        gmpo_jax.policy_loss_from_logits(z, gmpo_jax.PolicyBatch(ids, m, a), objective=gmpo_jax.GRPO(beta=0.1))
    with pytest.raises(ValueError, match="temperature"):
        gmpo_jax.policy_loss_from_logits(z, gmpo_jax.PolicyBatch(ids, m, a), objective=obj, temperature=0.0)
    with pytest.raises(ValueError, match="implementation"):
        gmpo_jax.policy_loss_from_logits(z, gmpo_jax.PolicyBatch(ids, m, a), objective=obj, implementation="triton")
    if not _on_hopper():
        with pytest.raises(BackendUnavailableError):
            gmpo_jax.policy_loss_from_logits(
                z, gmpo_jax.PolicyBatch(ids, m, a), objective=obj, implementation="mosaic_gpu"
            )
    with pytest.raises(UnsupportedConfigError, match="dtype"):  # the kernels take bf16 / f16 / f32
        gmpo_jax.policy_loss_from_logits(
            z.astype(jnp.float8_e4m3fn), gmpo_jax.PolicyBatch(ids, m, a), objective=obj, implementation=INTERPRET
        )
    with pytest.raises(UnsupportedConfigError, match="no k meets"):  # 100-column rows: no 128-byte tiling
        gmpo_jax.policy_loss_from_logits(
            z[..., :100].astype(jnp.bfloat16), gmpo_jax.PolicyBatch(ids, m, a), objective=obj, implementation=INTERPRET
        )


# --------------------------------------------------------------------------------------------------
# The Mosaic GPU kernels, in the Pallas GPU interpreter (CPU), at shapes the device accepts (rows of the
# kernels' view a multiple of 8, V a multiple of 64) whose rows and vocabulary do not fill the last block.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, B, T, V, extra, obj, temperature, backend",
    [
        # 2 x 36 = 72 rows (two row blocks, the second slid back), V = 320 = 2.5 tiles of 128
        ("bfloat16", 2, 35, 320, True, Obj("gmpo", beta=0.04), 0.7, INTERPRET),
        # 3 x 22 = 66 rows: viewed as 264 rows of 192 columns (k = 4); target gathered outside the kernel
        ("float16", 3, 22, 768, False, Obj("dapo", level="sequence", delta=1.5), 1.0, INTERPRET_LEAN),
        # float32 logits: 128-byte rows of 32 elements; 2 x 40 = 80 rows, V = 288 = 2.25 tiles of 128
        ("float32", 2, 39, 288, True, Obj("cispo", beta=0.04), 1.3, INTERPRET),
        ("float32", 3, 22, 768, False, Obj("grpo"), 1.0, INTERPRET_LEAN),
    ],
    ids=["bf16-T+1-gmpo-beta", "f16-T-rowsplit4-lean-dapo-seq", "f32-T+1-cispo-beta", "f32-T-rowsplit4-lean-grpo"],
)
def test_mosaic_gpu_interpret(dtype, B, T, V, extra, obj, temperature, backend):
    case = make_inputs(11, B=B, T=T, V=V, dtype=dtype, extra=extra, temperature=temperature, empty_row=1)
    (loss, aux), g = check(case, obj, backend, temperature=temperature)
    (l_x, a_x), g_x = value_and_grad(case, obj, "xla", temperature=temperature)
    assert float(loss) == pytest.approx(float(l_x), rel=1e-5, abs=1e-7)
    assert float(aux.clip_fraction) == float(a_x.clip_fraction)


def test_row_block_flags():
    """One flag per CTA row block at its first row (the last block slid back to end at R), 0 elsewhere."""
    live = np.zeros(200, bool)
    live[[5, 150]] = True  # blocks 0 ([0, 64)) and 2 ([128, 192)); block 1 empty; block 3 = [136, 200)
    flags = np.asarray(K.row_block_flags(jnp.asarray(live)))
    want = np.zeros(200, np.float32)
    want[[0, 136, 128]] = 1.0  # rows 0, 128 and the slid-back 136 (150 is in it); row 64: 0
    np.testing.assert_array_equal(flags, want)
    assert np.asarray(K.row_block_flags(jnp.zeros(64, bool))).sum() == 0


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_kernels_skip_flagged_blocks_interpret(inplace):
    """Kernel level: a block flagged dead is not read, whatever its rows hold: the forward reports m2 = l =
    t2 = 0 there, the backward stores zeros there (its c is nonzero: a kernel that read it would not);
    the other blocks match the kernels without flags bitwise. R = 192: three blocks, the middle one
    flagged dead (a flag must hold for every row of its block: ``row_block_flags`` guarantees it, and
    rows shared with a slid-back block are then dead in both)."""
    rng = np.random.default_rng(13)
    R, V, tau = 192, 256, 0.7
    x = jnp.asarray(rng.normal(size=(R, V)).astype(ml_dtypes.bfloat16))
    ids = jnp.asarray(rng.integers(0, V, R).astype(np.int32))
    k = jnp.full((R,), K.LOG2E / tau, jnp.float32)
    flags = np.zeros(R, np.float32)
    flags[[0, 128]] = 1.0  # block [64, 128) dead
    flags = jnp.asarray(flags)
    dead = slice(64, 128)
    cfg = K.LogitsBlocks(block_v=128, stages=2, tiles_per_cta=1)
    params = INTERPRET._interpret_params()
    ref = K.logits_lse_partials(x, ids, k, cfg=cfg, num_splits=2, interpret=params)
    got = K.logits_lse_partials(x, ids, k, cfg=cfg, num_splits=2, block_live=flags, interpret=params)
    for r, g in zip(ref, got):
        r, g = np.array(r), np.asarray(g)
        assert np.all(g[:, dead] == 0), "a dead block must report zeros, not read its rows"
        r[:, dead] = 0.0
        np.testing.assert_array_equal(g, r)
    lse2 = K.logits_merge_splits(*ref)[2]
    c = jnp.asarray(rng.normal(size=R).astype(np.float32))
    kw = dict(cfg=cfg, inplace=inplace, interpret=params)
    d_ref = np.array(K.logits_dlogits(x, ids, k, lse2, c, **kw))
    d = np.asarray(K.logits_dlogits(x, ids, k, lse2, c, block_live=flags, **kw))
    assert np.all(d[dead] == 0) and np.abs(d_ref[dead]).max() > 0
    d_ref[dead] = 0
    np.testing.assert_array_equal(d, d_ref)


@pytest.mark.parametrize(
    "backend, beta",
    [
        (INTERPRET_SKIP, 0.04),
        (dataclasses.replace(INTERPRET_SKIP, fwd=INTERPRET_LEAN.fwd), 0.0),
        (dataclasses.replace(INTERPRET_SKIP, inplace=True), 0.0),
    ],
    ids=["pick-0.04", "lean-0.0", "inplace-0.0"],
)
def test_skip_masked_rows_three_pass_interpret(backend, beta):
    """``skip_masked_rows`` on the three-pass path (GMPO) against float64 and against the same call without
    skipping (equal loss and dlogits): 4 x 50 rows of the kernels' view = four 64-row blocks, the
    second all masked (sequence 1 after 10 tokens, sequence 2 empty: not read forward or backward), the third
    and the slid-back fourth ([136, 200)) hold sequence 3, of zero advantage (read forward; without a KL term
    its gradient is exactly 0: not read backward). beta only changes the backward's flags (the forward reads
    the zero-advantage blocks either way): the out-of-place backward runs with that block skipped (lean, 0.0)
    and read (pick, 0.04), the in-place one with it skipped (zeros stored in place); the forward picks the
    target (pick, inplace) and gathers it outside (lean)."""
    B, T, V = 4, 49, 320
    case = make_inputs(21, B=B, T=T, V=V, dtype="bfloat16", lengths=[T, 10, 0, T], adv=[0.8, -1.1, 0.5, 0.0])
    obj = Obj("gmpo", beta=beta)
    (loss, aux), g = check(case, obj, backend, temperature=0.8)
    (l_0, a_0), g_0 = value_and_grad(case, obj, dataclasses.replace(backend, skip_masked_rows=False), temperature=0.8)
    assert float(loss) == pytest.approx(float(l_0), rel=1e-6, abs=1e-8)
    assert float(aux.clip_fraction) == float(a_0.clip_fraction)
    # within one bfloat16 ulp: the wrapper's selects change XLA's fusion of the lean path's log-sum-exp, and a
    # float32 ulp there can move a bfloat16 rounding (seen once in 64000 entries); bitwise otherwise
    g, g_0 = _f64(g), _f64(g_0)
    np.testing.assert_allclose(g, g_0, rtol=2**-7, atol=0)
    if backend.fwd.pick_target:
        np.testing.assert_array_equal(g, g_0)


@pytest.mark.parametrize("pick_target", [True, False], ids=["pick", "lean"])
def test_mosaic_gpu_kernels_interpret_extreme(pick_target):
    """Kernel level: extreme and -inf logits, ids outside [0, V), a row block sliding back (R = 72)."""
    rng = np.random.default_rng(12)
    R, V, tau = 72, 192, 0.5
    x = rng.normal(size=(R, V)).astype(np.float32)
    x[0, :7] = 1e4
    x[1, 3:] = -np.inf
    x[2, :] = -np.inf
    x[3, ::2] = -1e4
    x = x.astype(ml_dtypes.bfloat16)
    ids = rng.integers(0, V, R).astype(np.int32)
    ids[1], ids[5], ids[6] = 0, -100, V + 3
    k = jnp.full((R,), K.LOG2E / tau, jnp.float32)
    cfg = K.LogitsBlocks(block_v=128, stages=2, tiles_per_cta=1, pick_target=pick_target)
    params = INTERPRET._interpret_params()
    tgt, lse, lse2 = K.logits_merge_splits(
        *K.logits_lse_partials(jnp.asarray(x), jnp.asarray(ids), k, cfg=cfg, num_splits=2, interpret=params)
    )
    z = _f64(x) / tau
    with np.errstate(invalid="ignore", divide="ignore"):
        zmax = z.max(1)
        want_lse = np.where(np.isfinite(zmax), zmax + np.log(np.exp(z - zmax[:, None]).sum(1)), -np.inf)
    ok = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[ok], want_lse[ok], rtol=2e-6, atol=1e-5)
    assert np.asarray(lse)[2] == -np.inf  # an all -inf row: no NaN
    if pick_target:
        valid = (ids >= 0) & (ids < V)
        want_t = np.where(valid, z[np.arange(R), np.clip(ids, 0, V - 1)], 0.0)
        np.testing.assert_allclose(np.asarray(tgt)[ok], want_t[ok], rtol=1e-6)
        return
    c = rng.normal(size=R).astype(np.float32)
    c[2] = 0.0  # a row with -inf lse must not leak NaN when it carries no gradient
    d = K.logits_dlogits(jnp.asarray(x), jnp.asarray(ids), k, lse2, jnp.asarray(c), cfg=cfg, interpret=params)
    d = _f64(d)
    assert np.all(d[2] == 0) and np.all(np.isfinite(d))
    p = np.exp(z[ok] - want_lse[ok, None])
    onehot = np.arange(V) == ids[ok, None]
    want_d = c[ok, None] * (onehot - p)
    np.testing.assert_allclose(d[ok], want_d, rtol=1e-2, atol=1e-2 * np.abs(want_d).max())


@pytest.mark.parametrize("backend", [INTERPRET, INTERPRET_LEAN], ids=["pick", "lean"])
@pytest.mark.parametrize("temperature", [1e-6, 1e-2])
def test_mosaic_gpu_interpret_tiny_temperature_argmax_targets(backend, temperature):
    """Targets at each row's argmax, tiny temperature: the softmax is one-hot, so logp = 0 and dlogits
    ~ 0 (float64); the gradient compared at 1e-2 of its scale 1 / T (CISPO at 5.0: d loss / d logp =
    -1 / N). Failed at T = 1e-6 before the backward's snap (``snap_tolerance``) and the ``logp <= 0``
    clamp: ulps of a ~1e7 log-sum-exp gave the argmax p = 2**(+-0.5) and a positive log-prob."""
    rng = np.random.default_rng(3)
    B, T, V = 2, 39, 256  # 80 rows
    z = jnp.asarray(rng.standard_normal((B, T + 1, V)), jnp.bfloat16)
    ids = np.asarray(z[:, :T]).argmax(-1).astype(np.int32)  # argmax of the bf16 logits themselves
    loss, g = jax.jit(
        jax.value_and_grad(
            lambda zl: gmpo_jax.policy_loss_from_logits(
                zl,
                gmpo_jax.PolicyBatch(ids, np.ones((B, T)), np.ones(B)),
                objective=gmpo_jax.CISPO(epsilon_high=5.0),
                temperature=temperature,
                implementation=backend,
            )[0]
        )
    )(z)
    zt = _f64(z[:, :T]) / temperature
    p = np.exp(zt - zt.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logp = np.log(np.take_along_axis(p, ids[..., None], -1))[..., 0]
    # float32 resolves a log-prob to a few ulps of |z| / T (0.25 at 1e-6): 1e-6 |z / T| absolute
    assert float(loss) == pytest.approx(-logp.mean(), rel=1e-5, abs=1e-6 * np.abs(zt).max())
    want = -(np.eye(V)[ids] - p) / temperature / (B * T)
    np.testing.assert_allclose(_f64(g)[:, :T], want, rtol=0, atol=1e-2 / temperature / (B * T))
    assert np.all(_f64(g)[:, T] == 0)


@pytest.mark.parametrize(
    "B, T, extra, V, lean, dtype",
    [
        (2, 1024, True, 128256, False, jnp.bfloat16),  # 2050 rows -> viewed as 8200 x 32064 (k = 4)
        (16, 1024, True, 128256, True, jnp.bfloat16),  # 16400 rows (k = 1)
        (3, 22, False, 768, False, jnp.bfloat16),  # 66 rows -> 264 x 192
        (2, 1024, True, 128256, True, jnp.float32),  # float32: 32-column (128-byte) tiles, 2x the SMEM
        (2, 1024, True, 128256, "inplace", jnp.bfloat16),  # dlogits into the logits' buffer, 64-column tiles
        (16, 1024, True, 128256, "skip", jnp.bfloat16),  # skip_masked_rows: blocks without work not read
        (2, 1024, True, 128256, "inplace-skip", jnp.bfloat16),  # zero blocks stored in place
    ],
    ids=[
        "llama3-2x1025",
        "llama3-16x1025-lean",
        "tiny-3x22",
        "llama3-2x1025-f32-lean",
        "llama3-2x1025-inplace",
        "llama3-16x1025-skip",
        "llama3-2x1025-inplace-skip",
    ],
)
def test_mosaic_gpu_lowers_for_cuda(B, T, extra, V, lean, dtype):
    """Both kernels lower to Mosaic GPU for CUDA (jax.export on CPU; no GPU needed): shapes, layouts and
    the tiled bulk copies' divisibility rules are checked at this stage (what failed on the device at
    2050 rows before the row split)."""
    backend = MosaicGpuLogitsBackend(
        fwd=K.LogitsBlocks(pick_target=not lean),
        inplace=str(lean).startswith("inplace"),
        skip_masked_rows=str(lean).endswith("skip"),
    )
    dataclasses.replace(backend, interpret=True).check_supported(dtype=dtype, B=B, T=T, Tl=T + int(extra), V=V)
    z = jax.ShapeDtypeStruct((B, T + int(extra), V), dtype)
    i = jax.ShapeDtypeStruct((B, T), jnp.int32)
    m = jax.ShapeDtypeStruct((B, T), jnp.bool_)
    f = jax.ShapeDtypeStruct((B, T), jnp.float32)
    r = jax.ShapeDtypeStruct((B, T + int(extra)), jnp.float32)
    fwd = jax.jit(lambda z, i, m: backend.logprobs(z, i, T=T, temperature=jnp.float32(0.9), mask=m))
    bwd = jax.jit(lambda z, i, r, d: backend.dlogits(z, i, r, d, T=T, temperature=jnp.float32(0.9)))
    jax.export.export(fwd, platforms=["cuda"])(z, i, m)
    jax.export.export(bwd, platforms=["cuda"])(z, i, r, f)


# --------------------------------------------------------------------------------------------------
# The fused path: token-local objectives, dlogits written by the forward (``logits_lse_and_dlogits``)
# --------------------------------------------------------------------------------------------------
TOKEN_LOCAL = [
    Obj("grpo", beta=0.04),
    Obj("dapo", epsilon_low=0.2, epsilon_high=0.28, delta=1.5),
    Obj("bnpo", beta=0.04, bias_kl=True),
    Obj("dr_grpo", max_completion_length=17),
    Obj("cispo", epsilon_high=1.3, beta=0.04, bias_kl=True),
    Obj("sapo", tau_pos=0.5, tau_neg=2.0, beta=0.04),
]


def _uses_fused(backend, obj, case) -> bool:
    from gmpo_jax.logits.vjp import LogitsConfig, _fused

    B, T = case["ids"].shape
    return _fused(LogitsConfig(backend=backend, T=T), obj, jnp.asarray(case["logits"]))


@pytest.mark.parametrize("obj", TOKEN_LOCAL, ids=str)
def test_fused_interpret(obj):
    """Every token-local objective through the fused kernel (interpreter) against float64: bf16 with
    [B, T + 1, V] (64 rows of 1152 = 72 slabs of 16 columns: a slid-back last tile) and float32 with
    [B, T, V] (576 = 72 slabs of 8), ragged masks with an empty row and padding ids, temperature 0.7, a
    rollout IS ratio, on- and off-policy; in turn with rows resident in the ring or read twice, with and
    without ``skip_masked_rows``."""
    i = TOKEN_LOCAL.index(obj)
    backend = (FUSED, FUSED_SKIP, FUSED_REREAD_SKIP, FUSED_REREAD)[i % 4]
    dtype, T, V, extra = (("bfloat16", 15, 1152, True), ("float32", 16, 576, False))[i % 2]
    ris = (None, "bt", "b1")[i % 3]
    case = make_inputs(
        30 + i, B=4, T=T, V=V, dtype=dtype, extra=extra, empty_row=2, ris=ris, temperature=0.7, off_policy=i != 3
    )
    assert _uses_fused(backend, obj.lib(), case)
    num_items = 29 if obj.loss_type in ("dapo", "cispo") else None
    (loss, aux), g = check(case, obj, backend, temperature=0.7, num_items=num_items)
    (l_3, a_3), g_3 = value_and_grad(case, obj, INTERPRET, temperature=0.7, num_items=num_items)
    assert float(loss) == pytest.approx(float(l_3), rel=1e-5, abs=1e-7)
    assert float(aux.clip_fraction) == float(a_3.clip_fraction)


def test_fused_only_where_it_applies():
    """GMPO and GSPO (sequence-level) keep the three passes, and so do traced hyper-parameters, in place,
    ``fused=False`` and vocabularies that do not view as slabs; the primal (no gradient) never fuses."""
    case = make_inputs(1, B=4, T=15, V=1152, dtype="bfloat16")
    assert _uses_fused(FUSED, gmpo_jax.GRPO(), case)
    for obj in (gmpo_jax.GMPO(), gmpo_jax.GRPO(importance_sampling_level="sequence")):
        assert not obj.token_local and not _uses_fused(FUSED, obj, case)
    for backend in (dataclasses.replace(FUSED, inplace=True), dataclasses.replace(FUSED, fused=False)):
        assert not _uses_fused(backend, gmpo_jax.GRPO(), case)
    assert not _uses_fused(FUSED, gmpo_jax.GRPO(), make_inputs(1, B=4, T=15, V=1088, dtype="bfloat16"))
    # float16: the stored unit-cotangent dlogits would lose small entries before a loss scale lifts them
    assert not _uses_fused(FUSED, gmpo_jax.GRPO(), make_inputs(1, B=4, T=15, V=1152, dtype="float16"))
    assert _uses_fused(FUSED, gmpo_jax.GRPO(), make_inputs(1, B=4, T=15, V=2048, dtype="bfloat16"))  # w = 32
    traced = []
    jax.jit(lambda e: traced.append(_uses_fused(FUSED, gmpo_jax.GRPO(epsilon_high=e), case)) or e)(jnp.float32(0.3))
    assert traced == [False]
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Spy(MosaicGpuLogitsBackend):
        def logprobs_and_dlogits(self, *a, **kw):
            calls.append("fused")
            return super().logprobs_and_dlogits(*a, **kw)

    spy = Spy(interpret=True, fwd=FUSED.fwd, num_splits=2)
    args = _args(case, 1.0, None)
    jax.eval_shape(lambda z: _call(gmpo_jax.GRPO(), spy, z, *args[1:]), args[0])
    assert calls == []
    jax.eval_shape(jax.grad(lambda z: _call(gmpo_jax.GRPO(), spy, z, *args[1:])[0]), args[0])
    assert calls == ["fused"]


@pytest.mark.parametrize("obj", [gmpo_jax.GRPO(loss_type="dapo"), gmpo_jax.CISPO(epsilon_high=5.0)], ids=str)
def test_fused_interpret_tiny_temperature_unique_max(obj):
    """Targets at each row's unique maximum (6.90625: its product with log2(e) / tau is not exact), tau =
    1e-6, old = 0 (true ratio 1): logp = 0, the same loss and metrics as xla, a zero gradient. Failed
    before pass A formed (x - m) k instead of x k - m k, which the compiler contracts into a multiply-add
    that left the maximum 2**+-0.5 (found by a review: loss 0.0051 instead of 3e-8, |dlogits| 2784)."""
    rng = np.random.default_rng(0)
    B, T, V, tau = 4, 15, 1152, 1e-6
    z = np.clip(rng.normal(size=(B, T + 1, V)) * 2, -6, 6).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    z[np.arange(B)[:, None], np.arange(T)[None], ids] = 6.90625
    logits = jnp.asarray(z, jnp.bfloat16)
    mask, adv, old = np.ones((B, T), bool), np.asarray([1.0, -0.5, 0.7, -1.2], np.float32), np.zeros((B, T))
    out = {}
    for name, impl in (("fused", FUSED), ("xla", "xla")):
        assert name != "fused" or _uses_fused(FUSED, obj, dict(ids=ids, logits=logits))
        out[name] = jax.jit(
            jax.value_and_grad(
                lambda l: gmpo_jax.policy_loss_from_logits(
                    l,
                    gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old),
                    objective=obj,
                    temperature=tau,
                    implementation=impl,
                ),
                has_aux=True,
            )
        )(logits)
    ((loss, aux), g), ((l_x, a_x), _) = out["fused"], out["xla"]
    assert float(loss) == pytest.approx(float(l_x), rel=1e-6, abs=1e-6)
    assert float(aux.log_ratio_min) == float(a_x.log_ratio_min) == 0.0
    assert float(aux.clip_fraction) == float(a_x.clip_fraction)
    scale = 1.0 / tau / (B * T)  # the gradient's scale: 1 / (tau N)
    assert np.abs(_f64(g)).max() <= 1e-6 * scale


def test_fused_token_loss_is_chunk_numerator():
    """``sum(token_weights * token_loss)`` has the gradient of ``chunk_numerator / denominator`` for every
    token-local objective, on- and off-policy, with ratios at and around the clip bounds."""
    from gmpo_jax.objectives import PolicyInputs

    rng = np.random.default_rng(5)
    B, T = 6, 7
    mask = jnp.asarray(ragged_mask(B, T, rng, empty_row=1))
    logp = jnp.asarray(-rng.uniform(0.1, 4.0, (B, T)), jnp.float32)
    bounds = np.log(np.array([0.8, 1.2, 1.28, 1.5, 1.3]))
    lr = np.where(rng.random((B, T)) < 0.3, rng.choice(bounds, (B, T)), rng.normal(0, 0.4, (B, T)))
    old = logp - jnp.asarray(lr, jnp.float32)
    ref = logp + jnp.asarray(rng.uniform(-0.5, 0.5, (B, T)), jnp.float32)
    ris = jnp.asarray(rng.uniform(0.5, 1.5, (B, T)), jnp.float32)
    adv = jnp.asarray([1.0, -0.5, 0.0, 2.0, -1.5, 0.3], jnp.float32)
    adv_bt = jnp.broadcast_to(adv[:, None], (B, T))
    for obj in TOKEN_LOCAL:
        o = obj.lib()
        for old_ in (old, None):
            data = PolicyInputs(mask, adv, old_, ref if obj.beta else None, ris)
            want = jax.grad(lambda lp: o.chunk_numerator(lp, data)[0] / o.denominator(mask, None))(logp)
            got = jax.grad(
                lambda lp: jnp.sum(
                    o.token_weights(mask, None)
                    * jnp.where(mask, o.token_loss(lp, old_, data.ref_logps, adv_bt, ris), 0.0)
                )
            )(logp)
            np.testing.assert_allclose(
                np.asarray(got),
                np.asarray(want),
                rtol=1e-6,
                atol=1e-9,
                err_msg=f"{obj} old={'given' if old_ is not None else 'None'}",
            )
            assert np.any(np.asarray(want) != 0)


@pytest.mark.parametrize(
    "V, dtype",
    [(128256, jnp.bfloat16), (151936, jnp.bfloat16), (128256, jnp.float32)],
    ids=["llama3-bf16", "qwen2-bf16", "llama3-f32"],
)
@pytest.mark.parametrize("obj", [Obj("grpo", beta=0.04), Obj("cispo", beta=0.04, bias_kl=True), Obj("sapo")], ids=str)
def test_fused_lowers_for_cuda(V, dtype, obj):
    """The fused kernel with the device's plan (clusters of CTAs that merge statistics through distributed
    shared memory, which the interpreter lacks) lowers for CUDA, with each objective's gradient inside."""
    backend = MosaicGpuLogitsBackend()
    B, T = 2, 1024
    assert backend.fused_plan(dtype=dtype, R=B * (T + 1), V=V)[1].cluster == 4
    o = obj.lib()
    z = jax.ShapeDtypeStruct((B, T + 1, V), dtype)
    f = jax.ShapeDtypeStruct((B, T), jnp.float32)
    i = jax.ShapeDtypeStruct((B, T), jnp.int32)
    b = jax.ShapeDtypeStruct((B,), jnp.float32)
    mask = jnp.ones((B, T), bool)
    fused = jax.jit(
        lambda z, i, a, old, ref: backend.logprobs_and_dlogits(
            z,
            i,
            T=T,
            temperature=jnp.float32(0.9),
            objective=o,
            old_logps=old,
            ref_logps=ref if obj.beta else None,
            advantages=a,
            rollout_is_ratio=None,
            weights=o.token_weights(mask, None),
            mask=mask,
            id_ok=mask,
        )
    )
    text = jax.export.export(fused, platforms=["cuda"])(z, i, b, f, f).mlir_module()
    assert "lse_and_dlogits" in text


# --------------------------------------------------------------------------------------------------
# On the device (Hopper): the real vocabulary, both kernels, against float64 and the xla path
# --------------------------------------------------------------------------------------------------
@gpu
@needs_hopper
@pytest.mark.parametrize(
    "extra, obj, dtype",
    [
        (True, Obj("gmpo"), "bfloat16"),
        (False, Obj("dapo", beta=0.04), "bfloat16"),
        (True, Obj("grpo", level="sequence"), "bfloat16"),
        (True, Obj("cispo", beta=0.04), "float32"),
    ],
    ids=str,
)
def test_mosaic_gpu_real_vocab(extra, obj, dtype):
    case = make_inputs(13, B=2, T=96, V=128256, dtype=dtype, extra=extra, temperature=0.9, scale=3.0)
    (loss, aux), g = check(case, obj, "mosaic_gpu", temperature=0.9)
    (l_x, _), g_x = value_and_grad(case, obj, "xla", temperature=0.9)
    assert float(loss) == pytest.approx(float(l_x), rel=1e-4)
    (loss2, _), g2 = value_and_grad(case, obj, "mosaic_gpu", temperature=0.9)
    assert float(loss2) == float(loss) and np.array_equal(np.asarray(g2), np.asarray(g)), "not deterministic"


@gpu
@needs_hopper
@pytest.mark.parametrize(
    "extra, obj, dtype",
    [
        (True, Obj("grpo", beta=0.04), "bfloat16"),
        (False, Obj("dapo", delta=1.5), "bfloat16"),
        (True, Obj("cispo", beta=0.04, bias_kl=True), "float32"),
        (True, Obj("sapo", beta=0.04), "bfloat16"),
    ],
    ids=str,
)
def test_fused_real_vocab(extra, obj, dtype):
    """The fused kernel on the device (clusters of 4 CTAs per row) against float64 and the xla path, at the
    real vocabulary; bitwise repeatable."""
    backend = MosaicGpuLogitsBackend()
    case = make_inputs(23, B=2, T=96, V=128256, dtype=dtype, extra=extra, temperature=0.9, scale=3.0, ris="bt")
    assert _uses_fused(backend, obj.lib(), case)
    (loss, aux), g = check(case, obj, backend, temperature=0.9)
    (l_x, _), g_x = value_and_grad(case, obj, "xla", temperature=0.9)
    assert float(loss) == pytest.approx(float(l_x), rel=1e-4)
    (loss2, _), g2 = value_and_grad(case, obj, backend, temperature=0.9)
    assert float(loss2) == float(loss) and np.array_equal(np.asarray(g2), np.asarray(g)), "not deterministic"


@gpu
@needs_hopper
def test_fused_full_shape_and_tiny_temperature():
    """B = 2, T = 1024, Llama-3 vocabulary, GRPO (the public benchmark's objective) through the default
    dispatch: the fused path, same loss and dlogits as xla; then targets at each row's unique maximum at
    T = 1e-6 (p = 1: a zero gradient, up to 1e-2 of its scale)."""
    case = make_inputs(24, B=2, T=1024, V=128256, dtype="bfloat16", with_ref=False, scale=1.0)
    obj = gmpo_jax.GRPO(loss_type="grpo")
    assert _uses_fused(MosaicGpuLogitsBackend(), obj, case)
    args = _args(case, 1.0, None)
    (l_m, _), g_m = _VG(obj, None, *args)
    (l_x, _), g_x = _VG(obj, "xla", *args)
    assert float(l_m) == pytest.approx(float(l_x), rel=1e-5)
    gm, gx = _f64(g_m).ravel(), _f64(g_x).ravel()
    assert gm @ gx / np.linalg.norm(gm) / np.linalg.norm(gx) > 0.9999
    np.testing.assert_allclose(gm, gx, rtol=0, atol=2e-2 * np.abs(gx).max())
    ids = jnp.asarray(np.where(case["mask"], case["ids"], 0))
    # a unique maximum whose product with log2(e) / tau is not exact (8.0 would hide a rounding of m k)
    z = jnp.asarray(case["logits"]).at[jnp.arange(2)[:, None], jnp.arange(1024)[None], ids].set(6.90625)
    tau = 1e-6
    g = jax.jit(
        jax.grad(
            lambda zl: gmpo_jax.policy_loss_from_logits(
                zl,
                gmpo_jax.PolicyBatch(ids, np.ones((2, 1024)), np.ones(2)),
                objective=gmpo_jax.CISPO(epsilon_high=5.0),
                temperature=tau,
            )[0]
        )
    )(z)
    assert np.all(np.isfinite(_f64(g)))
    assert np.abs(_f64(g)).max() < 1e-2 / tau / 2048


@gpu
@needs_hopper
def test_mosaic_gpu_default_dispatch_and_full_shape():
    """implementation=None picks mosaic_gpu on Hopper; B = 2, T = 1024: same loss and dlogits as xla."""
    case = make_inputs(14, B=2, T=1024, V=128256, dtype="bfloat16", with_ref=False, scale=1.0)
    args = _args(case, 1.0, None)
    (l_m, _), g_m = _VG(gmpo_jax.GMPO(), None, *args)
    (l_x, _), g_x = _VG(gmpo_jax.GMPO(), "xla", *args)
    assert float(l_m) == pytest.approx(float(l_x), rel=1e-5)
    gm, gx = np.asarray(g_m, np.float32), np.asarray(g_x, np.float32)
    cos = float(np.sum(gm * gx) / np.sqrt(np.sum(gm * gm) * np.sum(gx * gx)))
    assert cos > 0.9999 and np.all(gm[:, -1] == 0)


def test_docstring_example():
    import doctest

    import gmpo_jax.logits.api

    result = doctest.testmod(gmpo_jax.logits.api, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "B, T, V, extra",
    [
        (2, 39, 320, True),  # 80 rows (a slid-back second row block), V = 2.5 tiles: 64-column tiles in place
        (3, 22, 768, False),  # 66 rows viewed as 264 x 192 (k = 4): slid-back rows, 192 = 3 x 64 columns
    ],
    ids=["80x320", "66x768-rowsplit4"],
)
def test_mosaic_gpu_inplace_interpret(B, T, V, extra):
    """``MosaicGpuLogitsBackend(inplace=True)``: the backward writes dlogits into the logits' buffer (a
    ``jax.Ref``); the same dlogits as the out-of-place kernel, also under ``donate_argnums``, with slid-back
    row blocks and a row length that needs the 128-byte column tiles; to one bf16 ulp: the interpreter's
    XLA:CPU code for the kernel's ``exp2`` differs between programs and tile widths.)"""
    case = make_inputs(21, B=B, T=T, V=V, dtype="bfloat16", extra=extra, temperature=0.8, empty_row=1)
    obj = Obj("dapo", beta=0.04)
    inplace = dataclasses.replace(INTERPRET, inplace=True)
    (l0, _), g0 = value_and_grad(case, obj, INTERPRET, temperature=0.8)
    (l1, _), g1 = value_and_grad(case, obj, inplace, temperature=0.8)
    assert float(l1) == float(l0)
    np.testing.assert_allclose(_f64(g1), _f64(g0), rtol=2.0**-7, atol=0)
    logits, *rest = _args(case, 0.8, None)
    f = jax.jit(
        lambda z, *rest: jax.grad(lambda z: _call(obj.lib(), inplace, z, *rest)[0])(z),
        donate_argnums=0,
        compiler_options=FAST_COMPILE,
    )
    np.testing.assert_allclose(_f64(f(jnp.array(logits), *rest)), _f64(g1), rtol=2.0**-7, atol=0)


@gpu
@needs_hopper
def test_mosaic_gpu_inplace_full_shape():
    """In place on the device at B = 2, T = 1024 (kernels' view 8200 x 32064: 64-column tiles, a slid-back
    row block), donated: the dlogits of the out-of-place kernel (to one bf16 ulp)."""
    case = make_inputs(17, B=2, T=1024, V=128256, dtype="bfloat16", extra=True, temperature=1.0, scale=3.0)
    obj = Obj("grpo")
    (_, _), g0 = value_and_grad(case, obj, "mosaic_gpu")
    logits, *rest = _args(case, 1.0, None)
    inplace = MosaicGpuLogitsBackend(inplace=True)
    f = jax.jit(lambda z, *rest: jax.grad(lambda z: _call(obj.lib(), inplace, z, *rest)[0])(z), donate_argnums=0)
    np.testing.assert_allclose(_f64(f(jnp.array(logits), *rest)), _f64(g0), rtol=2.0**-7, atol=0)


@gpu
@needs_hopper
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_skip_masked_rows_three_pass_full_shape(inplace):
    """``skip_masked_rows`` on the device, three-pass path (GMPO), Llama-3 vocabulary, B = 8, T = 256 (2056
    rows: a slid-back row block): sequences 2-3 empty, 5 half masked, 6-7 of zero advantage; against
    float64 (``check``) and the same call without skipping (to one bf16 ulp)."""
    B, T = 8, 256
    lengths, adv = [T, 175, 0, 0, T, 128, T, 75], [0.9, -0.6, 0.4, 1.2, -1.0, 0.7, 0.0, 0.0]
    case = make_inputs(18, B=B, T=T, V=128256, dtype="bfloat16", scale=3.0, lengths=lengths, adv=adv)
    obj = Obj("gmpo")
    skip = MosaicGpuLogitsBackend(skip_masked_rows=True, inplace=inplace)
    (loss, _), g = check(case, obj, skip)
    (l_0, _), g_0 = value_and_grad(case, obj, dataclasses.replace(skip, skip_masked_rows=False))
    assert float(loss) == pytest.approx(float(l_0), rel=1e-6)
    np.testing.assert_allclose(_f64(g), _f64(g_0), rtol=2.0**-7, atol=0)


@pytest.mark.parametrize("backend", [INTERPRET, INTERPRET_LEAN], ids=["pick", "lean"])
def test_mosaic_gpu_interpret_tie_at_tiny_temperature(backend):
    """Two exactly tied maxima at T = 1e-4 (|z| / T = 8e4): p = 1/2 each, so dlogits of the target is
    -c / 2 and of its twin +c / 2 (float64), not the snap's p = 1 (``snap_tolerance``'s limit lies at
    |z| / T ~ 1.9e6)."""
    B, T, V, tau = 2, 39, 256, 1e-4
    z = np.zeros((B, T + 1, V), np.float32)
    z[0, 0, 3] = z[0, 0, 7] = 8.0
    ids = np.full((B, T), 3, np.int32)
    mask = np.zeros((B, T), bool)
    mask[0, 0] = True
    obj = gmpo_jax.GRPO(loss_type="dapo", epsilon_low=10.0, epsilon_high=10.0)
    g = jax.jit(
        jax.grad(
            lambda x: gmpo_jax.policy_loss_from_logits(
                x,
                gmpo_jax.PolicyBatch(ids, mask, jnp.array([1.0, 0.0]), old_logps=np.zeros((B, T), np.float32)),
                objective=obj,
                temperature=tau,
                implementation=backend,
            )[0]
        )
    )(jnp.asarray(z, jnp.bfloat16))
    # d loss / d logp = -A e^{logp - old} / N = -0.5 (logp = log 1/2, one token): dz = -0.5 / T (onehot - p)
    c = -0.5 / tau
    np.testing.assert_allclose(_f64(g)[0, 0, [3, 7]], [c * 0.5, -c * 0.5], rtol=1e-2)
    assert np.all(_f64(g)[0, 0, [v for v in range(V) if v not in (3, 7)]] == 0)


def test_mosaic_gpu_inplace_interpret_eager():
    """In place without an enclosing jit (the interpreter's GMEM Ref needs one: the kernel call wraps
    itself): the same dlogits as the jitted call."""
    case = make_inputs(23, B=2, T=39, V=320, dtype="bfloat16", extra=True, temperature=1.0)
    inplace = dataclasses.replace(INTERPRET, inplace=True)
    logits, *rest = _args(case, 1.0, None)
    f = lambda z: _call(Obj("grpo").lib(), inplace, z, *rest)[0]
    np.testing.assert_allclose(_f64(jax.grad(f)(logits)), _f64(jax.jit(jax.grad(f))(logits)), rtol=2.0**-7, atol=0)


@pytest.mark.parametrize(
    "stages, skip, resident",
    [(2, True, True), (3, True, True), (2, False, True), (2, True, False), (3, True, False), (2, False, False)],
    ids=["resident-skip", "resident-3-stages-skip", "resident", "reread-skip", "reread-too-few-tiles", "reread"],
)
def test_fused_kernel_dead_rows(stages, skip, resident):
    """``logits_lse_and_dlogits`` (interpreter, 3 CTAs of 5-6 rows, 2 tiles per row) on rows marked dead (``live =
    0``: runs of them, the first and the last row, whole CTAs' first rows) whose logits are NaN: with
    ``skip_dead_rows`` a dead row is not read: its dz is zeros and its logp 0 (any read would make them
    NaN), when the row is resident in the ring (2 tiles <= stages) or its two passes stream through a ring
    of at most its tiles (2 stages); a ring of 3 that re-reads rows, or no flag, reads every row (its logp
    is NaN there, its dz still zeros). Live rows' log-probs and dz equal float64 to 2e-6 relative, and the
    same with every row live."""
    rng = np.random.default_rng(3)
    R, V, w, tau = 16, 2048, 16, 0.8
    z = rng.normal(size=(R, V)).astype(np.float32) * 2
    ids = rng.integers(0, V, size=R)
    live = np.ones(R, bool)
    live[[0, 1, 2, 5, 9, 10, 15]] = False
    z[~live] = np.nan
    adv = rng.normal(size=R).astype(np.float32)
    old = -np.abs(rng.normal(size=R)).astype(np.float32) - 7.0
    scale = np.where(live, 0.5 / tau, 0.0).astype(np.float32)

    def token_fn(logp, old, ref, adv, ris, alive):  # ptl = -A exp(logp - old), its own derivative
        ptl = -adv * jnp.exp(logp - old)
        return ptl, ptl

    def run(live_col):
        F = K.RowData
        rd = K.pack_row_data(
            {
                F.K: np.full(R, K.LOG2E / tau),
                F.TARGET_LOGIT: z[np.arange(R), ids],
                F.OLD: old,
                F.REF: np.zeros(R),
                F.ADV: adv,
                F.RIS: np.ones(R),
                F.SCALE: scale,
                F.LIVE: live_col,
                F.WEIGHT: scale * tau,
            }
        )
        cfg = K.FusedLogitsBlocks(
            block_rows=64, stages=stages, out_stages=2, num_ctas=3, skip_dead_rows=skip, resident=resident
        )
        x = jnp.asarray(np.nan_to_num(z, nan=0.0) if live_col.all() else z)
        dz, st = jax.jit(
            lambda x, rd: K.logits_lse_and_dlogits(
                x.reshape(R, V // w, w), rd, token_fn, cfg=cfg, interpret=FUSED._interpret_params()
            )
        )(x, rd)
        return np.asarray(dz, np.float64).reshape(R, V), np.asarray(st, np.float64)

    dz, st = run(live.astype(np.float32))
    assert not np.any(dz[~live]) and not np.isnan(dz).any() and not np.any(st[~live, 3])
    if skip and (resident or stages == 2):
        assert np.all(st[~live, 0] == 0.0)
    else:
        assert np.all(np.isnan(st[~live, 0]))
    zl = z[live].astype(np.float64) / tau
    lse = np.log(np.exp(zl - zl.max(1, keepdims=True)).sum(1)) + zl.max(1)
    logp = zl[np.arange(live.sum()), ids[live]] - lse
    c = scale[live] * -adv[live] * np.exp(logp - old[live])
    want = -c[:, None] * np.exp(zl - lse[:, None])
    np.testing.assert_allclose(st[live, 0], logp, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(st[live, 2], c, rtol=2e-6)  # the gradient scale, and each token's loss term
    np.testing.assert_allclose(st[live, 3], c * tau, rtol=2e-6)
    np.testing.assert_allclose(dz[live], want, rtol=0, atol=2e-6 * np.abs(want).max())
    dz_all, st_all = run(np.ones(R, np.float32))  # every row live: the live rows' results are the same
    np.testing.assert_array_equal(dz_all[live], dz[live])
    np.testing.assert_array_equal(st_all[live, :4], st[live, :4])
