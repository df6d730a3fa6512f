"""Session 6 probe: kernel alone and end to end, session-5 kernel vs the current one (A/B alternated)."""
import importlib.util, sys, time, json
import jax, jax.numpy as jnp, gmpo_jax
from gmpo_jax.logits_backends import logits_mgpu as K
from gmpo_jax.logits_backends import mosaic_gpu as MG
sys.path.insert(0, "scratch")
from fused_bench import inputs, tg

spec = importlib.util.spec_from_file_location("logits_mgpu_s5", "scratch/logits_mgpu_s5.py")
OLD = importlib.util.module_from_spec(spec); sys.modules["logits_mgpu_s5"] = OLD; spec.loader.exec_module(OLD)
NEW = K

def timeit(f, *a, n=50):
    r = f(*a); jax.block_until_ready(r)
    t = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3

def kernel_alone(B, variants):
    R, V = B * 1025, 128256
    x, rd, ids, T = inputs(R, V)
    res = {}
    fs = {}
    for name, (mod, cfg) in variants.items():
        fs[name] = jax.jit(lambda x, rd, mod=mod, cfg=cfg: mod.lse_and_dlogits(x.reshape(R, V // 32, 32), rd, tg, cfg=cfg))
    outs = {n: f(x, rd) for n, f in fs.items()}
    base = next(iter(outs.values()))
    for n, o in outs.items():
        print(B, n, "maxdiff dz", float(jnp.abs(o[0].astype(jnp.float32) - base[0].astype(jnp.float32)).max()),
              "stats", float(jnp.abs(o[1][:, :3] - base[1][:, :3]).max()), flush=True)
    for rep in range(3):
        for n, f in fs.items():
            res.setdefault(n, []).append(round(timeit(f, x, rd), 4))
    print("KERNEL", B, json.dumps(res), flush=True)

def e2e(B, T=1024, V=128256):
    k = jax.random.split(jax.random.key(B), 4)
    logits = jax.random.normal(k[0], (B, T + 1, V), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(k[1], (B, T), 0, V)
    mask = jnp.ones((B, T), bool)
    adv = jax.random.normal(k[2], (B,))
    old = -jnp.abs(jax.random.normal(k[3], (B, T))) - 11.0
    obj = gmpo_jax.GRPO(loss_type="grpo")
    f = lambda z: gmpo_jax.policy_loss_from_logits(z, ids, mask, adv, objective=obj, old_logps=old)[0]
    res = {}
    for rep in range(3):
        for name, mod in (("old", OLD), ("new", NEW)):
            MG.K = mod
            vg = jax.jit(jax.value_and_grad(f))
            res.setdefault(name, []).append(round(timeit(vg, logits), 4))
    MG.K = NEW
    print("E2E", B, json.dumps(res), flush=True)

if __name__ == "__main__":
    what = sys.argv[1]
    for B in (2, 16):
        if what == "kernel":
            c = lambda **kw: K.FusedConfig(cluster=4, num_ctas=248, **kw)
            kernel_alone(B, {"old": (OLD, OLD.FusedConfig(cluster=4, num_ctas=248)), "new": (NEW, c()),
                             "new_st3": (NEW, c(stages=3)), "new_o1": (NEW, c(out_stages=1)),
                             "new_st5o1": (NEW, c(stages=5, out_stages=1))})
        else:
            e2e(B)
