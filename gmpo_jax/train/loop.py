"""The on-policy RL loop: rollout -> reward -> advantages -> fused-loss updates -> metrics, checkpoints, plots.

One step of `train`:

1. ``num_prompts`` prompts from ``np.random.default_rng([seed, step])``, each repeated ``G`` times;
2. `rollout.sample_completions` (jit, KV cache) with the key ``fold_in(PRNGKey(seed), step)``;
3. host rewards of the decoded completions (`tasks.Task.rewards`) and `rollout.group_advantages`;
4. ``old_logps`` of the behaviour policy when ``num_iterations > 1`` and ``ref_logps`` of the frozen
   initial policy when ``beta > 0``, both via ``gmpo_jax.fused_linear_logprobs``;
5. ``num_iterations`` calls of `train_step`: ``nnx.value_and_grad`` of `policy_loss`, which feeds the
   policy's final hidden states and its LM-head weight to ``gmpo_jax.fused_linear_policy_loss``; then
   ``optimizer.update`` (AdamW, global-norm clipping, warmup + cosine schedule);
6. one JSON line of metrics, the progress bar, periodic orbax checkpoints.

With ``--model qwen3`` the policy is a `gmpo_jax.train.qwen3.Qwen3Policy` (Tunix's Qwen3): step 2 runs its
layers against Tunix's KV cache, steps 4-5 take its hidden states and LM head from
``gmpo_jax.integrations.tunix``, and `Plan.tokens` maps the task's characters to its vocabulary.

With ``--mesh data=D,model=M`` (`gmpo_jax.train.parallel`) the policy and optimizer state are placed on a
``(D, M)`` mesh (replicated; the LM head split along its vocabulary when ``V % M == 0``), every rollout
batch is split over ``data``, and steps 4-5 call the fused functions with ``sharding=MeshAxes(...)`` (and
``HeadOptions(vocab_size=...)`` when the head is padded to a multiple of ``M``).

``metrics.jsonl`` keys, one line per step: ``step``; ``reward_mean`` / ``reward_std`` over the batch;
``exact_match`` (fraction of exact answers; NaN for a hook task without answers); ``completion_length``
(mean unmasked tokens) and ``eos_fraction``; ``loss``, ``kl``, ``clip_fraction``, ``clip_fraction_low``,
``clip_fraction_high``, ``grad_norm`` (means over the ``num_iterations`` updates); ``log_ratio_min`` /
``log_ratio_max`` (extremes of the token log importance ratio over those updates; 0 when on-policy);
``lr``; ``tokens`` (``batch_size * (P + T)``, prompt and completion slots of the batch);
``rollout_time_s``, ``update_time_s``, ``step_time_s`` (wall clock; step 1 includes compilation) and
``tokens_per_s = tokens / step_time_s``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gmpo_jax
from gmpo_jax.train import parallel
from gmpo_jax.train import rollout as rollout_lib
from gmpo_jax.train.config import ConfigError, TrainConfig, make_objective
from gmpo_jax.train.model import Transformer
from gmpo_jax.train.tasks import TOKENIZER, Task, TokenMap, make_task

__all__ = ["Plan", "TrainResult", "plan", "build_model", "make_optimizer", "training_loss", "train_step", "train"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything resolved from a `TrainConfig` before any JAX compilation.

    Attributes:
      config: the validated configuration.
      task: the resolved `Task`.
      max_completion_length: ``T``.
      vocab_size: ``V`` of the policy (>= the tokenizer's).
      objective: the ``gmpo_jax`` objective (static, hashable).
      train_mesh: the `parallel.TrainMesh` of ``--mesh`` (static, hashable), or None (one device).
      tokens: the `TokenMap` from task tokens to policy ids (identity unless a checkpoint says otherwise).
      architecture: ``--model qwen3``: Tunix ``ModelConfig`` keyword arguments (from ``--checkpoint``'s
        config.json or `gmpo_jax.train.qwen3.architecture`); None for the toy model.
    """

    config: TrainConfig
    task: Task
    max_completion_length: int
    vocab_size: int
    objective: Any
    train_mesh: Any = None
    tokens: TokenMap = dataclasses.field(default_factory=TokenMap.identity)
    architecture: dict | None = None

    @property
    def max_len(self) -> int:
        """Longest sequence, ``P + T``."""
        return self.task.prompt_length + self.max_completion_length


