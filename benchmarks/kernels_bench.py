"""Kernel-level GPU check and timing of the mosaic_gpu backend against xla_chunked and the XLA matmul.

  PYTHONPATH=. python3 -m benchmarks.kernels_bench [--quick] [--out DIR]
  PYTHONPATH=. python3 -m benchmarks.kernels_bench --sweep     # block sizes for gmpo_jax.tuning.MOSAIC_BLOCKS
  PYTHONPATH=. python3 -m benchmarks.kernels_bench --entropy   # log-probs with / without the entropy

One process, everything in one device call: correctness at real shapes (both layouts, bias,
temperature, bf16) against ``xla_chunked`` and a float32 dense reference on a row subset, a
bitwise rerun-equality check, then timings (median of 10 after warm-up, random data) of the
per-chunk seam calls ``logprobs`` and ``grads`` for both backends, of block-size variants of the
log-prob kernel, and of the plain XLA bf16 matmul ``[R, H] x [H, V]`` of the same shape (the
rate the floor uses). Results go to stdout (a table last) and ``DIR/kernels.jsonl``.
Numbers are recorded by hand in ``benchmarks/KERNELS_NOTES.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax.backends.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.backends.xla_chunked import XlaChunkedBackend

RESULTS: list[dict] = []


def log(msg):
  print(msg, flush=True)


def record(**kw):
  RESULTS.append(kw)
  log(json.dumps(kw))


def bench(fn, *args, n=10):
  out = fn(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3, min(ts) * 1e3


def make_inputs(R, H, V, layout, bias, seed=0, scale=1.0):
  k = jax.random.split(jax.random.key(seed), 5)
  h = jax.random.normal(k[0], (R, H), jnp.float32).astype(jnp.bfloat16)
  wshape = (H, V) if layout == "hv" else (V, H)
  w = (jax.random.normal(k[1], wshape, jnp.float32) * (scale / np.sqrt(H))).astype(jnp.bfloat16)
  b = jax.random.normal(k[2], (V,), jnp.float32) * 0.1 if bias else None
  ids = jax.random.randint(k[3], (R,), 0, V, jnp.int32)
  dlogp = jax.random.normal(k[4], (R,), jnp.float32)
  return h, w, b, ids, dlogp


def rel(a, b):
  a = jnp.asarray(a, jnp.float32).ravel()
  b = jnp.asarray(b, jnp.float32).ravel()
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def check(R, H, V, layout, bias, temperature, scale=1.0):
  name = f"check R={R} H={H} V={V} {layout} bias={bias} T={temperature} scale={scale}"
  try:
    h, w, b, ids, dlogp = make_inputs(R, H, V, layout, bias, seed=R + V, scale=scale)
    T = jnp.float32(temperature)
    mk, xk = MosaicGpuBackend(), XlaChunkedBackend()
    lp_m, lse_m = jax.jit(lambda *a: mk.logprobs(*a, weight_layout=layout))(h, w, b, ids, T)
    lp_x, lse_x = jax.jit(lambda *a: xk.logprobs(*a, weight_layout=layout))(h, w, b, ids, T)
    # float32 dense reference on the first 256 rows
    hs = h[:256].astype(jnp.float32)
    wf = w.astype(jnp.float32)
    z = (hs @ wf if layout == "hv" else hs @ wf.T)
    if b is not None:
      z = z + b
    z = z / T
    lse_r = jax.nn.logsumexp(z, axis=1)
    lp_r = jnp.take_along_axis(z, ids[:256, None], 1)[:, 0] - lse_r
    dw0 = jnp.zeros(w.shape, jnp.float32)
    db0 = None if b is None else jnp.zeros((V,), jnp.float32)
    gm = jax.jit(lambda *a: mk.grads(*a, weight_layout=layout, dw_acc=dw0, db_acc=db0))
    gx = jax.jit(lambda *a: xk.grads(*a, weight_layout=layout, dw_acc=dw0, db_acc=db0))
    dh_m, dw_m, db_m = gm(h, w, b, ids, dlogp, lse_x, T)
    dh_x, dw_x, db_x = gx(h, w, b, ids, dlogp, lse_x, T)
    dh_m2, dw_m2, db_m2 = gm(h, w, b, ids, dlogp, lse_x, T)
    lp_m2, lse_m2 = jax.jit(lambda *a: mk.logprobs(*a, weight_layout=layout))(h, w, b, ids, T)
    det = bool(jnp.array_equal(dh_m, dh_m2) and jnp.array_equal(dw_m, dw_m2)
               and jnp.array_equal(lp_m, lp_m2) and jnp.array_equal(lse_m, lse_m2))
    out = dict(
        kind="check", R=R, H=H, V=V, layout=layout, bias=bias, T=temperature, scale=scale,
        lse_maxabs_vs_xla=float(jnp.max(jnp.abs(lse_m - lse_x))),
        logp_maxabs_vs_xla=float(jnp.max(jnp.abs(lp_m - lp_x))),
        lse_maxabs_vs_f32=float(jnp.max(jnp.abs(lse_m[:256] - lse_r))),
        logp_maxabs_vs_f32=float(jnp.max(jnp.abs(lp_m[:256] - lp_r))),
        nan_logp=int(jnp.isnan(lp_m).sum()),
        dh_rel_vs_xla=rel(dh_m, dh_x), dw_rel_vs_xla=rel(dw_m, dw_x),
        db_rel_vs_xla=None if b is None else rel(db_m, db_x),
        deterministic=det)
    ok = (out["lse_maxabs_vs_xla"] < 2e-2 and out["logp_maxabs_vs_xla"] < 2e-2 and out["nan_logp"] == 0
          and out["dh_rel_vs_xla"] < 2e-2 and out["dw_rel_vs_xla"] < 2e-2 and det)
    out["ok"] = ok
    record(**out)
  except Exception as e:  # keep going: one device call must answer every question
    record(kind="check", name=name, ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
    traceback.print_exc()


def time_shape(tag, R, H, V, layout="hv", variants=(), grad_variants=()):
  try:
    h, w, b, ids, dlogp = make_inputs(R, H, V, layout, False, seed=7)
    T = jnp.float32(1.0)
    flops = 2.0 * R * H * V
    # XLA matmul of the same shape (bf16 out, f32 accumulation)
    mm = jax.jit(lambda h, w: h @ w if layout == "hv" else h @ w.T)
    ms, _ = bench(mm, h, w)
    record(kind="time", tag=tag, what="xla_matmul", R=R, H=H, V=V, ms=ms, tflops=flops / ms / 1e9)
    for name, be in (("mosaic_gpu", MosaicGpuBackend()), ("xla_chunked", XlaChunkedBackend())):
      f = jax.jit(lambda h, w, ids, T, be=be: be.logprobs(h, w, None, ids, T, weight_layout=layout))
      try:
        ms, _ = bench(f, h, w, ids, T)
        record(kind="time", tag=tag, what=f"{name}.logprobs", R=R, H=H, V=V, ms=ms,
               tflops=flops / ms / 1e9)
      except Exception as e:
        record(kind="time", tag=tag, what=f"{name}.logprobs", error=f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()
      lse = jax.jit(lambda h, w, ids, T: XlaChunkedBackend().logprobs(h, w, None, ids, T, weight_layout=layout)[1])(h, w, ids, T)

      def g(h, w, ids, dlogp, lse, T, be=be):
        dw0 = jnp.zeros(w.shape, jnp.float32)
        return be.grads(h, w, None, ids, dlogp, lse, T, weight_layout=layout, dw_acc=dw0, db_acc=None)

      try:
        ms, _ = bench(jax.jit(g), h, w, ids, dlogp, lse, T)
        record(kind="time", tag=tag, what=f"{name}.grads", R=R, H=H, V=V, ms=ms,
               tflops=3 * flops / ms / 1e9)
      except Exception as e:
        record(kind="time", tag=tag, what=f"{name}.grads", error=f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()
    time_variants(tag, h, w, ids, T, layout, variants, grad_variants)
  except Exception as e:
    record(kind="time", tag=tag, error=f"{type(e).__name__}: {str(e)[:2000]}")
    traceback.print_exc()


def time_variants(tag, h, w, ids, T, layout, variants, grad_variants):
  """The log-prob kernel and the dz kernel (whole vocabulary) alone for each ``(block_m, block_n, stages)``;
  records carry ``kernel`` and ``block`` = ``(block_m, block_n, block_k, stages)`` for ``table_entries``."""
  from gmpo_jax.kernels import _common as C
  from gmpo_jax.kernels.lm_head_dlogits import lm_head_dlogits_window
  from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials
  from gmpo_jax.backends.mosaic_gpu import _prepare
  R, H = h.shape
  V = w.shape[1] if layout == "hv" else w.shape[0]
  flops = 2.0 * R * H * V
  for kernel, plan in (("logprob", variants), ("grad", grad_variants)):
    for bm, bn, st in plan:
      cfg = C.LMHeadBlocks(block_m=bm, block_n=bn, block_k=64, num_stages=st)
      what = f"{kernel} kernel bm={bm} bn={bn} stages={st}"
      try:
        hp, ids_p, scale, _, Rp = _prepare(h, ids, None, T, cfg, V)
        nt = C.cdiv(V, bn)
        splits = C.lm_head_num_splits(Rp // cfg.rows_per_cta, nt, jax.devices()[0].core_count)
        if kernel == "logprob":
          f = jax.jit(lambda hp, w, ids_p, scale, cfg=cfg, splits=splits: lm_head_lse_partials(
              hp, w, None, ids_p, scale, weight_layout=layout, vocab_size=V, cfg=cfg, num_splits=splits))
        else:
          f = jax.jit(lambda hp, w, ids_p, scale, cfg=cfg, splits=splits, nt=nt: lm_head_dlogits_window(
              hp, w, None, ids_p, scale, scale, scale, weight_layout=layout, vocab_size=V,
              window_start=0, window_tiles=nt, cfg=cfg, num_splits=splits))
        ms, _ = bench(f, hp, w, ids_p, scale)
        record(kind="time", tag=tag, what=f"{what} splits={splits}", kernel=kernel, block=[bm, bn, 64, st],
               R=R, H=H, V=V, ms=ms, tflops=flops / ms / 1e9)
      except Exception as e:
        record(kind="time", tag=tag, what=what, error=f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()


def table_entries(records, device_kind):
  """``gmpo_jax.tuning.MOSAIC_BLOCKS`` entries from sweep records: per head (H, V), the fastest block of
  each kernel. Returns ``{(device_kind, H, V): {"logprob": (...), "grad": (...)}}`` (kernels with records)."""
  best = {}
  for r in records:
    if "kernel" not in r or "ms" not in r:
      continue
    key = (device_kind, r["H"], r["V"])
    cur = best.setdefault(key, {}).get(r["kernel"])
    if cur is None or r["ms"] < cur[0]:
      best[key][r["kernel"]] = (r["ms"], tuple(r["block"]))
  return {k: {kind: blk for kind, (_, blk) in v.items()} for k, v in best.items()}


SWEEP_HEADS = {"qwen2.5-0.5b": (896, 151936), "llama3-8b": (4096, 128256)}
SWEEP_LOGPROB = [(64, 256, 4), (128, 128, 4), (128, 128, 3), (64, 128, 6), (64, 256, 3)]
SWEEP_GRAD = [(128, 128, 3), (64, 128, 6), (128, 128, 2), (64, 256, 3)]


def sweep(R=8192):
  """The offline block sweep behind ``gmpo_jax.tuning.MOSAIC_BLOCKS``: both kernels, each head, R rows."""
  for name, (H, V) in SWEEP_HEADS.items():
    h, w, _, ids, _ = make_inputs(R, H, V, "hv", False, seed=7)
    time_variants(f"sweep {name} R={R}", h, w, ids, jnp.float32(1.0), "hv", SWEEP_LOGPROB, SWEEP_GRAD)
    del h, w
  entries = table_entries(RESULTS, jax.devices()[0].device_kind)
  log("== MOSAIC_BLOCKS entries (paste into gmpo_jax/tuning.py after review) ==")
  for key, kinds in entries.items():
    log(f"    {key!r}: {kinds!r},")


def time_entropy(tag, R, H, V, layout="hv"):
  """The seam's ``logprobs`` with and without the entropy (mosaic_gpu, xla_chunked), and the entropy's
  largest difference between the two (logits ~ N(0, 1))."""
  try:
    h, w, b, ids, _ = make_inputs(R, H, V, layout, False, seed=5)
    T = jnp.float32(1.0)
    flops = 2.0 * R * H * V
    out = {}
    for name, be in (("mosaic_gpu", MosaicGpuBackend()), ("xla_chunked", XlaChunkedBackend())):
      for ent in (False, True):
        f = jax.jit(lambda h, w, ids, T, be=be, ent=ent: be.logprobs(h, w, None, ids, T, weight_layout=layout,
                                                                     with_entropy=ent))
        out[name, ent] = f(h, w, ids, T)
        ms, _ = bench(f, h, w, ids, T)
        record(kind="time", tag=tag, what=f"{name}.logprobs entropy={ent}", R=R, H=H, V=V, ms=ms,
               tflops=flops / ms / 1e9)
    (lp_m, _, e_m), (_, _, e_x) = out["mosaic_gpu", True], out["xla_chunked", True]
    record(kind="check", tag=tag, what="entropy mosaic_gpu vs xla_chunked", R=R, H=H, V=V,
           entropy_maxabs=float(jnp.max(jnp.abs(e_m - e_x))), entropy_mean=float(jnp.mean(e_x)),
           logp_bitwise_same_without_entropy=bool(jnp.array_equal(lp_m, out["mosaic_gpu", False][0])),
           ok=bool(jnp.max(jnp.abs(e_m - e_x)) < 1e-3))
  except Exception as e:
    record(kind="time", tag=tag, what="entropy", error=f"{type(e).__name__}: {str(e)[:1500]}")
    traceback.print_exc()


def time_e2e(tag, B, T, H, V, impls, layout="hv"):
  """fused_linear_policy_loss (GMPO defaults) forward+backward and forward-only, per implementation."""
  import gmpo_jax
  k = jax.random.split(jax.random.key(11), 5)
  h = jax.random.normal(k[0], (B, T, H), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (H, V), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
  ids = jax.random.randint(k[2], (B, T), 0, V, jnp.int32)
  mask = jnp.ones((B, T), bool)
  adv = jax.random.normal(k[3], (B,), jnp.float32)
  old = -jnp.abs(jax.random.normal(k[4], (B, T), jnp.float32)) - 10.0
  floor_flops = 6.0 * B * T * H * V
  for impl in impls:
    def loss(h, w, impl=impl):
      l, aux = gmpo_jax.fused_linear_policy_loss(h, w, ids, mask, adv, objective=gmpo_jax.GMPO(),
                                                 old_logps=old, implementation=impl)
      return l
    for mode, fn in (("fwd+bwd", jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))),
                     ("fwd", jax.jit(loss))):
      try:
        ms, _ = bench(fn, h, w)
        record(kind="time", tag=tag, what=f"e2e {impl} {mode}", B=B, T=T, H=H, V=V, ms=ms,
               tflops=(floor_flops if mode == "fwd+bwd" else floor_flops / 3) / ms / 1e9)
      except Exception as e:
        record(kind="time", tag=tag, what=f"e2e {impl} {mode}", error=f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kernels_bench"))
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--skip-checks", action="store_true")
  ap.add_argument("--final", action="store_true", help="config timings + workspace variant + e2e")
  ap.add_argument("--entropy", action="store_true", help="only the with/without-entropy log-prob timings")
  ap.add_argument("--sweep", action="store_true", help="only the block sweep behind gmpo_jax.tuning.MOSAIC_BLOCKS")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  d = jax.devices()[0]
  log(f"jax {jax.__version__} device {d.device_kind} cc={getattr(d, 'compute_capability', None)} "
      f"sms={getattr(d, 'core_count', None)}")
  t_start = time.time()
  if args.sweep:
    sweep()
  elif args.entropy:
    time_entropy("qwen R=16384", 16384, 896, 151936)
    time_entropy("llama R=8192", 8192, 4096, 128256)
  elif not args.skip_checks:
    check(1000, 896, 151936, "hv", False, 1.0)
    check(1000, 896, 151936, "vh", True, 0.7)
    check(515, 1536, 50264, "hv", True, 1.3, scale=30.0)
    check(64, 2048, 32000, "hv", False, 1.0, scale=1000.0)
    check(300, 4096, 32000, "vh", False, 1.0)
  log(f"checks done in {time.time() - t_start:.1f}s")
  if args.entropy or args.sweep:
    pass
  elif args.final:
    time_shape("qwen R=8192", 8192, 896, 151936, "hv")
    try:
      h, w, b, ids, dlogp = make_inputs(8192, 896, 151936, "hv", False, seed=7)
      lse = jax.jit(lambda h, w, ids: XlaChunkedBackend().logprobs(h, w, None, ids, jnp.float32(1), weight_layout="hv")[1])(h, w, ids)
      for wsb in (128 * 2**20, 512 * 2**20):
        be = MosaicGpuBackend(workspace_bytes=wsb)
        g = jax.jit(lambda h, w, ids, dlogp, lse, be=be: be.grads(h, w, None, ids, dlogp, lse, jnp.float32(1), weight_layout="hv", dw_acc=jnp.zeros(w.shape, jnp.float32), db_acc=None))
        ms, _ = bench(g, h, w, ids, dlogp, lse)
        record(kind="time", tag="qwen R=8192", what=f"mosaic_gpu.grads workspace={wsb >> 20}MiB", ms=ms,
               tflops=3 * 2.0 * 8192 * 896 * 151936 / ms / 1e9)
      del h, w
    except Exception as e:
      record(kind="time", tag="ws", error=f"{type(e).__name__}: {str(e)[:1500]}")
    time_e2e("qwen 8x2048", 8, 2048, 896, 151936, ("mosaic_gpu", "xla_chunked"))
    time_e2e("llama 4x2048", 4, 2048, 4096, 128256, ("mosaic_gpu", "xla_chunked"))
    time_e2e("qwen 16x4096", 16, 4096, 896, 151936, ("mosaic_gpu",))
  else:
    time_shape("qwen R=8192", 8192, 896, 151936, "hv",
               variants=[(128, 128, 4), (64, 256, 4), (128, 128, 3), (64, 128, 6)],
               grad_variants=[(128, 128, 3), (64, 128, 6)])
  if not args.quick and not args.final and not args.entropy and not args.sweep:
    time_shape("qwen R=8192 vh", 8192, 896, 151936, "vh")
    time_shape("llama R=8192", 8192, 4096, 128256, "hv", variants=[(128, 128, 4), (64, 256, 4)])
  with open(os.path.join(args.out, "kernels.jsonl"), "w") as f:
    for r in RESULTS:
      f.write(json.dumps(r) + "\n")
  log("\n== summary ==")
  for r in RESULTS:
    if r["kind"] == "check" and "entropy_maxabs" in r:
      log(f"check {r['tag']}: {r['what']}: {r['entropy_maxabs']:.2e} (mean entropy {r['entropy_mean']:.3f}) "
          f"logp unchanged={r['logp_bitwise_same_without_entropy']} ok={r['ok']}")
    elif r["kind"] == "check":
      log(f"check {r.get('R')} {r.get('H')} {r.get('V')} {r.get('layout')} ok={r.get('ok')} "
          + (r.get("error", "")[:300] if "error" in r else
             f"lse {r['lse_maxabs_vs_xla']:.2e}/{r['lse_maxabs_vs_f32']:.2e} dh {r['dh_rel_vs_xla']:.2e} "
             f"dw {r['dw_rel_vs_xla']:.2e} det={r['deterministic']}"))
    else:
      log(f"{r.get('tag')}: {r.get('what')}: "
          + (f"{r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s" if "ms" in r else r.get("error", "")[:300]))
  log(f"total {time.time() - t_start:.1f}s")


if __name__ == "__main__":
  sys.exit(main())
