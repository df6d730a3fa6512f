"""value_and_grad of the GRPO loss from logits (default implementation), pipelined ms; checks vs xla at B=2."""
import sys, time, json, jax, jax.numpy as jnp, gmpo_jax
print("pkg", gmpo_jax.__file__, flush=True)

def timeit(f, *a, n=50):
    r = f(*a); jax.block_until_ready(r)
    t = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3

res = {}
for B in (2, 16):
    T, V = 1024, 128256
    k = jax.random.split(jax.random.key(B), 4)
    logits = jax.random.normal(k[0], (B, T + 1, V), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(k[1], (B, T), 0, V)
    mask = jnp.ones((B, T), bool); adv = jax.random.normal(k[2], (B,))
    old = -jnp.abs(jax.random.normal(k[3], (B, T))) - 11.0
    obj = gmpo_jax.GRPO(loss_type="grpo")
    f = lambda z, impl=None: gmpo_jax.policy_loss_from_logits(z, ids, mask, adv, objective=obj, old_logps=old,
                                                              implementation=impl)[0]
    vg = jax.jit(jax.value_and_grad(f))
    res[B] = dict(vg=[round(timeit(vg, logits), 4) for _ in range(3)],
                  fwd=[round(timeit(jax.jit(f), logits), 4) for _ in range(2)])
    if B == 2:
        l, g = vg(logits)
        lx, gx = jax.jit(jax.value_and_grad(lambda z: f(z, "xla")))(logits)
        d = jnp.abs(g.astype(jnp.float32) - gx.astype(jnp.float32)).max() / jnp.abs(gx.astype(jnp.float32)).max()
        res["check"] = dict(loss_rel=abs(float(l) - float(lx)) / abs(float(lx)), grad_maxrel=float(d))
    del logits
print("E2E", json.dumps(res), flush=True)
