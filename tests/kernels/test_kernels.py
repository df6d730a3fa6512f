"""The Pallas Mosaic GPU backend at the seam (``logprobs`` / ``grads``).

On CPU the kernels run in Mosaic GPU interpret mode at small odd shapes: ragged rows (padded to the
row block), a vocabulary that is not a multiple of the tile (masked tail), both weight layouts,
bias, temperature, bf16 and f16, large logits. Each case is compared with the portable
``xla_chunked`` backend (tight: same inputs, same float32 accumulation) and with a float64 NumPy
oracle computed from the same 16-bit-rounded inputs. The ``gpu`` tests rerun real shapes on a
Hopper GPU and check bitwise rerun equality.

Tolerances: ``LOGP_TOL``, ``ENTROPY_TOL``, ``GRAD_REL_F64``, ``LSE_VS_XLA``, ``GRAD_REL_XLA``, ``SAVED_REL`` and
``INTERPRET_MAX_ULP`` of ``conftest.py`` (the reasons are there).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import (
    ENTROPY_TOL,
    GRAD_REL_F64,
    GRAD_REL_XLA,
    INTERPRET_MAX_ULP,
    LOGP_TOL,
    LSE_VS_XLA,
    SAVED_REL,
    needs_hopper,
    rel_err,
)

from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels import _lm_head_pipeline as P
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend, supported_on
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend


def _inputs(R, H, V, layout, dtype, bias, scale, seed):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((R, H)), dtype)
    w = jnp.asarray(rng.standard_normal((H, V)) * scale / np.sqrt(H), dtype)
    if layout == "vh":
        w = w.T
    b = jnp.asarray(rng.standard_normal(V) * 0.5, jnp.float32) if bias else None
    ids = jnp.asarray(rng.integers(0, V, R), jnp.int32)
    dlogp = jnp.asarray(rng.standard_normal(R), jnp.float32)
    return h, w, b, ids, dlogp


def _oracle(h, w, b, ids, dlogp, T, layout):
    """float64 NumPy: logits, lse, logp, dhidden, dW, db from the (16-bit-rounded) inputs."""
    h64 = np.asarray(h, np.float64)
    w64 = np.asarray(w, np.float64)
    W = w64 if layout == "hv" else w64.T  # [H, V]
    z = h64 @ W
    if b is not None:
        z = z + np.asarray(b, np.float64)
    z = z / T
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    V = W.shape[1]
    ids_np = np.asarray(ids)
    valid = (ids_np >= 0) & (ids_np < V)
    tgt = np.where(valid, z[np.arange(len(ids_np)), np.clip(ids_np, 0, V - 1)], np.nan)
    logp = tgt - lse
    onehot = np.zeros_like(z)
    onehot[np.arange(len(ids_np))[valid], ids_np[valid]] = 1.0
    dz = np.asarray(dlogp, np.float64)[:, None] * (onehot - np.exp(z - lse[:, None])) / T
    dh = dz @ W.T
    dW = h64.T @ dz
    return dict(z=z, lse=lse, logp=logp, dh=dh, dw=dW if layout == "hv" else dW.T, db=dz.sum(0))


def _run_case(be, R, H, V, layout, dtype, bias, T, scale, seed, bad_ids=False, saved=None):
    h, w, b, ids, dlogp = _inputs(R, H, V, layout, dtype, bias, scale, seed)
    if bad_ids:
        ids = ids.at[1].set(-1).at[2].set(V)
    Tf = jnp.float32(T)
    ref = _oracle(h, w, b, ids, dlogp, T, layout)
    xk = XlaChunkedBackend(vocab_block=64)

    logp, lse = be.logprobs(h, w, b, ids, Tf, weight_layout=layout)
    assert logp.shape == (R,) and logp.dtype == jnp.float32 and lse.dtype == jnp.float32
    tol = LOGP_TOL * (1.0 + np.abs(ref["z"]).max())
    np.testing.assert_allclose(np.asarray(lse), ref["lse"], rtol=0, atol=tol)
    np.testing.assert_array_equal(np.isnan(np.asarray(logp)), np.isnan(ref["logp"]))
    ok = ~np.isnan(ref["logp"])
    np.testing.assert_allclose(np.asarray(logp)[ok], ref["logp"][ok], rtol=0, atol=tol)
    logp_x, lse_x = xk.logprobs(h, w, b, ids, Tf, weight_layout=layout)
    np.testing.assert_allclose(
        np.asarray(lse), np.asarray(lse_x), rtol=0, atol=LSE_VS_XLA * (1.0 + np.abs(ref["z"]).max())
    )

    if bad_ids:  # the loss masks invalid tokens: their cotangent is zero
        dlogp = jnp.where(jnp.isnan(logp), 0.0, dlogp)
        ref = _oracle(h, w, b, jnp.clip(ids, 0, V - 1), dlogp, T, layout)
        ref_dz_rows = np.asarray(dlogp) != 0
        assert ref_dz_rows.sum() == R - 2
    dw0 = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(w.shape), jnp.float32)
    db0 = jnp.zeros((V,), jnp.float32) if bias else None
    dh, dw, db = be.grads(h, w, b, ids, dlogp, lse, Tf, weight_layout=layout, dw_acc=dw0, db_acc=db0)
    assert dh.dtype == h.dtype and dh.shape == h.shape
    assert dw.dtype == jnp.float32 and dw.shape == w.shape
    assert rel_err(dh, ref["dh"]) < GRAD_REL_F64
    assert rel_err(np.asarray(dw) - np.asarray(dw0), ref["dw"]) < GRAD_REL_F64
    if bias:
        assert rel_err(db, ref["db"]) < GRAD_REL_F64
    else:
        assert db is None
    dh_x, dw_x, db_x = xk.grads(h, w, b, ids, dlogp, lse, Tf, weight_layout=layout, dw_acc=dw0, db_acc=db0)
    assert rel_err(dh, dh_x) < GRAD_REL_XLA
    assert rel_err(np.asarray(dw) - np.asarray(dw0), np.asarray(dw_x) - np.asarray(dw0)) < GRAD_REL_XLA
    if saved is not None:  # the logits kept by the log-prob kernel (float16) replace the recompute
        if saved == "all":
            logp_s, lse_s, kept = be.logprobs_for_grads(h, w, b, ids, Tf, weight_layout=layout, budget_bytes=2**40)
            assert kept is not None and kept.d.shape[1] >= V
        else:  # the leading `saved` tiles kept, the rest recomputed
            (logp_s, lse_s), kept, _ = be._logprobs(
                h, w, b, ids, Tf, weight_layout=layout, with_entropy=False, save_tiles=saved
            )
            assert kept.m.shape[0] == saved and kept.d.shape[1] < V
        np.testing.assert_array_equal(np.asarray(logp_s), np.asarray(logp))
        np.testing.assert_array_equal(np.asarray(lse_s), np.asarray(lse))
        dh_s, dw_s, db_s = be.grads(
            h, w, b, ids, dlogp, lse, Tf, weight_layout=layout, dw_acc=None, db_acc=db0, saved=kept
        )
        assert dh_s.dtype == h.dtype and dw_s.dtype == w.dtype and dw_s.shape == w.shape
        assert rel_err(dh_s, ref["dh"]) < GRAD_REL_F64 and rel_err(dw_s, ref["dw"]) < GRAD_REL_F64
        # against the recompute: float16 logits (p off by <= p |ln p| 2**-11) and a 16-bit dW
        assert rel_err(dh_s, dh) < SAVED_REL and rel_err(dw_s, np.asarray(dw) - np.asarray(dw0)) < SAVED_REL
        if bias:
            assert rel_err(db_s, ref["db"]) < GRAD_REL_F64 and rel_err(db_s, db) < SAVED_REL
        # no budget, nothing kept: decided while tracing (eval_shape: the kernel is traced, not run)
        no_budget = jax.eval_shape(
            lambda *a: be.logprobs_for_grads(*a, weight_layout=layout, budget_bytes=0), h, w, b, ids, Tf
        )
        assert no_budget[2] is None
        dh_n, dw_n, _ = be.grads(h, w, b, ids, dlogp, lse, Tf, weight_layout=layout, dw_acc=None, db_acc=db0)
        # no accumulator, recompute: the chunk's own gradient rounded once to a bfloat16 weight's dtype (float32
        # for a float16 weight: its range), within half an ulp of the accumulated float32 one
        assert dw_n.dtype == (jnp.float32 if w.dtype == jnp.float16 else w.dtype)
        np.testing.assert_array_equal(np.asarray(dh_n), np.asarray(dh))
        acc = np.asarray(dw, np.float64) - np.asarray(dw0, np.float64)
        ulp = np.abs(acc) * (2.0**-7 if dw_n.dtype == jnp.bfloat16 else 0.0)
        np.testing.assert_array_less(
            np.abs(np.asarray(dw_n, np.float64) - acc), ulp / 2 + 1e-5 * float(np.abs(np.asarray(dw0)).max())
        )
    return logp, lse, dh, dw


INTERPRET = MosaicGpuBackend(interpret=True)
KEEP = MosaicGpuBackend(interpret=True, save_min_hidden=0)  # keeps the logits at any hidden size


# Curated cases. The interpreter's time grows with the kernels' CTAs (vocabulary splits times row blocks; the dz
# kernel runs one split per tile of its window) and with the number of kernel calls, so each case combines
# several branches and every branch runs in at least one case. block_config(interpret=True) = 64 rows per
# warpgroup, 128 vocabulary columns; every case's rows are padded to one 128-row CTA block. Every case runs the
# log-prob kernel, the gradient pass with a float32 accumulator and without one (written once per window), and
# the kept logits (``saved``), all with a workspace of one tile (the gradient windows run in scans). Which case
# covers which branch:
#   hv layout (wgmma): hv-...; vh layout (the transposed operand): vh-...
#   bfloat16: hv-...; float16 (its gradient without accumulator comes back in float32): vh-...
#   bias, temperature != 1 (0.7, 1.3), masked tail columns (V % 128 != 0: 64, 75 columns): both
#   large logits (scale 30, |z| / T ~ 100): hv-...
#   H 128 / 192 (two / three pipeline steps per tile; three: the 2-slot ring wraps inside a tile): hv / vh
#   V a multiple of the bulk-copy tiling (64 for "hv", 8 for "vh"), read past its end (the bulk copy's zero fill
#     along the minor axis): hv-...-V320; not a multiple: a zero-padded weight copy, its columns sliced off the
#     last windows, read past its end along the major axis: vh-...-V331
#   invalid ids (-1 and V: NaN log-prob, zero cotangent): vh-...
#   gradient windows: full windows in the scan, then a partial one: both (the recompute), hv-... (the kept
#     tiles); a scan without a partial window: the kept tiles of vh-...; a partial window at a static offset after
#     the kept tiles: vh-... (one whole window, no scan: the API tests below, default workspace)
#   kept logits: all tiles (hv-..., ``logprobs_for_grads``), the leading tiles with the rest recomputed (vh-...:
#     2 of 3, the log-prob kernel's ``save_tiles``)
WS1 = 128 * 128 * 2  # a workspace of one 128-column tile of 16-bit dz for 128 rows


@pytest.mark.parametrize(
    "R,H,V,layout,dtype,bias,T,scale,workspace,saved",
    [
        pytest.param(
            100, 128, 320, "hv", jnp.bfloat16, True, 0.7, 30.0, WS1, "all", id="hv-bf16-bias-T0.7-logits30-V320-keepall"
        ),
        pytest.param(
            70, 192, 331, "vh", jnp.float16, True, 1.3, 1.0, WS1, 2, id="vh-f16-bias-T1.3-H192-V331-unaligned-keep2of3"
        ),
    ],
)
def test_interpret_matches_oracle_and_xla(monkeypatch, R, H, V, layout, dtype, bias, T, scale, workspace, saved):
    """The log-prob kernel and the gradient pass against the float64 oracle and xla_chunked (``_run_case``);
    then ``logprobs_for_grads`` keeps the logits (float16 relative to the running max, the log-prob kernel's
    ``save_tiles``) and ``grads(saved=...)`` builds dz from them and recomputes the tiles not kept: the float64
    oracle and the recompute path agree (the saved path's dW comes back in the weight's dtype, written once
    per window; with a one-tile workspace the windows run in the scans, with partial tails). The hv case keeps a
    wgmma product in flight (``tuning.WGMMA_IN_FLIGHT = 1``: each ring slot released a step later; the interpreter
    runs the vh layout's transposed products as float32 dots, where the setting does nothing)."""
    from gmpo_jax import tuning

    monkeypatch.setattr(tuning, "WGMMA_IN_FLIGHT", int(layout == "hv"))
    be = KEEP if workspace is None else MosaicGpuBackend(interpret=True, workspace_bytes=workspace, save_min_hidden=0)
    _run_case(be, R, H, V, layout, dtype, bias, T, scale, seed=R + V + 1, bad_ids=(layout == "vh"), saved=saved)


def test_kept_logits_only_for_bfloat16_weights():
    """A float16 weight keeps no logits (its gradient would be returned in float16 before the cotangent
    scales it: a loss times 1e-3 overflowed to inf; fresh-user review, 2026-11-30); there the kept-logits
    backend gives the recompute path's finite gradient."""
    import gmpo_jax

    rng = np.random.default_rng(0)
    B, T, H, V = 1, 8, 64, 120  # one vocabulary tile: one dz CTA
    h = jnp.asarray(rng.standard_normal((B, T, H)) * 20, jnp.float16)
    w = jnp.asarray(rng.standard_normal((H, V)) * 0.01, jnp.float16)
    ids = jnp.full((B, T), 5, jnp.int32)

    def kept(h, w):  # what logprobs_for_grads keeps: decided while tracing (eval_shape: the kernel is not run)
        f = lambda h, w: KEEP.logprobs_for_grads(h, w, None, ids[0], 1.0, weight_layout="hv", budget_bytes=2**40)
        return jax.eval_shape(f, h, w)[2]

    assert kept(h[0], w) is None
    assert kept(h[0].astype(jnp.bfloat16), w.astype(jnp.bfloat16)) is not None
    mask = jnp.ones((B, T), bool)
    adv = jnp.array([3e3], jnp.float32)

    def grad(impl):
        f = lambda w: (
            1e-3
            * gmpo_jax.fused_linear_policy_loss(
                h,
                w,
                gmpo_jax.PolicyBatch(ids, mask, adv),
                objective=gmpo_jax.GMPO(),
                head=gmpo_jax.HeadOptions(implementation=impl),
            )[0]
        )
        return np.asarray(jax.jit(jax.grad(f))(w), np.float64)

    g, g0 = grad(KEEP), grad("xla_chunked")
    assert np.all(np.isfinite(g)) and g.dtype == np.float64
    np.testing.assert_allclose(g, g0, rtol=0, atol=1e-2 * np.abs(g0).max())


def test_save_plan():
    """``save_plan`` keeps the most leading tiles whose peak extra memory (``saved_bytes``) fits the budget
    (not monotone in the tiles: the recomputed rest's window shrinks as more are kept), none without
    ``save_logits`` or below ``save_min_hidden``; at the real heads with the fused loss's budget (4 H V +
    384 MiB): all of Llama-3's tiles at 8192 rows, half at 16384; none of Qwen2.5-0.5B's (H 896: measured
    no faster), which would be 15 % at 16384 rows."""
    from gmpo_jax.lm_head.vjp import SAVED_LOGITS_SLACK

    be = MosaicGpuBackend(save_min_hidden=0)
    for rows, H, V in [(8192, 4096, 128256), (16384, 4096, 128256), (16384, 896, 151936), (512, 896, 151936)]:
        budget = 4 * H * V + SAVED_LOGITS_SLACK
        t = be.save_plan(rows=rows, H=H, V=V, budget_bytes=budget)
        n = C.cdiv(V, 256)
        assert be.saved_bytes(rows=rows, H=H, V=V, save_tiles=t) <= budget
        assert all(be.saved_bytes(rows=rows, H=H, V=V, save_tiles=u) > budget for u in range(t + 1, n + 1))
        assert MosaicGpuBackend(save_logits=False).save_plan(rows=rows, H=H, V=V, budget_bytes=budget) == 0
    assert be.save_plan(rows=8192, H=4096, V=128256, budget_bytes=4 * 4096 * 128256 + SAVED_LOGITS_SLACK) == 501
    assert be.save_plan(rows=16384, H=4096, V=128256, budget_bytes=4 * 4096 * 128256 + SAVED_LOGITS_SLACK) == 248
    assert be.save_plan(rows=16384, H=896, V=151936, budget_bytes=4 * 896 * 151936 + SAVED_LOGITS_SLACK) == 90
    assert be.save_plan(rows=8192, H=4096, V=128256, budget_bytes=0) == 0
    assert MosaicGpuBackend().save_plan(rows=16384, H=896, V=151936, budget_bytes=2**40) == 0  # H < 3584
    assert MosaicGpuBackend().save_plan(rows=8192, H=4096, V=128256, budget_bytes=2**40) == 501


def test_interpret_saved_logits_kernel_tiles():
    """The kernel's saved tiles: ``d + m`` is ``z2 = z log2(e) / T`` to float16's precision (``|d| 2**-11``),
    ``d <= 0``, ``-inf`` past V; the statistics are bitwise those of the kernel without ``save_tiles``
    (two vocabulary splits: each has its own running max)."""
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials
    from gmpo_jax.lm_head.mosaic_gpu import _prepare, block_config

    R, H, V, T = 100, 128, 700, 0.7
    h, w, b, ids, _ = _inputs(R, H, V, "hv", jnp.bfloat16, True, 1.0, seed=21)
    cfg = block_config(rows=R, H=H, V=V, kind="logprob_saved", interpret=True)
    hp, ids_p, scale, b_p, _ = _prepare(h, ids, b, jnp.float32(T), cfg, V)
    kw = dict(weight_layout="hv", vocab_size=V, cfg=cfg, num_splits=2, interpret=interpret_params())
    plain = lm_head_lse_partials(hp, w, b_p, ids_p, scale, **kw)
    *stats, d, m = lm_head_lse_partials(hp, w, b_p, ids_p, scale, save_tiles=6, **kw)
    *stats4, d4, m4 = lm_head_lse_partials(hp, w, b_p, ids_p, scale, save_tiles=4, **kw)  # the leading tiles only
    for x, y in zip(stats, stats4):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(d4), np.asarray(d)[:, : 4 * 128])
    np.testing.assert_array_equal(np.asarray(m4), np.asarray(m)[:4])
    for x, y in zip(plain, stats):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    d = np.asarray(d, np.float64)
    assert d.dtype == np.float64 and d.shape == (128, 6 * 128) and np.asarray(m).shape == (6, 128)
    assert np.all(d[:, V:] == -np.inf) and np.all(d[:, :V] <= 0)
    z2 = (np.asarray(h, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)) / T * C.LOG2E
    rebuilt = d[:R, :V] + np.repeat(np.asarray(m, np.float64).T, 128, axis=1)[:R, :V]
    assert np.all(np.abs(rebuilt - z2) <= np.abs(d[:R, :V]) * 2.0**-11 + 1e-5 * (1 + np.abs(z2)))


