"""Device sweep of the logits kernels (issue 5): kernel-level block sizes, floors, end-to-end timings.

    PYTHONPATH=. python3 benchmarks/logits_sweep.py [--quick]

Prints one JSON object per line (``{"what": ..., ...}``); every configuration runs in try/except so one
failing variant does not hide the others. Measures, at the Llama-3 vocabulary (V = 128256, bf16):

* floors: a device-to-device copy (``-x``: read + write of the logits) and a read-only reduction;
* the Mosaic GPU forward kernel (online log-sum-exp) and backward kernel (dlogits) alone, per block
  configuration, against the xla path's two passes (``online`` and ``two_pass`` log-sum-exp);
* end to end (``jax.value_and_grad`` of ``policy_loss_from_logits`` with GMPO, off-policy) for mosaic_gpu
  with the best configurations, xla, and the dense ``jax.grad`` of the straightforward loss.

Times: ``sync_ms`` = median of single calls each followed by ``block_until_ready`` (includes launch
latency); ``pipe_ms`` = ``n`` back-to-back calls / n (what a training step sees).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import gmpo_jax
from gmpo_jax import kernels as K
from gmpo_jax.logits_backends.mosaic_gpu import MosaicGpuLogitsBackend
from gmpo_jax.logits_backends.xla import XlaLogitsBackend
from gmpo_jax.objectives import ChunkData

V = 128256
SMOKE = False


def emit(**rec):
    print(json.dumps(rec), flush=True)


def bench(fn, *args, n=20, warmup=3):
    n, warmup = (1, 1) if SMOKE else (n, warmup)
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    pipe = (time.perf_counter() - t0) / n
    return dict(sync_ms=round(statistics.median(ts) * 1e3, 4), min_ms=round(min(ts) * 1e3, 4),
                pipe_ms=round(pipe * 1e3, 4))


def inputs(B, T, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    logits = jax.random.normal(k[0], (B, T + 1, V), jnp.bfloat16)
    ids = jax.random.randint(k[1], (B, T), 0, V)
    adv = jax.random.normal(k[2], (B,), jnp.float32)
    mask = jnp.ones((B, T), bool)
    old = jax.jit(lambda z: jax.nn.log_softmax(z[:, :T].astype(jnp.float32), -1))(logits)
    old = jnp.take_along_axis(old, ids[..., None], -1)[..., 0] + 0.2 * jax.random.normal(k[3], (B, T))
    return logits, ids, mask, adv, jax.block_until_ready(old)


def dense_loss(logits, ids, mask, adv, old):
    """The straightforward loss: full float32 log_softmax, the library's GMPO objective, jax.grad."""
    T = ids.shape[1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :T].astype(jnp.float32), -1), ids[..., None], -1)[..., 0]
    obj = gmpo_jax.GMPO()
    num, _ = obj.chunk_numerator(logp, ChunkData(mask, adv, old))
    return num / obj.denominator(mask, None)


