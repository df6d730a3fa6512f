"""gmpo_jax: GMPO and GRPO-family policy losses fused with the LM head, for JAX / Flax.

The ``[tokens, vocab]`` logits are never materialised: a custom VJP scans over chunks of sequences,
computes log-probs with a vocabulary-blocked online log-sum-exp (Pallas Mosaic GPU kernels on Hopper
GPUs, portable XLA elsewhere) and stores the hidden-state and weight gradients as residuals.
"""

from gmpo_jax.api import LossAux, fused_linear_logprobs, fused_linear_policy_loss
from gmpo_jax.backends.base import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.flax_utils import lm_head_weight
from gmpo_jax.logits_loss import policy_loss_from_logits
from gmpo_jax.objectives import CISPO, GMPO, GRPO, SAPO
from gmpo_jax import reference

__version__ = "0.1.0"

__all__ = [
    "GMPO",
    "GRPO",
    "CISPO",
    "SAPO",
    "LossAux",
    "fused_linear_policy_loss",
    "fused_linear_logprobs",
    "policy_loss_from_logits",
    "lm_head_weight",
    "reference",
    "UnsupportedConfigError",
    "BackendUnavailableError",
]