def plan(config: TrainConfig) -> Plan:
    """Validate ``config`` and resolve task, lengths, objective and mesh; nothing compiles.

    Raises:
      ConfigError: one-line message naming the offending ``--option``.
    """
    config.validate()
    try:
        task = make_task(
            config.task, digits=config.digits, partial_credit=config.partial_credit, prompt_task=config.prompt_task
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = config.max_completion_length or task.answer_length + 1
    tokens, arch = TokenMap.identity(), None
    if config.model == "qwen3" and config.checkpoint is not None:
        from gmpo_jax.train import qwen3

        info = qwen3.read_checkpoint(config.checkpoint)
        arch, tokens = info.architecture, qwen3.checkpoint_token_map(info)
        vocab = arch["vocab_size"]
    else:
        vocab = config.vocab_size or TOKENIZER.vocab_size
        if vocab < TOKENIZER.vocab_size:
            raise ConfigError(f"--vocab-size must be >= the tokenizer's {TOKENIZER.vocab_size}, got {vocab}")
        if config.model == "qwen3":
            from gmpo_jax.train import qwen3

            arch = qwen3.architecture(config, vocab)
    shape = config.mesh_shape()
    train_mesh = None if shape is None else parallel.make_train_mesh(*shape)
    return Plan(config, task, t, vocab, make_objective(config, t), train_mesh, tokens, arch)


def build_model(p: Plan, seed: int | None = None):
    """The policy of plan ``p``, initialised from ``seed`` (default ``p.config.seed``).

    Returns:
      ``--model toy``: a `Transformer`; ``--model qwen3``: a `gmpo_jax.train.qwen3.Qwen3Policy`, loaded
      from ``--checkpoint`` (``seed`` unused) or randomly initialised.
    """
    c = p.config
    seed = c.seed if seed is None else seed
    if c.model == "qwen3":
        from gmpo_jax.train import qwen3

        return qwen3.build_policy(p.architecture, dtype=c.dtype, seed=seed, checkpoint=c.checkpoint)
    return Transformer(
        p.vocab_size,
        p.max_len,
        c.d_model,
        c.n_layers,
        c.n_heads,
        c.d_ff,
        tie_embeddings=c.tie_embeddings,
        dtype=jnp.dtype(c.dtype),
        rngs=nnx.Rngs(seed),
    )


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup over ``warmup_steps`` updates, then cosine decay to 10% (or constant)."""
    total = config.steps * config.num_iterations
    warmup = min(config.warmup_steps, max(total - 1, 0))
    if config.lr_schedule == "constant":
        return optax.warmup_constant_schedule(0.0, config.learning_rate, max(warmup, 1))
    return optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, max(warmup, 1), max(total, warmup + 1), end_value=0.1 * config.learning_rate
    )


def make_optimizer(config: TrainConfig, model: Transformer) -> nnx.Optimizer:
    """``nnx.Optimizer`` over the policy's ``nnx.Param``: global-norm clipping then AdamW with the schedule."""
    tx = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(learning_rate_schedule(config), b2=config.adam_b2, weight_decay=config.weight_decay),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def training_loss(
    model: Transformer,
    batch: rollout_lib.RolloutBatch,
    objective,
    *,
    temperature: float = 1.0,
    train_mesh: parallel.TrainMesh | None = None,
):
    """The training loss: ``gmpo_jax.fused_linear_policy_loss`` on the policy's completion hidden states.

    Args:
      model: the policy.
      batch: a `rollout.RolloutBatch` (``N`` completions of ``T`` tokens).
      objective: ``GMPO(...)``, ``GRPO(...)``, ``CISPO(...)`` or ``SAPO(...)``.
      temperature: the sampling temperature (log-probs of the distribution that was sampled).
      train_mesh: None (one device) or the ``--mesh`` `parallel.TrainMesh`: the fused loss runs sharded
        over its data / vocabulary axes (the head zero-padded to a multiple of ``M``, ``HeadOptions(vocab_size=V)``).

    Returns:
      ``(loss f32[], aux: gmpo_jax.LossAux)``; differentiable with respect to the policy's parameters.
    """
    hidden = rollout_lib.completion_hidden(model, batch.prompt_ids, batch.completion_ids)
    weight, layout = rollout_lib.head_weight(model, hidden.dtype)
    weight, head, axes = parallel.fused_head(weight, layout, train_mesh)
    policy_batch = gmpo_jax.PolicyBatch(
        batch.completion_ids,
        batch.completion_mask,
        batch.advantages,
        old_logps=batch.old_logps,
        ref_logps=batch.ref_logps,
    )
    return gmpo_jax.fused_linear_policy_loss(
        hidden, weight, policy_batch, objective=objective, temperature=temperature, head=head, sharding=axes
    )


@nnx.jit(static_argnames=("objective", "temperature", "train_mesh"))
def train_step(
    model: Transformer,
    optimizer: nnx.Optimizer,
    batch: rollout_lib.RolloutBatch,
    objective,
    temperature: float = 1.0,
    train_mesh: parallel.TrainMesh | None = None,
) -> dict:
    """One optimizer update on ``batch`` (compiled; updates ``model`` and ``optimizer`` in place).

    Returns:
      dict of float32 scalars: ``loss``, the ``LossAux`` fields (``kl``, ``clip_fraction``,
      ``clip_fraction_low``, ``clip_fraction_high``, ``log_ratio_min``, ``log_ratio_max``, ...) and
      ``grad_norm`` (before clipping).
    """

    def loss_fn(m):
        return training_loss(m, batch, objective, temperature=temperature, train_mesh=train_mesh)

    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return {"loss": loss, **aux._asdict(), "grad_norm": optax.tree.norm(grads)}


@dataclasses.dataclass
class TrainResult:
    """What `train` returns.

    Attributes:
      config: the configuration run. run_dir: its output folder.
      history: one metrics dict per step (also in ``run_dir/metrics.jsonl``).
      summary: steps, wall time, steps/s and tokens/s after compilation, mean reward of the first and
        last 10 steps.
      model: the trained policy. optimizer: its optimizer.
    """

    config: TrainConfig
    run_dir: str
    history: list
    summary: dict
    model: Any = None
    optimizer: Any = None


_STEP_KEYS_MEAN = ("loss", "kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "grad_norm")


def _rollout(p: Plan, model, ref_model, step: int):
    """Steps 1-4 of the module docstring; returns the batch and host-side stats."""
    c = p.config
    rng = np.random.default_rng([c.seed, step])
    prompts = p.task.make_prompts(rng, c.num_prompts)
    prompts = [q for q in prompts for _ in range(c.group_size)]
    tokens = p.tokens
    prompt_ids = jnp.asarray(tokens.encode_batch(prompts))
    tm = p.train_mesh
    if tm is not None:
        prompt_ids = tm.put_batch(prompt_ids)
    key = jax.random.fold_in(jax.random.PRNGKey(c.seed), step)
    ids, mask = rollout_lib.sample_completions(
        model,
        prompt_ids,
        key,
        jnp.float32(c.temperature),
        max_new_tokens=p.max_completion_length,
        top_p=float(c.top_p),
        eos_id=tokens.eos_id,
        pad_id=tokens.pad_id,
    )
    ids_np = np.asarray(ids)
    completions = [tokens.decode(row) for row in ids_np]
    rewards = p.task.rewards(prompts, completions)
    adv = rollout_lib.group_advantages(rewards, c.group_size, scale=c.scale_rewards)
    old = ref = None
    adv = jnp.asarray(adv)
    if tm is not None:
        ids, mask, adv = tm.put_batch((ids, mask, adv))
    logprob_kw = dict(temperature=float(c.temperature), **({} if tm is None else {"train_mesh": tm}))
    if c.num_iterations > 1:
        old = rollout_lib.policy_logprobs(model, prompt_ids, ids, mask, **logprob_kw)
    if c.beta > 0:
        ref = rollout_lib.policy_logprobs(ref_model, prompt_ids, ids, mask, **logprob_kw)
    batch = rollout_lib.RolloutBatch(prompt_ids, ids, mask, adv, old, ref)
    if tm is not None:
        batch = tm.put_batch(batch)
    mask_np = np.asarray(mask)
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "exact_match": p.task.exact_match(prompts, completions),
        "completion_length": float(mask_np.sum(axis=1).mean()),
        "eos_fraction": float(np.mean(np.any(ids_np == tokens.eos_id, axis=1))),
        "sample": f"{prompts[0]}{completions[0]}",
    }
    return batch, stats


def _update(p: Plan, model, optimizer, batch) -> dict:
    """Step 5: ``num_iterations`` compiled updates; metrics averaged (ratio range: min / max)."""
    kw = {} if p.train_mesh is None else {"train_mesh": p.train_mesh}
    outs = [
        train_step(model, optimizer, batch, p.objective, temperature=float(p.config.temperature), **kw)
        for _ in range(p.config.num_iterations)
    ]
    outs = jax.device_get(outs)
    m = {k: float(np.mean([o[k] for o in outs])) for k in _STEP_KEYS_MEAN}
    m["log_ratio_min"] = float(min(o["log_ratio_min"] for o in outs))
    m["log_ratio_max"] = float(max(o["log_ratio_max"] for o in outs))
    return m


def _read_history(path: str, upto: int) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def _summarise(history: list, new_rows: list, wall: float) -> dict:
    """Reward of the first / last 10 steps of ``history``; throughput of ``new_rows`` minus the first
    (compiling) step of this invocation."""
    k = min(10, len(history))
    timed = new_rows[1:]
    t = sum(h["step_time_s"] for h in timed)
    tok = sum(h["tokens"] for h in timed)

    def mean(key, rows):
        return float(np.mean([h[key] for h in rows])) if rows else float("nan")

    return {
        "steps": len(history),
        "new_steps": len(new_rows),
        "wall_time_s": wall,
        "first_step_s": new_rows[0]["step_time_s"] if new_rows else float("nan"),
        "steps_per_s": len(timed) / t if t > 0 else float("nan"),
        "tokens_per_s": tok / t if t > 0 else float("nan"),
        "reward_first10": mean("reward_mean", history[:k]),
        "reward_last10": mean("reward_mean", history[len(history) - k :]),
        "exact_first10": mean("exact_match", history[:k]),
        "exact_last10": mean("exact_match", history[len(history) - k :]),
    }


def train(config: TrainConfig, *, log=None) -> TrainResult:
    """Run the RL loop of the module docstring for ``config.steps`` steps.

    Writes ``config.json``, ``metrics.jsonl`` (one line per step), ``checkpoints/`` (orbax) and, with
    ``config.plots``, ``training.png`` under ``config.run_dir``. Without ``config.resume`` an existing
    run folder's metrics and checkpoints are replaced; with it, the newest checkpoint is loaded and the
    run continues from its step (an absent checkpoint starts afresh).

    Args:
      config: the run configuration (validated here).
      log: ``print``-like callable for the end-of-run summary; None = ``tqdm.write`` to stderr when
        ``config.progress`` else silent.

    Returns:
      A `TrainResult`.

    Raises:
      ConfigError: invalid configuration (before anything compiles).
    """
    from tqdm.auto import tqdm

    from gmpo_jax.train.checkpoint import Checkpointer

    p = plan(config)
    c = p.config
    if log is None:
        log = (lambda s: tqdm.write(s, file=sys.stderr)) if c.progress else (lambda s: None)
    metrics_path, ckpt_dir = _prepare_run_dir(c)
    model, ref_model, optimizer = _build_state(p)
    ckpt = Checkpointer(ckpt_dir)
    start = 0
    if c.resume and ckpt.latest_step() is not None:
        start = int(ckpt.restore(model, optimizer)["step"])
        log(f"resumed {c.run_dir} at step {start}")
    history = _read_history(metrics_path, start)
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
    log(_describe(p, model))
    bar = tqdm(
        total=c.steps,
        initial=start,
        desc=c.run_name,
        unit="step",
        disable=not c.progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    schedule = learning_rate_schedule(c)
    t_start = time.perf_counter()
    new_rows, sample = [], ""
    with open(metrics_path, "a") as mf:
        for step in range(start, c.steps):
            row, sample = _train_step_row(p, model, ref_model, optimizer, step, schedule)
            if not all(math.isfinite(v) for k, v in row.items() if isinstance(v, float) and k != "exact_match"):
                log(f"warning: non-finite metric at step {step + 1}: {row}")
            mf.write(json.dumps(row) + "\n")
            mf.flush()
            new_rows.append(row)
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}",
                loss=f"{row['loss']:.3f}",
                clip=f"{row['clip_fraction']:.3f}",
                kl=f"{row['kl']:.4f}",
                refresh=False,
            )
            bar.update(1)
            if c.save_every and (step + 1) % c.save_every == 0 and step + 1 < c.steps:
                ckpt.save(step + 1, model, optimizer, {"config": json.loads(c.to_json())})
    bar.close()
    wall = time.perf_counter() - t_start
    if start < c.steps:
        ckpt.save(c.steps, model, optimizer, {"config": json.loads(c.to_json())})
    ckpt.close()
    history = history + new_rows
    summary = _finish(c, history, new_rows, wall, sample, log)
    return TrainResult(c, c.run_dir, history, summary, model, optimizer)