def test_interpret_rerun_is_bitwise_equal():
    h, w, b, ids, _ = _inputs(64, 64, 192, "hv", jnp.bfloat16, True, 1.0, seed=3)
    f = jax.jit(lambda *a: INTERPRET.logprobs(*a, weight_layout="hv"))
    a = f(h, w, b, ids, jnp.float32(1.0))
    c = f(h, w, b, ids, jnp.float32(1.0))
    for x, y in zip(a, c):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(hidden_dtype=jnp.float32, weight_dtype=jnp.float32), "16-bit"),
        (dict(hidden_dtype=jnp.bfloat16, weight_dtype=jnp.float16), "16-bit"),
        (dict(H=100), "multiple of 64"),
        (dict(weight_layout="vv"), "weight_layout"),
    ],
)
def test_check_supported_raises_typed_error(kw, match):
    cfg = dict(
        hidden_dtype=jnp.bfloat16,
        weight_dtype=jnp.bfloat16,
        H=896,
        V=151936,
        rows=4096,
        weight_layout="hv",
        has_bias=False,
    )
    cfg.update(kw)
    with pytest.raises(UnsupportedConfigError, match=match):
        INTERPRET.check_supported(**cfg)


def test_check_supported_accepts_real_heads():
    for H, V in (
        (896, 151936),
        (1536, 151936),
        (2048, 128256),
        (3584, 152064),
        (4096, 128256),
        (4096, 32000),
        (768, 50257),
    ):
        for layout in ("hv", "vh"):
            MosaicGpuBackend(interpret=True).check_supported(
                hidden_dtype=jnp.bfloat16,
                weight_dtype=jnp.bfloat16,
                H=H,
                V=V,
                rows=8192,
                weight_layout=layout,
                has_bias=True,
            )


