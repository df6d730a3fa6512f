"""A Tunix GRPO training step with Tunix's own policy loss against the same step on gmpo_jax's fused loss.

Examples::

    python -m benchmarks.tunix_bench --preset cpu --results /tmp/tunix.jsonl    # tiny Qwen3, < 1 min
    python3 -m benchmarks.tunix_bench --preset gpu --commit <hash> --results $OUT/tunix.jsonl   # H200
    python -m benchmarks.tunix_bench --preset gpu --build-only     # trace the GPU-size steps on the CPU
    python -m benchmarks.tunix_bench --report /tmp/tunix.jsonl     # markdown table of the records

One training step of a randomly initialised Tunix model (its input embedding scaled to ``EMBED_STD``;
Tunix's ``GRPOConfig``: ``beta=0.04``, ``kl_loss_mode="low_var_kl"``, ``sequence-mean-token-mean``,
off-policy old log-probs), as Tunix's trainer
runs it: ``nnx.value_and_grad`` of the policy loss function over every parameter, then
``optimizer.update`` (AdamW), jitted with the train state donated. Two implementations of the loss:

* ``tunix_grpo``: Tunix's registered ``grpo`` loss (``function_registry.get_policy_loss_fn("grpo")``), whose
  log-probs come from the model's full ``[B, P+T, V]`` float32 logits;
* ``gmpo_jax_fused``: the loss that ``gmpo_jax.integrations.tunix.register()`` registers (final hidden
  states and the LM-head weight into the fused loss; the logits are never materialised).

Jobs, each in its own process (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so the device's peak is the job's
own). A step job per configuration and implementation: compile (the compiled memory analysis gives
``temp_bytes``), ``--warmup`` steps (the first one's loss and metrics are recorded: the same initial
parameters and batch for both implementations), then ``--iters`` timed steps, each
``block_until_ready``; ``step_ms`` is their median, ``peak_bytes`` the device's ``peak_bytes_in_use``
(None on the CPU). Then a gradient check per configuration: the loss and every parameter gradient of
both implementations in one process, at float32 and ``HIGHEST`` matmul precision (``grad_rel_err`` =
``||g_fused - g_tunix|| / ||g_tunix||`` over all parameters, ``grad_max_err`` the worst leaf's largest
difference over its largest entry); it is copied into the configuration's step records.

Batch (seeded): left-padded prompts of ``P`` tokens (lengths ``P/2..P``), right-padded completions of
``T`` (lengths ``T/4..T``), advantages normalised within groups of ``num_generations``; the old and
reference log-probs are the model's own (one fused forward pass before compiling the step, through the
integration's ``final_hidden_states`` / ``lm_head`` and ``gmpo_jax.fused_linear_logprobs``, so no dense
logits raise the peak) plus Gaussian noise, so that ratios clip as in training.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import re
import sys
import time
from typing import Any

from benchmarks import _common

IMPLS = ("tunix_grpo", "gmpo_jax_fused")
PAD_ID, EOS_ID = 0, 1
OLD_NOISE, REF_NOISE = 0.15, 0.05  # std of the log-prob noise of the old and reference policies
# Tunix's Embedder draws the embedding from N(0, 1); tied to the LM head (Qwen2.5-0.5B) that gives logits up to
# |z| ~ 950, which Tunix's Qwen2 rounds to bf16 (log-probs off by ~1 nat: benchmarks/RESULTS.md, 2026-12-01) and
# which made both losses' steps non-finite. Scaled to Hugging Face's initializer_range for these models.
EMBED_STD = 0.02


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked configuration: a Tunix model (``MODELS``) at one batch."""

    name: str
    model: str
    B: int
    T: int
    P: int
    dtype: str
    layers: int | None = None  # None: the model's own
    remat: str = "none"  # Tunix's RematConfig: none, block (attention) or decoder (whole layer)


