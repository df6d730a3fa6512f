"""The trainer-vs-sampler mismatch correction (:class:`RolloutCorrection`) and the weights it gives the
policy term: per token for the token-level objectives, per sequence for GMPO."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.params import Scalar, _check_pos, _register, poisoned, read

if TYPE_CHECKING:
    from gmpo_jax.objectives.inputs import PolicyInputs
    from gmpo_jax.objectives.sequences import Sequences

ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class RolloutCorrection:
    r"""How the trainer-vs-sampler mismatch is corrected, given the sampler's log-probs (a pytree).

    With ``d = old - rollout`` per token (``old`` the trainer's behaviour-policy log-prob, ``sg(logp)``
    on-policy; ``rollout`` the sampler's, e.g. vLLM's), and ``D_b = sum_t m d`` per sequence, the weight
    (no gradient) that multiplies the policy term is, for the token-level objectives (GRPO family incl.
    GSPO, CISPO, SAPO), per token:

    ======================  ============================================================================
    ``"token_truncate"``    ``min(e^d, cap)`` (truncated IS, "TIS")
    ``"token_mask"``        ``e^d`` if ``e^d <= cap`` else 0 (masked IS, "MIS")
    ``"sequence_truncate"`` ``min(e^{D_b}, cap)`` on every token of the sequence
    ``"sequence_mask"``     ``e^{D_b}`` if ``e^{D_b} <= cap`` else 0
    ======================  ============================================================================

    GMPO's policy term is per sequence, ``-A_b e^{s_b}`` with ``s_b`` the mean clipped log ratio, and
    takes one weight per sequence: for the token modes the geometric mean of its tokens' weights, as
    GMPO takes the geometric mean of their ratios: ``exp(mean_t min(d, log cap))`` (truncate), or, for
    ``token_mask``, the tokens with ``e^d > cap`` leave the sequence (its geometric means ``s_b`` and of
    the weights run over the kept tokens); the sequence modes use the ``e^{D_b}`` weight above.

    Attributes:
      mode: one of ``ROLLOUT_IS_MODES`` (static).
      cap: ``> 0`` (float or traced scalar; ``inf`` disables truncation / masking).

    Sources: TRL ``GRPOConfig.vllm_importance_sampling_mode`` / ``vllm_importance_sampling_cap`` (the
    four modes, ``old - sampling`` log-probs, products over the sequence); Yao et al., "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training" (truncated IS, cap 2); verl ``rollout_is``
    (token / sequence level, truncate / mask). The GMPO forms are this library's definition (SPEC.md).
    """

    mode: str = "token_truncate"
    cap: Scalar = 2.0

    def __post_init__(self):
        self._check()

    def _check(self) -> None:
        if self.mode not in ROLLOUT_IS_MODES:
            raise ValueError(f"rollout_is_mode must be one of {ROLLOUT_IS_MODES}, got rollout_is_mode={self.mode!r}")
        _check_pos("rollout_is_cap", self.cap)


RolloutCorrection = _register(RolloutCorrection, ["cap"], ["mode"])


def _rollout_d(logp, data: PolicyInputs):
    """``old - rollout`` per token (0 on masked tokens; no gradient); ``old = logp`` on-policy."""
    old = logp if data.old_logps is None else data.old_logps
    return jax.lax.stop_gradient(jnp.where(data.mask, old - data.rollout_logps, 0.0))


def _capped(log_w, cap, mode: str):
    """``min(e^x, cap)`` (truncate) or ``e^x if e^x <= cap else 0`` (mask), elementwise, float32; ``cap`` as
    :func:`~gmpo_jax.objectives.params.read` gives it (the caller poisons the result with it)."""
    w = jnp.exp(log_w)
    return jnp.minimum(w, cap) if mode.endswith("truncate") else jnp.where(w > cap, 0.0, w)


def _rollout_token_weights(logp, data: PolicyInputs) -> jax.Array | None:
    """``[B, T]`` weight of each token's policy term: :meth:`PolicyInputs.token_policy_weights` times the
    :class:`RolloutCorrection` weight (token-level objectives); None without any of them."""
    w = data.token_policy_weights()
    corr = data.rollout_correction
    if data.rollout_logps is not None and corr is not None:
        d = _rollout_d(logp, data)
        if corr.mode.startswith("sequence"):
            seqs = data.sequences()
            d = seqs.tokens(seqs.sum(d, data.mask), d.shape)
        cap = read(corr.cap, positive=True)
        u = poisoned(_capped(d, cap, corr.mode), cap)  # a traced cap <= 0 (the mask modes compare only): NaN
        w = u if w is None else w * u
    return w


def _gmpo_rollout(logp, data: PolicyInputs, seqs: Sequences):
    """GMPO's mismatch correction: ``(tokens of the geometric mean [B, T] bool, weight per sequence
    [slots] or None)``. ``rollout_is_ratio`` (``[B, T]``; ``[B, 1]`` per row) enters as the geometric
    mean of the sequence's token ratios (a 0 zeroes the sequence); the :class:`RolloutCorrection` as
    defined there."""
    m = data.mask
    log_w, keep = None, m
    if data.rollout_is_ratio is not None:
        ris = jnp.broadcast_to(data.rollout_is_ratio.astype(jnp.float32), m.shape)
        log_w = seqs.mean(jnp.log(jnp.where(m, ris, 1.0)), m)
    corr = data.rollout_correction
    if data.rollout_logps is None or corr is None:
        return keep, None if log_w is None else jnp.exp(log_w)
    d = _rollout_d(logp, data)
    cap = read(corr.cap, positive=True)
    if corr.mode == "token_truncate":
        u = jnp.exp(seqs.mean(jnp.minimum(d, jnp.log(cap)), m))
    elif corr.mode == "token_mask":
        keep = m & ~(jnp.exp(d) > cap)
        u = jnp.exp(seqs.mean(d, keep))
    else:
        u = _capped(seqs.sum(d, m), cap, corr.mode)
    u = poisoned(u, cap)  # a traced cap <= 0 (token_mask compares with it only): NaN
    return keep, u if log_w is None else u * jnp.exp(log_w)
