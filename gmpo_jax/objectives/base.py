"""The interface every objective shares (:class:`Objective`): numerator, denominator, KL term, entropy weights,
and the loss-shaping fields every objective takes."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from gmpo_jax.objectives.inputs import PolicyInputs
from gmpo_jax.objectives.metrics import MetricSums
from gmpo_jax.objectives.params import Scalar, _check_optional_real, _check_pos, _concrete_value, shared_field
from gmpo_jax.objectives.ratios import _k3_kl
from gmpo_jax.objectives.rollout import ROLLOUT_IS_MODES, RolloutCorrection
from gmpo_jax.objectives.sequences import _aggregation_weights, _denominator


@dataclasses.dataclass(frozen=True, repr=False)
class Objective:
    r"""Interface shared by every objective (see the package docstring), and the loss shaping they all take.

    A subclass provides :meth:`chunk_numerator` and ``loss_type`` (the name of its aggregation, SPEC.md
    "Reductions"); the denominator, the entropy weights and the KL term follow from them.

    Every objective (``GMPO``, ``GRPO``, ``CISPO``, ``SAPO``) also takes these keyword-only fields (TRL's
    ``GRPOConfig`` names), checked at construction:

    Attributes:
      entropy_coef: None (default: no term), or a real scalar ``c`` (float or traced; a pytree leaf): the loss
        gains the entropy term ``-c * agg(H)``, ``H`` the per-token entropy of ``softmax(z / temperature)``
        aggregated as the objective aggregates its KL term (per-sequence mean for gmpo / grpo / sapo, token
        sum over the loss's normaliser for bnpo / dapo / dr_grpo / cispo; SPEC.md "Entropy term"), with its
        exact gradient :math:`\partial H / \partial z = -p (\log p + H) / \tau`. ``c > 0`` rewards entropy
        (verl's ``entropy_coeff``). Whether the term exists is static (None or not).
      top_entropy_quantile: Python float in ``(0, 1]`` (static; default 1: every token). Below 1 only the tokens
        whose entropy is at or above the ``1 - top_entropy_quantile`` quantile of the unmasked tokens'
        entropies (over the global batch) receive policy gradient ("Beyond the 80/20 rule", arXiv
        2506.01939): the token-level objectives multiply the others' policy term by 0 (their tokens still
        count in the normalisers, as in TRL), GMPO keeps them in the geometric mean without gradient. The KL
        term is not selected; ``aux.entropy_threshold`` is the quantile.
      rollout_is_mode: the trainer-vs-sampler mismatch correction computed from ``batch.rollout_logps``:
        ``"token_truncate"`` (None: this default), ``"token_mask"``, ``"sequence_truncate"`` or
        ``"sequence_mask"`` (static; TRL's ``vllm_importance_sampling_mode``; each formula, GMPO's included:
        :class:`~gmpo_jax.objectives.RolloutCorrection`).
      rollout_is_cap: ``> 0`` truncation / masking threshold of that weight (float or traced; None: 2.0). A
        traced cap ``<= 0`` cannot raise: it makes the loss NaN.

    ``rollout_is_mode`` and ``rollout_is_cap`` take effect only in a call whose batch has ``rollout_logps``
    (an objective configured once serves batches with and without them).

    Raises:
      TypeError: an ``entropy_coef`` that is not a real scalar; a ``top_entropy_quantile`` that is not a
        Python real.
      ValueError: a concrete non-finite ``entropy_coef``; ``top_entropy_quantile`` outside ``(0, 1]``; an
        unknown ``rollout_is_mode``; a concrete ``rollout_is_cap <= 0``.
    """

    name: ClassVar[str]
    entropy_coef: Scalar | None = shared_field(None, static=False)
    top_entropy_quantile: float = shared_field(1.0, static=True)
    rollout_is_mode: str | None = shared_field(None, static=True)
    rollout_is_cap: Scalar | None = shared_field(None, static=False)

    # --- to be provided by subclasses -------------------------------------------------------
    def chunk_numerator(self, logp: jax.Array, data: PolicyInputs) -> tuple[jax.Array, MetricSums]:
        """Loss numerator of a chunk (float32 scalar) and its metric sums; differentiable in ``logp``."""
        raise NotImplementedError

    def denominator(
        self, mask: jax.Array, num_items_in_batch: jax.Array | None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """Global loss normaliser (float32 scalar) from the whole call's ``[B, T]`` mask (and its
        ``segment_ids``, which decide the number of sequences of a packed batch)."""
        mcl = getattr(self, "max_completion_length", None)
        return _denominator(self.loss_type, mask, num_items_in_batch, mcl, segment_ids)

    # --- token-local objectives (optional) ---------------------------------------------------
    @property
    def token_local(self) -> bool:
        """True iff ``d loss / d logp`` of a token depends only on that token's own data, its weight
        (:meth:`token_weights`) and ``logp``: then :meth:`token_loss` is defined and a kernel may write
        the gradient while it first reads the logits. False for GMPO and sequence-level (GSPO) ratios."""
        return False

    def token_loss(self, logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask=True):
        """Loss of one token, elementwise on arrays of any one shape (or scalars):
        ``loss = sum_{b,t} token_weights[b, t] * token_loss(logp[b, t], ...)``. ``old_logps``,
        ``ref_logps`` and ``rollout_is_ratio`` may be None (on-policy / no KL / no correction), as in
        :class:`PolicyInputs`; ``mask`` (bool, default True) is the token's mask: a masked token has no
        gradient whatever its values (its loss is weighted by 0). Only for :attr:`token_local` objectives.

        Raises:
          NotImplementedError: the objective is not :attr:`token_local`.
        """
        raise NotImplementedError(f"{type(self).__name__} is not token-local")

    def token_weights(self, mask, num_items_in_batch, segment_ids=None):
        """``[B, T]`` float32 weight of each token's :meth:`token_loss` in the loss (0 where masked).

        Raises:
          NotImplementedError: the objective is not :attr:`token_local`.
        """
        raise NotImplementedError(f"{type(self).__name__} is not token-local")

    # --- shared ---------------------------------------------------------------------------
    def entropy_weights(self, mask, segment_ids=None) -> jax.Array:
        """``[B, T]`` float32 weights ``w`` of the entropy term in the loss NUMERATOR:
        ``loss += -entropy_coef * sum_{b,t} w H / denominator``. The objective's own aggregation of a
        per-token quantity, the one its KL term has: the per-sequence mean (``w = m / max(n_b, 1)``) for
        grpo, sapo and gmpo, the token sum (``w = m``) for bnpo, dapo, dr_grpo and cispo. Local to a chunk
        of whole sequences (the denominator is the global one)."""
        return _aggregation_weights(self.loss_type, mask.astype(jnp.float32), mask, segment_ids)

    def __repr__(self) -> str:
        """The fields in the constructor's order; the loss-shaping ones only where they are set."""
        fields = [f for f in dataclasses.fields(self) if f.repr and not f.kw_only]
        fields += [f for f in dataclasses.fields(self) if f.kw_only and getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"

    def __post_init__(self):
        self._check_shaping(strict=True)
        self._check()
        # Static (pytree aux data): fixed here from the beta given at construction, restored as it is when
        # JAX rebuilds the objective from its leaves (params._register), never re-derived from a tracer.
        object.__setattr__(self, "_has_kl", _concrete_value(getattr(self, "beta", 0.0)) != 0)

    def _check(self) -> None:
        """The hyper-parameter checks (concrete values only); rerun whenever JAX rebuilds the objective."""

    def _check_shaping(self, *, strict: bool) -> None:
        """The checks of the loss-shaping fields; ``strict`` at construction (see ``params._check_optional_real``)."""
        _check_optional_real("entropy_coef", self.entropy_coef, strict=strict)
        q = self.top_entropy_quantile
        if isinstance(q, (bool, np.bool_)) or not isinstance(q, numbers.Real):
            raise TypeError(f"top_entropy_quantile must be a Python float in (0, 1], got top_entropy_quantile={q!r}")
        if not 0.0 < float(q) <= 1.0:
            raise ValueError(f"top_entropy_quantile must lie in (0, 1], got top_entropy_quantile={q!r}")
        object.__setattr__(self, "top_entropy_quantile", float(q))  # static: a plain, hashable float
        if self.rollout_is_mode is not None and self.rollout_is_mode not in ROLLOUT_IS_MODES:
            raise ValueError(
                f"rollout_is_mode must be None or one of {ROLLOUT_IS_MODES}, got rollout_is_mode={self.rollout_is_mode!r}"
            )
        if self.rollout_is_cap is not None:
            _check_pos("rollout_is_cap", self.rollout_is_cap)

    def _recheck(self) -> None:
        """The checks rerun when JAX rebuilds the objective from its leaves (``params._register``)."""
        self._check_shaping(strict=False)
        self._check()

    def rollout_correction(self) -> RolloutCorrection:
        """The :class:`~gmpo_jax.objectives.RolloutCorrection` of ``rollout_is_mode`` / ``rollout_is_cap``
        (None: ``"token_truncate"`` / 2.0), for a batch with ``rollout_logps``."""
        mode = "token_truncate" if self.rollout_is_mode is None else self.rollout_is_mode
        return RolloutCorrection(mode, 2.0 if self.rollout_is_cap is None else self.rollout_is_cap)

    @property
    def has_kl(self) -> bool:
        """Whether the loss has a KL term (static). Fixed when the objective is constructed: False iff
        ``beta`` was then a concrete 0 (a Python / NumPy number or an untraced JAX scalar); True for a
        non-zero ``beta`` and for one that was traced at construction (e.g. ``GMPO(beta=schedule(step))``
        inside ``jit``). It is pytree aux data: an objective passed through ``jax.jit`` / ``vmap`` /
        ``shard_map`` as an argument keeps its flag while its ``beta`` becomes a tracer, so the value of a
        traced ``beta`` stays in the math (a schedule does not recompile: ``GMPO(beta=0.01)`` and
        ``GMPO(beta=0.02)`` have the same tree structure) and never decides whether a reference is needed.
        ``GMPO(beta=0.0)`` and ``GMPO(beta=0.1)`` differ in structure (one program each). Rebuilding an
        objective built without a KL term with a concrete non-zero ``beta`` (e.g. ``jax.tree.map``) raises
        ValueError: the term would be silently missing; a concrete zero or a traced ``beta`` is allowed. An
        objective defined elsewhere without ``Objective.__post_init__`` gets it from its ``beta`` here."""
        flag = getattr(self, "_has_kl", None)
        return _concrete_value(getattr(self, "beta", 0.0)) != 0 if flag is None else flag

    @property
    def requires_reference(self) -> bool:
        """:attr:`has_kl`: True iff the loss has a KL term, which needs a reference at call time.

        A ``beta`` traced at construction counts as a KL term (its value may be non-zero): without a
        reference it would silently train without the KL term (a schedule with a forgotten reference), so
        it is an error; build the objective with ``beta=0.0`` as a number to train without KL.
        """
        return self.has_kl

    def _kl_values(self, logp, ref, mask, log_weight) -> jax.Array | None:
        """Per-token KL (k3, 0 on masked tokens; ``mask`` may be the scalar True), times
        ``exp(log_weight)`` with ``use_bias_correction_kl``.

        None without a reference or without a KL term (:attr:`has_kl` False; SPEC: the KL term exists
        only if beta != 0). A traced beta that is 0 selects the KL away before it is formed, so an
        overflowing ``exp(ref - logp)`` cannot turn into ``0 * inf``.
        """
        if ref is None or not self.has_kl:
            return None
        beta = getattr(self, "beta", 0.0)
        live = mask if _concrete_value(beta) is not None else mask & (jnp.asarray(beta) != 0)
        kl = _k3_kl(logp, ref, live)
        if getattr(self, "use_bias_correction_kl", False):
            kl = kl * jnp.exp(jnp.where(live, log_weight, 0.0))
        return kl