def _prepare_run_dir(c: TrainConfig) -> tuple[str, str]:
    """``(metrics.jsonl path, checkpoints dir)`` of the run folder, written ``config.json``; without
    ``resume`` the previous metrics and checkpoints are removed."""
    os.makedirs(c.run_dir, exist_ok=True)
    metrics_path = os.path.join(c.run_dir, "metrics.jsonl")
    ckpt_dir = os.path.join(c.run_dir, "checkpoints")
    if not c.resume:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
    with open(os.path.join(c.run_dir, "config.json"), "w") as f:
        f.write(c.to_json() + "\n")
    return metrics_path, ckpt_dir


def _build_state(p: Plan):
    """``(model, frozen reference or None, optimizer)``, placed on the training mesh when there is one
    (before a checkpoint is restored into them: it is read into the placed arrays' shardings)."""
    c = p.config
    model = build_model(p)
    ref_model = build_model(p) if c.beta > 0 else None  # frozen copy of the initial policy
    optimizer = make_optimizer(c, model)
    if p.train_mesh is not None:
        layout = "vh" if c.tie_embeddings else "hv"
        for module in (model, ref_model, optimizer):
            if module is not None:
                p.train_mesh.place_module(module, p.vocab_size, layout)
    return model, ref_model, optimizer


