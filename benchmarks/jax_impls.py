"""JAX worker: builds inputs on the device, times one implementation in one or more modes, measures floors.

Implementations
---------------
LM head (issues 2, 3), GMPO objective with its defaults, ``old_logps`` given (off-policy ratios):

* ``xla_chunked``, ``mosaic_gpu``: ``gmpo_jax.fused_linear_policy_loss(..., head=HeadOptions(implementation=name))``.
* ``dense_jax``: ``gmpo_jax.reference.policy_loss(..., upcast=False)`` under ``jax.jit`` (full ``[N, V]``
  logits, bf16 matmul with f32 accumulation: the naive training step). Records before commit 6bd1818's
  successor used ``upcast=True`` (the f32 HIGHEST oracle); see docs/performance.md.

Loss features (``opts``; 0 / ``"none"`` = off): ``entropy_coef``, ``softcap`` (both LM-head
implementations and ``dense_jax``), ``logits_precision`` (``xla_chunked`` / ``mosaic_gpu``; ``dense_jax``
refuses it: its float32 path is ``Precision.HIGHEST`` already) and ``input_dtype`` (``float32``: hidden and
weight in float32, see ``as_float32``).

Logits already computed (issue 5), logits ``[B, T + 1, V]``:

* ``mosaic_gpu``, ``xla``: ``gmpo_jax.policy_loss_from_logits(..., implementation=name)``.
* ``dense_jax``: ``gmpo_jax.reference.policy_loss_from_logits`` when it exists, else the plain jnp GMPO
  below (``log_softmax`` of the whole logits in float32) -- the "naive JAX" of ANCHORS.md.

Modes: ``fwd`` = the loss only, jitted, no gradient; ``fwd+bwd`` = ``jax.value_and_grad`` with respect to
hidden and weight (LM head) or logits.

Inputs: ``benchmarks.workloads`` (``opts["data"]``: ``peaked`` trained-LM-like batches, ``peaked-live``,
or ``flat`` N(0, 1) data with uniform ids), created on the device in chunks (no float32 ``[N, V]``); each
record carries the batch's statistics (mean entropy, masked / zero-advantage / clipped fractions). With
``opts["grad_acc"]`` the LM-head records also carry the relative L2 error of both gradients against a
dense oracle of the same loss (``grad_accuracy``; ``opts["oracle"]``: ``float32`` or ``float64``). Only the
public API of gmpo_jax is used (``gmpo_jax.reference`` included): keep it that way, so that moving
gmpo_jax's internals cannot break the benchmarks.

Peak memory is ``jax.devices()[0].memory_stats()["peak_bytes_in_use"]`` (a high-water mark of the whole
process, inputs included; ``None`` on CPU). JAX cannot reset it, so only the first mode run in a process
has an exact peak (``peak_exact``, and only when the input preparation's own high-water mark
(``prep_peak_gib``) stayed below it); the driver runs ``fwd+bwd`` first.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import _common, workloads
from benchmarks.shapes import Config

# ----------------------------------------------------------------------------------------------------
# Random inputs without temporaries


# the index-hashed generators live in benchmarks.workloads (one definition for every worker)
_hash_bits, hashed_normal, hashed_randint = workloads._hash_bits, workloads.hashed_normal, workloads.hashed_randint


def _mask(seed: int, B: int, T: int, kind: str):
    if kind == "full":
        return jnp.ones((B, T), jnp.bool_)
    if kind == "ragged":  # lengths uniform in [3T/4, T]
        lengths = T - (_hash_bits(seed, 6, (B,)) % jnp.uint32(T // 4 + 1)).astype(jnp.int32)
        return lax.broadcasted_iota(jnp.int32, (B, T), 1) < lengths[:, None]
    raise ValueError(f"unknown mask kind {kind!r}")


def lm_head_arrays(cfg: Config, opts: dict[str, Any]):
    """``(hidden, weight, ids, mask, advantages)`` of an LM-head configuration (trace under ``jax.jit``;
    ``out_shardings`` places them, as ``benchmarks.sharded_bench`` does)."""
    B, T, H, V = cfg.B, cfg.T, cfg.H, cfg.V
    seed, layout = opts["seed"], opts["weight_layout"]
    hidden = hashed_normal(seed, 1, (B, T, H), jnp.bfloat16)
    w_shape = (H, V) if layout == "hv" else (V, H)
    weight = hashed_normal(seed, 2, w_shape, jnp.bfloat16, opts["logit_scale"] / math.sqrt(H))
    ids = hashed_randint(seed, 3, (B, T), V)
    adv = hashed_normal(seed, 4, (B,), jnp.float32)
    return hidden, weight, ids, _mask(seed, B, T, opts["mask"]), adv


def _workload(opts: dict[str, Any]) -> workloads.Workload:
    return workloads.Workload(
        data=opts["data"], seed=opts["seed"], ratio_noise=opts["ratio_noise"], logit_scale=opts["logit_scale"]
    )


def lm_head_batch(cfg: Config, opts: dict[str, Any]) -> workloads.LMHeadBatch:
    """The workload's batch; the legacy flat options (``--mask ragged``: lengths in [3T/4, T]) applied."""
    batch = workloads.make_lm_head_batch(cfg.B, cfg.T, cfg.H, cfg.V, _workload(opts))
    if opts["data"] == "flat" and opts["mask"] != "full":
        batch = batch._replace(mask=_mask(opts["seed"], cfg.B, cfg.T, opts["mask"]))
    return batch