@pytest.mark.skipif(any(supported_on(d) for d in jax.devices()), reason="a Hopper GPU is present")
def test_unavailable_without_hopper():
    with pytest.raises(BackendUnavailableError):
        MosaicGpuBackend().check_supported(
            hidden_dtype=jnp.bfloat16,
            weight_dtype=jnp.bfloat16,
            H=896,
            V=151936,
            rows=64,
            weight_layout="hv",
            has_bias=False,
        )


def test_block_config_and_splits():
    with pytest.raises(ValueError):
        P.LMHeadBlocks(block_m=96)
    with pytest.raises(ValueError):
        P.LMHeadBlocks(block_n=100)
    for rows_ctas, tiles in ((32, 1187), (1, 2), (64, 594), (4, 1002), (1, 1)):
        s = P.lm_head_num_splits(rows_ctas, tiles, 132)
        per = C.cdiv(tiles, s)
        assert 1 <= s <= tiles and C.cdiv(tiles, per) == s  # every split non-empty
    # a gradient-filter window on 256 rows (2 row blocks) of 16 tiles: 4 tiles per split at least by default,
    # one per split for the window kernels (min_tiles=1), the grid being what limits so few rows
    assert P.lm_head_num_splits(2, 16, 132) == 4
    assert P.lm_head_num_splits(2, 16, 132, min_tiles=1) == 16
    assert P.lm_head_num_splits(128, 16, 132, min_tiles=1) == 1  # a full wave already


