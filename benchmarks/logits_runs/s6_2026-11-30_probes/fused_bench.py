"""Device probe of logits_mgpu.lse_and_dlogits: correctness at the real vocabulary, then a block sweep."""
import itertools, json, sys, time
import numpy as np, jax, jax.numpy as jnp
from gmpo_jax.logits_backends import logits_mgpu as K

def tg(logp, old, ref, adv, ris, live):
    return -adv * jnp.exp(logp - old)

def inputs(R, V, dt=jnp.bfloat16, T=0.9, seed=0):
    x = jax.random.normal(jax.random.key(seed), (R, V), jnp.float32).astype(dt)
    ids = jax.random.randint(jax.random.key(1), (R,), 0, V)
    tgt = x[jnp.arange(R), ids].astype(jnp.float32)
    old = -jnp.abs(jax.random.normal(jax.random.key(2), (R,))) * 3 - 10
    adv = jax.random.normal(jax.random.key(3), (R,))
    scale = jnp.where(jnp.arange(R) % 5 == 0, 0.0, 0.5 / T)
    rd = jnp.stack([jnp.full((R,), K.LOG2E / T), tgt, old, jnp.zeros(R), adv, jnp.ones(R), scale]
                   + [jnp.zeros(R)] * (K.ROW_WIDTH - 7), 1)
    return x, rd, ids, T

def timeit(f, *a, n=20):
    r = f(*a); jax.block_until_ready(r)
    t = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3

def run(R, V, cfg, x, rd):
    w = K.slab_width(V, x.dtype); S = V // w
    return jax.jit(lambda x, rd: K.lse_and_dlogits(x.reshape(R, S, w), rd, tg, cfg=cfg))(x, rd)

CHECK_CLUSTER = 1

def main():
  out = {}
  # correctness
  R, V = 2050, 128256
  x, rd, ids, T = inputs(R, V)
  dz, st = run(R, V, K.FusedConfig(cluster=CHECK_CLUSTER, num_ctas=264), x, rd)
  sub = np.arange(0, R, 37)
  z = np.asarray(x[sub], np.float64) / T
  lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
  logp = np.minimum(np.asarray(rd[sub, 1], np.float64) / T - lse, 0)
  c = np.asarray(rd[sub, 6], np.float64) * (-np.asarray(rd[sub, 4], np.float64) * np.exp(logp - np.asarray(rd[sub, 2], np.float64)))
  ref = -c[:, None] * np.exp(z - lse[:, None])
  out['lse'] = float(np.abs(np.asarray(st[sub, 1]) - lse).max())
  got = np.asarray(dz.reshape(R, V)[sub], np.float64)
  out["check"] = dict(logp=float(np.abs(np.asarray(st[sub, 0]) - logp).max()),
                      c=float(np.abs(np.asarray(st[sub, 2]) - c).max() / np.abs(c).max()),
                      dz=float(np.abs(got - ref).max() / np.abs(ref).max()))
  print(out["check"], flush=True)
  for B in (2, 16):
      R = B * 1025
      x, rd, ids, T = inputs(R, V)
      nbytes = x.size * 2
      cp = timeit(jax.jit(lambda x: -x), x)
      rd_only = timeit(jax.jit(lambda x: jnp.max(x, axis=1)), x)
      res = dict(copy_neg=cp, read_max=rd_only, floor_4249=2 * nbytes / 4249e9 * 1e3)
      grid = [(256, 4, 2, G, True, 4) for G in (176, 200, 224, 240, 256, 264)]
      grid += [(256, 4, 2, G, True, 2) for G in (200, 240, 264)] + [(256, 6, 2, 132, True, 2)]
      for bs, st_, ost, cps, rev, C in grid:
          cfg = K.FusedConfig(block_rows=bs, stages=st_, out_stages=ost, num_ctas=cps, reverse=rev, cluster=C)
          try:
              f = jax.jit(lambda x, rd, cfg=cfg: K.lse_and_dlogits(x.reshape(R, V // 32, 32), rd, tg, cfg=cfg))
              res[f"bs{bs}_st{st_}_o{ost}_G{cps}_r{int(rev)}_C{C}"] = timeit(f, x, rd)
          except Exception as e:
              res[f"bs{bs}_st{st_}_o{ost}_G{cps}_r{int(rev)}_C{C}"] = repr(e)[:200]
          print(B, bs, st_, ost, cps, rev, C, res[f"bs{bs}_st{st_}_o{ost}_G{cps}_r{int(rev)}_C{C}"], flush=True)
      out[B] = res
      print(json.dumps(res), flush=True)

if __name__ == "__main__":
  CHECK_CLUSTER = int(sys.argv[1]) if len(sys.argv) > 1 else 1
  main()
