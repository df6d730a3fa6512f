"""The interface every objective shares (:class:`Objective`): numerator, denominator, KL term, entropy weights."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from gmpo_jax.objectives.inputs import PolicyInputs
from gmpo_jax.objectives.metrics import MetricSums
from gmpo_jax.objectives.params import _concrete_value
from gmpo_jax.objectives.ratios import _k3_kl
from gmpo_jax.objectives.sequences import _aggregation_weights, _denominator


class Objective:
    """Interface shared by every objective (see the package docstring).

    A subclass provides :meth:`chunk_numerator` and ``loss_type`` (the name of its aggregation, SPEC.md
    "Reductions"); the denominator, the entropy weights and the KL term follow from them.
    """

    name: ClassVar[str]

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

    def __post_init__(self):
        self._check()
        # Static (pytree aux data): fixed here from the beta given at construction, restored as it is when
        # JAX rebuilds the objective from its leaves (params._register), never re-derived from a tracer.
        object.__setattr__(self, "_has_kl", _concrete_value(getattr(self, "beta", 0.0)) != 0)

    def _check(self) -> None:
        """The hyper-parameter checks (concrete values only); rerun whenever JAX rebuilds the objective."""

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
