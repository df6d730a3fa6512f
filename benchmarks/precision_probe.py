"""Where the float32 LM head's gradient error comes from on the GPU (issue 19's open question).

On the H200 (2026-12-01) ``logits_precision="float32"`` gave a hidden-gradient error of 3-6e-5 against float64,
the same as ``"bf16x3"`` and 50-100x the Pallas interpreter's 6e-7 (docs/performance.md "Float32 LM head"). The
gradient pass has two parts that could cause it: the dz kernel (the logits from split products on the tensor
cores, then ``exp2``) and the two gradient GEMMs of the split parts (``backend.split_dot``, cuBLAS bf16 GEMMs
with float32 accumulation). This probe runs the same call twice: as shipped, and with ``split_dot`` replaced by
one float32 GEMM at ``Precision.HIGHEST`` of the recombined operands. If the error drops to the portable path's
(~5e-6), the GEMMs' accumulation is the cause; if not, the kernels are.

    python3 -m benchmarks.precision_probe          # on the GPU: Qwen2.5-0.5B's head, 2048 rows, ~1-2 min
    python -m benchmarks.precision_probe --cpu     # a small shape in the Pallas interpreter (a smoke run)

Prints one JSON line per variant: log-prob max error, hidden- and weight-gradient relative L2 error against a
float64 NumPy oracle (``d(sum logp)``, as ``tests/kernels/test_logits_precision.py``'s GPU test).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import gmpo_jax
from gmpo_jax.lm_head import mosaic_gpu
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend


def highest_dot(a_parts, b_parts, dimension_numbers, order):
    """``split_dot``'s replacement: one float32 GEMM of the recombined operands at ``Precision.HIGHEST``."""
    del order
    a = sum(p.astype(jnp.float32) for p in a_parts)
    b = sum(p.astype(jnp.float32) for p in b_parts)
    return lax.dot_general(a, b, dimension_numbers, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def oracle(h: np.ndarray, w: np.ndarray, ids: np.ndarray):
    """float64 log-probs and the gradients of their sum: ``dh = dz W^T``, ``dW = h^T dz``, ``dz = onehot - p``."""
    z = h.astype(np.float64) @ w.astype(np.float64)
    m = z.max(1, keepdims=True)
    p = np.exp(z - m)
    s = p.sum(1, keepdims=True)
    logp = z[np.arange(len(ids)), ids] - (m[:, 0] + np.log(s[:, 0]))
    dz = -p / s
    dz[np.arange(len(ids)), ids] += 1.0
    return logp, dz @ w.T.astype(np.float64), h.T.astype(np.float64) @ dz


def rel(x, y) -> float:
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def probe(R: int, H: int, V: int, interpret: bool, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(R, H)).astype(np.float32)
    w = (rng.normal(size=(H, V)) * (3.0 / np.sqrt(H))).astype(np.float32)
    ids = rng.integers(0, V, size=R).astype(np.int32)
    want_lp, want_dh, want_dw = oracle(h, w, ids)

    def run(implementation, precision):
        def logp(h, w):
            head = gmpo_jax.HeadOptions(implementation=implementation, logits_precision=precision)
            return gmpo_jax.fused_linear_logprobs(h[None], w, ids[None], head=head)[0]

        summed = lambda h, w: (lambda lp: (lp.sum(), lp))(logp(h, w))  # noqa: E731  (one forward for both)
        (_, lp), (dh, dw) = jax.jit(jax.value_and_grad(summed, argnums=(0, 1), has_aux=True))(
            jnp.asarray(h), jnp.asarray(w)
        )
        return lp, dh, dw

    out = []
    variants = [(p, g) for p in ("float32", "bf16x3") for g in ("split_dot", "highest")] + [(None, "portable")]
    for precision, gemm in variants:
        jax.clear_caches()  # the patched GEMM is a module global: no stale traces
        shipped = mosaic_gpu.split_dot
        if gemm == "highest":
            mosaic_gpu.split_dot = highest_dot
        try:
            impl = "xla_chunked" if gemm == "portable" else MosaicGpuBackend(interpret=interpret)
            with jax.default_matmul_precision("highest") if gemm == "portable" else contextlib.nullcontext():
                lp, dh, dw = run(impl, precision)
        finally:
            mosaic_gpu.split_dot = shipped
        rec = dict(
            R=R, H=H, V=V, logits_precision=precision, gradient_gemms=gemm,
            logp_max_err=float(np.abs(np.asarray(lp, np.float64) - want_lp).max()),
            dh_rel=rel(dh, want_dh), dw_rel=rel(dw, want_dw),
            device=jax.devices()[0].device_kind, jax=jax.__version__,
        )  # fmt: skip
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="a small shape in the Pallas interpreter")
    args = p.parse_args(argv)
    if args.cpu:
        probe(R=128, H=128, V=500, interpret=True)
    else:
        probe(R=2048, H=896, V=151936, interpret=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