def test_block_table():
    """block_config reads the reviewed table (gmpo_jax.tuning.MOSAIC_BLOCKS) for a listed GPU and head,
    the default elsewhere, 64-row gradient blocks for <= 128 rows, and every entry fits shared memory."""
    from gmpo_jax import tuning
    from gmpo_jax.lm_head.mosaic_gpu import block_config, epilogue_bytes

    cfg = block_config(rows=8192, H=896, V=151936, kind="logprob", device_kind="NVIDIA H200")
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages) == tuning.MOSAIC_BLOCKS[
        ("NVIDIA H200", 896, 151936)
    ]["logprob"]
    other = block_config(rows=8192, H=1536, V=151936, kind="grad", device_kind="NVIDIA H100 80GB HBM3")
    assert (other.block_m, other.block_n, other.block_k, other.num_stages) == tuning.MOSAIC_DEFAULT["grad"]
    assert block_config(rows=100, H=896, V=151936, kind="grad", device_kind="NVIDIA H200").block_m == 64
    for entry in [*tuning.MOSAIC_BLOCKS.values(), tuning.MOSAIC_DEFAULT]:
        for kind, (bm, bn, bk, st) in entry.items():
            cfg = P.LMHeadBlocks(block_m=bm, block_n=bn, block_k=bk, num_stages=st)
            extra = epilogue_bytes(kind, cfg, 2)
            assert cfg.smem_bytes(2, extra) <= C.SMEM_BYTES, (kind, cfg)


# --------------------------------------------------------------------------------------------------
# GPU: real shapes on a Hopper GPU
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "R,H,V,layout,bias,T,scale",
    [
        pytest.param(1000, 896, 151936, "hv", False, 1.0, 1.0, id="qwen0.5b-hv"),
        pytest.param(1000, 896, 151936, "vh", True, 0.7, 1.0, id="qwen0.5b-vh-bias"),
        pytest.param(515, 1536, 50304, "hv", True, 1.3, 30.0, id="hv-tail64-logits30"),
        pytest.param(300, 4096, 32008, "vh", False, 1.0, 1.0, id="llama-vh-tail8"),
        pytest.param(700, 768, 50257, "hv", True, 1.0, 1.0, id="gpt2-hv-padded-copy"),
    ],
)
def test_gpu_real_shapes(R, H, V, layout, bias, T, scale):
    be = MosaicGpuBackend(save_min_hidden=0)  # the kept-logits checks below run at every head
    h, w, b, ids, dlogp = _inputs(R, H, V, layout, jnp.bfloat16, bias, scale, seed=R)
    Tf = jnp.float32(T)
    xk = XlaChunkedBackend()
    lp = jax.jit(lambda *a: be.logprobs(*a, weight_layout=layout))
    lp_x = jax.jit(lambda *a: xk.logprobs(*a, weight_layout=layout))
    logp, lse = lp(h, w, b, ids, Tf)
    logp_x, lse_x = lp_x(h, w, b, ids, Tf)
    zmax = float(jnp.max(jnp.abs(lse_x)))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_x), rtol=0, atol=1e-4 * (1 + zmax))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_x), rtol=0, atol=1e-4 * (1 + zmax))
    dw0 = jnp.zeros(w.shape, jnp.float32)
    db0 = jnp.zeros((V,), jnp.float32) if bias else None
    g = jax.jit(lambda *a: be.grads(*a, weight_layout=layout, dw_acc=dw0, db_acc=db0))
    g_x = jax.jit(lambda *a: xk.grads(*a, weight_layout=layout, dw_acc=dw0, db_acc=db0))
    dh, dw, db = g(h, w, b, ids, dlogp, lse_x, Tf)
    dh_x, dw_x, db_x = g_x(h, w, b, ids, dlogp, lse_x, Tf)
    assert rel_err(dh, dh_x) < 1e-2 and rel_err(dw, dw_x) < 1e-2
    if bias:
        assert rel_err(db, db_x) < 1e-2
    # bitwise rerun equality (no atomics)
    logp2, lse2 = lp(h, w, b, ids, Tf)
    dh2, dw2, db2 = g(h, w, b, ids, dlogp, lse_x, Tf)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(logp2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
    np.testing.assert_array_equal(np.asarray(dh), np.asarray(dh2))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw2))
    # the kept logits (log-prob kernel with save_logits; dz from them, dW in the weight's dtype)
    fs = jax.jit(lambda *a: be.logprobs_for_grads(*a, weight_layout=layout, budget_bytes=2**40))
    gs = jax.jit(
        lambda h, w, b, ids, d, l, T, kept: be.grads(
            h, w, b, ids, d, l, T, weight_layout=layout, dw_acc=None, db_acc=db0, saved=kept
        )
    )
    logp_s, lse_s, kept = fs(h, w, b, ids, Tf)
    np.testing.assert_allclose(np.asarray(lse_s), np.asarray(lse_x), rtol=0, atol=1e-4 * (1 + zmax))
    dh_s, dw_s, db_s = gs(h, w, b, ids, dlogp, lse_s, Tf, kept)
    assert dw_s.dtype == w.dtype and rel_err(dh_s, dh_x) < 1e-2 and rel_err(dw_s, dw_x) < 1e-2
    if bias:
        assert rel_err(db_s, db_x) < 1e-2
    dh_s2, dw_s2, _ = gs(h, w, b, ids, dlogp, lse_s, Tf, fs(h, w, b, ids, Tf)[2])
    np.testing.assert_array_equal(np.asarray(dh_s), np.asarray(dh_s2))
    np.testing.assert_array_equal(np.asarray(dw_s), np.asarray(dw_s2))
    # a third of the tiles kept, the rest recomputed after them
    n_keep = C.cdiv(V, kept.block_n) // 3
    (_, lse_p), part, _ = jax.jit(
        lambda *a: be._logprobs(*a, weight_layout=layout, with_entropy=False, save_tiles=n_keep)
    )(h, w, b, ids, Tf)
    dh_p, dw_p, db_p = gs(h, w, b, ids, dlogp, lse_p, Tf, part)
    assert part.m.shape[0] == n_keep and rel_err(dh_p, dh_x) < 1e-2 and rel_err(dw_p, dw_x) < 1e-2
    if bias:
        assert rel_err(db_p, db_x) < 1e-2