# name -> (Tunix module, one-line description); the configs are built by ``model_config``
MODELS = {
    "qwen2.5-0.5b": ("qwen2", "Tunix Qwen2 ModelConfig.qwen2p5_0p5b() (tied embedding, H=896, V=151936, 24 layers)"),
    "llama3-8b-head": (
        "qwen3",
        "Tunix Qwen3 architecture with the dims of Tunix's Llama3 ModelConfig.llama3p1_8b() (H=4096, V=128256, "
        "untied LM head), 2 of its 32 layers; Tunix 0.1.7's Llama3 has no output_hidden_states (the fused "
        "loss cannot read its hidden states) and no dtype option",
    ),
    "tiny-qwen3": ("qwen3", "tiny random Tunix Qwen3 (H=64, V=4096, 2 layers), CPU smoke preset"),
}

PRESETS = {
    "cpu": [Case("tiny-qwen3", "tiny-qwen3", B=4, T=128, P=16, dtype="float32")],
    "qwen2.5-0.5b": [Case("qwen2.5-0.5b", "qwen2.5-0.5b", B=8, T=1024, P=256, dtype="bfloat16")],
    "llama3-8b-head": [Case("llama3-8b-head", "llama3-8b-head", B=8, T=1024, P=256, dtype="bfloat16", layers=2)],
}
PRESETS["gpu"] = PRESETS["qwen2.5-0.5b"] + PRESETS["llama3-8b-head"]
TIMEOUT_S = {"cpu": 120.0, "gpu": 150.0}


def model_config(case: Case, dtype: str):
    """The Tunix ``ModelConfig`` of a case at ``dtype`` (params and activations)."""
    import jax.numpy as jnp

    family, _ = MODELS[case.model]
    if family == "qwen2":
        from tunix.models.qwen2 import model as module
    else:
        from tunix.models.qwen3 import model as module
    if case.model == "qwen2.5-0.5b":
        cfg = module.ModelConfig.qwen2p5_0p5b()
    elif case.model == "llama3-8b-head":
        from tunix.models.llama3 import model as llama3

        ll = llama3.ModelConfig.llama3p1_8b()
        fields = ("vocab_size", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads", "rope_theta")
        cfg = module.ModelConfig(
            num_layers=ll.num_layers,
            norm_eps=ll.norm_eps,
            use_tied_embedding=False,
            **{k: getattr(ll, k) for k in fields},
        )
    else:
        cfg = module.ModelConfig(
            num_layers=2,
            vocab_size=4096,
            embed_dim=64,
            hidden_dim=128,
            num_heads=4,
            head_dim=16,
            num_kv_heads=2,
            rope_theta=10_000,
            norm_eps=1e-6,
        )
    dt = jnp.dtype(dtype)
    cfg = dataclasses.replace(cfg, dtype=dt, param_dtype=dt)
    if case.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=case.layers)
    cfg = dataclasses.replace(cfg, remat_config=module.RematConfig[case.remat.upper()])
    model_cls = module.Qwen2 if family == "qwen2" else module.Qwen3
    return model_cls, cfg


# ----------------------------------------------------------------------------------------------------
# Worker


def _algo_config():
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    config = GRPOConfig(num_generations=4, beta=0.04, kl_loss_mode="low_var_kl")
    config.temperature = 1.0  # what GRPOLearner sets from the rollout config
    return config


def _loss_fn(impl: str):
    """The policy loss function Tunix's learner would look up for ``impl``."""
    from tunix.rl import function_registry

    name = {"tunix_grpo": "grpo", "gmpo_jax_fused": _register()}[impl]
    return function_registry.get_policy_loss_fn(name)


@functools.cache
def _register() -> str:
    from gmpo_jax.integrations import tunix as gtx

    return gtx.register()


def _build(case: Case, dtype: str, seed: int, abstract: bool = False):
    """``(model, optimizer)`` at ``dtype`` (AdamW, as Tunix's trainers use); abstract: shapes only."""
    import jax
    import optax
    from flax import nnx

    model_cls, cfg = model_config(case, dtype)

    def make():
        model = model_cls(cfg, rngs=nnx.Rngs(seed))
        emb = model.embedder.input_embedding  # Tunix draws it from N(0, 1): see EMBED_STD
        emb.value = emb.value * jax.numpy.asarray(EMBED_STD, emb.value.dtype)
        return model, nnx.Optimizer(model, optax.adamw(1e-6), wrt=nnx.Param)

    return nnx.eval_shape(make) if abstract else make()


