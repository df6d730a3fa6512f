"""Packed batches: several sequences per row (``segment_ids``) and per-token ``[B, T]`` advantages.

Two independent checks, on both ops and every implementation (the Mosaic kernels in the interpreter):

* against the float64 oracle, which unpacks the sequences one per row and applies SPEC.md's padded
  formulas (``spec_numpy.spec_loss_from_logp_packed``), with tolerances from ``conftest.TOLERANCES``;
* the same sequences padded one per row and packed several per row give the same loss, metrics and
  gradients (float32; bound: a few float32 roundings, since only the order of the per-sequence sums
  differs).

Packings include padding runs (id 0, whose tokens count as masked even where ``completion_mask`` says 1),
two adjacent sequences with different ids, a masked prompt at the start of each sequence, rows of one
sequence and an all-padding row; the scan chunks rows (``chunk_size=1``: one row per chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import DTYPES, Obj, assert_grad_close, assert_loss_close, check_against_spec, make_case

import gmpo_jax
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

# rows of L = 16 tokens: (segment id, length, masked prompt tokens at its start) per run
PACKING = [
    [(1, 5, 1), (2, 7, 2), (0, 4, 0)],  # two sequences, then padding
    [(3, 16, 3)],  # one sequence fills the row
    [(4, 3, 0), (5, 2, 1), (6, 6, 0), (0, 2, 0), (7, 3, 1)],  # padding between sequences
    [(0, 16, 0)],  # padding only
]
R, L, H = len(PACKING), 16, 64
V_LM_HEAD, V_LOGITS = 200, 2048  # as test_contract: a partial kernel tile; the fused logits kernel's smallest view


def _layout():
    """``(segment_ids, completion_mask)`` of PACKING; the mask is 1 on padding's first tokens too."""
    seg = np.zeros((R, L), np.int32)
    mask = np.zeros((R, L), bool)
    for r, runs in enumerate(PACKING):
        t = 0
        for sid, n, prompt in runs:
            seg[r, t : t + n] = sid
            mask[r, t + prompt : t + n] = True if sid else np.arange(n) < 2  # padding: must not count
            t += n
        assert t == L
    return seg, mask


def packed_case(seed, dtype, V, *, token_adv=False, layout="hv"):
    """A packed :class:`conftest.Case` with ``[R, L]`` advantages (constant per sequence, or per token)."""
    seg, mask = _layout()
    case = make_case(seed, B=R, T=L, H=H, V=V, dtype=DTYPES[dtype], layout=layout, mask=mask)
    rng = np.random.default_rng(seed + 1)
    per_seq = rng.normal(size=seg.max() + 1)
    per_seq[2] = 0.0  # a zero-advantage sequence
    adv = per_seq[seg] + (rng.normal(size=seg.shape) * 0.3 if token_adv else 0.0)
    case.adv = adv.astype(np.float32)
    return case, seg


def spec_packed(case, seg, obj: Obj):
    return spec.spec_policy_loss(
        case.hidden,
        case.weight,
        case.ids,
        case.mask,
        case.adv,
        weight_layout=case.layout,
        old_logps=case.old,
        ref_logps=case.ref,
        segment_ids=seg,
        **obj.spec_kwargs(),
    )


def lm_head_call(case, seg, obj: Obj, implementation, **head):
    """``head``: more of the ``HeadOptions``'."""

    def f(h, w):
        batch = gmpo_jax.PolicyBatch(
            case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, segment_ids=seg
        )
        options = gmpo_jax.HeadOptions(weight_layout=case.layout, implementation=implementation, **head)
        return gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=obj.lib(), head=options)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        jnp.asarray(case.hidden), jnp.asarray(case.weight)
    )


OBJECTIVES = [
    Obj("gmpo", beta=0.04),
    Obj("grpo"),
    Obj("grpo", level="sequence"),
    Obj("dr_grpo", max_completion_length=16),
    Obj("dapo", epsilon_low=0.2, epsilon_high=0.28),
    Obj("bnpo", delta=1.5),
    Obj("cispo", epsilon_high=1.3),
    Obj("sapo", beta=0.04),
]


