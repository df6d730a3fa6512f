"""GMPO training demo: a Flax NNX policy trained end to end with the fused GMPO loss (``gmpo-jax train``).

Data flow, one file per stage: `config` (options, presets, validation) -> `tasks` (prompts, rewards) ->
`plan` (the config resolved: task, lengths, objective, mesh) -> `model` (transformer returning hidden
states) -> `state` (policy, reference and optimizer built) -> `rollout` (KV-cache sampling, advantages,
log-probs) -> `step` (the fused training loss and the compiled update) -> `loop` (the steps, metrics,
checkpoints via `checkpoint`) -> `run_dir` (run folder, metrics history, summary) -> `plots`; `cli` is the
command line; `parallel` places a run on a ``--mesh data=D,model=M`` device mesh; `qwen3` replaces
`model` with Tunix's Qwen3 (``--model qwen3 [--checkpoint DIR]``: random init, or a Hugging Face
checkpoint read by `hf_checkpoint`).

Programmatic use::

    from gmpo_jax.train import TrainConfig, train
    result = train(TrainConfig(steps=20, progress=False, plots=False, output_dir="/tmp/run"))
    result.summary["reward_last10"]
"""

from gmpo_jax.train.config import ConfigError, TrainConfig, preset_config
from gmpo_jax.train.tasks import Task

__all__ = ["ConfigError", "Task", "TrainConfig", "TrainResult", "preset_config", "train"]


def __getattr__(name):  # lazy: importing the package (e.g. for the CLI's --help) does not import JAX
    if name in ("train", "TrainResult"):
        from gmpo_jax.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'gmpo_jax.train' has no attribute {name!r}")
