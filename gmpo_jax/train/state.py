"""The training state of a `Plan`: the policy, its frozen reference and the optimizer.

`build_model` makes the policy (the toy `Transformer`, or Tunix's Qwen3 via `gmpo_jax.train.qwen3`);
`make_optimizer` wraps it in an ``nnx.Optimizer`` (global-norm clipping, AdamW,
`learning_rate_schedule`: linear warmup then cosine decay or constant); `build_state` builds all three for
a run and places them on the ``--mesh`` when there is one. `gmpo_jax.train.checkpoint` saves and restores
what these build.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx

from gmpo_jax.train.config import TrainConfig
from gmpo_jax.train.model import Transformer
from gmpo_jax.train.plan import Plan

__all__ = ["build_model", "build_state", "learning_rate_schedule", "make_optimizer"]


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


def build_state(p: Plan):
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
