"""Policy objectives on per-token log-probs: GMPO and the GRPO family.

Each objective is a frozen dataclass registered as a JAX pytree: its numeric hyper-parameters
(epsilons, beta, delta, SAPO temperatures) are pytree *leaves*, so they may be Python floats or traced
JAX scalars (a schedule does not recompile); its variant choices (``loss_type``,
``importance_sampling_level``, ``use_bias_correction_kl``, ``max_completion_length``) are static, and so
is whether it has a KL term (:attr:`Objective.has_kl`, fixed at construction from a concrete ``beta``):
an objective passed through ``jax.jit`` as an argument keeps it while its ``beta`` is a tracer.

An objective knows nothing of the LM head. Given the per-token log-probs of a *chunk of whole
sequences* it returns the chunk's loss numerator and metric sums; the normaliser (the denominator) is a
function of the whole call's mask only. Because every reduction of SPEC.md is a sum over sequences
divided by a global normaliser, summing chunk numerators reproduces the unchunked loss exactly, and
``jax.grad`` of a chunk's numerator divided by the global denominator is d loss / d logp for that chunk.

Boundary rule (SPEC.md "Boundaries"): a token is clipped only *strictly* past its bound; at the exact
bound the gradient passes as if unclipped. All branch choices are made on stop-gradient values with
``jnp.where`` and the differentiable branch is evaluated on a "safe" input where it is not selected
(the double-``where`` pattern), so a clipped or zero-advantage branch contributes exactly zero gradient
even when its unclipped ratio overflows (no ``0 * inf``).

References: Zhao et al., "Geometric-Mean Policy Optimization", arXiv 2507.20673 (GMPO); Shao et al.,
arXiv 2402.03300 (GRPO); Liger-Kernel ``LigerFusedLinearGRPOLoss`` and TRL ``GRPOTrainer`` (loss types,
normalisers, metrics); Zheng et al., arXiv 2507.18071 (GSPO, sequence-level importance sampling);
MiniMax-M1, arXiv 2506.13585 (CISPO); Gao et al., arXiv 2511.20347 (SAPO).

Layout (one role per module): ``inputs`` (the batch data model, :class:`PolicyInputs`), ``sequences``
(where the sequences lie, per-sequence reductions, each loss type's aggregation and denominator),
``params`` (hyper-parameter checks, pytree registration), ``ratios`` (log ratio, k3 KL), ``base``
(:class:`Objective`), ``per_token`` (the objectives with one loss term per token, each stated once),
``gmpo``, ``grpo``, ``cispo``, ``sapo`` (one objective family each), ``rollout`` (the mismatch
correction), ``entropy`` (entropy selection), ``metrics`` (:class:`MetricSums`, :class:`LossAux`),
``evaluation`` (:func:`evaluate`, :func:`loss_and_aux`).
"""

from __future__ import annotations

from gmpo_jax.objectives.base import Objective
from gmpo_jax.objectives.cispo import CISPO
from gmpo_jax.objectives.entropy import high_entropy_tokens
from gmpo_jax.objectives.evaluation import evaluate, loss_and_aux
from gmpo_jax.objectives.gmpo import GMPO
from gmpo_jax.objectives.grpo import GRPO
from gmpo_jax.objectives.inputs import PolicyInputs
from gmpo_jax.objectives.metrics import LossAux, MetricSums, token_mean
from gmpo_jax.objectives.params import Scalar, _concrete_value
from gmpo_jax.objectives.ratios import _k3_kl
from gmpo_jax.objectives.rollout import ROLLOUT_IS_MODES, RolloutCorrection
from gmpo_jax.objectives.sapo import SAPO
from gmpo_jax.objectives.sequences import Sequences

__all__ = [
    "GMPO",
    "GRPO",
    "CISPO",
    "SAPO",
    "Objective",
    "PolicyInputs",
    "RolloutCorrection",
    "ROLLOUT_IS_MODES",
    "MetricSums",
    "LossAux",
    "evaluate",
    "high_entropy_tokens",
    "loss_and_aux",
    "token_mean",
]

# Also importable from here, as before the package split (not public API): Scalar, Sequences (the Tunix
# adapter), _concrete_value (the logits VJP), _k3_kl (tests).
_ = (Scalar, Sequences, _concrete_value, _k3_kl)