def _tiny_temperature_policy_case(implementation, B, T, H, V, temperature):
    """GMPO through the public API (one chunk: the Mosaic backend keeps its logits) with every target at
    its row's argmax and a tiny temperature, against float64: ``d loss / d logp_t = -A exp(mean_t logp) /
    (B T)`` (old log-probs 0, nothing clipped), compared at 1e-2 of the gradient scale ``|W| / (T B T_len)``.
    A saved logit that loses the argmax's exact 0 (p = 2**(+-0.5)) is off by ~0.4 of that scale."""
    import gmpo_jax

    rng = np.random.default_rng(8)
    h = jnp.asarray(rng.standard_normal((B, T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((H, V)) / 8, jnp.bfloat16)
    w64 = np.asarray(w, np.float64)
    z = np.einsum("bth,hv->btv", np.asarray(h, np.float64), w64) / temperature
    ids = z.argmax(-1)
    logp_all = z - z.max(-1, keepdims=True)
    logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    logp = np.take_along_axis(logp_all, ids[..., None], -1)[..., 0]
    dlogp = -np.exp(logp.mean(-1, keepdims=True)) / (B * T)  # [B, 1], A = 1
    want = dlogp[..., None] * (np.eye(V)[ids] - p) / temperature @ w64.T
    mask = jnp.ones((B, T), bool)
    f = lambda h: gmpo_jax.fused_linear_policy_loss(
        h,
        w,
        gmpo_jax.PolicyBatch(
            jnp.asarray(ids, jnp.int32), mask, jnp.ones((B,), jnp.float32), old_logps=jnp.zeros((B, T), jnp.float32)
        ),
        objective=gmpo_jax.GMPO(),
        temperature=temperature,
        head=gmpo_jax.HeadOptions(implementation=implementation),
    )[0]
    v, g = jax.jit(jax.value_and_grad(f))(h)
    assert np.isfinite(float(v))
    scale = float(np.abs(np.asarray(w, np.float32)).max()) / temperature / (B * T)
    np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=0, atol=1e-2 * scale)


def _tiny_temperature_case(implementation, B, T, H, V, temperature):
    """Targets at each row's argmax, tiny temperature: the softmax is one-hot, so d logp / dh ~ 0 (float64)
    and logp ~ 0; compared at 1e-2 of the gradient scale |W| / T."""
    import gmpo_jax

    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.standard_normal((B, T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((H, V)) / 8, jnp.bfloat16)
    z = np.einsum("bth,hv->btv", np.asarray(h, np.float64), np.asarray(w, np.float64))
    ids = jnp.asarray(z.argmax(-1), jnp.int32)
    zt = z / temperature
    p = np.exp(zt - zt.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (np.eye(V)[np.asarray(ids)] - p) / temperature @ np.asarray(w, np.float64).T
    f = lambda h: jnp.sum(
        gmpo_jax.fused_linear_logprobs(
            h, w, ids, temperature=temperature, head=gmpo_jax.HeadOptions(implementation=implementation)
        )
    )
    v, g = jax.jit(jax.value_and_grad(f))(h)
    assert np.isfinite(float(v)) and float(v) <= 0
    scale = float(np.abs(np.asarray(w, np.float32)).max()) / temperature
    np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=0, atol=1e-2 * scale)


@pytest.mark.parametrize("temperature", [1e-6, 1e-2])
def test_interpret_tiny_temperature_argmax_targets(temperature):
    """The Pallas interpreter runs the kernels' arithmetic: failed at T = 1e-6 before the backward's
    ``z2 - lse2`` snap (``_common.snap_tolerance``): the log-sum-exp's round trip through natural-log
    units moved it by an ulp (~0.5 at |z| / T ~ 1e7), so the argmax got p = 2**(+-0.5), not 1."""
    _tiny_temperature_case(INTERPRET, 1, 64, 128, 256, temperature)


@pytest.mark.parametrize("temperature", [1e-6, 1e-2])
def test_interpret_tiny_temperature_saved_logits(temperature):
    """The same through the policy loss, whose single chunk keeps its logits (float16, relative to the
    running max): the argmax's ``d = 0`` and the snap keep its p = 1."""
    _tiny_temperature_policy_case(KEEP, 1, 64, 128, 256, temperature)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("temperature", [1e-6, 1e-2])
def test_gpu_tiny_temperature_argmax_targets(temperature):
    """As the interpreter test, at 128 rows of V = 1024 on the GPU. Failed at T = 1e-6 on the H200
    (2026-11-30, 75e1d17) before the snap; the GPU compiler may also contract ``z * scale - lse2`` into
    a fused multiply-add that skips the rounding of ``z * scale``, which the snap covers too."""
    _tiny_temperature_case("mosaic_gpu", 2, 64, 128, 1024, temperature)
    _tiny_temperature_policy_case(MosaicGpuBackend(save_min_hidden=0), 2, 64, 128, 1024, temperature)


@pytest.mark.parametrize(
    "R,H,V,layout,bias,loop",
    [
        (16384, 896, 151936, "hv", False, True),  # Qwen head, 16k rows: full windows in a loop + a tail
        (8192, 4096, 128256, "vh", True, True),  # Llama head layout with bias
        (1000, 4096, 128256, "vh", True, False),  # rows padded; dz of all of V fits: one window, no loop
        (8192, 768, 50257, "hv", False, True),  # GPT-2: V unaligned, padded copy
        (4096, 768, 50257, "vh", True, True),
    ],
    ids=["qwen-16k-hv", "llama-8k-vh-bias", "llama-1000-vh-bias", "gpt2-8k-hv", "gpt2-4k-vh-bias"],
)
def test_lm_head_kernels_lower_for_cuda(monkeypatch, R, H, V, layout, bias, loop):
    """Both LM-head kernels (the log-prob one also with the entropy; with a bias, one wgmma product in flight),
    inside the backend (window loop, row padding, tails), lower to Mosaic GPU for
    CUDA with jax.export on the CPU (no GPU needed): shared-memory budgets, tiled bulk-copy rules and the
    scan over windows are checked before any device time is spent."""
    from gmpo_jax import tuning
    from gmpo_jax.lm_head import mosaic_gpu

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    monkeypatch.setattr(tuning, "WGMMA_IN_FLIGHT", int(bias))  # the vh cases keep one wgmma product in flight
    be = MosaicGpuBackend(save_min_hidden=0)
    h = jax.ShapeDtypeStruct((R, H), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((H, V) if layout == "hv" else (V, H), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((V,), jnp.float32) if bias else None
    i = jax.ShapeDtypeStruct((R,), jnp.int32)
    f = jax.ShapeDtypeStruct((R,), jnp.float32)
    acc = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    fwd = jax.jit(lambda h, w, b, i: be.logprobs(h, w, b, i, jnp.float32(0.9), weight_layout=layout))
    bwd = jax.jit(
        lambda h, w, b, i, d, l, a: be.grads(
            h,
            w,
            b,
            i,
            d,
            l,
            jnp.float32(0.9),
            weight_layout=layout,
            dw_acc=a,
            db_acc=None if b is None else jnp.zeros(V),
        )
    )
    jax.export.export(fwd, platforms=["cuda"])(h, w, b, i)
    fwd_ent = jax.jit(
        lambda h, w, b, i: be.logprobs(h, w, b, i, jnp.float32(0.9), weight_layout=layout, with_entropy=True)
    )
    jax.export.export(fwd_ent, platforms=["cuda"])(h, w, b, i)
    exp = jax.export.export(bwd, platforms=["cuda"])(h, w, b, i, f, f, acc)
    assert ("stablehlo.while" in exp.mlir_module()) == loop

    from gmpo_jax.lm_head.vjp import SAVED_LOGITS_SLACK

    def saved_path(h, w, b, i, d, budget):  # the log-prob kernel keeping tiles, dz from what it kept
        logp, lse, kept = be.logprobs_for_grads(h, w, b, i, jnp.float32(0.9), weight_layout=layout, budget_bytes=budget)
        assert kept is not None
        return be.grads(
            h,
            w,
            b,
            i,
            d,
            lse,
            jnp.float32(0.9),
            weight_layout=layout,
            dw_acc=None,
            db_acc=None if b is None else jnp.zeros(V),
            saved=kept,
        )

    # all tiles kept, and the fused loss's budget (Qwen at 16384 rows: 90 of 594 kept, the rest recomputed)
    for budget in (2**40, 4 * H * V + SAVED_LOGITS_SLACK):
        jax.export.export(jax.jit(functools.partial(saved_path, budget=budget)), platforms=["cuda"])(h, w, b, i, f)


def test_interpret_padded_vocab_size_through_the_api():
    """``vocab_size=`` masks a padded vocabulary with a -inf bias; through the public API the Mosaic
    backend (interpret mode) returns the xla_chunked log-probs and gradients, not NaN, even when the
    padding covers whole vocabulary tiles (here whole splits of the dz kernel, one per tile; whole splits of the
    log-prob kernel: ``test_interpret_entropy_matches_float64[padded-vocab250]`` through the API,
    ``test_interpret_split_of_masked_vocabulary_is_not_nan`` at the kernel)."""
    import gmpo_jax

    rng = np.random.default_rng(4)
    B, T, H, V, real = 2, 40, 64, 384, 250  # tile 2 all padding
    h = jnp.asarray(rng.standard_normal((B, T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((H, V)) / 8, jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, real, (B, T)), jnp.int32)

    def run(impl):
        f = lambda h, w: jnp.sum(
            gmpo_jax.fused_linear_logprobs(h, w, ids, head=gmpo_jax.HeadOptions(vocab_size=real, implementation=impl))
        )
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)

    (v, (dh, dw)), (v0, (dh0, dw0)) = run(INTERPRET), run("xla_chunked")
    assert np.isfinite(float(v))
    np.testing.assert_allclose(float(v), float(v0), rtol=1e-5)
    assert rel_err(dh, dh0) < GRAD_REL_XLA and rel_err(dw, dw0) < GRAD_REL_XLA
    assert np.all(np.asarray(dw)[:, real:] == 0)


@pytest.mark.parametrize("objective", ["GMPO", "GRPO-dapo"])
def test_interpret_kept_logits_through_the_api(objective):
    """The fused loss through the public API with a backend that keeps its logits (one chunk: float16
    logits, dz from them, dW in the weight's dtype) against the same kernels with two chunks (float32 dW
    accumulator, logits recomputed) and float64 (tests/spec_numpy.py): loss and metrics to 1e-5, gradients
    to the float16 logits' tolerance (``SAVED_REL``) and 1e-2 of float64; dW comes back in bfloat16. The
    two-chunk comparison runs for GMPO (sequence level) only: the kernels see the objective only through the
    cotangent, and the chunked run is four more kernel CTAs; GRPO-dapo (token level) is checked against
    float64."""
    import gmpo_jax

    rng = np.random.default_rng(12)
    B, T, H, V = 2, 50, 64, 120  # one partial vocabulary tile (one dz CTA per chunk); V % 64 != 0: the padded copy
    h = jnp.asarray(rng.standard_normal((B, T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((H, V)) / 8, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(V) / 4, jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) > 0.2)
    adv = jnp.asarray([0.7, -1.2], jnp.float32)
    old = jnp.asarray(-np.log(V) + 0.3 * rng.standard_normal((B, T)), jnp.float32)
    obj = gmpo_jax.GMPO() if objective == "GMPO" else gmpo_jax.GRPO(loss_type="dapo")

    def run(impl, chunk_size=None):
        f = lambda h, w, b: gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old),
            objective=obj,
            bias=b,
            temperature=0.9,
            head=gmpo_jax.HeadOptions(chunk_size=chunk_size, implementation=impl),
        )
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(h, w, bias)

    (loss, aux), (dh, dw, db) = run(KEEP)
    assert dw.dtype == w.dtype and dh.dtype == h.dtype and db.dtype == bias.dtype
    if objective == "GMPO":
        (loss2, aux2), (dh2, dw2, db2) = run(KEEP, chunk_size=1)
        np.testing.assert_allclose(float(loss), float(loss2), rtol=1e-5, atol=1e-7)
        for k in ("clip_fraction", "log_ratio_min", "log_ratio_max"):
            np.testing.assert_allclose(float(getattr(aux, k)), float(getattr(aux2, k)), rtol=1e-5, atol=1e-6)
        for a, b in ((dh, dh2), (dw, dw2), (db, db2)):
            assert rel_err(a, b) < SAVED_REL
    kw = (
        dict(loss_type="gmpo", epsilon_low=0.4, epsilon_high=0.4)
        if objective == "GMPO"
        else dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2)
    )
    ref = spec.spec_policy_loss(h, w, ids, mask, adv, bias=bias, temperature=0.9, old_logps=old, **kw)
    np.testing.assert_allclose(float(loss), ref.loss, rtol=1e-4, atol=1e-6)
    for a, b in zip((dh, dw, db), (ref.dhidden, ref.dweight, ref.dbias)):
        assert rel_err(a, b) < GRAD_REL_F64


@pytest.mark.parametrize(
    "layout,bias,V,vocab_size,temperature,peaky",
    [
        # three 128-column tiles (the running sums rescale), V % 128 != 0 (masked tail columns), bias; the second
        # sequence's hidden states times 30: a peaky softmax (large logits, entropy ~ 0) beside ordinary rows
        ("vh", True, 328, None, 0.7, True),
        ("hv", False, 1024, 250, 1.3, False),  # vocab_size padding: whole splits with no finite logit
        ("hv", False, 384, None, 1e-6, False),  # tiny temperature: one-hot softmax, entropy 0
    ],
    ids=["vh-bias-T0.7-tail-peaky", "padded-vocab250", "T1e-6"],
)
def test_interpret_entropy_matches_float64(layout, bias, V, vocab_size, temperature, peaky):
    """``return_entropy=True`` through the Mosaic log-prob kernel (interpreter): the entropy equals float64
    ``-sum p log p`` (absolute, per row, ``ENTROPY_TOL (1 + min(max |z| / T, 104))`` with the row's largest
    logit: the kernel's online sum of ``p (z2 - m2)`` in float32; terms with ``m - z > 104`` have ``p = 0`` in
    float32 and add nothing, so a tiny temperature must give 0), lies in ``[0, log V]``, and the log-probs are
    within ``INTERPRET_MAX_ULP`` ulps of those of ``return_entropy=False``: with and without the entropy outputs
    the interpreter runs two different compiled XLA:CPU programs, which may round an element differently (1 ulp
    seen at ``padded-vocab250``). Bitwise equality holds for the compiled kernel on the GPU
    (``test_gpu_entropy_real_heads``)."""
    import gmpo_jax

    B, T, H = 2, 64, 128
    h, w, b, _, _ = _inputs(B * T, H, V, layout, jnp.bfloat16, bias, 1.0, seed=11)
    h = h.reshape(B, T, H)
    if peaky:
        h = h.at[1].multiply(30)
    real = vocab_size or V
    rng = np.random.default_rng(12)
    ids = jnp.asarray(rng.integers(0, real, (B, T)), jnp.int32)
    head = gmpo_jax.HeadOptions(weight_layout=layout, vocab_size=vocab_size, implementation=INTERPRET)
    kw = dict(bias=b, temperature=temperature, head=head)
    logp, ent = jax.jit(lambda h: gmpo_jax.fused_linear_logprobs(h, w, ids, return_entropy=True, **kw))(h)
    want = spec.spec_entropy(h, w, bias=b, temperature=temperature, weight_layout=layout, vocab_size=vocab_size)
    zmax = np.abs(spec._logits(h, w, b, temperature, layout)).max(axis=-1)  # [B, T]: each row's
    if peaky:  # the setup: peaky rows (near-zero entropy) beside ordinary ones
        assert zmax[1].min() > 5 * zmax[0].max() and np.median(want[1]) < 0.01 and want[0].min() > 0.5
    tol = ENTROPY_TOL * (1 + np.minimum(zmax, 104.0))
    err = np.abs(np.asarray(ent, np.float64) - want)
    assert np.all(err <= tol), f"entropy off by {err.max():.3e}, {np.max(err / tol):.3f} of its bound"
    assert np.all(np.asarray(ent) >= 0) and np.all(np.asarray(ent) <= np.log(real) + 1e-6)
    logp0 = jax.jit(lambda h: gmpo_jax.fused_linear_logprobs(h, w, ids, **kw))(h)
    np.testing.assert_array_max_ulp(np.asarray(logp), np.asarray(logp0), maxulp=INTERPRET_MAX_ULP)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpret_split_of_masked_vocabulary_is_not_nan(num_splits):
    """A -inf bias over a whole vocabulary tile (as ``vocab_size`` masks a padded vocabulary; here the middle one
    of three): with three splits it leaves a whole split without a finite logit, whose statistics must stay (m =
    -inf, l = -1), not NaN (was NaN: exp2(-inf - -inf)); with one split the running state passes through it. The
    merged log-sum-exp and the entropy's per-split sums re-based to the global maximum (``lm_head_merge_splits``)
    equal the float64 ones over the finite columns. Rows with every column masked give lse = -inf."""
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials, lm_head_merge_splits
    from gmpo_jax.lm_head.mosaic_gpu import _prepare, block_config

    R, H, V = 128, 64, 384
    h, w, _, ids, _ = _inputs(R, H, V, "hv", jnp.bfloat16, False, 3.0, seed=13)
    bias = jnp.where((jnp.arange(V) >= 128) & (jnp.arange(V) < 256), -jnp.inf, 0.0).astype(jnp.float32)
    cfg = block_config(rows=R, H=H, V=V, kind="logprob", interpret=True)
    hp, ids_p, scale, bias_p, _ = _prepare(h, ids, bias, jnp.float32(1.0), cfg, V)
    stats = lm_head_lse_partials(
        hp,
        w,
        bias_p,
        ids_p,
        scale,
        weight_layout="hv",
        vocab_size=V,
        cfg=cfg,
        num_splits=num_splits,
        with_entropy=True,
        interpret=interpret_params(),
    )
    assert len(stats) == 4
    m2, l = np.asarray(stats[0]), np.asarray(stats[1])
    if num_splits == 3:  # the empty state (m = -inf, l = -1): l is the sum excluding one instance of the max (issue 31)
        assert np.all(m2[1] == -np.inf) and np.all(l[1] == -1)
    assert np.all(np.isfinite(m2[0])) and np.all(np.isfinite(l))
    _, lse, ent = lm_head_merge_splits(*stats)
    z = (np.asarray(h, np.float64) @ np.asarray(w, np.float64))[:, np.r_[0:128, 256:384]]
    want_lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=0, atol=LOGP_TOL * (1 + np.abs(z).max()))
    logsm = z - z.max(1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(1, keepdims=True))
    want = -(np.exp(logsm) * logsm).sum(1)
    np.testing.assert_allclose(np.asarray(ent), want, rtol=0, atol=ENTROPY_TOL * (1 + np.abs(z).max()))
    all_masked = lm_head_merge_splits(jnp.full((2, 4), -jnp.inf), jnp.full((2, 4), -1.0), jnp.zeros((2, 4)))[1]
    assert np.all(np.asarray(all_masked) == -np.inf)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout,bias,H,V", [("hv", False, 896, 151936), ("vh", True, 4096, 128256)])
def test_gpu_entropy_real_heads(layout, bias, H, V):
    """The kernel's entropy on the GPU at real heads equals the float64 entropy of a row subset (absolute
    2e-5 (1 + max |z|)), and return_entropy leaves the log-probs bitwise unchanged."""
    import gmpo_jax

    R = 512
    h, w, b, ids, _ = _inputs(R, H, V, layout, jnp.bfloat16, bias, 3.0, seed=21)
    kw = dict(bias=b, temperature=0.8, head=gmpo_jax.HeadOptions(weight_layout=layout, implementation="mosaic_gpu"))
    logp, ent = jax.jit(lambda h: gmpo_jax.fused_linear_logprobs(h, w, ids[None], return_entropy=True, **kw))(h[None])
    logp0 = jax.jit(lambda h: gmpo_jax.fused_linear_logprobs(h, w, ids[None], **kw))(h[None])
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(logp0))
    sub = slice(0, 64)
    want = spec.spec_entropy(h[sub], w, bias=b, temperature=0.8, weight_layout=layout)
    zmax = np.abs(spec._logits(h[sub], w, b, 0.8, layout)).max()
    np.testing.assert_allclose(np.asarray(ent)[0, sub], want, rtol=0, atol=ENTROPY_TOL * (1 + zmax))