@functools.partial(jax.jit, static_argnums=(1, 2))
def as_float32(x, seed: int, stream: int):
    """A bf16 array as float32 with the 16 mantissa bits below bf16 filled: ``x (1 + u 2**-10)``, ``u``
    uniform in [-1, 1) (index-hashed). Within half a bf16 ulp, so it rounds back to ``x``: the float32 rows
    see the bf16 batch. A plain cast would leave the low bits zero, and the split products of
    ``logits_precision`` (``"bf16x3"`` drops the low x low terms) would then be exact by accident."""
    u = (_hash_bits(seed, stream, x.shape) >> 8).astype(jnp.float32) * 2.0**-23 - 1.0
    return x.astype(jnp.float32) * (1.0 + u * 2.0**-10)


def lm_head_inputs(cfg: Config, opts: dict[str, Any]):
    """``(hidden, weight, ids, mask, adv, old)`` in the call's argument order, and the batch statistics
    (of the bf16 batch). ``opts["input_dtype"] == "float32"``: hidden and weight through ``as_float32``."""
    batch = lm_head_batch(cfg, opts)
    stats = workloads.batch_stats(batch)
    hidden, weight = batch.hidden, batch.weight
    if opts.get("input_dtype", "bfloat16") == "float32":
        hidden, weight = as_float32(hidden, opts["seed"], 21), as_float32(weight, opts["seed"], 22)
    elif opts.get("input_dtype", "bfloat16") != "bfloat16":
        raise ValueError(f"unknown input_dtype {opts['input_dtype']!r}")
    if opts["weight_layout"] != "hv":
        weight = jax.jit(jnp.transpose)(weight)
    return (hidden, weight, batch.ids, batch.mask, batch.advantages, batch.old_logps), stats


@functools.partial(jax.jit, static_argnums=2)
def _target_logps(logits, ids, T: int):
    """float32 ``log_softmax(logits[:, :T])[ids]``, one sequence at a time (one ``[T, V]`` float32 block live)."""

    def one(args):
        z, i = args
        return jnp.take_along_axis(jax.nn.log_softmax(z[:T].astype(jnp.float32), axis=-1), i[:, None], axis=-1)[:, 0]

    return jax.lax.map(one, (logits, ids))


def logits_inputs(cfg: Config, opts: dict[str, Any]):
    """``(logits, ids, mask, adv, old)`` and the batch statistics (``None`` for the legacy flat options)."""
    B, T, V = cfg.B, cfg.T, cfg.V
    seed = opts["seed"]
    if opts["data"] != "flat" or (opts["logits_std"] == 1.0 and opts["mask"] == "full"):
        b = workloads.make_logits_batch(B, T, V, _workload(opts))
        return (b.logits, b.ids, b.mask, b.advantages, b.old_logps), workloads.batch_stats(b)

    @jax.jit
    def make():
        logits = hashed_normal(seed, 11, (B, T + 1, V), jnp.bfloat16, opts["logits_std"])
        ids = hashed_randint(seed, 3, (B, T), V)
        adv = hashed_normal(seed, 4, (B,), jnp.float32)
        return logits, ids, _mask(seed, B, T, opts["mask"]), adv

    logits, ids, mask, adv = make()
    logp = _target_logps(logits, ids, T)
    old = jax.jit(lambda lp: lp + opts["ratio_noise"] * hashed_normal(seed, 5, (B, T), jnp.float32))(logp)
    del logp
    return (logits, ids, mask, adv, old), None


# ----------------------------------------------------------------------------------------------------
# Loss functions under test


def _loss_only(out):
    return out[0] if isinstance(out, tuple) else out


def loss_features(opts: dict[str, Any]) -> dict[str, Any]:
    """``entropy_coef`` / ``softcap`` of the LM-head loss and its oracles (only those that are on)."""
    return {k: float(opts[k]) for k in ("entropy_coef", "softcap") if opts.get(k)}


def feature_objective(features: dict[str, Any]):
    """``GMPO()`` with the ``entropy_coef`` of ``features`` (its loss shaping)."""
    import gmpo_jax

    return gmpo_jax.GMPO(entropy_coef=features.get("entropy_coef"))


