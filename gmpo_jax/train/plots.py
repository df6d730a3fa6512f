"""Headless (matplotlib Agg) plots of a run's per-step metrics."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plot_history"]


def plot_history(history: Sequence[dict], path: str, *, title: str | None = None) -> str:
    """Save a 2 x 3 figure of a run: reward, loss, clip fractions, KL, token log-ratio range, throughput.

    Args:
      history: per-step metric dicts as written to ``metrics.jsonl`` (keys ``step``, ``reward_mean``,
        ``reward_std``, ``exact_match``, ``loss``, ``clip_fraction[_low|_high]``, ``kl``,
        ``log_ratio_min``, ``log_ratio_max``, ``tokens_per_s``).
      path: PNG file to write.
      title: figure title.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def col(key):
        return np.array([h.get(key, np.nan) for h in history], dtype=float)

    step = col("step")
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), constrained_layout=True)
    ax = axes[0, 0]
    mean, std = col("reward_mean"), col("reward_std")
    ax.plot(step, mean, label="reward mean")
    ax.fill_between(step, mean - std, mean + std, alpha=0.2, label="± std")
    ax.plot(step, col("exact_match"), label="exact-answer fraction")
    ax.set_title("reward")
    ax.legend(fontsize=8)
    axes[0, 1].plot(step, col("loss"))
    axes[0, 1].set_title("loss")
    ax = axes[0, 2]
    for key in ("clip_fraction", "clip_fraction_low", "clip_fraction_high"):
        ax.plot(step, col(key), label=key)
    ax.set_title("clipped token fraction")
    ax.legend(fontsize=8)
    axes[1, 0].plot(step, col("kl"))
    axes[1, 0].set_title("KL to the initial policy (k3; 0 when beta = 0)")
    ax = axes[1, 1]
    lo, hi = col("log_ratio_min"), col("log_ratio_max")
    ax.fill_between(step, lo, hi, alpha=0.3)
    ax.plot(step, lo, lw=0.8)
    ax.plot(step, hi, lw=0.8)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_title("token log importance ratio, min / max")
    axes[1, 2].plot(step, col("tokens_per_s"))
    axes[1, 2].set_title("tokens / s (step 1 includes compilation)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