def test_interpret_tie_at_tiny_temperature():
    """Two identical weight columns that hold every row's maximum, T = 1e-4 (|z| / T ~ 3e5): the tied
    maxima have p = 1/2 each, so d logp / dW of the two columns is equal and that of the others ~0
    (float64), not all on one column (the snap's limit lies at |z| / T ~ 1.9e6, ``_common.snap_tolerance``)."""
    import gmpo_jax

    rng = np.random.default_rng(8)
    B, T, H, V, tau = 1, 64, 64, 256, 1e-4
    u = rng.standard_normal(H)
    h = jnp.asarray(u + 0.01 * rng.standard_normal((B, T, H)), jnp.bfloat16)
    w = rng.standard_normal((H, V)) / 8
    w[:, 3] = w[:, 7] = u / 2  # z_3 = z_7 ~ |u|^2 / 2 ~ 32, the others ~ N(0, 1)
    w = jnp.asarray(w, jnp.bfloat16)
    ids = jnp.full((B, T), 3, jnp.int32)
    f = lambda w: jnp.sum(
        gmpo_jax.fused_linear_logprobs(h, w, ids, temperature=tau, head=gmpo_jax.HeadOptions(implementation=INTERPRET))
    )
    dw = np.asarray(jax.jit(jax.grad(f))(w), np.float64)
    want = spec.spec_head_vjp(h, w, ids, None, np.ones((B, T)), temperature=tau)[1]
    assert np.allclose(want[:, 3], -want[:, 7]) and np.abs(want[:, 3]).max() > 0  # the setup: a real tie
    np.testing.assert_allclose(dw, want, rtol=0, atol=1e-2 * np.abs(want).max())


