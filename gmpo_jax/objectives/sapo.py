"""SAPO: soft, sigmoid-gated policy optimisation (token level, no hard clip)."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.params import (
    _DERIVED,
    Scalar,
    _check_flag,
    _check_nonneg,
    _check_pos,
    _check_token_level,
    _register,
    read,
)
from gmpo_jax.objectives.per_token import PerTokenObjective

# Above this log-ratio exp() is ~5.5e34: every sigmoid(tau * (e^w - 1)) with tau >= 1e-33 is exactly 1
# in float32 and its derivative exactly 0, so clamping there changes no representable value.
_SAPO_LOG_RATIO_CAP = 80.0


class SAPO(PerTokenObjective):
    r"""SAPO: soft, sigmoid-gated policy optimisation (token level, no hard clip).

    .. math::
        \ell_{b,t} = -A_b\,\sigma\!\left(\tau_b (e^{r_{b,t}} - 1)\right)\frac{4}{\tau_b}
        \,[\times\,\text{rollout\_is\_ratio}] + \beta\,\mathrm{kl}_{b,t},\qquad
        \tau_b = \tau_{pos} \text{ if } A_b > 0 \text{ else } \tau_{neg}

    reduced like ``grpo`` (per-sequence mean, then mean over ``B``). Clip metrics are 0.

    Args:
      temperature_pos: ``> 0`` gate temperature for positive advantages (Liger/TRL
        ``sapo_temperature_pos``). Default 1.0.
      temperature_neg: ``> 0`` gate temperature for non-positive advantages. Default 1.05.
      beta: KL coefficient, finite and ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference at call time.
      use_bias_correction_kl: multiply the KL by :math:`e^{r}` (static).
      importance_sampling_level: ``"token"`` only (static; the field exists for TRL / Liger signature
        compatibility; ``"sequence"`` raises).
      entropy_coef, top_entropy_quantile, rollout_is_mode, rollout_is_cap: the loss shaping every objective
        takes (keyword-only; documented on :class:`~gmpo_jax.objectives.Objective`).

    Raises:
      ValueError: a concrete temperature ``<= 0`` or a negative ``beta`` (a traced one there makes the loss NaN).

    References: Gao et al., "Soft Adaptive Policy Optimization", arXiv 2511.20347; Liger-Kernel
    ``LigerFusedLinearGRPOLoss(loss_type="sapo")``.
    """

    name: ClassVar[str] = "sapo"
    temperature_pos: Scalar = 1.0
    temperature_neg: Scalar = 1.05
    beta: Scalar = 0.0
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"

    def _check(self) -> None:
        _check_token_level("SAPO", self.importance_sampling_level)
        _check_flag("use_bias_correction_kl", self.use_bias_correction_kl)
        _check_pos("temperature_pos", self.temperature_pos)
        _check_pos("temperature_neg", self.temperature_neg)
        _check_nonneg("beta", self.beta, finite=True)

    @property
    def loss_type(self) -> str:
        return "sapo"

    def policy_term(self, logp, log_weight, advantages, mask):
        """``-A sigmoid(tau (e^r - 1)) 4 / tau`` (0 where masked or ``A == 0``); nothing clips."""
        a = advantages
        tau = jnp.where(a > 0, read(self.temperature_pos, positive=True), read(self.temperature_neg, positive=True))
        capped = jax.lax.stop_gradient(log_weight) > _SAPO_LOG_RATIO_CAP
        w = jnp.where(capped, _SAPO_LOG_RATIO_CAP, log_weight)
        gate = jax.nn.sigmoid(tau * (jnp.exp(w) - 1.0)) * (4.0 / tau)
        return jnp.where(mask, jnp.where(a != 0, -a * gate, 0.0), 0.0), None, None


SAPO = _register(
    SAPO,
    ["temperature_pos", "temperature_neg", "beta"],
    ["use_bias_correction_kl", "importance_sampling_level"],
    _DERIVED,
)
