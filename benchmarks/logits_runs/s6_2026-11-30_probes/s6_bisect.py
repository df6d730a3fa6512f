import sys, time, json, jax, jax.numpy as jnp
sys.path.insert(0, "scratch")
import kvar as K
from s6_probe import timeit
def tg(logp, old, ref, adv, ris, live):
    return -adv * jnp.exp(logp - old)
V = 128256
for B in (2, 16):
    R = B * 1025
    x = jax.random.normal(jax.random.key(0), (R, V), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (R,), 0, V)
    rd = jnp.stack([jnp.full((R,), K.LOG2E), (ids // 32).astype(jnp.float32), (ids % 32).astype(jnp.float32),
                    jnp.full((R,), -12.0), jnp.zeros(R), jnp.ones(R), jnp.ones(R), jnp.full((R,), 0.001)]
                   + [jnp.zeros(R)] * (K.ROW_WIDTH - 8), 1)
    cfg = K.FusedConfig(cluster=4, num_ctas=248)
    fs = {}
    for pick in (False, True):
        for onehot in (False, True):
            K.PICK, K.ONEHOT = pick, onehot
            f = jax.jit(lambda x, rd: K.lse_and_dlogits(x.reshape(R, V // 32, 32), rd, tg, cfg=cfg))
            f.lower(x, rd)  # trace now, with these flags
            fs[f"pick{int(pick)}_onehot{int(onehot)}"] = f.lower(x, rd).compile()
    res = {}
    for rep in range(3):
        for n, f in fs.items():
            res.setdefault(n, []).append(round(timeit(f, x, rd), 4))
    print("BISECT", B, json.dumps(res), flush=True)
    del x