# --------------------------------------------------------------------------------------------------
# Every Pallas kernel traces and runs with jax_enable_x64 (issue 16): bitwise the x64-off result
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def x64():
    """A context manager that turns ``jax_enable_x64`` on; the previous setting is restored on leaving it
    and again after the test (also when it fails)."""
    before = jax.config.read("jax_enable_x64")

    @contextlib.contextmanager
    def enabled():
        jax.config.update("jax_enable_x64", True)
        try:
            yield
        finally:
            jax.config.update("jax_enable_x64", before)

    yield enabled
    jax.config.update("jax_enable_x64", before)


def _x64_lm_head_inputs():
    from gmpo_jax.lm_head.mosaic_gpu import _prepare, block_config

    R, H, V = 100, 64, 200
    h, w, b, ids, dlogp = _inputs(R, H, V, "hv", jnp.bfloat16, True, 1.0, seed=31)
    cfg = block_config(rows=R, H=H, V=V, kind="logprob", interpret=True)
    hp, ids_p, scale, b_p, Rp = _prepare(h, ids, b, jnp.float32(0.7), cfg, V)
    lse2 = jnp.asarray(np.random.default_rng(1).standard_normal(Rp) + 6.0, jnp.float32)
    coef = jnp.pad(dlogp, (0, Rp - R))
    return dict(hp=hp, w=w, b=b_p, ids=ids_p, scale=scale, lse2=lse2, coef=coef, V=V, cfg=cfg)