@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
@pytest.mark.parametrize("implementation", ["xla_chunked", "reference"])
def test_lm_head_against_spec(obj, implementation):
    case, seg = packed_case(OBJECTIVES.index(obj), "float32", V_LM_HEAD)
    want = spec_packed(case, seg, obj)
    assert want.margin > 1e-4, "test setup: a ratio sits within 1e-4 of a bound"
    if implementation == "reference":
        f = lambda h, w: gmpo_jax.reference.policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(
                case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, segment_ids=seg
            ),
            objective=obj.lib(),
        )
        (loss, aux), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(case.hidden, case.weight)
    else:
        (loss, aux), grads = lm_head_call(case, seg, obj, implementation, chunk_size=1)
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


@pytest.mark.parametrize("obj", [Obj("gmpo"), Obj("grpo", level="sequence", beta=0.04)], ids=str)
def test_lm_head_kernels_against_spec(obj):
    """The Mosaic kernels (interpreter) with row skipping on: padding and zero-advantage rows skipped (GMPO, no
    KL term), or padding only (the KL term keeps zero-advantage rows live). The kernels see per-row
    coefficients only; every objective runs packed on the portable paths (``test_lm_head_against_spec``)."""
    case, seg = packed_case(10 + len(str(obj)), "bfloat16", V_LM_HEAD, layout="vh")
    want = spec_packed(case, seg, obj)
    (loss, aux), grads = lm_head_call(case, seg, obj, MosaicGpuBackend(interpret=True, row_buckets=4))
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


def test_gmpo_token_advantages_are_averaged_per_sequence():
    """Per-token advantages that vary within a sequence: GMPO uses their masked mean (SPEC.md)."""
    obj = Obj("gmpo")
    case, seg = packed_case(3, "float32", V_LM_HEAD, token_adv=True)
    want = spec_packed(case, seg, obj)
    (loss, aux), grads = lm_head_call(case, seg, obj, "xla_chunked")
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


# --------------------------------------------------------------------------------------------------
# The logits op
# --------------------------------------------------------------------------------------------------
def logits_oracle(case, seg, logits, obj: Obj):
    """(SpecLoss, dlogits) in float64 for ``[R, L + 1, V]`` logits."""
    z = np.asarray(logits, np.float64)[:, :L]
    logsm = z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)
    m = case.mask & (seg > 0)
    lp = np.where(m, np.take_along_axis(logsm, np.where(m, case.ids, 0)[..., None], -1)[..., 0], 0.0)
    sl = spec.spec_loss_from_logp_packed(
        lp, m, seg, case.adv, old_logps=case.old, ref_logps=case.ref, **obj.spec_kwargs()
    )
    onehot = np.arange(z.shape[-1]) == np.where(m, case.ids, -1)[..., None]
    dz = np.zeros(np.shape(logits))
    dz[:, :L] = np.where(m[..., None], sl.dlogp[..., None] * (onehot - np.exp(logsm)), 0.0)
    return sl, dz


def logits_of(case, dtype):
    w = np.asarray(case.weight, np.float64)
    z = np.asarray(case.hidden, np.float64) @ (w if case.layout == "hv" else w.T)
    return np.concatenate([z, z[:, :1]], axis=1).astype(DTYPES[dtype])


def logits_call(case, seg, logits, obj: Obj, implementation):
    f = lambda z: gmpo_jax.policy_loss_from_logits(
        z,
        gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, segment_ids=seg),
        objective=obj.lib(),
        implementation=implementation,
    )
    return jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logits))


LOGITS_IMPLS = {
    "xla": lambda: "xla",
    "mosaic_gpu": lambda: MosaicGpuLogitsBackend(interpret=True, fused=False),
    "mosaic_gpu_fused": lambda: MosaicGpuLogitsBackend(interpret=True),
}


@pytest.mark.parametrize(
    "obj,impl",
    [(o, "xla") for o in OBJECTIVES] + [(Obj("gmpo", beta=0.04), "mosaic_gpu"), (Obj("grpo"), "mosaic_gpu_fused")],
    ids=str,
)
def test_logits_against_spec(obj, impl):
    """Every objective on the portable path; the three-pass kernels (GMPO) and the fused kernel (GRPO; each
    token-local objective's fused kernel: ``test_logits_loss.test_fused_interpret``) on the packed batch."""
    case, seg = packed_case(20 + OBJECTIVES.index(obj) if obj in OBJECTIVES else 30, "float32", V_LOGITS)
    dtype = "float32" if impl == "xla" else "bfloat16"
    logits = logits_of(case, dtype)
    want, dwant = logits_oracle(case, seg, logits, obj)
    (loss, aux), g = logits_call(case, seg, logits, obj, LOGITS_IMPLS[impl]())
    assert_loss_close(loss, want.loss, want.scale, np.dtype(DTYPES[dtype]))
    assert float(aux.loss_denominator) == pytest.approx(want.metrics["loss_denominator"], rel=1e-6)
    assert_grad_close(np.asarray(g), dwant, DTYPES[dtype], "dlogits")


