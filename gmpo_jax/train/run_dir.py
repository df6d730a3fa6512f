"""A run's folder: ``config.json``, the ``metrics.jsonl`` history, ``summary.json`` and the closing log lines.

`prepare_run_dir` writes ``config.json`` and, unless resuming, clears the previous metrics and
checkpoints; `read_history` reads back the metrics of the steps a resumed run keeps; `summarise` and
`finish` turn the history into ``summary.json`` (rewards of the first and last 10 steps, throughput after
compilation), the ``training.png`` plot (`gmpo_jax.train.plots`) and the end-of-run log lines.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from gmpo_jax.train.config import TrainConfig

__all__ = ["finish", "prepare_run_dir", "read_history", "summarise"]


def prepare_run_dir(c: TrainConfig) -> tuple[str, str]:
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


def read_history(path: str, upto: int) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def summarise(history: list, new_rows: list, wall: float) -> dict:
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


def finish(c: TrainConfig, history, new_rows, wall: float, sample: str, log) -> dict:
    """The run's summary (``summary.json``, the plot) and its closing log lines."""
    summary = summarise(history, new_rows, wall)
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