def _batch(case: Case, V: int, seed: int, num_generations: int):
    """Host arrays: prompts, completions, advantages, the noise of the old / reference log-probs."""
    import numpy as np

    rng = np.random.default_rng(seed)
    B, T, P = case.B, case.T, case.P
    prompt = rng.integers(2, V, (B, P))
    comp = rng.integers(2, V, (B, T))
    for b in range(B):
        prompt[b, : P - int(rng.integers(P // 2, P + 1))] = PAD_ID
        n = int(rng.integers(max(1, T // 4), T + 1))
        comp[b, n - 1] = EOS_ID
        comp[b, n:] = PAD_ID
    rewards = rng.normal(size=(B // num_generations, num_generations)) if B % num_generations == 0 else None
    if rewards is None:
        adv = rng.normal(size=B)
    else:
        adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)).reshape(B)
    return dict(
        prompt=prompt.astype("int32"),
        comp=comp.astype("int32"),
        adv=adv.astype("float32"),
        old_noise=(OLD_NOISE * rng.normal(size=(B, T))).astype("float32"),
        ref_noise=(REF_NOISE * rng.normal(size=(B, T))).astype("float32"),
    )


def _policy_logps(graphdef, state, prompt, comp):
    """The model's own per-token log-probs of ``comp`` (no gradient use): the integration's
    ``final_hidden_states`` and ``lm_head`` into ``gmpo_jax.fused_linear_logprobs`` (no dense logits)."""
    from flax import nnx

    import gmpo_jax
    from gmpo_jax.integrations import tunix as gtx

    model = nnx.merge(graphdef, state)
    hidden = gtx.final_hidden_states(model, prompt, comp, pad_id=PAD_ID, eos_id=EOS_ID)
    weight, layout = gtx.lm_head(model)
    head = gmpo_jax.HeadOptions(weight_layout=layout)
    return gmpo_jax.fused_linear_logprobs(
        hidden, weight.astype(hidden.dtype), comp, completion_mask=comp != PAD_ID, head=head
    )


def _example(model, host: dict[str, Any]):
    """Tunix's ``TrainExample``; old / reference log-probs = the model's own plus noise."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.rl.grpo.grpo_learner import TrainExample

    prompt, comp = jnp.asarray(host["prompt"]), jnp.asarray(host["comp"])
    mask = comp != PAD_ID
    graphdef, state = nnx.split(model)
    lp = jax.jit(functools.partial(_policy_logps, graphdef))(state, prompt, comp)
    return TrainExample(
        prompt_ids=prompt,
        prompt_mask=prompt != PAD_ID,
        completion_ids=comp,
        completion_mask=mask,
        advantages=jnp.asarray(host["adv"]),
        ref_per_token_logps=jnp.where(mask, lp + host["ref_noise"], 0.0),
        old_per_token_logps=jnp.where(mask, lp + host["old_noise"], 0.0),
    )


def _abstract_example(case: Case):
    import jax
    import jax.numpy as jnp
    from tunix.rl.grpo.grpo_learner import TrainExample

    B, T, P = case.B, case.T, case.P
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    return TrainExample(
        prompt_ids=s((B, P), jnp.int32),
        prompt_mask=s((B, P), jnp.bool_),
        completion_ids=s((B, T), jnp.int32),
        completion_mask=s((B, T), jnp.bool_),
        advantages=s((B,), jnp.float32),
        ref_per_token_logps=s((B, T), jnp.float32),
        old_per_token_logps=s((B, T), jnp.float32),
    )


def _train_step(loss_fn, algo_config, graphdef):
    """``step(state, example) -> (state, (loss, aux))``: Tunix's trainer step as a pure function of the
    split ``(model, optimizer)`` state (``peft_trainer._train_step``: value_and_grad, optimizer.update)."""
    from flax import nnx

    def step(state, example):
        model, optimizer = nnx.merge(graphdef, state)
        f = lambda m: loss_fn(m, example, algo_config=algo_config, pad_id=PAD_ID, eos_id=EOS_ID)  # noqa: E731
        (loss, aux), grads = nnx.value_and_grad(f, has_aux=True)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), (loss, {k: aux[k] for k in ("kl", "pg_clipfrac")})

    return step


def _grad_fn(loss_fn, algo_config, graphdef):
    """``grads(params, rest, example) -> (loss, grads)`` over every ``nnx.Param`` of the model."""
    import jax
    from flax import nnx

    def value_and_grad(params, rest, example):
        def f(params):
            model = nnx.merge(graphdef, params, rest)
            return loss_fn(model, example, algo_config=algo_config, pad_id=PAD_ID, eos_id=EOS_ID)[0]

        return jax.value_and_grad(f)(params)

    return value_and_grad


class _Backends(logging.Handler):
    """Collects the implementation names gmpo_jax's dispatch logs (``implementation=NAME``) while tracing."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.names: list[str] = []

    def emit(self, record):
        m = re.search(r"implementation=([\w']+)", record.getMessage())
        if m and m.group(1).strip("'") not in self.names:
            self.names.append(m.group(1).strip("'"))


def _trace_backends(fn):
    """``(fn(), backends gmpo_jax dispatched to while fn ran)``."""
    logger = logging.getLogger("gmpo_jax")
    handler, level, propagate = _Backends(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        return fn(), ",".join(handler.names) or None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _base(case: Case, impl: str, kind: str, dtype: str) -> dict[str, Any]:
    import jax

    from benchmarks import jax_impls

    _, cfg = model_config(case, dtype)
    device = jax_impls.device_kind()
    return {
        "kind": kind,
        "impl": impl,
        "config": case.name,
        "model": MODELS[case.model][1],
        "B": case.B,
        "T": case.T,
        "P": case.P,
        "H": cfg.embed_dim,
        "V": cfg.vocab_size,
        "layers": cfg.num_layers,
        "remat": case.remat,
        "dtype": dtype,
        "algo": "GRPOConfig(num_generations=4, beta=0.04, kl_loss_mode='low_var_kl'), sequence-mean-token-mean, "
        "old and reference log-probs given; AdamW; state donated",
        "status": None,
        "device": _common.device_slug(device),
        "device_name": device,
        "jax": jax.__version__,
        "jaxlib": _common.pkg_version("jaxlib"),
        "flax": _common.pkg_version("flax"),
        "tunix": _common.pkg_version("google-tunix"),
        "date": _common.now_utc(),
        "commit": _common.git_commit(),
    }


def run_step(case: Case, impl: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Compile, warm up and time one training step of ``impl``; the record of it."""
    import jax
    from flax import nnx

    from benchmarks import jax_impls

    rec = _base(case, impl, "tunix_step", case.dtype)
    algo = _algo_config()
    model, optimizer = _build(case, case.dtype, opts["seed"])
    rec["params"] = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    example = _example(model, _batch(case, rec["V"], opts["seed"], algo.num_generations))
    graphdef, state = nnx.split((model, optimizer))
    del model, optimizer
    jax.block_until_ready((state, example))
    rec["prep_peak_bytes"] = jax_impls.peak_bytes()
    step = jax.jit(_train_step(_loss_fn(impl), algo, graphdef), donate_argnums=0)
    t0 = time.perf_counter()
    compiled, rec["fused_backend"] = _trace_backends(lambda: step.lower(state, example).compile())
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    ma = compiled.memory_analysis()
    for key in ("temp", "argument", "output", "alias"):
        rec[f"{key}_bytes"] = int(getattr(ma, f"{key}_size_in_bytes")) if ma is not None else None
    times = []
    for i in range(opts["warmup"] + opts["iters"]):
        t = time.perf_counter()
        state, (loss, aux) = compiled(state, example)
        jax.block_until_ready((state, loss))
        if i == 0:  # the initial parameters: the same for both implementations
            rec.update(loss=float(loss), kl=float(aux["kl"]), pg_clipfrac=float(aux["pg_clipfrac"]))
        if i >= opts["warmup"]:
            times.append(time.perf_counter() - t)
    stats = _common.timing_stats(times)
    rec.update(step_ms=stats["median_ms"], step_ms_min=stats["min_ms"], n_runs=stats["n_runs"])
    rec["peak_bytes"] = jax_impls.peak_bytes()
    rec["finite"] = bool(jax.numpy.isfinite(loss))
    rec["status"] = "ok"
    return rec


def run_check(case: Case, dtype: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Loss and parameter gradients of both implementations at ``dtype`` (one process, same parameters
    and batch); float32 at HIGHEST matmul precision, so both sides are float32-exact. The model runs with
    Tunix's ``RematConfig.DECODER``: the same gradients, and it should keep the float32 check's memory on
    the GPU down (Tunix's attention materialises every layer's ``[B, heads, L, L]`` scores). Not measured
    yet: the CPU compile's memory analysis gives ~95 GiB of temporaries for Qwen2.5-0.5B at 8 x 1280 with
    or without the remat, so it says nothing of the GPU's schedule."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rec = _base(case, "gmpo_jax_fused_vs_tunix_grpo", "tunix_grad_check", dtype)
    rec["check_remat"] = "decoder"
    algo = _algo_config()
    exact = jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()
    with exact:
        model, _ = _build(dataclasses.replace(case, remat="decoder"), dtype, opts["seed"])
        example = _example(model, _batch(case, rec["V"], opts["seed"], algo.num_generations))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        out = {}
        for impl in IMPLS:
            fn = jax.jit(_grad_fn(_loss_fn(impl), algo, graphdef))
            out[impl], backend = _trace_backends(lambda fn=fn: jax.block_until_ready(fn(params, rest, example)))
            if impl == "gmpo_jax_fused":
                rec["fused_backend"] = backend
    (loss_t, g_t), (loss_f, g_f) = out["tunix_grpo"], out["gmpo_jax_fused"]
    f32 = lambda g: [x.astype(jnp.float32) for x in jax.tree.leaves(g)]  # noqa: E731
    a, b = f32(g_t), f32(g_f)
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b))
    den = sum(float(jnp.sum(x**2)) for x in a)
    leaf = max(float(jnp.max(jnp.abs(x - y))) / max(float(jnp.max(jnp.abs(x))), 1e-30) for x, y in zip(a, b))
    rec.update(
        loss_tunix=float(loss_t),
        loss_fused=float(loss_f),
        loss_abs_err=abs(float(loss_f) - float(loss_t)),  # the GRPO loss is near 0 (zero-mean advantages)
        loss_rel_err=abs(float(loss_f) - float(loss_t)) / max(abs(float(loss_t)), 1e-30),
        grad_rel_err=(num / den) ** 0.5 if den > 0 else None,
        grad_max_err=leaf,
        grad_norm=den**0.5,
        status="ok",
    )
    return rec


def build_only(case: Case, compile_steps: bool = False) -> list[str]:
    """Trace both training steps (lowered), the float32 check's gradients and the log-prob pass at the
    case's shapes, on abstract parameters (nothing allocated): catches shape and API errors before a
    device run. Returns a line per traced function group. ``compile_steps``: also compile both steps for
    this machine's backend and report their compiled memory analysis (temporaries: what the step allocates
    beyond its arguments; on the CPU a property of the CPU program, not a GPU measurement)."""
    import jax
    from flax import nnx

    algo = _algo_config()
    model, optimizer = _build(case, case.dtype, 0, abstract=True)
    graphdef, state = nnx.split((model, optimizer))
    example = _abstract_example(case)
    lines = []
    for impl in IMPLS:
        step = jax.jit(_train_step(_loss_fn(impl), algo, graphdef), donate_argnums=0)
        t0 = time.perf_counter()
        lowered, backend = _trace_backends(lambda step=step: step.lower(state, example))
        out = jax.tree.leaves(lowered.out_info)
        lines.append(
            f"{case.name} {impl}: lowered in {time.perf_counter() - t0:.1f}s ({len(out)} outputs; "
            f"gmpo_jax backend here: {backend})"
        )
        if compile_steps:
            t0 = time.perf_counter()
            ma = lowered.compile().memory_analysis()
            lines.append(
                f"{case.name} {impl}: compiled for {jax.default_backend()} in {time.perf_counter() - t0:.1f}s; "
                f"temp {_gib(ma.temp_size_in_bytes)} GiB, arguments {_gib(ma.argument_size_in_bytes)} GiB"
            )
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    f32_model, _ = _build(dataclasses.replace(case, remat="decoder"), "float32", 0, abstract=True)  # the check's
    g32, params32, rest32 = nnx.split(f32_model, nnx.Param, ...)
    for impl in IMPLS:
        loss, grads = jax.eval_shape(_grad_fn(_loss_fn(impl), algo, g32), params32, rest32, example)
        assert loss.shape == () and len(jax.tree.leaves(grads)) == len(jax.tree.leaves(params32))
    lines.append(f"{case.name}: {n_params / 1e6:.1f} M parameters; float32 gradient check traced for both")
    g, model_state = nnx.split(model)
    lp = jax.eval_shape(functools.partial(_policy_logps, g), model_state, example.prompt_ids, example.completion_ids)
    assert lp.shape == (case.B, case.T), lp.shape
    host = _batch(case, model_config(case, case.dtype)[1].vocab_size, 0, algo.num_generations)
    assert host["comp"].shape == (case.B, case.T) and host["prompt"].shape == (case.B, case.P)
    lines.append(f"{case.name} old / reference log-probs pass: traced, {lp.shape} {lp.dtype}")
    return lines


# ----------------------------------------------------------------------------------------------------
# Driver


def jobs_for(cases: list[Case], check_dtypes: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """The step jobs of every case (the measurement: a budget cut drops the tail first), then the
    gradient checks (float32 first: its grad_rel_err goes into the case's step records)."""
    jobs = [
        dict(kind="step", case=dataclasses.asdict(c), impl=impl, timeout_s=timeout_s) for c in cases for impl in IMPLS
    ]
    for dtype in sorted(check_dtypes, key=lambda d: d != "float32"):
        jobs += [dict(kind="check", case=dataclasses.asdict(c), dtype=dtype, timeout_s=timeout_s) for c in cases]
    return jobs


def _label(job: dict[str, Any]) -> str:
    c = job["case"]
    what = f"check {job['dtype']}" if job["kind"] == "check" else f"{job['impl']} {c['dtype']}"
    remat = "" if c["remat"] == "none" else f" remat={c['remat']}"
    return f"{c['name']} B={c['B']} T={c['T']} P={c['P']}{remat} {what}"


def execute(job: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """A worker: runs one job and emits its record."""
    case = Case(**job["case"])
    try:
        rec = run_check(case, job["dtype"], opts) if job["kind"] == "check" else run_step(case, job["impl"], opts)
    except Exception as e:  # an allocation failure is a result: a record with its status
        kind, impl = ("tunix_grad_check", "gmpo_jax_fused_vs_tunix_grpo") if job["kind"] == "check" else ("", "")
        rec = _base(case, impl or job["impl"], kind or "tunix_step", job.get("dtype") or case.dtype)
        rec.update(status=_common.classify_error(e), error=_common.short_error(e))
    _common.emit(rec)
    return rec


def _placeholder(job: dict[str, Any], status: str, device: str | None) -> dict[str, Any]:
    c = job["case"]
    check = job["kind"] == "check"
    return {
        "kind": "tunix_grad_check" if check else "tunix_step",
        "impl": "gmpo_jax_fused_vs_tunix_grpo" if check else job["impl"],
        "config": c["name"],
        "remat": c["remat"],
        "B": c["B"],
        "T": c["T"],
        "P": c["P"],
        "dtype": job.get("dtype") or c["dtype"],
        "status": status.split(" ")[0],
        "error": status,
        "device": device,
        "date": _common.now_utc(),
        "commit": _common.git_commit(),
    }


def run_jobs(jobs, opts, budget_s: float | None, log_path: str | None, results: str | None) -> list[dict]:
    """Each job in its own process, within the budget. Records are appended to ``results`` as they come,
    except the step records: they wait for their configuration's float32 check, whose ``grad_rel_err``
    they then carry (written at the end of the run at the latest). Budget-skipped jobs are only shown."""
    t0, records, device = time.perf_counter(), [], None
    pending: dict[str, list[dict[str, Any]]] = {}  # config -> its step records
    log = open(log_path, "a", encoding="utf-8") if log_path else None

    def write(recs):
        if results:
            _common.append_jsonl(results, [r for r in recs if not r["status"].startswith("skipped")])

    for job in jobs:
        elapsed = time.perf_counter() - t0
        timeout = job["timeout_s"]
        if budget_s is not None:
            timeout = min(timeout, budget_s - elapsed)
            if timeout < 15:
                print(f"[tunix_bench] skip {_label(job)}: budget spent", flush=True)
                records.append(_placeholder(job, "skipped (budget)", device))
                continue
        print(f"[tunix_bench] {elapsed:6.1f}s  {_label(job)}  (timeout {timeout:.0f}s)", flush=True)
        recs, status, secs = _common.run_child("benchmarks.tunix_bench", job, opts, _label(job), timeout, log)
        recs = recs or [_placeholder(job, status, device)]
        for r in recs:
            device = device or r.get("device")
            print(f"[tunix_bench]   {_summary(r)} ({secs:.1f}s)", flush=True)
            records.append(r)
            if r["kind"] == "tunix_step":
                pending.setdefault(r["config"], []).append(r)
                continue
            write([r])
            if r["dtype"] == "float32":
                steps = pending.pop(r["config"], [])
                if r["status"] == "ok":
                    for step in steps:
                        step.update(
                            grad_rel_err=r["grad_rel_err"], grad_max_err=r["grad_max_err"], grad_check="float32"
                        )
                write(steps)
    write([r for steps in pending.values() for r in steps])
    if log:
        log.close()
    return records


def _gib(x) -> str:
    return "-" if x is None else f"{x / _common.GIB:.3g}"


def _summary(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r['impl']} {r['config']}: {r.get('status')} {r.get('error', '')}"
    if r["kind"] == "tunix_grad_check":
        return (
            f"check {r['dtype']} {r['config']}: loss {r['loss_tunix']:.6g} vs {r['loss_fused']:.6g} "
            f"(abs {r['loss_abs_err']:.1e}), grad rel err {r['grad_rel_err']:.1e}, max leaf {r['grad_max_err']:.1e}"
        )
    return (
        f"{r['impl']} {r['config']}: {r['step_ms']:.4g} ms, peak {_gib(r['peak_bytes'])} GiB, "
        f"temp {_gib(r['temp_bytes'])} GiB, loss {r['loss']:.6g}, backend {r.get('fused_backend')}"
    )


def report(records: list[dict[str, Any]]) -> str:
    """A markdown table: per configuration and implementation, the step time, memory and agreement, and
    the fused step's ratios to Tunix's (the last record of each wins)."""
    steps: dict[tuple, dict] = {}
    checks: dict[tuple, dict] = {}
    for r in records:
        key = (r.get("device"), r["config"], r.get("remat", "none"), r["B"], r["T"], r["P"], r["dtype"])
        if r.get("kind") == "tunix_step":
            steps[key + (r["impl"],)] = r
        elif r.get("kind") == "tunix_grad_check":
            checks[key] = r
    lines = [
        "| device | config | B x T (+P) | dtype | impl | backend | step ms | peak GiB | temp GiB | loss | "
        "grad rel err (f32) | x Tunix time / peak / temp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in steps.items():
        base = steps.get(key[:-1] + ("tunix_grpo",))
        check = checks.get(key[:-2] + ("float32",))
        ratio = "-"
        if r["impl"] != "tunix_grpo" and base and r.get("status") == base.get("status") == "ok":
            parts = [
                f"{r[k] / base[k]:.2f}" if r.get(k) and base.get(k) else "-"
                for k in ("step_ms", "peak_bytes", "temp_bytes")
            ]
            ratio = " / ".join(parts)
        ok = r.get("status") == "ok"
        err = check.get("grad_rel_err") if check and check.get("status") == "ok" else None
        loss = format(r["loss"], ".6g") if ok else "-"
        err = "-" if err is None else format(err, ".1e")
        config = r["config"] + ("" if r.get("remat", "none") == "none" else f" remat={r['remat']}")
        lines.append(
            f"| {r.get('device')} | {config} | {r['B']} x {r['T']} (+{r['P']}) | {r['dtype']} | {r['impl']} | "
            f"{r.get('fused_backend') or '-'} | {format(r['step_ms'], '.4g') if ok else r.get('status')} | "
            f"{_gib(r.get('peak_bytes'))} | {_gib(r.get('temp_bytes'))} | {loss} | {err} | {ratio} |"
        )
    for c in checks.values():
        if c["dtype"] != "float32" and c.get("status") == "ok":
            lines.append(
                f"\n{c['config']} at {c['dtype']}: loss abs err {c['loss_abs_err']:.1e}, "
                f"grad rel err {c['grad_rel_err']:.1e} (backend {c.get('fused_backend')})"
            )
    return "\n".join(lines)


def _split(values: list[str] | None) -> list[str]:
    return [x.strip() for v in values or [] for x in v.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tunix_bench",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="configurations (default cpu)")
    p.add_argument("--B", type=int, help="sequences (default: the preset's)")
    p.add_argument("--T", type=int, help="completion tokens per sequence")
    p.add_argument("--P", "--prompt-len", dest="P", type=int, help="prompt tokens per sequence")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="params and activations of the timed step")
    p.add_argument(
        "--remat", choices=("none", "block", "decoder"), help="Tunix's RematConfig of the model (default none)"
    )
    p.add_argument(
        "--check-dtypes",
        default="float32",
        help="dtypes of the gradient check, comma-separated; 'none' skips it (default float32)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default 2, >= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="JSONL to append the records to")
    p.add_argument("--log", help="append every job's output here")
    p.add_argument("--table", help="also write the markdown table to this file")
    p.add_argument("--budget-s", type=float, help="start no job after this many seconds (jobs are cut to it)")
    p.add_argument("--timeout-s", type=float, help="per-job timeout (default 120 s on the CPU preset, else 150 s)")
    p.add_argument("--dry-run", action="store_true", help="list the jobs and exit")
    p.add_argument("--build-only", action="store_true", help="trace the steps at the preset's shapes (no run)")
    p.add_argument(
        "--compile", action="store_true", help="with --build-only: also compile both steps, print their memory analysis"
    )
    p.add_argument("--report", metavar="JSONL", help="print the markdown table of these records and exit")
    _common.add_worker_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _common.worker_main(args, execute):
        return 0
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            print(report([json.loads(line) for line in f if line.strip()]))
        return 0
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the first step's loss is recorded)")
    over = {k: getattr(args, k) for k in ("B", "T", "P", "layers", "dtype", "remat") if getattr(args, k) is not None}
    cases = [dataclasses.replace(c, **over) for c in PRESETS[args.preset]]
    if args.build_only:
        for case in cases:
            for line in build_only(case, compile_steps=args.compile):
                print(line, flush=True)
        return 0
    check_dtypes = [] if args.check_dtypes == "none" else _split([args.check_dtypes])
    timeout = args.timeout_s or TIMEOUT_S["cpu" if args.preset == "cpu" else "gpu"]
    jobs = jobs_for(cases, check_dtypes, timeout)
    if args.dry_run:
        for job in jobs:
            print(f"{_label(job):70s} timeout {job['timeout_s']:.0f}s")
        return 0
    opts = dict(iters=args.iters, warmup=args.warmup, seed=args.seed)
    records = run_jobs(jobs, opts, args.budget_s, args.log, args.results)
    text = report(records)
    print("\n" + text, flush=True)
    if args.table:
        with open(args.table, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