def _describe(p: Plan, model) -> str:
    """The run's one-line header: objective, task, policy size, batch, device, mesh."""
    c, tm = p.config, p.train_mesh
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if p.architecture is None:
        head = "tied nnx.Embed head (vh)" if c.tie_embeddings else "nnx.Linear head (hv)"
        policy = f"policy {n_params / 1e6:.2f}M params (H={c.d_model}, {c.n_layers} layers, V={p.vocab_size}, {head}"
    else:
        a = p.architecture
        origin = f"loaded from {c.checkpoint}" if c.checkpoint else "random init"
        policy = (
            f"Tunix Qwen3 {n_params / 1e6:.2f}M params, {origin} (H={a['embed_dim']}, {a['num_layers']} layers, "
            f"{a['num_heads']}/{a['num_kv_heads']} heads of {a['head_dim']}, MLP {a['hidden_dim']}, "
            f"V={a['vocab_size']}, {'tied' if a['use_tied_embedding'] else 'untied'} head; task tokens: "
            f"{p.tokens.source}"
        )
    return (
        f"{c.run_name}: {p.objective} on {p.task.name} | {policy}, {c.dtype}) | {c.batch_size} completions/step = "
        f"{c.num_prompts} prompts x {c.group_size}, T={p.max_completion_length}, {c.num_iterations} update(s) "
        f"per batch | {jax.devices()[0].device_kind}"
        f"{'' if tm is None else f' x {tm.data * tm.model}, {tm.describe()}'} | {c.steps} steps -> {c.run_dir}/"
    )