def _x64_logits_inputs(R=72, V=256):
    rng = np.random.default_rng(32)
    x = jnp.asarray(rng.standard_normal((R, V)) * 3, jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, V, R), jnp.int32)
    k = jnp.full((R,), C.LOG2E / 0.8, jnp.float32)
    lse2 = jnp.asarray(rng.standard_normal(R) + 9.0, jnp.float32)
    c = jnp.asarray(rng.standard_normal(R), jnp.float32)
    return x, ids, k, lse2, c


def _x64_run_lm_head_lse():
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials

    a = _x64_lm_head_inputs()
    return lm_head_lse_partials(
        a["hp"],
        a["w"],
        a["b"],
        a["ids"],
        a["scale"],
        weight_layout="hv",
        vocab_size=a["V"],
        cfg=a["cfg"],
        num_splits=1,  # one CTA (the interpreter's cost); the split index is traced alike for any count
        with_entropy=True,
        save_tiles=1,
        interpret=interpret_params(),
    )


def _x64_run_lm_head_dlogits():
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.lm_head_dlogits import lm_head_dlogits_window

    a = _x64_lm_head_inputs()
    return lm_head_dlogits_window(
        a["hp"],
        a["w"],
        a["b"],
        a["ids"],
        a["scale"],
        a["lse2"],
        a["coef"],
        weight_layout="hv",
        vocab_size=a["V"],
        window_start=0,
        window_tiles=2,
        cfg=a["cfg"],
        num_splits=1,  # one CTA (the interpreter's cost); the split index is traced alike for any count
        interpret=interpret_params(),
    )


def _x64_run_logits_lse(pick_target):
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.logits_lse import logits_lse_partials

    x, ids, k, _, _ = _x64_logits_inputs()
    cfg = C.LogitsBlocks(block_v=128, stages=2, pick_target=pick_target)
    return logits_lse_partials(x, ids, k, cfg=cfg, num_splits=2, interpret=interpret_params())


def _x64_run_logits_dlogits(inplace):
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.logits_dlogits import logits_dlogits

    x, ids, k, lse2, c = _x64_logits_inputs()
    cfg = C.LogitsBlocks(block_v=128, stages=2, tiles_per_cta=1)
    return logits_dlogits(x, ids, k, lse2, c, cfg=cfg, inplace=inplace, interpret=interpret_params())


def _x64_run_logits_fused(resident, skip):
    from gmpo_jax.kernels import logits_fused as K
    from gmpo_jax.kernels._compat import interpret_params

    R, V, w = 8, 2048, 16
    rng = np.random.default_rng(33)
    x = jnp.asarray(rng.standard_normal((R, V)) * 2, jnp.bfloat16)
    ids = rng.integers(0, V, R)
    live = np.ones(R, np.float32)
    live[[2, 5]] = 0.0
    scale = live * 0.5
    F = K.RowData
    rd = K.pack_row_data(
        {
            F.K: np.full(R, C.LOG2E / 0.9),
            F.TARGET_LOGIT: np.asarray(x, np.float32)[np.arange(R), ids],
            F.OLD: rng.normal(size=R) - 7.0,
            F.REF: np.zeros(R),
            F.ADV: rng.normal(size=R),
            F.RIS: np.ones(R),
            F.SCALE: scale,
            F.LIVE: live,
            F.WEIGHT: scale * 0.9,
        }
    )

    def token_fn(logp, old, ref, adv, ris, alive):
        ptl = -adv * jnp.exp(logp - old)
        return ptl, ptl

    cfg = K.FusedLogitsBlocks(block_rows=64, stages=2, out_stages=2, num_ctas=3, skip_dead_rows=skip, resident=resident)
    return K.logits_lse_and_dlogits(x.reshape(R, V // w, w), rd, token_fn, cfg=cfg, interpret=interpret_params())


X64_KERNELS = {
    "lm_head_lse": _x64_run_lm_head_lse,
    "lm_head_dlogits": _x64_run_lm_head_dlogits,
    "logits_lse_pick": functools.partial(_x64_run_logits_lse, True),
    "logits_lse_lean": functools.partial(_x64_run_logits_lse, False),
    "logits_dlogits": functools.partial(_x64_run_logits_dlogits, False),
    "logits_dlogits_inplace": functools.partial(_x64_run_logits_dlogits, True),
    "logits_fused_resident_skip": functools.partial(_x64_run_logits_fused, True, True),
    "logits_fused_reread": functools.partial(_x64_run_logits_fused, False, False),
}


@pytest.mark.parametrize("kernel", list(X64_KERNELS))
def test_interpret_kernels_with_x64(kernel, x64):
    """Each kernel (interpreter, small shapes) traces and runs with ``jax_enable_x64`` and returns bitwise
    its result without x64: loop indices stay int32 and no float64 enters the hot path. (Failed while
    tracing before issue 16: int32 / int64 mismatches in the Mosaic loop arithmetic.)"""
    want = jax.tree.leaves(X64_KERNELS[kernel]())
    with x64():
        got = jax.tree.leaves(X64_KERNELS[kernel]())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
