"""How close a plain copy of the B = 2 logits gets to the floor (copy rate of a 2 GiB copy)."""
import time, json, jax, jax.numpy as jnp
def timeit(f, *a, n=100):
    r = f(*a); jax.block_until_ready(r)
    out = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            r = f(*a)
        jax.block_until_ready(r)
        out.append(round((time.perf_counter() - t) / n * 1e3, 4))
    return out
res = {}
big = jnp.zeros((2 * 1024**3 // 2,), jnp.bfloat16)
res["copy_2GiB"] = timeit(jax.jit(lambda x: jnp.copy(x)), big, n=20)
res["neg_2GiB"] = timeit(jax.jit(lambda x: -x), big, n=20)
del big
for B in (2, 16):
    x = jax.random.normal(jax.random.key(0), (B, 1025, 128256), jnp.float32).astype(jnp.bfloat16)
    res[f"copy_B{B}"] = timeit(jax.jit(lambda x: jnp.copy(x)), x, n=100 if B == 2 else 20)
    res[f"neg_B{B}"] = timeit(jax.jit(lambda x: -x), x, n=100 if B == 2 else 20)
    res[f"bytes_B{B}"] = x.size * 2
    del x
print("COPY", json.dumps(res), flush=True)
