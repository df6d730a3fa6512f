"""The LM-head log-prob kernel on a runtime row prefix (``kernels._lm_head_pipeline.RowPrefixGrid``): one compiled kernel for
every number of live rows, against the same kernel compiled for those rows.

In the interpreter with uninitialised memory read as NaN (so an output the grid did not write, read by mistake,
shows), three row blocks and a ragged vocabulary, no live row and a partial second block: the log-sum-exp
statistics (with the entropy) merge to the full grid's within float32 rounding (the split boundaries differ: one
split there, two here), the rest of the rows are an empty split's (``lse = -inf``); kept logits rebuild the same
logits (one kernel run per row count, with the entropy and kept tiles, serves both checks). The gradient GEMMs
(``lm_head_dhidden``: ``dz W^T`` on a row-prefix grid; ``lm_head_dweight``: ``h^T dz`` with a runtime contraction)
against float64 NumPy in both weight layouts, the same way. The kernels on the grid, and the backend's passes around
them, also lower to Mosaic GPU for CUDA (``jax.export`` on the CPU) with a traced row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels import _lm_head_pipeline as P
from gmpo_jax.kernels._compat import _interpret_params_cls
from gmpo_jax.kernels.lm_head_dhidden import dhidden_blocks, lm_head_dhidden_window
from gmpo_jax.kernels.lm_head_dweight import dweight_blocks, lm_head_dweight_window
from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials, lm_head_merge_splits

R, H, V = 384, 64, 300  # three CTA row blocks of 128 rows; 3 tiles of 128 columns, the last ragged (44)
CFG = P.LMHeadBlocks(block_m=64, block_n=128, block_k=64, num_stages=2)
NAN_MEMORY = _interpret_params_cls()(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
N_ROWS = [0, 129]  # none; a partial block past the first (two of three blocks live)
LIVE = 256  # rows of the blocks that hold the first 129: the full grid runs on these only
SAVE = 2  # kept logits tiles (of 3)
SMS = 4  # a small GPU: prefixes of one, two and three blocks take 3, 2 and 1 splits: a grid of 4 CTAs


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((R, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((H, V)) / np.sqrt(H), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, V, R), jnp.int32)
    scale = jnp.full((R,), C.LOG2E / 0.8, jnp.float32)
    return h, w, ids, scale


def test_grid_deals_every_live_block_and_split_once():
    grid = P.RowPrefixGrid.balanced(128, 64, 594, 132, min_tiles=1)
    for n in (0, 1, 128, 129, 4000, 8192):
        nb, s, t = (int(x) for x in grid.info(n)[:3])
        assert nb == C.cdiv(n, 128) and s == grid.splits[nb] and t == C.cdiv(594, s)
        assert nb * s <= grid.num_ctas  # the grid has a CTA for every (block, split)
    assert grid.splits[64] <= grid.splits[1]  # a short prefix takes more splits
    fixed = P.RowPrefixGrid.fixed(128, 4, 594, 32)
    assert set(fixed.splits) == {19} and set(fixed.tiles) == {32}


@pytest.mark.parametrize("rows_fastest", [True, False], ids=["rows-fastest", "splits-fastest"])
def test_cta_assignment_covers_each_block_and_split_once(rows_fastest):
    """Every live (row block, split) goes to exactly one CTA of the grid, the others have no work; rows fastest:
    consecutive CTAs take consecutive row blocks of one split (the static grid's order), else one block's splits."""
    grid = P.RowPrefixGrid.balanced(128, 64, 594, 132, min_tiles=1)
    i = jnp.arange(grid.num_ctas, dtype=jnp.int32)
    for n in (0, 1, 129, 4000, 8192):
        nb, s = (int(x) for x in grid.info(n)[:2])
        block, split, live = (np.asarray(x) for x in P.cta_assignment(i, jnp.int32(nb), jnp.int32(s), rows_fastest))
        pairs = sorted(zip(block[live].tolist(), split[live].tolist()))
        assert pairs == [(b, t) for b in range(nb) for t in range(s)]
        if nb > 1 and s > 1:
            assert (block[1], split[1]) == ((1, 0) if rows_fastest else (0, 1))


@pytest.fixture(scope="module")
def runs():
    """The kernel's outputs (the statistics with the entropy's, then ``SAVE`` kept tiles) on the full grid of the
    first ``LIVE`` rows, and per row count of ``N_ROWS`` on the row-prefix grid (one compiled kernel); the two tests
    below read one run each of a count."""
    h, w, ids, scale = _inputs(1)
    kw = dict(weight_layout="hv", vocab_size=V, cfg=CFG, with_entropy=True, save_tiles=SAVE, interpret=NAN_MEMORY)
    full = lm_head_lse_partials(h[:LIVE], w, None, ids[:LIVE], scale[:LIVE], num_splits=1, **kw)
    grid = P.RowPrefixGrid.balanced(128, R // 128, C.cdiv(V, 128), SMS, min_tiles=1)
    assert grid.splits == (3, 3, 2, 1) and grid.num_ctas == 4  # 129 rows: two splits, of tiles 0-1 and 2
    run = jax.jit(lambda n: lm_head_lse_partials(h, w, None, ids, scale, num_splits=0, row_grid=grid, n_rows=n, **kw))
    return full, {n: run(jnp.int32(n)) for n in N_ROWS}


def test_interpret_lse_on_a_row_prefix(runs):
    full, got = runs
    full = lm_head_merge_splits(*full[:-2])
    for n in N_ROWS:
        stats = lm_head_merge_splits(*got[n][:-2])
        live = C.cdiv(n, 128) * 128
        assert live <= LIVE
        for x, y in zip(stats, full):
            np.testing.assert_allclose(np.asarray(x)[:live], np.asarray(y)[:live], rtol=2e-6, atol=2e-6)
        assert np.all(np.asarray(stats[1])[live:] == -np.inf)


def test_interpret_kept_logits_on_a_row_prefix(runs):
    """Kept tiles are relative to the split's running maximum (``d = z2 - m``), so other split boundaries give
    other ``d`` and ``m``; the logits they rebuild (``d + m``) agree to float16's precision of ``d``."""
    n = 129
    live = C.cdiv(n, 128) * 128

    def rebuilt(d, m):
        d, m = np.asarray(d, np.float64)[:live], np.asarray(m, np.float64)[:, :live]
        return d + np.repeat(m.T, 128, axis=1), np.abs(d)

    full, d_full = rebuilt(*runs[0][-2:])
    got, d_got = rebuilt(*runs[1][n][-2:])
    assert got.shape == (live, SAVE * 128)
    assert np.all(np.abs(got - full) <= (d_full + d_got) * 2.0**-11 + 1e-6 * (1 + np.abs(full)))


