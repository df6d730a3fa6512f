"""Times one configured ``MosaicGpuBackend`` (e.g. another gradient workspace) on one LM-head shape.

    python -m benchmarks.backend_variant --shape qwen2.5-0.5b --B 8 --T 2048 --workspace-mib 256

GMPO, off-policy ``old_logps``, the inputs of ``benchmarks.run``; fwd+bwd (``jax.value_and_grad`` w.r.t.
hidden and weight) or fwd; prints one JSON line (median / min ms over >= 10 calls, process peak).
Unlike ``benchmarks.run`` it compiles after the inputs exist, so its peak also holds XLA's compile-time
autotuning buffers: an upper bound (at N = 512 it read 1.55 GiB where ``benchmarks.run`` read 1.33).
Used for the window-schedule experiments in KERNELS_NOTES.md.
"""

from __future__ import annotations

import argparse
import json

import jax

import gmpo_jax
from benchmarks import jax_impls
from benchmarks.run import DEFAULT_OPTS
from benchmarks.shapes import select
from gmpo_jax.backends.mosaic_gpu import MosaicGpuBackend


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--B", type=int, required=True)
    p.add_argument("--T", type=int, required=True)
    p.add_argument("--workspace-mib", type=int, default=256)
    p.add_argument("--mode", choices=("fwd+bwd", "fwd"), default="fwd+bwd")
    a = p.parse_args(argv)
    cfg = select(a.shape, B=a.B, T=a.T)
    opts = dict(DEFAULT_OPTS)
    args = jax_impls.lm_head_inputs(cfg, opts)
    backend = MosaicGpuBackend(workspace_bytes=a.workspace_mib * 2**20)

    def loss(h, w, ids, mask, adv, old):
        return gmpo_jax.fused_linear_policy_loss(h, w, ids, mask, adv, old_logps=old, objective=gmpo_jax.GMPO(),
                                                 implementation=backend)[0]

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))) if a.mode == "fwd+bwd" else jax.jit(loss)
    st = jax_impls.time_fn(fn, args, opts)
    print(json.dumps(dict(shape=a.shape, B=a.B, T=a.T, workspace_mib=a.workspace_mib, mode=a.mode,
                          median_ms=st["median_ms"], min_ms=st["min_ms"], loss=st.get("loss"),
                          peak_gib=round(jax_impls.peak_bytes() / 2**30, 3))), flush=True)


if __name__ == "__main__":
    main()
