"""The training loss and the compiled optimizer update.

`training_loss` feeds the policy's completion hidden states and its LM-head weight (`gmpo_jax.train.rollout`)
to ``gmpo_jax.fused_linear_policy_loss``, sharded over the ``--mesh`` axes through
`gmpo_jax.train.parallel.fused_head`; `train_step` is one ``nnx.jit`` update: ``nnx.value_and_grad`` of
that loss, then ``optimizer.update``.
"""

from __future__ import annotations

import optax
from flax import nnx

import gmpo_jax
from gmpo_jax.train import parallel
from gmpo_jax.train import rollout as rollout_lib
from gmpo_jax.train.model import Transformer

__all__ = ["training_loss", "train_step"]


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
