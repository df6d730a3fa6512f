"""ncu target: one value_and_grad step of the fused path (profiled between cuProfilerStart / Stop)."""
import ctypes, sys, jax, jax.numpy as jnp, gmpo_jax
B, T, V = int(sys.argv[1]), 1024, 128256
k = jax.random.split(jax.random.key(B), 4)
logits = jax.random.normal(k[0], (B, T + 1, V), jnp.float32).astype(jnp.bfloat16)
ids = jax.random.randint(k[1], (B, T), 0, V)
mask = jnp.ones((B, T), bool); adv = jax.random.normal(k[2], (B,))
old = -jnp.abs(jax.random.normal(k[3], (B, T))) - 11.0
f = lambda z: gmpo_jax.policy_loss_from_logits(z, ids, mask, adv, objective=gmpo_jax.GRPO(loss_type="grpo"),
                                               old_logps=old)[0]
vg = jax.jit(jax.value_and_grad(f))
jax.block_until_ready(vg(logits)); jax.block_until_ready(vg(logits))
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuProfilerStart()
jax.block_until_ready(vg(logits))
cuda.cuProfilerStop()
print(vg.lower(logits).compile().as_text().count("fusion"), "fusions", flush=True)