def memory(f, *args):
    """XLA's buffer assignment of the compiled call: arguments, outputs and temporaries (bytes)."""
    try:
        m = f.lower(*args).compile().memory_analysis()
        return dict(arg_b=int(m.argument_size_in_bytes), out_b=int(m.output_size_in_bytes),
                    temp_b=int(m.temp_size_in_bytes))
    except Exception as e:  # noqa: BLE001
        return dict(mem_error=repr(e)[:200])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="2,16")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--V", type=int, default=128256)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (tiny --V/--T)")
    a = ap.parse_args()
    global V, SMOKE
    V, SMOKE = a.V, a.interpret
    ip = None
    if a.interpret:
        from gmpo_jax.kernels._compat import interpret_params
        ip = interpret_params()
    dev = jax.devices()[0]
    sms = getattr(dev, "core_count", None) or 132
    emit(what="env", jax=jax.__version__, device=dev.device_kind, sms=sms,
         date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    batches = [int(b) for b in a.batches.split(",")]
    best = {}
    for B in batches:
        T = a.T
        logits, ids, mask, adv, old = inputs(B, T)
        nbytes = logits.size * 2
        view = MosaicGpuLogitsBackend(interpret=bool(ip))
        x, ids_r, R0, ksplit = view._rows(logits, ids, T)  # the kernels' [R * k, V / k] view
        R, W = x.shape
        emit(what="view", B=B, rows=R, cols=W, k=ksplit)
        k = jnp.full((R,), K.LOG2E, jnp.float32)
        # ---- floors
        try:
            r = bench(jax.jit(lambda z: -z), logits)
            emit(what="floor_copy", B=B, bytes=2 * nbytes, **r, tbps=round(2 * nbytes / r["pipe_ms"] / 1e9, 3))
            r = bench(jax.jit(lambda z: jnp.max(z, axis=-1)), logits)
            emit(what="floor_read_max", B=B, bytes=nbytes, **r, tbps=round(nbytes / r["pipe_ms"] / 1e9, 3))
        except Exception as e:  # noqa: BLE001
            emit(what="floor", B=B, error=repr(e)[:500])
        # ---- kernel-level correctness smoke (a few rows vs float32 XLA)
        lse2_ref = None
        try:
            z = x[:256].astype(jnp.float32)
            lse_ref = jax.nn.logsumexp(z, -1)
            m2, l, t2 = K.logits_lse_partials(x, ids_r, k, cfg=K.LogitsBlocks(), num_splits=K.logits_num_splits(
                -(-R // 64), -(-W // 128), sms), interpret=ip)
            tgt, lse, lse2 = K.logits_merge_splits(m2, l, t2)
            lse2_ref = lse2
            err = float(jnp.max(jnp.abs(lse[:256] - lse_ref)))
            hit = (ids_r[:256] >= 0) & (ids_r[:256] < W)
            want_t = jnp.where(hit, jnp.take_along_axis(z, jnp.clip(ids_r[:256], 0, W - 1)[:, None], -1)[:, 0], 0.0)
            terr = float(jnp.max(jnp.abs(tgt[:256] - want_t)))
            c = jnp.full((R,), 1e-3, jnp.float32)
            d = K.logits_dlogits(x, ids_r, k, lse2, c, cfg=K.LogitsBlocks(block_v=128, stages=3), interpret=ip)
            dref = (1e-3 * (jax.nn.one_hot(ids_r[:256], W) - jax.nn.softmax(z, -1)))
            derr = float(jnp.max(jnp.abs(d[:256].astype(jnp.float32) - dref)))
            emit(what="kernel_smoke", B=B, lse_err=err, tgt_err=terr, dlogits_err=derr,
                 dlogits_ref_max=float(jnp.max(jnp.abs(dref))))
        except Exception as e:  # noqa: BLE001
            emit(what="kernel_smoke", B=B, error=traceback.format_exc()[-3000:])
        # ---- forward kernel sweep
        fwd_cfgs = [(128, 4, None, True), (128, 4, None, False), (128, 6, None, False), (128, 6, None, True),
                    (256, 4, None, False), (64, 8, None, False), (128, 3, None, True), (128, 4, 4, True),
                    (128, 4, 32, True), (128, 4, 32, False)]
        if a.quick or B != batches[0]:
            fwd_cfgs = fwd_cfgs[:4]
        res_f = []
        for bv, st, sp, pick in fwd_cfgs:
            try:
                cfg = K.LogitsBlocks(block_v=bv, stages=st, pick_target=pick)
                tiles = -(-W // bv)
                if sp is None:
                    S = K.logits_num_splits(-(-R // 64), tiles, sms)
                else:
                    tps = -(-tiles // sp)
                    S = -(-tiles // tps)
                f = jax.jit(lambda x, i, k, cfg=cfg, S=S: K.logits_merge_splits(*K.logits_lse_partials(x, i, k, cfg=cfg,
                                                                                            num_splits=S, interpret=ip)))
                r = bench(f, x, ids_r, k)
                emit(what="fwd_kernel", B=B, block_v=bv, stages=st, splits=S, pick_target=pick, **r,
                     tbps=round(nbytes / r["pipe_ms"] / 1e9, 3))
                if sp is None:
                    res_f.append((r["pipe_ms"], bv, st, pick))
            except Exception as e:  # noqa: BLE001
                emit(what="fwd_kernel", B=B, block_v=bv, stages=st, pick_target=pick,
                     error=traceback.format_exc()[-2000:])
        # ---- backward kernel sweep
        bwd_cfgs = [(128, 3, 32), (128, 2, 32), (64, 4, 32), (256, 2, 32), (128, 4, 32), (64, 6, 32),
                    (128, 3, 8), (128, 3, 128), (128, 2, 64)]
        if a.quick or B != batches[0]:
            bwd_cfgs = bwd_cfgs[:3]
        res_b = []
        lse2 = lse2_ref if lse2_ref is not None else jnp.zeros((R,), jnp.float32)
        c = jnp.full((R,), 1e-3, jnp.float32)
        for bv, st, tpc in bwd_cfgs:
            try:
                cfg = K.LogitsBlocks(block_v=bv, stages=st, tiles_per_cta=tpc)
                f = jax.jit(lambda x, i, k, l, c, cfg=cfg: K.logits_dlogits(x, i, k, l, c, cfg=cfg, interpret=ip))
                r = bench(f, x, ids_r, k, lse2, c)
                emit(what="bwd_kernel", B=B, block_v=bv, stages=st, tiles_per_cta=tpc, **r,
                     tbps=round(2 * nbytes / r["pipe_ms"] / 1e9, 3))
                res_b.append((r["pipe_ms"], bv, st, tpc))
            except Exception as e:  # noqa: BLE001
                emit(what="bwd_kernel", B=B, block_v=bv, stages=st, error=traceback.format_exc()[-2000:])
        # ---- xla passes alone
        for lse_mode in ("online", "two_pass"):
            try:
                be = XlaLogitsBackend(lse=lse_mode)
                f = jax.jit(lambda z, i, be=be: be.logprobs(z, i, T=T, temperature=jnp.float32(1.0)))
                r = bench(f, logits, ids)
                emit(what="xla_fwd_pass", B=B, lse=lse_mode, **r, tbps=round(nbytes / r["pipe_ms"] / 1e9, 3))
            except Exception as e:  # noqa: BLE001
                emit(what="xla_fwd_pass", B=B, lse=lse_mode, error=repr(e)[:800])
        try:
            be = XlaLogitsBackend()
            lse_n = jnp.zeros((B, T), jnp.float32)
            dl = jnp.full((B, T), 1e-3, jnp.float32)
            f = jax.jit(lambda z, i, l, d: be.dlogits(z, i, l, d, T=T, temperature=jnp.float32(1.0)))
            r = bench(f, logits, ids, lse_n, dl)
            emit(what="xla_bwd_pass", B=B, **r, tbps=round(2 * nbytes / r["pipe_ms"] / 1e9, 3))
        except Exception as e:  # noqa: BLE001
            emit(what="xla_bwd_pass", B=B, error=repr(e)[:800])
        # ---- end to end
        if res_f and res_b:
            _, bvf, stf, pk = min(res_f)
            _, bvb, stb, tpc = min(res_b)
            best[B] = dict(fwd=(bvf, stf, pk), bwd=(bvb, stb, tpc))
        impls = {"xla": "xla", "mosaic_gpu_default": MosaicGpuLogitsBackend(interpret=True) if ip else "mosaic_gpu",
                 "mosaic_gpu_lean": MosaicGpuLogitsBackend(fwd=K.LogitsBlocks(pick_target=False), interpret=bool(ip))}
        if B in best:
            bf, bb = best[B]["fwd"], best[B]["bwd"]
            impls["mosaic_gpu_best"] = MosaicGpuLogitsBackend(
                fwd=K.LogitsBlocks(block_v=bf[0], stages=bf[1], pick_target=bf[2]),
                bwd=K.LogitsBlocks(block_v=bb[0], stages=bb[1], tiles_per_cta=bb[2]), interpret=bool(ip))
        for name, impl in impls.items():
            for mode in ("fwd+bwd", "fwd"):
                try:
                    loss = lambda z, i, m, a, o, impl=impl: gmpo_jax.policy_loss_from_logits(
                        z, i, m, a, objective=gmpo_jax.GMPO(), old_logps=o, implementation=impl)[0]
                    f = jax.jit(jax.value_and_grad(loss) if mode == "fwd+bwd" else loss)
                    r = bench(f, logits, ids, mask, adv, old)
                    out = f(logits, ids, mask, adv, old)
                    l0 = float(out[0] if mode == "fwd+bwd" else out)
                    emit(what="e2e", B=B, impl=name, mode=mode, loss=l0, **r, **memory(f, logits, ids, mask, adv, old),
                         config=str(impl) if not isinstance(impl, str) else None)
                except Exception as e:  # noqa: BLE001
                    emit(what="e2e", B=B, impl=name, mode=mode, error=traceback.format_exc()[-2000:])
        for mode in ("fwd+bwd", "fwd"):
            try:
                f = jax.jit(jax.value_and_grad(dense_loss) if mode == "fwd+bwd" else dense_loss)
                r = bench(f, logits, ids, mask, adv, old, n=10)
                out = f(logits, ids, mask, adv, old)
                emit(what="e2e", B=B, impl="dense_jax", mode=mode,
                     loss=float(out[0] if mode == "fwd+bwd" else out), **r, **memory(f, logits, ids, mask, adv, old))
            except Exception as e:  # noqa: BLE001
                emit(what="e2e", B=B, impl="dense_jax", mode=mode, error=repr(e)[:800])
        del logits, x, view
    emit(what="best", best={str(k): v for k, v in best.items()})


if __name__ == "__main__":
    sys.exit(main())
