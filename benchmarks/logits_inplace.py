"""The logits path's in-place backward (``MosaicGpuLogitsBackend(inplace=True)``): time and memory.

    PYTHONPATH=. python3 -m benchmarks.logits_inplace [--B 2 16] [--iters 10] [--out run.jsonl]
    python -m benchmarks.logits_inplace --interpret --B 1 --T 63 --V 256 --iters 2   # CPU smoke test

For each batch size, ``jax.grad`` of ``policy_loss_from_logits`` (GMPO, off-policy, logits ``[B, 1025,
128256]`` bf16 ~ N(0, 1), full mask) in three configurations, each compiled once:

* ``out-of-place``: the default backend; the logits are a plain argument.
* ``inplace, donated``: ``inplace=True`` and ``donate_argnums=0``, so XLA may write ``dlogits`` into the
  logits' buffer (as in a training step, where the logits are an intermediate of the same jit).
* ``inplace, kept``: ``inplace=True`` without donation: XLA must copy the logits first.

Memory is XLA's own accounting of the compiled program (``memory_analysis``: arguments + outputs +
temporaries - aliased bytes), so the copies of the logits that feed the donated calls do not count.
Time: the median of single calls each followed by ``block_until_ready`` (every donated call gets its own
copy of the logits, made beforehand), and pipelined (all calls enqueued, then one wait, divided by n).
Each result is one JSON line on stdout (and in ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

import gmpo_jax
from gmpo_jax.logits_backends.mosaic_gpu import MosaicGpuLogitsBackend

def _inputs(B: int, T: int, V: int):
    k = jax.random.split(jax.random.key(B), 4)
    logits = jax.random.normal(k[0], (B, T + 1, V), jnp.bfloat16)
    ids = jax.random.randint(k[1], (B, T), 0, V, jnp.int32)
    mask = jnp.ones((B, T), bool)
    adv = jax.random.normal(k[2], (B,), jnp.float32)
    old = -jnp.log(jnp.float32(V)) + 0.2 * jax.random.normal(k[3], (B, T), jnp.float32)
    return logits, ids, mask, adv, old


def _grad_fn(backend, donate: bool):
    def loss(logits, ids, mask, adv, old):
        return gmpo_jax.policy_loss_from_logits(logits, ids, mask, adv, objective=gmpo_jax.GMPO(), old_logps=old,
                                                implementation=backend)[0]

    return jax.jit(jax.grad(loss), donate_argnums=(0,) if donate else ())


def measure(B: int, T: int, V: int, name: str, backend, donate: bool, iters: int) -> dict:
    logits, *rest = _inputs(B, T, V)
    fn = _grad_fn(backend, donate)
    compiled = fn.lower(logits, *rest).compile()
    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    fresh = (lambda: jnp.copy(logits)) if donate else (lambda: logits)
    ref = fn(fresh(), *rest)
    copies = [fresh() for _ in range(iters)]
    jax.block_until_ready(copies)
    singles = []
    for i in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(copies[i], *rest))
        singles.append((time.perf_counter() - t0) * 1e3)
    copies = [fresh() for _ in range(iters)]
    jax.block_until_ready(copies)
    t0 = time.perf_counter()
    outs = [fn(c, *rest) for c in copies]
    jax.block_until_ready(outs)
    pipelined = (time.perf_counter() - t0) * 1e3 / iters
    same = bool(jnp.array_equal(outs[-1], ref))
    del outs, copies
    logits_gib = logits.size * logits.dtype.itemsize / 2**30
    return dict(what="logits_inplace", B=B, T=T, V=V, config=name, donate=donate,
                median_ms=statistics.median(singles), min_ms=min(singles), pipelined_ms=pipelined,
                xla_peak_gib=peak / 2**30, logits_gib=logits_gib, alias_gib=ma.alias_size_in_bytes / 2**30,
                temp_gib=ma.temp_size_in_bytes / 2**30, repeatable=same, device=jax.devices()[0].device_kind,
                jax=jax.__version__)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, nargs="+", default=[2, 16])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--V", type=int, default=128256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="kernels in the Pallas interpreter (CPU smoke test)")
    args = ap.parse_args()
    base = MosaicGpuLogitsBackend(interpret=args.interpret)
    configs = [("out-of-place", base, False),
               ("inplace, donated", dataclasses.replace(base, inplace=True), True),
               ("inplace, kept", dataclasses.replace(base, inplace=True), False)]
    for B in args.B:
        for name, backend, donate in configs:
            rec = measure(B, args.T, args.V, name, backend, donate, args.iters)
            line = json.dumps(rec)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
