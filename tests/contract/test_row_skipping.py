"""Exact work skipping (``gmpo_jax.lm_head.rows``): the same loss, metrics and gradients with and without it.

Skipping reorders a chunk's rows (unmasked with a non-zero advantage, unmasked with a zero advantage,
masked) and runs the backend on a static prefix. Per-row results are computed by the same code, so the
loss, the metrics and the hidden-state gradient agree to float32 rounding; the weight gradient sums the
rows in another order (tolerance: a few float32 ulps of its largest entry, 1e-5 relative; where it is returned in
bfloat16, one bfloat16 ulp of each entry more: a float32 sum in another order can round to the neighbouring
bfloat16, as it did on one CPU and not on another at the same commit). Shapes: R = B T
rows above ``tuning.ROW_ALIGN`` so that several prefix sizes exist.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Obj, check_against_spec, make_case, needs_hopper, spec_for

import gmpo_jax
from gmpo_jax import tuning
from gmpo_jax.lm_head import rows
from gmpo_jax.lm_head.backend import with_settings
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend

RTOL = 1e-5


def _batch(seed, B=8, T=64, H=16, V=50, dtype=np.float32, empty_rows=(), zero_adv=(1, 4)):
    rng = np.random.default_rng(seed)
    mask = np.arange(T)[None] < rng.integers(T // 5, T + 1, B)[:, None]
    for b in empty_rows:
        mask[b] = False
    adv = rng.normal(size=B).astype(np.float32)
    adv[list(zero_adv)] = 0.0
    return make_case(seed, B=B, T=T, H=H, V=V, dtype=dtype, mask=mask, adv=adv, with_bias=True)


def _run(case, obj, backend, chunk_size=None):
    def f(h, w, b):
        return gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref),
            objective=obj,
            bias=b,
            head=gmpo_jax.HeadOptions(chunk_size=chunk_size, implementation=backend),
        )

    args = (jnp.asarray(case.hidden), jnp.asarray(case.weight), jnp.asarray(case.bias))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*args)


def _assert_same(got, want):
    (loss, aux), grads = got
    (loss0, aux0), grads0 = want
    np.testing.assert_allclose(float(loss), float(loss0), rtol=RTOL, atol=1e-7)
    for name, a, b in zip(aux._fields, aux, aux0):
        np.testing.assert_allclose(float(a), float(b), rtol=RTOL, atol=1e-7, err_msg=name)
    for name, a, b in zip(("hidden", "weight", "bias"), grads, grads0):
        rtol = 2.0**-7 if a.dtype == jnp.bfloat16 else 0.0  # one bfloat16 ulp: the other order's rounding
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=RTOL * max(np.abs(b).max(), 1e-30), err_msg=name)


def test_prefix_sizes_and_choice():
    assert rows.prefix_sizes(1000, 4) == (256, 512, 768, 1000)
    assert rows.prefix_sizes(100, 8) == (100,)  # fewer rows than one block: one prefix
    sizes = (128, 256, 384)
    pick = jax.jit(lambda n: rows.on_prefix(n, sizes, lambda S: jnp.int32(S), lambda: jnp.int32(0)))
    assert [int(pick(n)) for n in (0, 1, 128, 129, 256, 300, 384)] == [0, 128, 128, 256, 256, 384, 384]


def test_order_puts_live_rows_first():
    live = np.array([[True, False, True], [True, True, False], [False, False, False]])
    order = rows.order(jnp.asarray(live))
    flat = live.reshape(-1)
    assert list(np.asarray(order.perm)) == [*np.flatnonzero(flat), *np.flatnonzero(~flat)]  # live first, stable
    assert int(order.n_live) == 4
    np.testing.assert_array_equal(np.asarray(order.perm)[np.asarray(order.inv)], np.arange(9))


@pytest.mark.parametrize("n", [1, 2, 127, 1000])
def test_order_is_numpys_stable_argsort(n):
    """The prefix-sum partition is NumPy's stable argsort of the 0/1 key, also for all-live and all-dead rows,
    and its batched form (the gradient filter's per-window orders, ``jax.vmap``) matches row by row."""
    rng = np.random.default_rng(n)
    masks = np.stack([rng.random(n) < 0.3, np.ones(n, bool), np.zeros(n, bool)])
    batched = jax.vmap(rows.order)(jnp.asarray(masks))
    for k, live in enumerate(masks):
        want = np.argsort(np.where(live, 0, 1), kind="stable")
        order = rows.order(jnp.asarray(live))
        as_int = rows.order(jnp.asarray(live, jnp.int32))  # a 0/1 integer or float mask means the same
        as_float = rows.order(jnp.asarray(live, jnp.float32))
        for got in (order, jax.tree.map(lambda x: x[k], batched), as_int, as_float):
            np.testing.assert_array_equal(np.asarray(got.perm), want)
            np.testing.assert_array_equal(np.asarray(got.inv)[want], np.arange(n))
            assert int(got.n_live) == int(live.sum())


@pytest.mark.parametrize(
    "obj, chunk_size",
    [
        (Obj("gmpo"), None),
        (Obj("gmpo"), 3),
        (Obj("gmpo", beta=0.04), 3),
        (Obj("grpo", beta=0.04), None),
        (Obj("dapo", level="sequence"), 3),
        (Obj("cispo"), None),
        (Obj("sapo"), 3),
    ],
    ids=str,
)
def test_skipping_matches_all_rows(obj, chunk_size):
    """Zero-advantage sequences (gradient-free unless beta != 0), an empty sequence, ragged masks; one chunk
    (``chunk_size=None``) and several (3 sequences, the last chunk overlapping). Each objective once, GMPO with
    both; a KL term (every unmasked row live) with one chunk and with several."""
    case = _batch(1, empty_rows=(6,))
    want = _run(case, obj.lib(), XlaChunkedBackend(row_buckets=1), chunk_size)
    got = _run(case, obj.lib(), XlaChunkedBackend(row_buckets=4), chunk_size)
    _assert_same(got, want)
    check_against_spec(*got[0], got[1], spec_for(case, obj), case, obj)


def test_skipping_edge_batches():
    """All masked: zero loss and gradients. All advantages zero without KL: every backward skipped."""
    case = _batch(2, empty_rows=range(8))
    (loss, _), grads = _run(case, gmpo_jax.GMPO(), XlaChunkedBackend(row_buckets=4))
    assert float(loss) == 0.0 and all(not np.asarray(g).any() for g in grads)
    case = _batch(3, zero_adv=range(8))
    (loss, aux), grads = _run(case, gmpo_jax.GRPO(), XlaChunkedBackend(row_buckets=4))
    assert float(loss) == 0.0 and all(not np.asarray(g).any() for g in grads)
    assert float(aux.log_ratio_max) != 0.0  # the forward still ran for the metrics


def _kept_case():
    return _batch(4, B=4, T=64, H=64, V=200, dtype=jnp.bfloat16, zero_adv=(1,))


@pytest.fixture(scope="module")
def kept_without_skipping():
    """The kept-logits case on every row (one row bucket: ``tuning.ROW_PREFIX_FORWARD`` does not enter), once for
    both forwards below."""
    return _run(_kept_case(), gmpo_jax.GMPO(), MosaicGpuBackend(interpret=True, save_min_hidden=0, row_buckets=1))


@pytest.mark.parametrize("row_prefix_forward", [False, True], ids=["per-bucket-forward", "one-forward-kernel"])
def test_skipping_mosaic_interpret_keeps_logits(monkeypatch, kept_without_skipping, row_prefix_forward):
    """The Mosaic backend in the interpreter, a single chunk whose logits are kept for the gradient pass
    (forward and backward on one prefix; the forward per prefix size, or once on a runtime row prefix:
    ``tuning.ROW_PREFIX_FORWARD``), bf16: as without skipping."""
    monkeypatch.setattr(tuning, "ROW_PREFIX_FORWARD", row_prefix_forward)
    got = _run(_kept_case(), gmpo_jax.GMPO(), MosaicGpuBackend(interpret=True, save_min_hidden=0, row_buckets=2))
    _assert_same(got, kept_without_skipping)


def test_skipping_mosaic_interpret_row_prefix_recomputes(monkeypatch):
    """The Mosaic backend in the interpreter recomputing the logits (nothing kept), two chunks: the forward on one
    compiled kernel for every number of live rows (``tuning.ROW_PREFIX_FORWARD``), as without skipping. One ragged
    vocabulary tile: the kernels' grids are one CTA a row block (several tiles and splits on a row prefix:
    ``test_row_prefix_grid.py``)."""
    monkeypatch.setattr(tuning, "ROW_PREFIX_FORWARD", True)
    case = _batch(6, B=4, T=64, H=64, V=100, dtype=jnp.bfloat16, zero_adv=(1,), empty_rows=(3,))
    be = MosaicGpuBackend(interpret=True, save_logits=False)
    want = _run(case, gmpo_jax.GMPO(), dataclasses.replace(be, row_buckets=1), chunk_size=2)
    got = _run(case, gmpo_jax.GMPO(), dataclasses.replace(be, row_buckets=2), chunk_size=2)
    _assert_same(got, want)


@pytest.mark.parametrize(
    "keep, grad_filter", [(False, None), (True, None), (True, 0.02)], ids=["recompute", "kept-logits", "kept-filter"]
)
def test_skipping_mosaic_interpret_one_program(monkeypatch, keep, grad_filter):
    """Forward and gradient pass each on one program for every number of live rows (``tuning.ROW_PREFIX_FORWARD``
    and ``ROW_PREFIX_GRADIENT``: the Pallas GEMMs ``dz W^T`` and ``h^T dz`` with the row count at run time, ``dz``
    from the dz kernel on a row-prefix grid or from the kept logits on every row), bf16 with a bias, uninitialised
    memory read as NaN (an undefined row read by mistake shows): as without skipping. One chunk of two 128-row
    blocks of which only the first has live rows (75 of 256), ``H = 128`` (the GEMMs' smallest hidden size), a
    ragged vocabulary of three tiles; the gradient GEMMs ran. ``kept-filter``: the gradient filter (windows of one
    tile) on the runtime prefix of each window's rows, against the same filter without skipping (per static prefix:
    the same kept blocks)."""
    from gmpo_jax import _device
    from gmpo_jax.kernels import _compat
    from gmpo_jax.lm_head.mosaic_gpu.grad_pass import _GradPass

    monkeypatch.setattr(_device, "DEFAULT_SMS", 1)  # the fewest CTAs: the interpreter's time goes by CTA
    nan = _compat._interpret_params_cls()(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
    monkeypatch.setattr(_compat, "interpret_params", lambda: nan)
    calls, gemms = [], _GradPass.prefix_gemms
    monkeypatch.setattr(
        _GradPass, "prefix_gemms", lambda self, *a: calls.append(self.saved is not None) or gemms(self, *a)
    )
    case = _batch(6, B=4, T=64, H=128, V=300, dtype=jnp.bfloat16, zero_adv=(1,), empty_rows=(3,))
    assert case.mask.sum() - case.mask[1].sum() < 128
    be = (
        MosaicGpuBackend(interpret=True, save_min_hidden=0, filter_window=128)
        if keep
        else MosaicGpuBackend(interpret=True, save_logits=False)
    )
    be = with_settings(be, grad_filter=grad_filter)
    want = _run(case, gmpo_jax.GMPO(), dataclasses.replace(be, row_buckets=1))
    assert not calls
    monkeypatch.setattr(tuning, "ROW_PREFIX_FORWARD", True)
    monkeypatch.setattr(tuning, "ROW_PREFIX_GRADIENT", True)
    got = _run(case, gmpo_jax.GMPO(), dataclasses.replace(be, row_buckets=2))
    assert calls and set(calls) == {keep}  # the GEMMs ran, on dz from the kept logits or recomputed
    _assert_same(got, want)


@pytest.mark.parametrize("flag", [True, False, None])
def test_row_prefix_settings_follow_the_filter(monkeypatch, flag):
    """``tuning.ROW_PREFIX_*``: True / False whatever the call; None: one program exactly where the call runs the
    gradient filter (a backend that declares it and has ``grad_filter`` set), and never on a backend without the
    runtime-prefix capability."""
    from types import SimpleNamespace

    from gmpo_jax.lm_head import chunks

    monkeypatch.setattr(tuning, "ROW_PREFIX_FORWARD", flag)
    monkeypatch.setattr(tuning, "ROW_PREFIX_GRADIENT", flag)
    mosaic = MosaicGpuBackend(interpret=True)
    for backend, filtered, capable in (
        (mosaic, False, True),
        (with_settings(mosaic, grad_filter=None), False, True),
        (with_settings(mosaic, grad_filter=0.01), True, True),
        (XlaChunkedBackend(), False, False),
    ):
        cfg = SimpleNamespace(backend=backend)
        want = capable and (filtered if flag is None else flag)
        assert chunks._row_prefix(cfg) is want and chunks._row_prefix_grads(cfg) is want, (backend, flag)


@pytest.mark.parametrize("flag", ["False", 1, 0.0])
def test_row_prefix_settings_must_be_bool_or_none(monkeypatch, flag):
    """A ``ROW_PREFIX_*`` value other than True / False / None is an error naming it (``"False"`` is truthy)."""
    from types import SimpleNamespace

    from gmpo_jax.lm_head import chunks

    monkeypatch.setattr(tuning, "ROW_PREFIX_GRADIENT", flag)
    with pytest.raises(TypeError, match="ROW_PREFIX_GRADIENT"):
        chunks._row_prefix_grads(SimpleNamespace(backend=MosaicGpuBackend(interpret=True)))


def test_logprobs_op_resolves_no_filter(monkeypatch):
    """``fused_linear_logprobs`` never filters (its backward has no window masses), so its backend carries no
    ``grad_filter`` whatever the ``HeadOptions`` say: ``ROW_PREFIX_*`` = None then leaves it per bucket, as the
    policy loss without the filter."""
    from gmpo_jax.lm_head import api

    seen, config = [], api._config
    monkeypatch.setattr(api, "_config", lambda *a, **k: seen.append(config(*a, **k)) or seen[-1])
    h, w = jnp.ones((1, 4, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16)
    head = gmpo_jax.HeadOptions(grad_filter=0.02, implementation=MosaicGpuBackend(interpret=True))
    gmpo_jax.fused_linear_logprobs(h, w, jnp.zeros((1, 4), jnp.int32), head=head)
    assert len(seen) == 1 and seen[0].backend.grad_filter is None


def test_default_buckets():
    assert tuning.row_buckets(XlaChunkedBackend()) == (tuning.ROW_BUCKETS if jax.default_backend() == "gpu" else 1)
    assert tuning.row_buckets(MosaicGpuBackend(interpret=True)) == 1
    assert tuning.row_buckets(XlaChunkedBackend(row_buckets=3)) == 3


@pytest.mark.parametrize("entropy", [False, True])
def test_logprobs_skipping(entropy):
    """fused_linear_logprobs: masked rows skipped in the forward, rows with a zero cotangent in the backward."""
    case = _batch(5, empty_rows=(2,))
    g = jnp.asarray(np.random.default_rng(0).normal(size=case.mask.shape) * (np.arange(64) % 3 != 0), jnp.float32)

    def run(rb):
        def f(h, w, b):
            out = gmpo_jax.fused_linear_logprobs(
                h,
                w,
                case.ids,
                completion_mask=case.mask,
                bias=b,
                return_entropy=entropy,
                head=gmpo_jax.HeadOptions(implementation=XlaChunkedBackend(row_buckets=rb)),
            )
            logp = out[0] if entropy else out
            return jnp.sum(logp * g), out

        args = (jnp.asarray(case.hidden), jnp.asarray(case.weight), jnp.asarray(case.bias))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*args)

    (v0, o0), g0 = run(1)
    (v1, o1), g1 = run(4)
    for a, b in zip(jax.tree.leaves(o1), jax.tree.leaves(o0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-7)
    for a, b in zip(g1, g0):
        b = np.asarray(b, np.float64)
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=RTOL * np.abs(b).max())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "row_prefix",
    [(False, False, None), (True, False, None), (True, True, None), (True, True, "auto")],
    ids=["per-bucket", "one-forward-kernel", "one-program", "one-program-filter"],
)
@pytest.mark.parametrize(
    "B, T, H, V, layout, chunk_size",
    [(8, 2048, 896, 151936, "hv", None), (4, 2048, 4096, 128256, "vh", None), (8, 1024, 896, 151936, "hv", 3)],
    ids=["qwen-one-chunk", "llama-kept-logits", "qwen-three-chunks"],
)
def test_gpu_skipping_matches_all_rows(monkeypatch, B, T, H, V, layout, chunk_size, row_prefix):
    """On the GPU at real heads: eight row buckets (each pass per prefix size; the forward on one kernel for every
    number of live rows: ``tuning.ROW_PREFIX_FORWARD``; and the gradient pass too: ``ROW_PREFIX_GRADIENT``) give the
    loss, metrics and gradients of no skipping (ragged masks, zero-advantage and empty sequences);
    ``one-program-filter``: ``grad_filter="auto"`` on the one program against the same filter without skipping (the
    same kept blocks; the program ``tuning.ROW_PREFIX_*`` = None gives a filtered call)."""
    monkeypatch.setattr(tuning, "ROW_PREFIX_FORWARD", row_prefix[0])
    monkeypatch.setattr(tuning, "ROW_PREFIX_GRADIENT", row_prefix[1])
    rng = np.random.default_rng(7)
    mask = np.arange(T)[None] < rng.integers(T // 5, T + 1, B)[:, None]
    mask[1] = False
    adv = rng.normal(size=B).astype(np.float32)
    adv[[2, 5 % B]] = 0.0
    k = jax.random.split(jax.random.key(8), 4)
    hidden = jax.random.normal(k[0], (B, T, H), jnp.bfloat16)
    weight = (jax.random.normal(k[1], (H, V) if layout == "hv" else (V, H)) * (2.0 / np.sqrt(H))).astype(jnp.bfloat16)
    ids = jnp.where(mask, jax.random.randint(k[2], (B, T), 0, V), -100)
    old = jax.random.normal(k[3], (B, T)) * 0.3 - 3.0  # off-policy: some tokens clipped

    def run(row_buckets):
        def f(h, w):
            batch = gmpo_jax.PolicyBatch(ids, jnp.asarray(mask), jnp.asarray(adv), old_logps=old)
            backend = MosaicGpuBackend(row_buckets=row_buckets)
            head = gmpo_jax.HeadOptions(
                weight_layout=layout, chunk_size=chunk_size, implementation=backend, grad_filter=row_prefix[2]
            )
            return gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=gmpo_jax.GMPO(), head=head)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, weight)

    (loss, aux), grads = run(8)
    (loss0, aux0), grads0 = run(1)
    np.testing.assert_allclose(float(loss), float(loss0), rtol=RTOL, atol=1e-7)
    for name, a, b in zip(aux._fields, aux, aux0):
        np.testing.assert_allclose(float(a), float(b), rtol=RTOL, atol=1e-7, err_msg=name)
    for name, a, b in zip(("hidden", "weight"), grads, grads0):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)), name
        # one bfloat16 ulp, and a few more where a column's float32 sum cancels to far below its largest terms
        # (another GEMM shape sums in another order: seen 2 ulps in 2 of 136M weight entries)
        np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-4 * max(np.abs(b).max(), 1e-30), err_msg=name)
