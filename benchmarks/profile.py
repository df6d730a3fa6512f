"""Where one LM-head step's GPU time goes: a `jax.profiler` trace of GMPO forward + backward, summed per kernel.

    PYTHONPATH=. python3 -m benchmarks.profile --shape qwen2.5-0.5b --B 8 --T 2048 --grad-filter 0.001
    PYTHONPATH=. python3 -m benchmarks.profile ... --tuning GRAD_FILTER_LEVELS=3   # a tuning constant

Prints the first call's time (compile + one step), the wall time per step and, per device-event name (kernels, copies), the time per step, the number
of launches per step and the share of the device's busy time, largest first. Names are XLA's (fusions,
custom calls: the Pallas kernels carry their own names). Reading it: docs/performance.md.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

import jax

from benchmarks import jax_impls
from benchmarks.run import DEFAULT_OPTS, _parse_setting
from benchmarks.shapes import select


def _device_events(path: str, prefix: str = "/device:GPU"):
    """``({(line, name): [durations_ns]}, [(start_ns, end_ns, name)])`` of every event on the GPU planes of the
    trace in ``path``."""
    files = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise SystemExit(f"no .xplane.pb under {path}")
    data = jax.profiler.ProfileData.from_file(files[0])
    per_name: dict[str, list[int]] = collections.defaultdict(list)
    spans = []
    for plane in data.planes:
        if not plane.name.startswith(prefix):
            continue
        for line in plane.lines:
            for ev in line.events:
                per_name[(line.name, ev.name)].append(ev.duration_ns)
                spans.append((ev.start_ns, ev.end_ns, ev.name))
    return per_name, spans


def _gaps(spans, steps: int, top: int) -> None:
    """Prints the device's idle time (no event on any stream) between the first and last event, per step, and
    the largest idle totals by the pair of events around them (what the device waited between)."""
    spans = sorted(spans)
    if not spans:
        print("-- no GPU device events in the trace (a GPU is needed: on CPU the trace has host events only)")
        return
    idle, pairs = 0.0, collections.Counter()
    end, last = spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end + 2000:  # idle for more than 2 us
            idle += s - end
            pairs[(last[:50], name[:50])] += s - end
        if e > end:
            end, last = e, name
    span = spans[-1][1] - spans[0][0]
    print(f"-- device span {span / steps / 1e6:.2f} ms/step, idle (> 2 us gaps) {idle / steps / 1e6:.2f} ms/step")
    for (a, b), t in pairs.most_common(top):
        print(f"{t / steps / 1e6:8.3f} ms idle  after {a}  before {b}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--impl", default="mosaic_gpu", help="mosaic_gpu or xla_chunked")
    p.add_argument("--data", default=DEFAULT_OPTS["data"])
    p.add_argument("--grad-filter", default=DEFAULT_OPTS["grad_filter"], help="none, auto or a float")
    p.add_argument("--tuning", action="append", default=[], help="NAME=VALUE of gmpo_jax.tuning")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)

    # before the backends are imported: their dataclass defaults read gmpo_jax.tuning
    jax_impls.apply_tuning(dict(_parse_setting(t) for t in args.tuning))
    # the benchmark's own batch and loss (benchmarks.run with these options measures the same step)
    cfg = select(args.shape, B=args.B, T=args.T)
    opts = dict(DEFAULT_OPTS, data=args.data, grad_filter=args.grad_filter)
    inputs, _ = jax_impls.lm_head_inputs(cfg, opts)
    step = jax.jit(jax.value_and_grad(jax_impls.lm_head_loss(args.impl, opts), argnums=(0, 1)))
    t0 = time.perf_counter()
    jax.block_until_ready(step(*inputs))
    first = time.perf_counter() - t0
    for _ in range(2):
        jax.block_until_ready(step(*inputs))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        jax.block_until_ready(step(*inputs))
    wall = (time.perf_counter() - t0) / args.steps
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                jax.block_until_ready(step(*inputs))
        events, spans = _device_events(d)
    print(
        f"{args.impl} {args.shape} {cfg.B}x{cfg.T} {args.data} grad_filter={args.grad_filter} {args.tuning}: "
        f"wall {wall * 1e3:.2f} ms/step; first call (compile + one step) {first:.1f} s"
    )
    _gaps(spans, args.steps, 12)
    for line in sorted({k[0] for k in events}):
        rows = [(n, d) for (ln, n), d in events.items() if ln == line]
        busy = sum(sum(d) for _, d in rows) / args.steps
        print(
            f"-- line {line!r}: busy {busy / 1e6:.2f} ms/step, {sum(len(d) for _, d in rows) / args.steps:.0f} events/step"
        )
        for name, d in sorted(rows, key=lambda r: -sum(r[1]))[: args.top]:
            t = sum(d) / args.steps
            print(f"{t / 1e6:8.3f} ms {len(d) / args.steps:6.1f}x {100 * t / busy:5.1f}%  {name[:110]}")


if __name__ == "__main__":
    main()