def test_row_prefix_kernel_lowers_for_cuda():
    """The log-prob kernel on a row-prefix grid lowers to Mosaic GPU for CUDA with a traced row count (Qwen-sized)."""
    rows, hd, vocab = 4096, 896, 151936
    cfg = P.LMHeadBlocks(block_m=64, block_n=256, block_k=64, num_stages=3)
    tiles = C.cdiv(vocab, 256)
    grid = P.RowPrefixGrid.balanced(128, rows // 128, tiles, 132)
    h = jax.ShapeDtypeStruct((rows, hd), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((hd, vocab), jnp.bfloat16)
    i = jax.ShapeDtypeStruct((rows,), jnp.int32)
    f = jax.ShapeDtypeStruct((rows,), jnp.float32)
    n = jax.ShapeDtypeStruct((), jnp.int32)

    def fwd(h, w, i, s, n):
        return lm_head_lse_partials(h, w, None, i, s, weight_layout="hv", vocab_size=vocab, cfg=cfg, num_splits=0,
                                    row_grid=grid, n_rows=n, with_entropy=True)  # fmt: skip

    jax.export.export(jax.jit(fwd), platforms=["cuda"])(h, w, i, f, n)


@pytest.mark.parametrize("layout, keep", [("hv", False), ("vh", True)], ids=["qwen-hv-recompute", "llama-vh-kept"])
def test_backend_on_a_row_prefix_lowers_for_cuda(monkeypatch, layout, keep):
    """The backend's forward on a traced row count (``Capabilities.row_prefix``: one kernel for every count) and the
    gradient pass after it (on a static prefix, reading the first rows of the kept logits) lower for CUDA at real
    heads, recomputing and keeping the logits."""
    from gmpo_jax.lm_head import mosaic_gpu
    from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    rows, hd, vocab = (16384, 896, 151936) if not keep else (8192, 4096, 128256)
    be = MosaicGpuBackend(row_buckets=8, save_min_hidden=0 if keep else 10**9)
    h = jax.ShapeDtypeStruct((rows, hd), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((hd, vocab) if layout == "hv" else (vocab, hd), jnp.bfloat16)
    i = jax.ShapeDtypeStruct((rows,), jnp.int32)
    f = jax.ShapeDtypeStruct((rows,), jnp.float32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    t = jnp.float32(0.9)

    S = rows // 2  # the gradient pass's static prefix

    def step(h, w, i, d, n):
        if keep:
            logp, lse, saved = be.logprobs_for_grads(
                h, w, None, i, t, weight_layout=layout, budget_bytes=2**40, n_rows=n
            )
        else:
            (logp, lse), saved = be.logprobs(h, w, None, i, t, weight_layout=layout, n_rows=n), None
        dh, dw, _ = be.grads(h[:S], w, None, i[:S], d[:S], lse[:S], t, weight_layout=layout, dw_acc=None,
                             db_acc=None, saved=saved)  # fmt: skip
        return logp, dh, dw

    jax.export.export(jax.jit(step), platforms=["cuda"])(h, w, i, f, n)


WIDE = (64, 256, 64, 3)  # 128 x 256 output tiles, 3 stages: a float32 tile staged in two halves


@pytest.mark.parametrize(
    "layout, dw_dtype, hd, blocks, in_flight",
    [
        ("hv", jnp.bfloat16, 128, None, 0),
        ("vh", jnp.float32, 128, None, 0),
        ("vh", jnp.float32, 256, WIDE, 1),  # dh and dW in halves, dh's wgmma products one in flight
    ],
    ids=["hv-bf16", "vh-f32", "vh-f32-wide-in-flight"],
)
def test_interpret_gradient_gemms_on_a_row_prefix(layout, dw_dtype, hd, blocks, in_flight):
    """``dz W^T`` and ``h^T dz`` of a 256-column window on the first 129 of 384 rows, one compiled kernel each for a
    traced count: ``dh`` matches float64 on the two row blocks holding them (the rows of ``dz`` after them hold NaN,
    and the third block is not written: NaN here); ``dW`` sums exactly the first 129 rows (its ``dz`` holds NaN from
    row 192 on, the count rounded up to the 64-row contraction step, and must not read them; rows 129-191 are zero,
    as the dlogits kernel writes rows without a cotangent). ``H = 128``: one output tile of ``dh``; ``dW`` written in
    bfloat16 as a single chunk's (``[H, 256]``: one 256-column tile, ``dweight_blocks``) or in float32 (``[256,
    H]``: two row blocks of one 128-column tile). ``dh`` added in place to a running sum (``acc``): the written rows
    hold the sum, the others keep the running sum's values. The wide case: ``H = 256`` in one 128 x 256 tile of each
    product, float32, so each warpgroup stages its tile in two column halves (the running sum fetched per half), and
    the ``dh`` kernel (a non-transposed product, which the interpreter runs as wgmma) keeps one product in flight."""
    rng = np.random.default_rng(3)
    rows, kw, n = 384, 256, 129
    dz = rng.standard_normal((rows, kw))
    dz[n:256] = 0.0
    dz[256:] = np.nan
    dz_w = jnp.asarray(np.where(np.arange(rows)[:, None] < 192, dz, np.nan), jnp.bfloat16)
    dz = jnp.asarray(dz, jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((rows, hd)), jnp.bfloat16)
    w_hv = jnp.asarray(rng.standard_normal((hd, kw)), jnp.bfloat16)
    cfg = dhidden_blocks(hd, *(() if blocks is None else (blocks,)), in_flight=in_flight)
    dw_cfg = dweight_blocks(kw if layout == "hv" else hd, dw_dtype, *(() if blocks is None else (blocks, blocks)))
    if blocks is not None:
        assert (cfg.block_n, dw_cfg.block_n, dw_cfg.num_stages) == (256, 256, 3)
    w = w_hv if layout == "hv" else w_hv.T
    lhs, rhs = (h, dz_w) if layout == "hv" else (dz_w, h)

    running = jnp.asarray(rng.standard_normal((rows, hd)), jnp.float32)

    def run(n, running):
        dh = lm_head_dhidden_window(dz, w, weight_layout=layout, n_rows=n, cfg=cfg, interpret=NAN_MEMORY)
        dh_acc = lm_head_dhidden_window(dz, w, weight_layout=layout, n_rows=n, cfg=cfg, acc=running,
                                        interpret=NAN_MEMORY)  # fmt: skip
        dw = lm_head_dweight_window(lhs, rhs, n_rows=n, cfg=dw_cfg, num_sms=SMS, out_dtype=dw_dtype,
                                    interpret=NAN_MEMORY)  # fmt: skip
        return dh, dh_acc, dw

    dh, dh_acc, dw = (np.asarray(x, np.float64) for x in jax.jit(run)(jnp.int32(n), running))
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    live = 256  # the row blocks (128 rows) holding the first 129
    want_dh = np.nan_to_num(f64(dz)[:live]) @ f64(w_hv).T
    np.testing.assert_allclose(dh[:live], want_dh, rtol=1e-5, atol=1e-5 * np.abs(want_dh).max())
    assert np.isnan(dh[live:]).all()  # not written
    prev = np.asarray(running, np.float64)
    np.testing.assert_allclose(dh_acc[:live], prev[:live] + want_dh, rtol=1e-5, atol=1e-5 * np.abs(want_dh).max())
    np.testing.assert_array_equal(dh_acc[live:], prev[live:])  # kept
    want_dw = f64(lhs)[:n].T @ f64(rhs)[:n]
    rtol = 2.0**-8 if dw_dtype == jnp.bfloat16 else 1e-5  # the float32 sums rounded once to the output's dtype
    np.testing.assert_allclose(dw, want_dw, rtol=rtol, atol=1e-5 * np.abs(want_dw).max())


def test_gradient_gemms_reject_bad_operands():
    """Mixed or non-16-bit operand dtypes, an unknown weight layout and no SMs raise a ValueError naming the kernel
    (a bf16 ``dz`` with an f16 weight hung the interpreter before the check)."""
    dz, h = jnp.zeros((128, 128), jnp.bfloat16), jnp.zeros((128, 128), jnp.bfloat16)
    cfg = dhidden_blocks(128, (64, 128, 64, 4))
    for args, match in [
        ((dz, h.astype(jnp.float16), "hv"), "lm_head_dhidden: both operands must be bfloat16 or both float16"),
        ((dz.astype(jnp.float32), h.astype(jnp.float32), "hv"), "lm_head_dhidden: both operands"),
        ((dz, h, "xy"), "lm_head_dhidden: weight_layout must be 'hv' or 'vh'"),
    ]:
        with pytest.raises(ValueError, match=match):
            lm_head_dhidden_window(args[0], args[1], weight_layout=args[2], n_rows=1, cfg=cfg)
    dw_cfg = dweight_blocks(128, jnp.float32, (64, 128, 64, 4), (64, 128, 64, 4))
    for lhs, sms, match in [(h.astype(jnp.float16), 132, "lm_head_dweight: both operands"), (h, 0, "num_sms")]:
        with pytest.raises(ValueError, match=match):
            lm_head_dweight_window(lhs, dz, n_rows=1, cfg=dw_cfg, num_sms=sms, out_dtype=jnp.float32)


def test_gradient_gemms_lower_for_cuda():
    """The gradient GEMMs lower to Mosaic GPU for CUDA with a traced row count at both heads' windows (the
    transposed left operand of ``h^T dz`` included, which the interpreter multiplies in float32 instead): in the
    default sizes (at the Llama-3 head 128 x 256 float32 tiles staged in halves), there also with one wgmma product
    in flight, and in 128 x 128 tiles (each float32 tile staged whole)."""
    S = jax.ShapeDtypeStruct
    for rows, hd, kw, layout, blocks, in_flight in [
        (16384, 896, 8192, "hv", (), 0),
        (8192, 4096, 4096, "vh", (), 1),
        (8192, 4096, 4096, "vh", ((64, 128, 64, 4),), 0),
    ]:
        cfg = dhidden_blocks(hd, *blocks, in_flight=in_flight)
        dz, h, n = S((rows, kw), jnp.bfloat16), S((rows, hd), jnp.bfloat16), S((), jnp.int32)
        w = S((hd, kw) if layout == "hv" else (kw, hd), jnp.bfloat16)

        def grads(dz, h, w, n, layout=layout, cfg=cfg, blocks=blocks * 2, in_flight=in_flight):
            dh = lm_head_dhidden_window(dz, w, weight_layout=layout, n_rows=n, cfg=cfg)
            dh = lm_head_dhidden_window(dz, w, weight_layout=layout, n_rows=n, cfg=cfg, acc=dh)  # in place
            lhs, rhs = (h, dz) if layout == "hv" else (dz, h)
            dws = [
                lm_head_dweight_window(
                    lhs,
                    rhs,
                    n_rows=n,
                    cfg=dweight_blocks(rhs.shape[1], d, *blocks, in_flight=in_flight),
                    num_sms=132,
                    out_dtype=d,
                )
                for d in (jnp.bfloat16, jnp.float32)
            ]
            return dh, *dws

        jax.export.export(jax.jit(grads), platforms=["cuda"])(dz, h, w, n)


@pytest.mark.parametrize(
    "B, T, H, V, layout, grad_filter, sites",
    [
        (8, 2048, 896, 151936, "hv", None, 7),
        (4, 2048, 4096, 128256, "vh", None, 5),
        (8, 2048, 896, 151936, "hv", 1e-3, 10),
        (4, 2048, 4096, 128256, "vh", 1e-3, 7),
        (8, 2048, 896, 151936, "hv", "default", 10),
        (4, 2048, 4096, 128256, "vh", "default", 7),
    ],
    ids=["qwen-recompute", "llama-kept-logits", "qwen-filter", "llama-kept-filter", "qwen-default", "llama-default"],
)
def test_one_program_lowers_for_cuda(monkeypatch, B, T, H, V, layout, grad_filter, sites):
    """GMPO's value and gradient with eight row buckets, ``ROW_PREFIX_FORWARD`` and ``ROW_PREFIX_GRADIENT``, lowered
    for CUDA at real heads: one program for every number of live rows, i.e. no conditional, no XLA GEMM (the gradient
    GEMMs are the Pallas ones) and few Mosaic call sites (the forward, then dz, dh and dW of the full and the partial
    vocabulary window; the kept-logits head forms dz in XLA). Per bucket it is 24 and 9 sites in 8 branches. With the
    gradient filter each window runs on the runtime prefix of its rows: the head windows and the tail's (three XLA
    dots, the dropped windows' correction: the rows' mean hidden state, its logits, the product with the tilted
    means); per static prefix it is 29 and 16 sites in 3 and 17 conditionals. ``default``: ``HeadOptions()`` and the
    tuning as shipped (``grad_filter="auto"``, ``ROW_PREFIX_*`` None) are that one filtered program."""
    import re

    import gmpo_jax
    from gmpo_jax import tuning
    from gmpo_jax.lm_head import mosaic_gpu
    from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend

    monkeypatch.setattr(mosaic_gpu, "supported_on", lambda device: True)
    default = grad_filter == "default"
    if not default:
        monkeypatch.setattr(tuning, "ROW_PREFIX_FORWARD", True)
        monkeypatch.setattr(tuning, "ROW_PREFIX_GRADIENT", True)

    def loss(h, w, ids, mask, adv):
        chosen = {} if default else {"grad_filter": grad_filter}
        head = gmpo_jax.HeadOptions(weight_layout=layout, implementation=MosaicGpuBackend(row_buckets=8), **chosen)
        batch = gmpo_jax.PolicyBatch(ids, mask, adv)
        return gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=gmpo_jax.GMPO(), head=head)[0]

    S = jax.ShapeDtypeStruct
    args = (S((B, T, H), jnp.bfloat16), S((H, V) if layout == "hv" else (V, H), jnp.bfloat16),
            S((B, T), jnp.int32), S((B, T), jnp.bool_), S((B,), jnp.float32))  # fmt: skip
    text = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), platforms=["cuda"])(*args).mlir_module()
    assert "stablehlo.case" not in text
    assert text.count("stablehlo.dot_general") == (3 if grad_filter is not None else 0)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == sites
    kernels = ["lm_head_lse", "lm_head_dhidden", "lm_head_dweight"] + (["lm_head_dlogits"] if layout == "hv" else [])
    assert all(name in text for name in kernels)  # each kernel named in profiles (the Mosaic module's kernel name)
