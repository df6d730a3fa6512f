"""First-call cost of the LM-head loss: trace, XLA + Mosaic compile, first run; and the step time it buys.

    python -m benchmarks.compile_probe --shape qwen2.5-0.5b --B 8 --T 2048 --row-buckets 1,2,4,8 \\
        --data heavy-shared,light,unsure,heavy-shared-live [--grad-filter 0.001] [--tuning ROW_PREFIX_FORWARD=True]
        [--results run.jsonl]

Records (``kind: compile_probe``) go to ``benchmarks/results/compile-<device>.jsonl``; docs/performance.md
"First-call time" tabulates them.

One process per ``--row-buckets`` value (``tuning.ROW_BUCKETS``; nothing is shared between them, as for a user's
first call): ``jax.jit(value_and_grad(loss))`` is lowered (``lower_s``), compiled (``compile_s``: XLA and every
Mosaic GPU kernel in the program; ``mosaic_calls`` counts the kernel call sites in the optimised HLO; XLA's
``memory_analysis()`` gives ``argument_gib`` / ``output_gib`` / ``temp_gib``) and run once (``first_run_s``), then
timed on each workload family member (median of ``--iters``, fwd + bwd). One JSON line per (row buckets, member).
Gradient accuracy is not measured here (``benchmarks.run --grad-acc``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from benchmarks.shapes import SHAPES, Config


def _worker(args) -> list[dict]:
    import jax

    from benchmarks import jax_impls
    from benchmarks.run import DEFAULT_OPTS

    tuning = {"ROW_BUCKETS": args.row_buckets, **dict(_parse_tuning(t) for t in args.tuning)}
    jax_impls.apply_tuning(tuning)
    shape = SHAPES[args.shape]
    cfg = Config(args.shape, shape.kind, args.B, args.T, shape.H, shape.V)
    datas = args.data.split(",")
    opts = dict(DEFAULT_OPTS, data=datas[0], grad_filter=args.grad_filter)
    fn = jax.jit(jax.value_and_grad(jax_impls.lm_head_loss("mosaic_gpu", opts), argnums=(0, 1)))
    inputs, _ = jax_impls.lm_head_inputs(cfg, opts)
    jax.block_until_ready(inputs)
    t0 = time.perf_counter()
    lowered = fn.lower(*inputs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    t3 = time.perf_counter()
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()  # XLA's buffers (its temporaries one block on the GPU): where the peak comes from
    common = dict(
        kind="compile_probe",
        status="ok",
        date=time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        commit=_commit(),
        shape=args.shape,
        B=args.B,
        T=args.T,
        row_buckets=args.row_buckets,
        grad_filter=args.grad_filter,
        variant=",".join(args.tuning) or None,
        lower_s=round(t1 - t0, 2),
        compile_s=round(t2 - t1, 2),
        first_run_s=round(t3 - t2, 2),
        mosaic_calls=hlo.count('custom_call_target="mosaic_gpu'),
        conditionals=hlo.count(" conditional("),
        **{
            f"{name}_gib": round(getattr(mem, f"{name}_size_in_bytes") / 2**30, 4) if mem else None
            for name in ("argument", "output", "temp")
        },
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
    )
    out = []
    for data in datas:
        inputs, stats = jax_impls.lm_head_inputs(cfg, dict(opts, data=data))
        jax.block_until_ready(compiled(*inputs))
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*inputs))
            times.append(time.perf_counter() - t0)
        rec = dict(common, data=data, median_ms=round(1e3 * float(np.median(times)), 3))
        rec.update({k: stats[k] for k in ("masked_frac", "zero_adv_frac") if k in stats})
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def _parse_tuning(item: str):
    """``NAME=VALUE`` with VALUE a Python literal (True, 8, 1e-3) or else a string."""
    import ast

    name, _, value = item.partition("=")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_probe", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--B", type=int, required=True)
    p.add_argument("--T", type=int, required=True)
    p.add_argument("--row-buckets", default="8", help="comma-separated tuning.ROW_BUCKETS values, one process each")
    p.add_argument("--data", default="peaked", help="comma-separated workload family members")
    p.add_argument("--grad-filter", default="none")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE", help="a gmpo_jax.tuning constant")
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument("--results", help="append the records to this JSONL")
    args = p.parse_args(argv)
    lines = []
    for nb in args.row_buckets.split(","):
        cmd = [sys.executable, "-c", "import sys; from benchmarks.compile_probe import _worker_entry; _worker_entry()"]
        cmd += [args.shape, str(args.B), str(args.T), nb, args.data, args.grad_filter, str(args.iters), *args.tuning]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(json.dumps(dict(shape=args.shape, row_buckets=int(nb), status="timeout")), flush=True)
            continue
        got = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        for ln in got:
            print(ln, flush=True)
        if res.returncode:
            print(res.stderr[-3000:], file=sys.stderr, flush=True)
        lines += got
    if args.results:
        with open(args.results, "a") as f:
            f.writelines(ln + "\n" for ln in lines)
    return 0


def _worker_entry() -> None:
    shape, B, T, nb, data, grad_filter, iters = sys.argv[1:8]
    ns = dict(
        shape=shape, B=int(B), T=int(T), row_buckets=int(nb), data=data, grad_filter=grad_filter, iters=int(iters)
    )
    _worker(argparse.Namespace(**ns, tuning=sys.argv[8:]))


if __name__ == "__main__":
    sys.exit(main())
