"""One configuration of the logits suite, for A / B comparisons and per-kernel profiles on the GPU.

The suite's inputs and loss (``benchmarks.jax_impls.logits_inputs`` / ``logits_loss``, jit arguments),
``jax.value_and_grad`` of the loss, then either

* ``--time``: ``--repeats`` batches of ``--calls`` calls queued back to back (no host sync between
  them), ms per call; unlike the suite's pipelined time, which keeps two calls in flight, a late host
  thread cannot leave the GPU idle, so this is the device throughput; or
* ``--profile``: one call between ``cuProfilerStart`` / ``cuProfilerStop``, for
  ``ncu --profile-from-start off --metrics gpu__time_duration.sum python3 -m benchmarks.logits_profile
  --profile`` (the duration of every kernel of one step).

Run it as a script so that ``PYTHONPATH`` decides which ``gmpo_jax`` runs (``python -m`` would put the
checkout first), e.g. two commits (``git archive``) in alternating processes (sixth session,
2026-11-30): ``PYTHONPATH=old:. python3 benchmarks/logits_profile.py --B 2 --mask ragged --time``.
The record names the ``gmpo_jax`` it ran.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import jax


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--impl", default="mosaic_gpu")
    p.add_argument("--objective", default="grpo", choices=("grpo", "gmpo"))
    p.add_argument("--mask", default="full", choices=("full", "ragged"),
                   help="the suite's completion masks: full, or lengths uniform in [3T/4, T]")
    p.add_argument("--skip-masked-rows", action="store_true",
                   help="mosaic_gpu only: MosaicGpuLogitsBackend(skip_masked_rows=True)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--time", action="store_true")
    mode.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)

    import gmpo_jax
    from benchmarks.jax_impls import logits_inputs, logits_loss
    from benchmarks.run import DEFAULT_OPTS
    from benchmarks.shapes import select

    opts = dict(DEFAULT_OPTS, objective=a.objective, mask=a.mask)
    args = logits_inputs(select("logits-llama3", B=a.B, T=a.T), opts)
    impl = a.impl
    if a.skip_masked_rows:
        from gmpo_jax.logits_backends.mosaic_gpu import MosaicGpuLogitsBackend

        assert impl == "mosaic_gpu", impl
        impl = MosaicGpuLogitsBackend(skip_masked_rows=True)
    loss, _ = logits_loss(impl, opts)
    step = jax.jit(jax.value_and_grad(loss))
    for _ in range(2):  # compile, then one warm call
        jax.block_until_ready(step(*args))
    if a.profile:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        jax.block_until_ready(step(*args))
        cuda.cuProfilerStop()
        return
    per_call = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            out = step(*args)
        jax.block_until_ready(out)
        per_call.append(round((time.perf_counter() - t0) / a.calls * 1e3, 4))
    print(json.dumps(dict(B=a.B, T=a.T, impl=a.impl, skip_masked_rows=a.skip_masked_rows, objective=a.objective,
                          mask=a.mask, gmpo_jax=gmpo_jax.__file__, queued_ms=per_call)))


if __name__ == "__main__":
    main()