def feature_head(layout: str, features: dict[str, Any], **options):
    """``HeadOptions`` with the weight layout, the ``softcap`` of ``features`` and ``options``."""
    import gmpo_jax

    return gmpo_jax.HeadOptions(weight_layout=layout, softcap=features.get("softcap"), **options)


def logits_precision(opts: dict[str, Any]) -> str | None:
    value = opts.get("logits_precision") or "none"
    return None if value == "none" else value


def lm_head_loss(impl: str, opts: dict[str, Any]) -> Callable:
    import gmpo_jax

    layout = opts["weight_layout"]
    features = loss_features(opts)
    objective = feature_objective(features)
    precision = logits_precision(opts)
    if impl in ("xla_chunked", "mosaic_gpu"):
        grad_filter = str(opts.get("grad_filter") or "none")
        head = feature_head(
            layout,
            features,
            implementation=impl,
            logits_precision=precision,
            grad_filter=None if grad_filter == "none" else grad_filter if grad_filter == "auto" else float(grad_filter),
            chunk_size=opts.get("chunk_size") or None,
        )

        def loss(h, w, ids, mask, adv, old):
            batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old)
            return _loss_only(gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=objective, head=head))

    elif impl == "dense_jax":
        from gmpo_jax import reference

        if precision is not None:  # its float32 inputs run at HIGHEST already; a label would lie
            raise NotImplementedError("dense_jax has no logits_precision (gmpo_jax.reference.policy_loss)")

        def loss(h, w, ids, mask, adv, old):
            # the naive bf16 training-step baseline: bf16 matmul with f32 accumulation, full logits
            # (upcast=True would be the f32 Precision.HIGHEST oracle, ~6x slower on the H200)
            batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old)
            head = feature_head(layout, features)
            return _loss_only(reference.policy_loss(h, w, batch, objective=objective, head=head, upcast=False))

    else:
        raise ValueError(f"unknown LM-head implementation {impl!r}")
    return loss


def naive_gmpo_from_logits(logits, ids, mask, adv, old, eps_low: float = 0.4, eps_high: float = 0.4):
    """Plain jnp GMPO from logits [B, T+1, V]: full float32 log_softmax (what a user writes first)."""
    B, T = ids.shape
    logp_all = jax.nn.log_softmax(logits[:, :T].astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp_all, ids[..., None], axis=-1)[..., 0]
    r = logp - old
    c = jnp.where(adv[:, None] > 0, jnp.minimum(r, eps_high), jnp.maximum(r, -eps_low))
    m = mask.astype(jnp.float32)
    cnt = m.sum(-1)
    s = (m * c).sum(-1) / jnp.maximum(cnt, 1.0)
    return jnp.sum(jnp.where(cnt > 0, -adv * jnp.exp(s), 0.0)) / B


def naive_grpo_from_logits(logits, ids, mask, adv, old, eps_low: float = 0.2, eps_high: float = 0.2):
    """Plain jnp GRPO (``loss_type="grpo"``) from logits [B, T+1, V]: full float32 log_softmax."""
    B, T = ids.shape
    logp_all = jax.nn.log_softmax(logits[:, :T].astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp_all, ids[..., None], axis=-1)[..., 0]
    ratio = jnp.exp(logp - old)
    a = adv[:, None]
    ptl = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    m = mask.astype(jnp.float32)
    return jnp.sum((m * ptl).sum(-1) / jnp.maximum(m.sum(-1), 1.0)) / B


def logits_loss(impl: Any, opts: dict[str, Any]) -> tuple[Callable, str | None]:
    import gmpo_jax

    grpo = opts.get("objective", "gmpo") == "grpo"
    objective = gmpo_jax.GRPO(loss_type="grpo") if grpo else gmpo_jax.GMPO()
    if impl == "mosaic_gpu" and not opts.get("skip_masked_rows", True):  # the library's default is True
        from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

        impl = MosaicGpuLogitsBackend(skip_masked_rows=False)
    if impl in ("mosaic_gpu", "xla") or not isinstance(impl, str):  # a name or a backend instance

        def loss(logits, ids, mask, adv, old):
            batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old)
            return _loss_only(gmpo_jax.policy_loss_from_logits(logits, batch, objective=objective, implementation=impl))

        return loss, None
    if impl == "dense_jax":
        ref = getattr(getattr(gmpo_jax, "reference", None), "policy_loss_from_logits", None)
        if ref is not None:

            def loss(logits, ids, mask, adv, old):
                return _loss_only(ref(logits, gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old), objective=objective))

            return loss, "gmpo_jax.reference.policy_loss_from_logits"
        if grpo:
            return naive_grpo_from_logits, "naive jnp GRPO (benchmarks.jax_impls)"
        return naive_gmpo_from_logits, "naive jnp (benchmarks.jax_impls)"
    raise ValueError(f"unknown logits implementation {impl!r}")


