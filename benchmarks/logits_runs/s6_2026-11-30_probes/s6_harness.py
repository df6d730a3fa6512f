"""The benchmark harness's inputs and loss (jit arguments), value_and_grad: pipelined ms, or one profiled step."""
import ctypes, sys, time, json, jax, gmpo_jax
from benchmarks.run import DEFAULT_OPTS
from benchmarks.shapes import select
from benchmarks.jax_impls import logits_inputs, logits_loss
B, what = int(sys.argv[1]), sys.argv[2]
opts = dict(DEFAULT_OPTS, objective="grpo")
args = logits_inputs(select("logits-llama3", B=B, T=1024), opts)
loss, _ = logits_loss("mosaic_gpu", opts)
vg = jax.jit(jax.value_and_grad(loss))
jax.block_until_ready(vg(*args)); jax.block_until_ready(vg(*args))
if what == "time":
    out = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(50):
            r = vg(*args)
        jax.block_until_ready(r)
        out.append(round((time.perf_counter() - t) / 50 * 1e3, 4))
    print("TIME", B, gmpo_jax.__file__, out, flush=True)
else:
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart(); jax.block_until_ready(vg(*args)); cuda.cuProfilerStop()