# --------------------------------------------------------------------------------------------------
# Packed == padded for the same sequences
# --------------------------------------------------------------------------------------------------
def _pack(padded, runs, fill=0):
    """``[S, Tp, ...]`` sequences into ``[R, L, ...]`` rows at ``runs`` = [(row, start, stop)] (one per sequence)."""
    out = np.full((R, L) + padded.shape[2:], fill, dtype=padded.dtype)
    for s, (r, t, u) in enumerate(runs):
        out[r, t:u] = padded[s, : u - t]
    return out


SAME_TOL = 1e-5  # relative: float32 per-sequence sums in another order, then the same float32 arithmetic


@pytest.mark.parametrize(
    "obj",
    [Obj("gmpo", beta=0.04), Obj("grpo", level="sequence"), Obj("dr_grpo", max_completion_length=16), Obj("sapo")],
    ids=str,
)
def test_packed_equals_padded(obj):
    seg, _ = _layout()
    runs = spec._runs(seg)
    S, Tp = len(runs), max(u - t for _, t, u in runs)
    lens = [u - t for _, t, u in runs]
    rng = np.random.default_rng(5)
    mask = np.arange(Tp)[None] < np.array(lens)[:, None]
    mask[:, 0] = False  # a masked prompt token
    case = make_case(7, B=S, T=Tp, H=H, V=V_LM_HEAD, dtype=np.float32, mask=mask)
    case.adv = np.where(np.arange(S) == 2, 0.0, rng.normal(size=S)).astype(np.float32)
    pk = dict(
        ids=_pack(case.ids, runs), mask=_pack(mask, runs, False), seg=seg, adv=_pack(np.repeat(case.adv[:, None], Tp, 1), runs),
        old=_pack(case.old, runs), ref=_pack(case.ref, runs), hidden=_pack(case.hidden, runs),
    )  # fmt: skip

    def run(h, ids, m, a, old, ref, sg):
        f = lambda h, w: gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, m, a, old_logps=old, ref_logps=ref, segment_ids=sg),
            objective=obj.lib(),
            head=gmpo_jax.HeadOptions(chunk_size=2, implementation="xla_chunked"),
        )
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, case.weight)

    (lp, auxp), (dhp, dwp) = run(case.hidden, case.ids, mask, case.adv, case.old, case.ref, None)
    (lq, auxq), (dhq, dwq) = run(pk["hidden"], pk["ids"], pk["mask"], pk["adv"], pk["old"], pk["ref"], pk["seg"])
    np.testing.assert_allclose(float(lq), float(lp), rtol=SAME_TOL, atol=1e-7)
    for name in auxp._fields:
        np.testing.assert_allclose(
            float(getattr(auxq, name)), float(getattr(auxp, name)), rtol=SAME_TOL, atol=1e-7, err_msg=name
        )
    dh_padded = np.asarray(dhp)
    dh_unpacked = np.stack([np.pad(np.asarray(dhq)[r, t:u], ((0, Tp - (u - t)), (0, 0))) for r, t, u in runs])
    scale = np.max(np.abs(dh_padded))
    assert np.max(np.abs(dh_unpacked - dh_padded)) <= SAME_TOL * scale
    assert np.max(np.abs(np.asarray(dwq) - np.asarray(dwp))) <= SAME_TOL * np.max(np.abs(np.asarray(dwp)))


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "segment_ids,advantages,err,match",
    [
        (np.zeros((R, L - 1), np.int32), None, ValueError, r"batch\.segment_ids must have shape \[B, T\]"),
        (np.zeros((R, L), np.float32), None, TypeError, r"batch\.segment_ids must be an integer array"),
        (
            np.full((R, L), -1, np.int32),
            None,
            ValueError,
            r"batch\.segment_ids must be >= 0 .*batch\.segment_ids\[0, 0\] = -1",
        ),
        (None, np.zeros((R, L + 1), np.float32), ValueError, r"batch\.advantages must have shape \[B\] .* or \[B, T\]"),
        (
            None,
            np.full((R, L), np.nan, np.float32),
            ValueError,
            r"batch\.advantages must be finite.*got batch\.advantages\[0, 1\]",
        ),
    ],
)
def test_bad_inputs_raise(segment_ids, advantages, err, match):
    case, seg = packed_case(0, "float32", V_LM_HEAD)
    adv = case.adv if advantages is None else advantages
    with pytest.raises(err, match=match):
        gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, adv, segment_ids=segment_ids),
            objective=gmpo_jax.GMPO(),
        )
    with pytest.raises(err, match=match):
        gmpo_jax.policy_loss_from_logits(
            logits_of(case, "float32"),
            gmpo_jax.PolicyBatch(case.ids, case.mask, adv, segment_ids=segment_ids),
            objective=gmpo_jax.GMPO(),
        )


