"""1 GPU vs 2 GPUs (issue 6): data- and vocabulary-parallel ``fused_linear_policy_loss`` at one shape.

Each layout runs in its own process (JAX's peak-memory counter cannot be reset), fwd+bwd
(``jax.value_and_grad`` w.r.t. hidden and weight, GMPO, off-policy ``old_logps``), median of >= 10 calls,
and reports the per-device peak (``memory_stats()["peak_bytes_in_use"]`` of every device of the mesh):

* ``single``: one device, no mesh (the reference time and loss);
* ``data``: mesh ``(n, 1)``, ``data_axis="data"`` -- the batch split, weight replicated;
* ``vocab``: mesh ``(1, n)``, ``vocab_axis="model"`` -- the weight split along V (Megatron style).

Inputs are created directly with their final sharding (``jax.jit(..., out_shardings=...)``), so no
device ever holds another's share. Usage (the device tool, 2 GPUs)::

    python -m benchmarks.sharded_bench --B 16 --T 4096 --impl mosaic_gpu,xla_chunked \
        --results benchmarks/results/sharded.jsonl

Records: ``benchmarks.run``'s keys plus ``layout``, ``n_devices``, ``peak_gib_per_device`` (list) and the
loss, so a sharded run can be checked against the single-device one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from benchmarks import _common

LAYOUTS = ("single", "data", "vocab")


def _worker(args) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import gmpo_jax
    from benchmarks import jax_impls
    from benchmarks.run import DEFAULT_OPTS
    from benchmarks.shapes import select

    cfg = select(args.shape, B=args.B, T=args.T)
    opts = dict(DEFAULT_OPTS, iters=args.iters)
    n = jax.device_count() if args.layout != "single" else 1
    rec = _common.base_record(
        cfg, args.impl, "fwd+bwd", layout=args.layout, n_devices=n, device=jax_impls.device_kind()
    )
    head = gmpo_jax.HeadOptions(implementation=args.impl)
    axes = None
    if args.layout == "single":
        shard = {k: None for k in ("h", "w", "bt", "b")}
    else:
        shape = (n, 1) if args.layout == "data" else (1, n)
        mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        axes = gmpo_jax.MeshAxes(
            mesh,
            data_axis="data" if args.layout == "data" else None,
            vocab_axis="model" if args.layout == "vocab" else None,
        )
        d = "data" if args.layout == "data" else None
        v = "model" if args.layout == "vocab" else None
        shard = {
            "h": NamedSharding(mesh, P(d, None, None)),
            "w": NamedSharding(mesh, P(None, v)),
            "bt": NamedSharding(mesh, P(d, None)),
            "b": NamedSharding(mesh, P(d)),
        }
    B, T, H, V, seed = cfg.B, cfg.T, cfg.H, cfg.V, opts["seed"]
    outs = (shard["h"], shard["w"], shard["bt"], shard["bt"], shard["b"])
    hidden, weight, ids, mask, adv = jax.jit(
        lambda: jax_impls.lm_head_arrays(cfg, opts), out_shardings=None if n == 1 else outs
    )()
    old = jax.jit(
        lambda h, w, i: (
            gmpo_jax.fused_linear_logprobs(h, w, i, head=head, sharding=axes)
            + opts["ratio_noise"] * jax_impls.hashed_normal(seed, 5, (B, T), jnp.float32)
        )
    )(hidden, weight, ids)

    def loss(h, w, ids, mask, adv, old):
        batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old)
        return gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=gmpo_jax.GMPO(), head=head, sharding=axes)[0]

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    try:
        stats = jax_impls.time_fn(fn, (hidden, weight, ids, mask, adv, old), opts)
    except Exception as exc:  # noqa: BLE001 - an OOM or a refusal is a result
        rec.update(status=_common.classify_error(exc), error=_common.short_error(exc))
        return rec
    peaks = [(dev.memory_stats() or {}).get("peak_bytes_in_use") for dev in jax.devices()[:n]]
    rec.update(
        stats,
        status="ok",
        peak_gib=_common.gib(max(p or 0 for p in peaks)),
        peak_gib_per_device=[_common.gib(p) for p in peaks],
        tflops_per_device=round(6 * cfg.N * H * V / n / (stats["median_ms"] * 1e-3) / 1e12, 1),
    )
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--impl", default="mosaic_gpu,xla_chunked", help="comma-separated")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout-s", type=int, default=240)
    p.add_argument("--results", default=None, help="JSONL file to append the records to")
    p.add_argument("--layout", help=argparse.SUPPRESS)  # worker mode
    args = p.parse_args(argv)
    if args.layout:
        _common.emit(_worker(args))
        return 0
    records = []
    for impl in args.impl.split(","):
        for layout in args.layouts.split(","):
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.sharded_bench",
                "--shape",
                args.shape,
                "--B",
                str(args.B),
                "--T",
                str(args.T),
                "--impl",
                impl,
                "--layout",
                layout,
                "--iters",
                str(args.iters),
            ]
            env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
            try:
                out = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env, cwd=_common.REPO_ROOT
                )
                got = _common.parse_records(out.stdout)
                if not got:
                    sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
            except subprocess.TimeoutExpired:
                got = [{"implementation": impl, "layout": layout, "status": "timeout"}]
            for r in got:
                print(
                    json.dumps(
                        {
                            k: r.get(k)
                            for k in (
                                "implementation",
                                "layout",
                                "n_devices",
                                "status",
                                "median_ms",
                                "peak_gib_per_device",
                                "loss",
                                "tflops_per_device",
                                "error",
                            )
                        }
                    ),
                    flush=True,
                )
            records += got
    if args.results:
        _common.append_jsonl(args.results, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