def _train_step_row(p: Plan, model, ref_model, optimizer, step: int, schedule) -> tuple[dict, str]:
    """One rollout and its updates: ``(metrics row, a decoded sample)``."""
    c = p.config
    tokens_per_step = c.batch_size * p.max_len
    t0 = time.perf_counter()
    batch, stats = _rollout(p, model, ref_model, step)
    t1 = time.perf_counter()
    upd = _update(p, model, optimizer, batch)
    t2 = time.perf_counter()
    row = {
        "step": step + 1,
        **{k: v for k, v in stats.items() if k != "sample"},
        **upd,
        "lr": float(schedule((step + 1) * c.num_iterations - 1)),
        "tokens": tokens_per_step,
        "rollout_time_s": t1 - t0,
        "update_time_s": t2 - t1,
        "step_time_s": t2 - t0,
        "tokens_per_s": tokens_per_step / (t2 - t0),
    }
    return row, stats["sample"]


def _finish(c: TrainConfig, history, new_rows, wall: float, sample: str, log) -> dict:
    """The run's summary (``summary.json``, the plot) and its closing log lines."""
    summary = _summarise(history, new_rows, wall)
    if c.plots and history:
        from gmpo_jax.train.plots import plot_history

        summary["plot"] = plot_history(history, os.path.join(c.run_dir, "training.png"), title=c.run_name)
    with open(os.path.join(c.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if new_rows:
        speed = (
            f"; after compilation {summary['steps_per_s']:.2f} steps/s, {summary['tokens_per_s']:,.0f} tokens/s"
            if len(new_rows) > 1
            else ""
        )
        log(
            f"{c.run_name}: {len(new_rows)} step(s) in {wall:.1f} s (first step, incl. compilation: "
            f"{summary['first_step_s']:.1f} s){speed}"
        )
    log(
        f"reward (mean of {min(10, summary['steps'])} steps): first {summary['reward_first10']:.3f} -> last "
        f"{summary['reward_last10']:.3f}; "
        f"exact answers {summary['exact_first10']:.1%} -> {summary['exact_last10']:.1%}"
        + (f"; last sample: {sample!r}" if sample else "")
    )
    plot = ", training.png" if "plot" in summary else ""
    log(f"outputs: {c.run_dir}/ (config.json, metrics.jsonl, summary.json, checkpoints/{c.steps}{plot})")
    return summary
