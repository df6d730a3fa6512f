"""gmpo_jax: GMPO and GRPO-family policy losses fused with the LM head, for JAX / Flax.

The ``[tokens, vocab]`` logits are never materialised: a custom VJP scans over chunks of sequences,
computes log-probs with a vocabulary-blocked online log-sum-exp (Pallas Mosaic GPU kernels on Hopper
GPUs, portable XLA elsewhere) and stores the hidden-state and weight gradients as residuals.

A call: ``fused_linear_policy_loss(hidden, weight, PolicyBatch(ids, mask, advantages, ...), objective=GMPO(),
head=HeadOptions(...))``: the per-token data in one pytree (``batch.py``), the loss and its shaping in the
objective (``objectives/``), how the LM head computes in one frozen option set (``options.py``).

Layout: ``objectives/`` (the losses on per-token log-probs), ``lm_head/`` and ``logits/`` (the two ops, built
alike), ``kernels/`` (their Pallas kernels), ``reference.py`` (dense oracles), ``train/`` (the demo).
"""

from gmpo_jax import reference
from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.batch import PolicyBatch, ReferenceHead
from gmpo_jax.flax_utils import lm_head_weight
from gmpo_jax.lm_head import fused_linear_logprobs, fused_linear_policy_loss
from gmpo_jax.logits import policy_loss_from_logits
from gmpo_jax.objectives import CISPO, GMPO, GRPO, SAPO, LossAux
from gmpo_jax.options import HeadOptions, MeshAxes

__version__ = "0.1.0"

__all__ = [
    "GMPO",
    "GRPO",
    "CISPO",
    "SAPO",
    "LossAux",
    "PolicyBatch",
    "ReferenceHead",
    "HeadOptions",
    "MeshAxes",
    "fused_linear_policy_loss",
    "fused_linear_logprobs",
    "policy_loss_from_logits",
    "lm_head_weight",
    "reference",
    "UnsupportedConfigError",
    "BackendUnavailableError",
]