def test_padding_only_batch_has_zero_loss():
    case, _ = packed_case(0, "float32", V_LM_HEAD)
    seg = np.zeros((R, L), np.int32)
    (loss, aux), (dh, dw) = lm_head_call(case, seg, Obj("gmpo"), "xla_chunked")
    assert float(loss) == 0.0 and float(aux.loss_denominator) == 1.0
    assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_ids_beyond_int32_keep_their_runs():
    """64-bit segment ids are compared before any cast: an id of 2**31 is a sequence, not padding, and
    2**32 + 7 next to 7 are two sequences (a cast to int32 would make them -2**31 and one merged run)."""
    case, _ = packed_case(0, "float32", V_LM_HEAD)
    seg = np.zeros((R, L), np.int64)
    seg[0, :6], seg[0, 6:12] = 2**32 + 7, 7
    seg[1, :] = 2**31
    seg[2, :5] = 3
    small = np.zeros((R, L), np.int32)
    small[0, :6], small[0, 6:12], small[1, :], small[2, :5] = 1, 2, 3, 4
    obj = Obj("grpo")
    got = lm_head_call(case, seg, obj, "xla_chunked")
    want = lm_head_call(case, small, obj, "xla_chunked")
    assert float(got[0][1].loss_denominator) == 4.0
    np.testing.assert_allclose(float(got[0][0]), float(want[0][0]), rtol=1e-6)


@pytest.mark.parametrize("op", ["lm_head", "logits"])
def test_padding_may_hold_anything_eagerly(op):
    """Padding (segment id 0) counts as masked whatever ``completion_mask`` says, in the value checks too: an eager
    call whose padding tokens (mask 1 there) hold an out-of-range id, a positive or NaN log-prob, a NaN
    ``rollout_is_ratio`` or a NaN hidden state / logit gives the clean batch's loss and gradients instead of
    raising about them (or a NaN entropy term: the entropy is weighted 0 there)."""
    case, seg = packed_case(0, "float32", V_LM_HEAD)
    pad = (seg == 0) & case.mask
    assert pad.any()
    obj = Obj("gmpo", beta=0.04).lib(entropy_coef=0.05)

    def run(garbage: bool):
        def put(bad, x):
            return np.where(pad if np.ndim(x) == 2 else pad[..., None], bad, x).astype(np.asarray(x).dtype)

        ids = put(-100 if garbage else 0, case.ids)
        old, ref = (put(9.0, case.old), put(np.nan, case.ref)) if garbage else (case.old, case.ref)
        ris = put(np.nan if garbage else 1.0, np.ones_like(case.old))
        batch = gmpo_jax.PolicyBatch(ids, case.mask, case.adv, old, ref, rollout_is_ratio=ris, segment_ids=seg)
        if op == "logits":
            logits = logits_of(case, "float32")  # [B, T + 1, V]: position t predicts ids[:, t]
            if garbage:
                logits = logits.copy()
                logits[:, :-1][pad] = np.nan
            logits = jnp.asarray(logits)
            return jax.value_and_grad(lambda z: gmpo_jax.policy_loss_from_logits(z, batch, objective=obj)[0])(logits)
        hidden = put(np.nan, case.hidden) if garbage else case.hidden
        f = lambda h, w: gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=obj)[0]
        return jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(case.weight))

    (got, g_got), (want, g_want) = run(True), run(False)
    assert np.isfinite(float(want)) and float(got) == float(want)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
