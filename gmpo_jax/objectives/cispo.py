"""CISPO: a clipped, stop-gradient importance weight times the log-prob (token level)."""

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
    poisoned,
    read,
)
from gmpo_jax.objectives.per_token import PerTokenObjective


class CISPO(PerTokenObjective):
    r"""CISPO: clipped, stop-gradient importance weight times the log-prob (token level).

    .. math::
        \ell_{b,t} = -\,\mathrm{sg}\!\left(\min(e^{r_{b,t}}, \epsilon_{high})\right) A_b \log\pi_\theta
        \,[\times\,\text{rollout\_is\_ratio}] + \beta\,\mathrm{kl}_{b,t},\qquad
        \mathcal L = \frac{\sum m\,\ell}{\max(N, 1)}

    Note that, as in Liger-Kernel and TRL, ``epsilon_high`` bounds the ratio itself (not ``1 + eps``).
    Only the upper bound clips, so ``clip_fraction_low`` is always 0; a token counts as clipped when
    ``e^r > epsilon_high`` and ``A > 0``.

    Args:
      epsilon_high: ``>= 0`` upper bound of the importance weight. Default 0.2 (the shared default of
        the GRPO family in TRL and Liger; MiniMax-M1 tunes it per task, typically well above 1). Below
        1 it caps even on-policy weights (``e^r = 1``): every token's gradient is scaled by
        ``epsilon_high``, i.e. the 0.2 default trains at a fifth of the learning rate (the
        ``gmpo-jax train`` CLI uses 5.0).
      beta: KL coefficient, finite and ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference at call time.
      use_bias_correction_kl: multiply the KL by :math:`e^{r}` (static).
      importance_sampling_level: ``"token"`` only (static; the field exists for TRL / Liger signature
        compatibility; ``"sequence"`` raises).
      entropy_coef, top_entropy_quantile, rollout_is_mode, rollout_is_cap: the loss shaping every objective
        takes (keyword-only; documented on :class:`~gmpo_jax.objectives.Objective`).

    Raises:
      ValueError: ``epsilon_high <= 0`` (it caps the ratio itself: 0 would zero every gradient) or a negative
        ``beta`` (concrete values; a traced one outside its range makes the loss NaN).

    References: MiniMax-M1, arXiv 2506.13585; Liger-Kernel ``LigerFusedLinearGRPOLoss(loss_type="cispo")``.
    """

    name: ClassVar[str] = "cispo"
    epsilon_high: Scalar = 0.2
    beta: Scalar = 0.0
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"

    def _check(self) -> None:
        _check_token_level("CISPO", self.importance_sampling_level)
        _check_flag("use_bias_correction_kl", self.use_bias_correction_kl)
        _check_pos("epsilon_high", self.epsilon_high)  # the cap on the ratio itself: 0 would zero every gradient
        _check_nonneg("beta", self.beta, finite=True)

    @property
    def loss_type(self) -> str:
        return "cispo"

    def policy_term(self, logp, log_weight, advantages, mask):
        """``-sg(min(e^r, epsilon_high)) A logp`` (0 where masked or ``A == 0``); only the upper bound clips."""
        coef_v = jnp.exp(jax.lax.stop_gradient(log_weight))
        eh = read(self.epsilon_high, positive=True)
        high = coef_v > eh
        weight = poisoned(jnp.where(high, eh, coef_v), eh)
        a = advantages
        return jnp.where(a != 0, -(weight * a) * jnp.where(mask, logp, 0.0), 0.0), None, high


CISPO = _register(CISPO, ["epsilon_high", "beta"], ["use_bias_correction_kl", "importance_sampling_level"], _DERIVED)