# ----------------------------------------------------------------------------------------------------
# Measuring


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def device_kind() -> str:
    d = jax.devices()[0]
    return d.device_kind if d.platform != "cpu" else "cpu"


def time_fn(fn: Callable, args: tuple, opts: dict[str, Any], *, sanity: bool = True) -> dict[str, Any]:
    """Compile + first call (kept, for sanity values), warm-up, then >= iters timed calls.

    Every output is dropped before the next call so that no stale gradients inflate the peak."""
    t0 = time.perf_counter()
    first = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    checks = _sanity(first) if sanity else {}
    del first
    est = compile_s
    for _ in range(max(1, opts["warmup"])):  # warm-up; the last one estimates the call time
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        est = time.perf_counter() - t0
        if est > 0.5:  # slow calls: one warm-up is plenty
            break
    times = []
    for _ in range(_common.n_iters(est, opts["iters"], opts["min_time_s"])):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    stats = _common.timing_stats(times)
    stats["compile_s"] = round(compile_s, 3)
    stats.update(checks)
    return stats


def time_pipelined(
    fn: Callable, args: tuple, per_call_ms: float, *, max_ms: float = 5.0, batch_ms: float = 50.0, repeats: int = 5
) -> dict[str, Any]:
    """Device time of short calls without the host round trip: K calls back to back, divided by K
    (median of ``repeats`` batches). Two calls are in flight at a time (the host waits for call i after
    launching call i + 1), so the device never idles on a sync and at most two calls' buffers are live.
    Only for calls under ``max_ms``, where the per-call ``block_until_ready`` latency (tens of
    microseconds) is a visible share; comparable with the CUDA-event times of the PyTorch peers. Run
    after the peak was read."""
    if per_call_ms >= max_ms:
        return {}
    k = max(2, min(200, int(batch_ms / max(per_call_ms, 1e-3))))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        prev = fn(*args)
        for _ in range(k - 1):
            cur = fn(*args)
            jax.block_until_ready(prev)
            prev = cur
        jax.block_until_ready(prev)
        per_call.append((time.perf_counter() - t0) / k)
        del prev, cur
    return {"pipelined_ms": round(sorted(per_call)[len(per_call) // 2] * 1e3, 4), "pipelined_k": k}


@jax.jit
def _finite_and_norm(g):
    """One fused reduction (no float32 copy of g is materialised, which would raise the peak)."""
    return jnp.all(jnp.isfinite(g)), jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))


def _sanity(out) -> dict[str, Any]:
    """Loss value, finiteness and gradient norms of the first call."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple):
        loss, grads = out
    else:
        loss, grads = out, ()
    res: dict[str, Any] = {"loss": float(loss)}
    finite = bool(jnp.isfinite(loss))
    norms = []
    for g in grads:
        ok, norm = _finite_and_norm(g)
        finite &= bool(ok)
        norms.append(float(norm))
    res["finite"] = finite
    if norms:
        res["grad_norms"] = [round(n, 6) for n in norms]
    return res


def _nbytes(*arrays) -> int:
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays))


def input_specs(cfg: Config, opts: dict[str, Any]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract arguments, so that every mode is compiled before any input exists on the device."""
    B, T, S = cfg.B, cfg.T, jax.ShapeDtypeStruct
    tail = (S((B, T), jnp.int32), S((B, T), jnp.bool_), S((B,), jnp.float32), S((B, T), jnp.float32))
    if cfg.kind == "lm_head":
        w = (cfg.H, cfg.V) if opts["weight_layout"] == "hv" else (cfg.V, cfg.H)
        dtype = jnp.dtype(opts.get("input_dtype", "bfloat16"))
        return (S((B, T, cfg.H), dtype), S(w, dtype)) + tail
    return (S((B, T + 1, cfg.V), jnp.bfloat16),) + tail


def _compile(fn: Callable, mode: str, argnums: tuple[int, ...], specs) -> tuple[Any, dict[str, Any]]:
    if mode == "fwd":
        f = jax.jit(fn)
    elif mode == "fwd+bwd":
        f = jax.jit(jax.value_and_grad(fn, argnums=argnums))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    t0 = time.perf_counter()
    compiled = f.lower(*specs).compile()
    info: dict[str, Any] = {"compile_s": round(time.perf_counter() - t0, 3)}
    try:
        ma = compiled.memory_analysis()
        info["compiled_temp_gib"] = _common.gib(ma.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - optional information
        pass
    return compiled, info


def apply_tuning(tuning: dict[str, Any] | None) -> dict[str, Any]:
    """Sets tuning constants for this process (a sweep): ``NAME`` is an attribute of gmpo_jax.tuning,
    ``pkg.module.NAME`` any module attribute. Only existing attributes may be set."""
    import importlib

    applied = {}
    for name, value in (tuning or {}).items():
        modname, attr = name.rsplit(".", 1) if "." in name else ("gmpo_jax.tuning", name)
        mod = importlib.import_module(modname)
        if not hasattr(mod, attr):
            raise AttributeError(f"{modname} has no attribute {attr!r} to tune")
        setattr(mod, attr, value)
        applied[name] = value
    return applied


GRAD_ORACLE_BYTES = 12 * 2**30  # largest logits the dense gradient oracle may form (float32 [N, V]; float64 [T, V])


def _oracle_budget() -> int:
    """``GRAD_ORACLE_BYTES``, or a tenth of the device's memory where that is less: the float32 oracle's value
    and gradient peak near four times its logits, beside the timed call's buffers (an H100's 80 GB ran out of
    memory at the Qwen head's 8 x 2048, where an H200's 141 GB does not)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return GRAD_ORACLE_BYTES if not limit else min(GRAD_ORACLE_BYTES, int(limit) // 10)


def oracle_T(cfg: Config, budget: int | None = None, *, itemsize: int = 4, sequences: int | None = None) -> int:
    """Tokens per sequence of the gradient-accuracy check: T, or the longest multiple of 128 whose logits
    (``sequences`` rows of T' x V, ``itemsize`` bytes; default all B, float32) fit ``budget`` (the check
    then runs on the first T' positions of every sequence)."""
    budget = _oracle_budget() if budget is None else budget
    rows = cfg.B if sequences is None else sequences
    if rows * cfg.T * cfg.V * itemsize <= budget:
        return cfg.T
    return max(128, (budget // (rows * cfg.V * itemsize)) // 128 * 128)


@jax.jit
def _rel_l2(g, ref):
    """Relative L2 error of ``g`` against ``ref`` in ``ref``'s precision (float32; float64 under x64)."""
    dt = jnp.promote_types(ref.dtype, jnp.float32)
    g, ref = g.astype(dt), ref.astype(dt)
    return jnp.sqrt(jnp.sum(jnp.square(g - ref)) / jnp.maximum(jnp.sum(jnp.square(ref)), 1e-30))


@functools.cache
def _oracle_f32(layout: str, features: tuple[tuple[str, float], ...]) -> Callable:
    """``(loss, (d hidden, d weight))`` of ``gmpo_jax.reference.policy_loss(upcast=True)``: full float32
    logits at ``Precision.HIGHEST``, the same loss (``entropy_coef`` / ``softcap``) as the timed call."""
    import gmpo_jax
    from gmpo_jax import reference

    def oracle(h, w, ids, mask, adv, old):
        batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old)
        objective, head = feature_objective(dict(features)), feature_head(layout, dict(features))
        return _loss_only(reference.policy_loss(h, w, batch, objective=objective, head=head, upcast=True))

    return jax.jit(jax.value_and_grad(oracle, argnums=(0, 1)))


@functools.cache
def _oracle_f64(layout: str, features: tuple[tuple[str, float], ...]) -> Callable:
    """``(loss, (d hidden, d weight))`` of ``GMPO()`` (its default epsilons, no KL), the entropy term and the
    soft cap as ``gmpo_jax.reference`` defines them, in float64 with full logits: call it under
    ``jax.enable_x64``. ``gmpo_jax.reference`` computes in float32 whatever its inputs (its logits, log-probs
    and objective math are float32 by contract), so this small copy of GMPO is the float64 oracle; the CPU
    test checks it against the reference. GMPO's loss is a sum of per-sequence terms over ``B``: one
    sequence at a time (``lax.scan``), so its float64 ``[T, V]`` logits and their residuals are what is live,
    beside the float64 weight gradient."""
    import gmpo_jax

    gmpo = gmpo_jax.GMPO()
    el, eh = float(gmpo.epsilon_low), float(gmpo.epsilon_high)
    f = dict(features)
    cap, coef = f.get("softcap"), f.get("entropy_coef")

    def term(h, w, ids, mask, adv, old):  # one sequence: h [T, H], ids / mask / old [T], adv []
        z = h @ w if layout == "hv" else h @ w.T
        if cap:
            z = cap * jnp.tanh(z / cap)
        ls = jax.nn.log_softmax(z, axis=-1)
        logp = jnp.take_along_axis(ls, jnp.where(mask, ids, 0)[:, None], axis=-1)[:, 0]
        r = jnp.where(mask, logp - old, 0.0)
        r_v = lax.stop_gradient(r)
        c = jnp.where(adv > 0, jnp.where(r_v > eh, eh, r), jnp.where(r_v < -el, -el, r))  # one-sided log clip
        n = jnp.maximum(jnp.sum(mask), 1)
        live = jnp.any(mask) & (adv != 0)
        out = jnp.where(live, -adv * jnp.exp(jnp.where(live, jnp.sum(jnp.where(mask, c, 0.0)) / n, 0.0)), 0.0)
        if coef:  # -c * the per-sequence mean entropy (GMPO aggregates it as its KL term)
            ent = -jnp.sum(jnp.exp(ls) * ls, axis=-1)
            out = out - coef * jnp.sum(jnp.where(mask, ent, 0.0)) / n
        return out

    def oracle(h, w, ids, mask, adv, old):
        h, w, adv, old = (x.astype(jnp.float64) for x in (h, w, adv, old))

        def step(gw, xs):
            value, (gh, gwb) = jax.value_and_grad(term, argnums=(0, 1))(xs[0], w, *xs[1:])
            return gw + gwb, (value, gh)

        gw, (values, gh) = lax.scan(step, jnp.zeros_like(w), (h, ids, mask, adv, old))
        B = h.shape[0]
        return jnp.sum(values) / B, (gh / B, gw / B)

    return jax.jit(oracle)


ORACLES = {
    "float32": "gmpo_jax.reference.policy_loss(upcast=True)",
    "float64": "float64 dense GMPO (benchmarks.jax_impls._oracle_f64, jax.enable_x64)",
}


def grad_accuracy(cfg: Config, fn: Callable, compiled_fwd_bwd, args: tuple, opts: dict[str, Any]) -> dict[str, Any]:
    """Relative L2 error of d loss / d hidden and d loss / d weight of ``fn`` against a dense oracle of the
    same loss on the same inputs (``opts["oracle"]``): ``float32``, ``gmpo_jax.reference.policy_loss(...,
    upcast=True)`` (full float32 logits, HIGHEST precision), or ``float64`` (``_oracle_f64`` under
    ``jax.enable_x64``: for the float32 modes, whose error is below the float32 oracle's own). On the first
    ``oracle_T`` positions when the oracle's logits do not fit (then ``fn``'s gradient is compiled again at
    that shape). Also the oracle's loss and ``fn``'s distance from it (the oracle computes the same loss)."""
    kind = opts.get("oracle", "float32")
    if kind not in ORACLES:
        raise ValueError(f"unknown oracle {kind!r}; known: {tuple(ORACLES)}")
    T2 = oracle_T(cfg, itemsize=8, sequences=1) if kind == "float64" else oracle_T(cfg)
    out: dict[str, Any] = {"grad_acc_N": cfg.B * T2, "grad_oracle": ORACLES[kind]}
    if T2 == cfg.T:
        sub, (loss, got) = args, compiled_fwd_bwd(*args)
    else:
        sub = tuple(a[:, :T2] if a.ndim >= 2 and i != 1 else a for i, a in enumerate(args))
        loss, got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(*sub)
        out["grad_acc_note"] = f"oracle on the first {T2} of {cfg.T} positions of each sequence (memory)"
    features = tuple(sorted(loss_features(opts).items()))
    if kind == "float64":
        with jax.enable_x64(True):
            ref_loss, ref = _oracle_f64(opts["weight_layout"], features)(*sub)
            errs = [float(_rel_l2(g, r)) for g, r in zip(got, ref)]
            ref_loss = float(ref_loss)
    else:  # float32 leaves: the oracle's gradients stay float32 (a bf16 leaf would round them to bf16)
        h32, w32 = sub[0].astype(jnp.float32), sub[1].astype(jnp.float32)
        ref_loss, ref = _oracle_f32(opts["weight_layout"], features)(h32, w32, *sub[2:])
        errs = [float(_rel_l2(g, r)) for g, r in zip(got, ref)]
        ref_loss = float(ref_loss)
    del ref
    out["grad_rel_err_hidden"], out["grad_rel_err_weight"] = (float(f"{e:.4g}") for e in errs)
    out["oracle_loss"] = ref_loss
    out["loss_abs_err"] = float(f"{abs(float(loss) - ref_loss):.3g}")
    return out


def _datas(opts: dict[str, Any]) -> list[str]:
    return list(opts.get("datas") or [opts["data"]])


def run_impl(cfg: Config, impl: str, modes: list[str], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Times one implementation on one configuration in each mode and each workload (``opts["datas"]``,
    default ``[opts["data"]]``); emits one record per (data, mode).

    Order: compile every mode (no input on the device yet, so compile-time allocations such as GEMM
    autotuning do not stack on the inputs); then per workload: create the inputs (and their statistics),
    time the modes in the given order, check the gradients against the oracle (``grad_acc``), and save
    the batch for the PyTorch worker (``save_batch``). Only the first timed mode has an exact peak, and
    only when the input preparation's own high-water mark stayed below it."""
    records: list[dict[str, Any]] = []
    device = device_kind()
    common: dict[str, Any] = dict(
        device=_common.device_slug(device),
        device_name=device,
        seed=opts["seed"],
        mask=opts["mask"],
        jaxlib=_common.pkg_version("jaxlib"),
        variant=opts.get("variant"),
    )
    common["objective"] = (
        "GRPO(loss_type='grpo')" if cfg.kind == "logits" and opts.get("objective") == "grpo" else "GMPO()"
    )
    if opts.get("tuning"):
        common["tuning"] = opts["tuning"]
    specs = input_specs(cfg, opts)
    if cfg.kind == "lm_head":
        argnums: tuple[int, ...] = (0, 1)
        grads_bytes = _nbytes(specs[0], specs[1])
        common.update(
            weight_layout=opts["weight_layout"],
            logit_scale=opts["logit_scale"],
            chunk_size=opts.get("chunk_size"),
            weight_f32_gib=_common.gib(cfg.H * cfg.V * 4),
            input_dtype=opts.get("input_dtype", "bfloat16"),
            logits_precision=logits_precision(opts),
            entropy_coef=float(opts.get("entropy_coef") or 0.0),
            softcap=float(opts.get("softcap") or 0.0),
        )
        if opts.get("grad_acc"):
            common["oracle"] = opts.get("oracle", "float32")
    else:
        argnums = (0,)
        grads_bytes = _nbytes(specs[0])
        common.update(logits_std=opts["logits_std"], logits_gib=_common.gib(_nbytes(specs[0])))
    common["inputs_gib"] = _common.gib(_nbytes(*specs))

    def fail(mode: str, data: str, exc: BaseException, **extra) -> None:
        rec = _common.base_record(cfg, impl, mode, data=data, **common, **extra)
        rec.update(status=_common.classify_error(exc), error=_common.short_error(exc))
        _common.emit(rec)
        records.append(rec)

    compiled: dict[str, tuple[Any, dict[str, Any]]] = {}
    try:
        apply_tuning(opts.get("tuning"))
        if cfg.kind == "lm_head":
            fn = lm_head_loss(impl, opts)
        else:
            fn, source = logits_loss(impl, opts)
            if source:
                common["impl_source"] = source
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        for data in _datas(opts):
            for mode in modes:
                fail(mode, data, exc)
        return records
    failed: dict[str, BaseException] = {}
    for mode in modes:
        try:
            compiled[mode] = _compile(fn, mode, argnums, specs)
        except Exception as exc:  # noqa: BLE001
            failed[mode] = exc

    first = True
    for data in _datas(opts):
        dopts = dict(opts, data=data)
        try:
            make = lm_head_inputs if cfg.kind == "lm_head" else logits_inputs
            args, stats = make(cfg, dopts)
            jax.block_until_ready(args)
            prep_peak = peak_bytes()
        except Exception as exc:  # noqa: BLE001
            for mode in modes:
                fail(mode, data, exc)
            continue
        dcommon = dict(common, data=data, prep_peak_gib=_common.gib(prep_peak), **(stats or {}))
        for mode in modes:
            if mode in failed:
                fail(mode, data, failed[mode])
                continue
            f, info = compiled[mode]
            rec = _common.base_record(cfg, impl, mode, **dcommon)
            rec["grads_gib"] = _common.gib(grads_bytes if mode == "fwd+bwd" else 0)
            try:
                tstats = time_fn(f, args, opts)
                tstats.pop("compile_s", None)  # first-call time of an already compiled program
                rec.update(tstats, **info)
                peak = peak_bytes()
                exact = first and (peak is None or prep_peak is None or prep_peak < peak)
                rec["peak_exact"] = exact
                rec["peak_gib"] = _common.gib(peak) if exact else None
                rec["peak_gib_cumulative"] = _common.gib(peak)
                rec.update(time_pipelined(f, args, tstats["median_ms"]))
                rec["status"] = "ok" if tstats.get("finite", True) else "nonfinite"
                rec.update(_common.throughput(cfg, mode, tstats["median_ms"]))
                if mode == "fwd+bwd" and cfg.kind == "lm_head" and opts.get("grad_acc"):
                    try:
                        rec.update(grad_accuracy(cfg, fn, f, args, opts))
                    except Exception as exc:  # noqa: BLE001 - the timing stands
                        rec["grad_acc_error"] = _common.short_error(exc)
            except Exception as exc:  # noqa: BLE001
                rec.update(status=_common.classify_error(exc), error=_common.short_error(exc))
            first = False
            _common.emit(rec)
            records.append(rec)
        if opts.get("save_batch") and cfg.kind == "lm_head" and opts["mask"] == "full":
            path = _common.cache_path(cfg.B, cfg.T, cfg.H, cfg.V, data, opts["seed"])
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                arrays = dict(zip(workloads.LOSS_FIELDS, args))
                if opts["weight_layout"] != "hv":
                    arrays["weight"] = arrays["weight"].T
                workloads.save_arrays(path, arrays)
        del args
    return records


# ----------------------------------------------------------------------------------------------------
# Floors


MATMUL_MAX_ROWS = 16384


def measure_matmul(N: int, H: int, V: int, opts: dict[str, Any], max_rows: int = MATMUL_MAX_ROWS) -> dict[str, Any]:
    """bf16 XLA matmul rate of [N, H] x [H, V] (f32 result). Rows are capped at ``max_rows`` (the rate
    is flat beyond; the f32 [N, V] result of N = 65536 would be 40 GB)."""
    rows = min(N, max_rows)

    @jax.jit
    def make():
        return (
            hashed_normal(7, 1, (rows, H), jnp.bfloat16),
            hashed_normal(7, 2, (H, V), jnp.bfloat16, 1.0 / math.sqrt(H)),
        )

    a, b = jax.block_until_ready(make())
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    stats = time_fn(f, (a, b), dict(opts, min_time_s=max(opts["min_time_s"], 0.2)), sanity=False)
    stats.update(time_pipelined(f, (a, b), stats["median_ms"]))
    del a, b
    ms = min(stats["median_ms"], stats.get("pipelined_ms") or math.inf)
    tflops = 2.0 * rows * H * V / (ms * 1e-3) / 1e12
    return dict(stats, rows=rows, tflops=round(tflops, 2))


def measure_copy(opts: dict[str, Any], nbytes: int | None = None) -> dict[str, Any]:
    """Device copy bandwidth (bytes read + bytes written per second) of a large bf16 array (2 GiB on an
    accelerator, 64 MiB on the CPU); the faster of ``jnp.copy`` and a negation (same bytes, not elided)."""
    if nbytes is None:
        nbytes = 2**26 if jax.devices()[0].platform == "cpu" else 2**31
    n = nbytes // 2
    x = jax.block_until_ready(jax.jit(lambda: hashed_normal(7, 3, (n,), jnp.bfloat16))())
    best = None
    for name, f in (("copy", jax.jit(jnp.copy)), ("negate", jax.jit(jnp.negative))):
        stats = time_fn(f, (x,), dict(opts, min_time_s=max(opts["min_time_s"], 0.2)), sanity=False)
        stats.update(time_pipelined(f, (x,), stats["median_ms"]))
        ms = min(stats["median_ms"], stats.get("pipelined_ms") or math.inf)
        gbps = 2.0 * nbytes / (ms * 1e-3) / 1e9
        if best is None or gbps > best["gbps"]:
            best = dict(
                median_ms=stats["median_ms"],
                min_ms=stats["min_ms"],
                n_runs=stats["n_runs"],
                pipelined_ms=stats.get("pipelined_ms"),
                gbps=round(gbps, 1),
                op=name,
                copy_gib=_common.gib(nbytes),
            )
    del x
    return best


def run_floors(matmuls: list[tuple[int, int, int]], copy: bool, opts: dict[str, Any]) -> dict[str, Any]:
    """Measures every requested floor; emits one record each; returns {'matmul_tflops': {...}, 'copy_gbps'}."""
    device = device_kind()
    floors: dict[str, Any] = {"matmul_tflops": {}, "copy_gbps": None}
    base = dict(
        device=_common.device_slug(device),
        device_name=device,
        jax=_common.pkg_version("jax"),
        date=_common.now_utc(),
        commit=_common.git_commit(),
        kind="floor",
        variant=None,
    )
    measured: dict[tuple[int, int, int], dict[str, Any]] = {}  # by (rows, H, V): N >= 16384 share one
    for N, H, V in matmuls:
        rec = dict(
            implementation="xla_matmul_bf16", shape=f"matmul {N}x{H}x{V}", B=1, T=N, H=H, V=V, N=N, mode="fwd", **base
        )
        key = (min(N, MATMUL_MAX_ROWS), H, V)
        try:
            if key not in measured:
                measured[key] = measure_matmul(N, H, V, opts)
            rec.update(measured[key], status="ok")
            floors["matmul_tflops"][f"{N},{H},{V}"] = measured[key]["tflops"]
        except Exception as exc:  # noqa: BLE001
            rec.update(status=_common.classify_error(exc), error=_common.short_error(exc))
        _common.emit(rec)
    if copy:
        rec = dict(implementation="xla_copy", shape="copy", B=0, T=0, H=0, V=0, N=0, mode="fwd", **base)
        try:
            c = measure_copy(opts)
            rec.update(c, status="ok")
            floors["copy_gbps"] = c["gbps"]
        except Exception as exc:  # noqa: BLE001
            rec.update(status=_common.classify_error(exc), error=_common.short_error(exc))
        _common.emit(rec)
    return floors
