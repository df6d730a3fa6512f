"""The GRPO family (ratio space, PPO-style clip): grpo, bnpo, dr_grpo, dapo, at token or sequence (GSPO) level."""

from __future__ import annotations

import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax.objectives.params import (
    _DERIVED,
    Scalar,
    _check_flag,
    _check_nonneg,
    _check_pos,
    _register,
    poisoned,
    read,
)
from gmpo_jax.objectives.per_token import PerTokenObjective
from gmpo_jax.objectives.sequences import _sequence_log_weight

_GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_IS_LEVELS = ("token", "sequence")


class GRPO(PerTokenObjective):
    r"""GRPO-family clipped-ratio objectives: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` (PPO-style clip).

    .. math::
        w = r \text{ (token) or } \frac{\sum_t m\,r}{\max(\sum_t m,1)} \text{ (sequence, GSPO)},\quad
        \rho = e^{w},\quad \rho_2 = \mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high}),\quad
        \rho \leftarrow \min(\rho, \delta)

        \ell_{b,t} = -\min(\rho A_b, \rho_2 A_b)\,[\times\,\text{rollout\_is\_ratio}]
        + \beta\,\mathrm{kl}_{b,t}

    reduced as ``grpo``: :math:`\frac1B\sum_b \frac{\sum_t m\ell}{\max(\sum_t m,1)}`; ``bnpo``:
    :math:`\frac{\sum m\ell}{\max(\sum m,1)}`; ``dr_grpo``: :math:`\frac{\sum m\ell}{B\,L_{max}}`;
    ``dapo``: :math:`\frac{\sum m\ell}{\max(N,1)}` with ``N = num_items_in_batch`` or ``sum m``.

    Args:
      loss_type: one of ``"dapo"`` (default, as TRL), ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` (static).
      epsilon_low: ``>= 0``; lower clip ``1 - epsilon_low`` of the ratio (``>= 1``: no lower clip). Default 0.2.
      epsilon_high: ``>= 0``; upper clip ``1 + epsilon_high``. Default 0.2 (DAPO's clip-higher: 0.28).
      beta: KL coefficient, finite and ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference at call time.
      importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO) (static).
      delta: optional upper bound ``> 0`` on the unclipped ratio (two-sided clipping, TRL ``delta``).
      use_bias_correction_kl: multiply the KL by the unclipped ratio :math:`e^{w}` (static).
      max_completion_length: positive int, required for ``dr_grpo`` (static).
      entropy_coef, top_entropy_quantile, rollout_is_mode, rollout_is_cap: the loss shaping every objective
        takes (keyword-only; documented on :class:`~gmpo_jax.objectives.Objective`).

    Raises:
      ValueError: unknown ``loss_type`` / ``importance_sampling_level``, negative epsilon or beta,
        ``delta <= 0``, a ``max_completion_length`` that is not a positive int (``dr_grpo``
        requires one). Numeric values are checked when concrete; a traced one outside its range makes the
        loss NaN.

    References: Shao et al. arXiv 2402.03300 (GRPO); Yu et al. arXiv 2503.14476 (DAPO); Liu et al.
    arXiv 2503.20783 (Dr. GRPO); Zheng et al. arXiv 2507.18071 (GSPO); Liger-Kernel
    ``LigerFusedLinearGRPOLoss``; TRL ``GRPOTrainer``.
    """

    name: ClassVar[str] = "grpo"
    loss_type: str = "dapo"
    epsilon_low: Scalar = 0.2
    epsilon_high: Scalar = 0.2
    beta: Scalar = 0.0
    importance_sampling_level: str = "token"
    delta: Scalar | None = None
    use_bias_correction_kl: bool = False
    max_completion_length: int | None = None

    def _check(self) -> None:
        if self.loss_type not in _GRPO_LOSS_TYPES:
            raise ValueError(
                f"loss_type must be one of {_GRPO_LOSS_TYPES} for GRPO (use GMPO / CISPO / SAPO for those),"
                f" got loss_type={self.loss_type!r}"
            )
        if self.importance_sampling_level not in _IS_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {_IS_LEVELS}, "
                f"got importance_sampling_level={self.importance_sampling_level!r}"
            )
        _check_nonneg("epsilon_low", self.epsilon_low)
        _check_nonneg("epsilon_high", self.epsilon_high)
        _check_nonneg("beta", self.beta, finite=True)
        if self.delta is not None:
            _check_pos("delta", self.delta)
        _check_flag("use_bias_correction_kl", self.use_bias_correction_kl)
        mcl = self.max_completion_length
        if isinstance(mcl, numbers.Integral) and not isinstance(mcl, (bool, np.bool_)):
            object.__setattr__(self, "max_completion_length", int(mcl))  # static: a plain, hashable int
            mcl = self.max_completion_length
        if self.loss_type == "dr_grpo" or mcl is not None:
            if not (isinstance(mcl, int) and not isinstance(mcl, bool) and mcl > 0):
                raise ValueError(
                    "max_completion_length must be a positive int (loss_type='dr_grpo' requires it), "
                    f"got max_completion_length={mcl!r}"
                )

    @property
    def token_local(self) -> bool:
        return self.importance_sampling_level == "token"

    def log_weight(self, r, data):
        """``r`` at token level; GSPO (``"sequence"``): the sequence-mean log ratio on each of its tokens."""
        if self.importance_sampling_level == "sequence":
            return _sequence_log_weight(r, data.mask, data.sequences())
        return r

    def policy_term(self, logp, log_weight, advantages, mask):
        """``-min(rho A, clip(rho) A)`` with ``rho = min(e^w, delta)`` of the log weight ``w``, and the clip
        flags (``rho < 1 - epsilon_low``, ``rho > 1 + epsilon_high``)."""
        w, a, m = log_weight, advantages, mask
        # branch decisions on values (no gradient)
        w_v = jax.lax.stop_gradient(w)
        coef_v = jnp.exp(w_v)
        lo = 1.0 - read(self.epsilon_low)
        hi = 1.0 + read(self.epsilon_high)
        low = coef_v < lo
        high = coef_v > hi
        coef2_v = jnp.where(low, lo, jnp.where(high, hi, coef_v))
        delta_clipped = None
        coef1_v = coef_v
        if self.delta is not None:
            delta = read(self.delta, positive=True)
            delta_clipped = coef_v > delta
            coef1_v = jnp.where(delta_clipped, delta, coef_v)
        t1 = coef1_v * a
        t2 = coef2_v * a
        nonzero = a != 0
        use_unclipped = t1 <= t2  # ties -> first branch (the gradient passes at the exact bound)
        # A token has a gradient (slope A e^w) when the selected branch is the ratio itself: the first
        # branch unless delta clipped it, or the second one when the ratio lies inside its clip range
        # (possible only with delta < 1 + epsilon_high, where min picks coef2 = coef). (No boolean
        # constants: the kernels' lowering takes none.)
        inside = ~low & ~high
        if delta_clipped is None:
            passes = use_unclipped | inside
        else:
            passes = jnp.where(use_unclipped, ~delta_clipped, inside)
        active = m & nonzero & passes
        const = jnp.where(nonzero, jnp.where(use_unclipped, t1, t2), 0.0)
        surrogate = jnp.where(active, a * jnp.exp(jnp.where(active, w, 0.0)), const)
        bounds = (lo, hi) if self.delta is None else (lo, hi, delta)
        return -poisoned(surrogate, *bounds), low, high


GRPO = _register(
    GRPO,
    ["epsilon_low", "epsilon_high", "beta", "delta"],
    ["loss_type", "importance_sampling_level", "use_bias_correction_kl", "max_completion_length"],
    _DERIVED,
)
