"""The run plan: a `TrainConfig` resolved, before any JAX compilation, into what the run needs.

`plan` validates the configuration and resolves the task, the completion length ``T``, the vocabulary,
the ``gmpo_jax`` objective, the ``--mesh`` `parallel.TrainMesh`, the task-token map and, for ``--model
qwen3``, the architecture (from ``--checkpoint``'s config.json via `gmpo_jax.train.hf_checkpoint`, else
`gmpo_jax.train.qwen3.architecture`). Every later stage (`gmpo_jax.train.state`, `gmpo_jax.train.loop`)
reads the frozen `Plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gmpo_jax.train import parallel
from gmpo_jax.train.config import ConfigError, TrainConfig, make_objective
from gmpo_jax.train.tasks import TOKENIZER, Task, TokenMap, make_task

__all__ = ["Plan", "plan"]


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
        from gmpo_jax.train import hf_checkpoint

        info = hf_checkpoint.read_checkpoint(config.checkpoint)
        arch, tokens = info.architecture, hf_checkpoint.checkpoint_token_map(info)
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
