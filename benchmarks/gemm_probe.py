"""The gradient GEMMs alone: the row-prefix Pallas kernels beside XLA's dots on one vocabulary window (GPU, ~2 min).

    python -m benchmarks.gemm_probe [--results benchmarks/results/gemm-<device>.jsonl] [--iters 50]
    python -m benchmarks.gemm_probe --heads tiny-hv,tiny-vh --iters 1 --results /tmp/g.jsonl  # CPU: the interpreter
    python -m benchmarks.gemm_probe --lse [--heads ...]  # the log-prob kernel: per bucket against the runtime prefix

Per headline head (Qwen2.5-0.5B: 16384 rows, H 896, an 8192-column window, weight ``[H, V]``; Llama-3-8B: 8192 rows,
H 4096, a 4096-column window, weight ``[V, H]``) and per product, ``dh += dz W^T`` (float32, added in place),
``dW = h^T dz`` in bfloat16 (a single chunk) and in float32: XLA's dot (cuBLAS or Triton, the per-bucket gradient
pass's) and ``kernels.lm_head_dhidden`` / ``lm_head_dweight`` in each block configuration
(``(block_m, block_n, block_k, num_stages)``, ``tuning.DHIDDEN_BLOCKS`` / ``DWEIGHT_BLOCKS_16`` / ``_32``) with
``in_flight`` 0 and 1 (``tuning.WGMMA_IN_FLIGHT``). All rows live (``n_rows = rows``). One JSON line per
(head, product, variant): median ms of ``--iters`` back-to-back calls (the sum donated: updated in place), TFLOP/s,
and the largest difference from XLA's result relative to its largest entry (a wrong kernel shows here, not as a time).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import append_jsonl, device_slug, git_commit, now_utc, timing_stats

HEADS = {"qwen2.5-0.5b": (16384, 896, 8192, "hv"), "llama3-8b": (8192, 4096, 4096, "vh")}
SMOKE = {"tiny-hv": (256, 128, 256, "hv"), "tiny-vh": (256, 256, 256, "vh")}  # the script's own check, on the CPU
DH_BLOCKS = [(64, 128, 64, 4), (64, 256, 64, 3), (128, 128, 64, 3)]
DW16_BLOCKS = [(64, 256, 64, 3), (128, 128, 64, 3), (64, 128, 64, 4)]
DW32_BLOCKS = [(64, 128, 64, 4), (64, 256, 64, 3)]


def _time(fn, args, donate_first: bool, iters: int) -> float:
    """Median ms of one call, over ``iters`` calls timed back to back in 5 groups (the first argument carried)."""
    out = fn(*args)  # compile and warm up
    jax.block_until_ready(out)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(out, *args[1:]) if donate_first else fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return timing_stats(times)["median_ms"]


def _products(rows: int, H: int, kw: int, layout: str, seed: int = 0):
    """The operands of one window: ``dz [rows, kw]``, ``h [rows, H]``, ``w`` (the window's columns in ``layout``)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    dz = (jax.random.normal(k1, (rows, kw), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    h = jax.random.normal(k2, (rows, H), jnp.bfloat16)
    w = (jax.random.normal(k3, (H, kw) if layout == "hv" else (kw, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return dz, h, w


def probe(head: str, iters: int) -> list[dict]:
    from gmpo_jax._device import num_sms
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.lm_head_dhidden import dhidden_blocks, lm_head_dhidden_window
    from gmpo_jax.kernels.lm_head_dweight import dweight_blocks, lm_head_dweight_window

    rows, H, kw, layout = {**HEADS, **SMOKE}[head]
    interpret = interpret_params() if jax.default_backend() != "gpu" else None
    axis = 1 if layout == "hv" else 0  # the weight's vocabulary axis
    dz, h, w = _products(rows, H, kw, layout)
    n = jnp.int32(rows)
    flops = 2.0 * rows * H * kw
    lhs, rhs = (h, dz) if layout == "hv" else (dz, h)  # dW in the weight's layout
    sms = num_sms(interpret is not None)

    xla_dh = jax.jit(
        lambda acc, dz, w: (
            acc + jax.lax.dot_general(dz, w, (((1,), (axis,)), ((), ())), preferred_element_type=jnp.float32)
        ),
        donate_argnums=0,
    )

    def xla_dw(dtype):
        return jax.jit(
            lambda lhs, rhs: jax.lax.dot_general(
                lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            ).astype(dtype)
        )

    acc0 = jnp.zeros((rows, H), jnp.float32)
    want = {"dh": np.asarray(xla_dh(acc0 + 0, dz, w))}
    for name, dtype in (("dw16", jnp.bfloat16), ("dw32", jnp.float32)):
        want[name] = np.asarray(xla_dw(dtype)(lhs, rhs).astype(jnp.float32))

    cases = [("dh", "xla", None, 0, xla_dh, (acc0 + 0, dz, w), True)]
    cases += [
        (name, "xla", None, 0, xla_dw(d), (lhs, rhs), False)
        for name, d in (("dw16", jnp.bfloat16), ("dw32", jnp.float32))
    ]
    for in_flight in (0, 1):
        for blocks in DH_BLOCKS:
            cfg = dhidden_blocks(H, blocks, in_flight)
            if (cfg.block_n, cfg.num_stages) != blocks[1::2]:
                continue  # not this head's (the fallback)
            fn = jax.jit(
                lambda acc, dz, w, cfg=cfg: lm_head_dhidden_window(
                    dz, w, weight_layout=layout, n_rows=n, cfg=cfg, acc=acc, interpret=interpret
                ),
                donate_argnums=0,
            )
            cases.append(("dh", "pallas", blocks, in_flight, fn, (acc0 + 0, dz, w), True))
        for name, dtype, table in (("dw16", jnp.bfloat16, DW16_BLOCKS), ("dw32", jnp.float32, DW32_BLOCKS)):
            for blocks in table:
                cfg = dweight_blocks(rhs.shape[1], dtype, blocks, blocks, in_flight)
                if (cfg.block_n, cfg.num_stages) != blocks[1::2] or lhs.shape[1] % cfg.rows_per_cta:
                    continue  # the fallback, or output rows (H 896 at Qwen) not a multiple of 2 block_m
                fn = jax.jit(
                    lambda lhs, rhs, cfg=cfg, dtype=dtype: lm_head_dweight_window(
                        lhs, rhs, n_rows=n, cfg=cfg, num_sms=sms, out_dtype=dtype, interpret=interpret
                    )
                )
                cases.append((name, "pallas", blocks, in_flight, fn, (lhs, rhs), False))

    records = []
    for product, impl, blocks, in_flight, fn, args, donate in cases:
        rec = dict(kind="gemm_probe", date=now_utc(), commit=git_commit(), device=jax.devices()[0].device_kind,
                   jax=jax.__version__, head=head, rows=rows, H=H, window=kw, layout=layout, product=product,
                   implementation=impl, blocks=blocks, in_flight=in_flight)  # fmt: skip
        try:
            if product == "dh":  # one call on a zero sum: the product itself
                got = np.asarray(fn(acc0 + 0, *args[1:]))
            else:
                got = np.asarray(fn(*args).astype(jnp.float32))
            rec["max_rel_diff"] = float(np.abs(got - want[product]).max() / np.abs(want[product]).max())
            ms = _time(fn, args, donate, iters)
            rec.update(status="ok", median_ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
            rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print(json.dumps(rec), flush=True)
        records.append(rec)
    return records


LSE_HEADS = {"qwen2.5-0.5b": (16384, 896, 151936, "hv"), "llama3-8b": (8192, 4096, 128256, "vh")}
LSE_SMOKE = {"tiny-hv": (512, 128, 1024, "hv"), "tiny-vh": (512, 128, 1024, "vh")}


def probe_lse(head: str, iters: int, live: float = 0.582) -> list[dict]:
    """The log-prob kernel (``kernels.lm_head_lse_partials``) on ``n = live * R`` rows three ways: compiled for a
    static row count (``n`` rounded up to the row block, and the per-bucket default's bucket,
    ``lm_head.rows.prefix_rows``) and on the runtime prefix of all ``R`` rows (``RowPrefixGrid``,
    ``tuning.ROW_PREFIX_FORWARD``); each with the logits kept (``save_tiles``, as at Llama-3) and without. One JSON
    line per variant: median ms."""
    from gmpo_jax import tuning
    from gmpo_jax._device import num_sms
    from gmpo_jax.kernels import _common as C
    from gmpo_jax.kernels import _lm_head_pipeline as P
    from gmpo_jax.kernels._compat import interpret_params
    from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials
    from gmpo_jax.lm_head import rows as rows_lib
    from gmpo_jax.lm_head.mosaic_gpu.layout import block_config

    R, H, V, layout = {**LSE_HEADS, **LSE_SMOKE}[head]
    gpu = jax.default_backend() == "gpu"
    interpret = None if gpu else interpret_params()
    sms = num_sms(not gpu)
    cfg = block_config(rows=R, H=H, V=V, kind="logprob_saved", interpret=not gpu)
    rpc, n_tiles = cfg.rows_per_cta, C.cdiv(V, cfg.block_n)
    n = int(live * R)
    k = jax.random.key(1)
    h = jax.random.normal(k, (R, H), jnp.bfloat16)
    w = (jax.random.normal(k, (H, V) if layout == "hv" else (V, H), jnp.float32) / H**0.5).astype(jnp.bfloat16)
    ids = jnp.zeros((R,), jnp.int32)
    scale = jnp.full((R,), C.LOG2E, jnp.float32)
    bucket = int(rows_lib.prefix_rows(jnp.int32(n), rows_lib.prefix_sizes(R, tuning.ROW_BUCKETS)))  # per bucket
    variants = [("static", C.cdiv(n, rpc) * rpc), ("static", bucket), ("prefix", R)]
    records = []
    for save in (n_tiles, 0):
        for kind, rows in variants:
            if kind == "static":
                splits = P.lm_head_num_splits(rows // rpc, n_tiles, sms)
                fn = jax.jit(lambda h, rows=rows, splits=splits, save=save: lm_head_lse_partials(
                    h[:rows], w, None, ids[:rows], scale[:rows], weight_layout=layout, vocab_size=V, cfg=cfg,
                    num_splits=splits, save_tiles=save, interpret=interpret))  # fmt: skip
            else:
                grid = P.RowPrefixGrid.balanced(rpc, R // rpc, n_tiles, sms)
                fn = jax.jit(lambda h, grid=grid, save=save: lm_head_lse_partials(
                    h, w, None, ids, scale, weight_layout=layout, vocab_size=V, cfg=cfg, num_splits=1,
                    save_tiles=save, row_grid=grid, n_rows=jnp.int32(n), interpret=interpret))  # fmt: skip
            rec = dict(kind="lse_probe", date=now_utc(), commit=git_commit(), device=jax.devices()[0].device_kind,
                       jax=jax.__version__, head=head, rows=R, H=H, V=V, layout=layout, live_rows=n, grid=kind,
                       compiled_rows=rows, kept_logits=bool(save),
                       blocks=[cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages])  # fmt: skip
            try:
                rec.update(status="ok", median_ms=round(_time(fn, (h,), False, iters), 4))
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default=",".join(HEADS), help="comma-separated: " + ", ".join([*HEADS, *SMOKE]))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--results", default=None, help="append the records here (default: results/gemm-<device>.jsonl)")
    p.add_argument("--lse", action="store_true", help="the log-prob kernel per bucket against the runtime prefix")
    args = p.parse_args(argv)
    path = args.results or f"benchmarks/results/gemm-{device_slug(jax.devices()[0].device_kind)}.jsonl"
    for head in args.heads.split(","):  # appended per head: a run cut short keeps the heads it finished
        append_jsonl(path, (probe_lse if args.lse else probe)(head, args.iters))


if __name__ == "__main__":
    main()
