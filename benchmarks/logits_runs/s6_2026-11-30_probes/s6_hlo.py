"""Dump the compiled HLO of the fused path (value_and_grad) and of the plain forward, B = 2."""
import os, sys, jax, jax.numpy as jnp, gmpo_jax
B, T, V = 2, 1024, 128256
k = jax.random.split(jax.random.key(B), 4)
logits = jax.random.normal(k[0], (B, T + 1, V), jnp.float32).astype(jnp.bfloat16)
ids = jax.random.randint(k[1], (B, T), 0, V)
mask = jnp.ones((B, T), bool); adv = jax.random.normal(k[2], (B,))
old = -jnp.abs(jax.random.normal(k[3], (B, T))) - 11.0
f = lambda z: gmpo_jax.policy_loss_from_logits(z, ids, mask, adv, objective=gmpo_jax.GRPO(loss_type="grpo"),
                                               old_logps=old)[0]
out = os.environ["OUT"]
open(f"{out}/hlo_vg.txt", "w").write(jax.jit(jax.value_and_grad(f)).lower(logits).compile().as_text())
open(f"{out}/hlo_fwd.txt", "w").write(jax.jit(f).lower(logits).compile().as_text())
