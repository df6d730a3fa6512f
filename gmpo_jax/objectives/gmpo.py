"""GMPO: Geometric-Mean Policy Optimization (token-level clipping in log space, geometric mean per sequence)."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.base import Objective
from gmpo_jax.objectives.metrics import _objective_sums
from gmpo_jax.objectives.params import (
    _DERIVED,
    Scalar,
    _check_flag,
    _check_nonneg,
    _check_token_level,
    _register,
    poisoned,
    read,
)
from gmpo_jax.objectives.ratios import _token_log_ratio
from gmpo_jax.objectives.rollout import _gmpo_rollout
from gmpo_jax.objectives.sequences import _masked_sum


class GMPO(Objective):
    r"""Geometric-Mean Policy Optimization (token-level clipping in log space, geometric mean per sequence).

    .. math::
        r_{b,t} = \log\pi_\theta - \log\pi_{old}, \quad
        c_{b,t} = \begin{cases} \min(r, \epsilon_{high}) & A_b > 0 \\ \max(r, -\epsilon_{low}) & A_b \le 0
        \end{cases}, \quad
        s_b = \frac{\sum_t m\, c}{\max(\sum_t m, 1)}

        \mathcal{L} = \frac{1}{B}\sum_b e_b\,(-A_b\, e^{s_b})
        + \beta \frac{1}{B}\sum_b \frac{\sum_t m\,\mathrm{kl}}{\max(\sum_t m, 1)}

    over the ``B`` sequences (rows, or the sequences of a packed batch: ``segment_ids``), with
    :math:`e_b = 1` iff sequence ``b`` has an unmasked token, and k3 KL
    :math:`\mathrm{kl} = e^{ref - \log\pi} - (ref - \log\pi) - 1` (times :math:`e^{r}` with
    ``use_bias_correction_kl``). A token is clipped only strictly past its bound.

    Args:
      epsilon_low: lower clip range in log space, ``>= 0`` (paper: 0.4, i.e. ratio >= e^-0.4).
      epsilon_high: upper clip range in log space, ``>= 0`` (paper: 0.4).
      beta: KL coefficient, finite and ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference (``batch.ref_logps`` or
        ``reference=``) at call time.
      use_bias_correction_kl: multiply the per-token KL by the unclipped ratio ``exp(r)`` (static).
      importance_sampling_level: ``"token"`` only (static; the field exists for TRL / Liger signature
        compatibility; ``"sequence"`` raises).
      entropy_coef, top_entropy_quantile, rollout_is_mode, rollout_is_cap: the loss shaping every objective
        takes (keyword-only; documented on :class:`~gmpo_jax.objectives.Objective`).

    Raises:
      ValueError: a concrete negative epsilon or beta, or an infinite beta (a traced one is not checked: outside
        that range the loss is NaN).

    References: Zhao et al., "Geometric-Mean Policy Optimization", arXiv 2507.20673 (ICLR 2026); TRL
    ``GMPOTrainer``; Liger-Kernel PR #1320.
    """

    name: ClassVar[str] = "gmpo"
    epsilon_low: Scalar = 0.4
    epsilon_high: Scalar = 0.4
    beta: Scalar = 0.0
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"

    def _check(self) -> None:
        _check_token_level("GMPO", self.importance_sampling_level)
        _check_flag("use_bias_correction_kl", self.use_bias_correction_kl)
        _check_nonneg("epsilon_low", self.epsilon_low)
        _check_nonneg("epsilon_high", self.epsilon_high)
        _check_nonneg("beta", self.beta, finite=True)

    @property
    def loss_type(self) -> str:
        return "gmpo"

    def chunk_numerator(self, logp, data):
        m = data.mask
        seqs = data.sequences()
        adv = seqs.mean_advantages(data)
        a = seqs.tokens(adv, m.shape)
        r = _token_log_ratio(logp, data.old_logps, m)
        r_v = jax.lax.stop_gradient(r)
        eh = read(self.epsilon_high)
        el = read(self.epsilon_low)
        high = r_v > eh
        low = r_v < -el
        # one-sided log-space clip; jnp.where passes the gradient to the selected branch only
        c = jnp.where(a > 0, jnp.where(high, eh, r), jnp.where(low, -el, r))
        if data.token_select is not None:  # unselected tokens count in the geometric mean, without gradient
            c = jnp.where(data.token_select, c, jax.lax.stop_gradient(c))
        keep, weight = _gmpo_rollout(logp, data, seqs)  # tokens of the geometric mean, sequence weights
        n_tok = seqs.lengths(keep)
        s = seqs.sum(c, keep) / jnp.maximum(n_tok, 1.0)
        live = (n_tok > 0) & (adv != 0)
        seq_term = jnp.where(live, -adv * jnp.exp(jnp.where(live, s, 0.0)), 0.0)
        if weight is not None:
            seq_term = seq_term * weight
        numerator = poisoned(jnp.sum(seq_term), el, eh)  # a traced invalid clip range: NaN
        kl = self._kl_values(logp, data.ref_logps, m, r)
        kl_sum = kl_term = None
        if kl is not None:
            kl_seq = seqs.mean(kl, m)
            numerator = numerator + read(self.beta, finite=True) * jnp.sum(kl_seq)
            kl_sum = jax.lax.stop_gradient(_masked_sum(kl, m))
            kl_term = jax.lax.stop_gradient(jnp.sum(kl_seq))
        return numerator, _objective_sums(r, a, m, low, high, kl_sum, kl_term)


GMPO = _register(
    GMPO, ["epsilon_low", "epsilon_high", "beta"], ["use_bias_correction_kl", "importance_sampling_level"], _DERIVED
)
