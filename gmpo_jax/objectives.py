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
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

Scalar = Union[float, jax.Array]

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

# Above this log-ratio exp() is ~5.5e34: every sigmoid(tau * (e^w - 1)) with tau >= 1e-33 is exactly 1
# in float32 and its derivative exactly 0, so clamping there changes no representable value.
_SAPO_LOG_RATIO_CAP = 80.0


ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class PolicyInputs(NamedTuple):
    """The per-token inputs of one policy-loss call, built once by the public function (a pytree).

    The objectives read ``mask``, ``advantages``, ``old_logps``, ``ref_logps``, ``rollout_is_ratio`` and
    ``segment_ids``; the LM-head and logits passes read ``ids`` and ``temperature``; ``num_items`` feeds
    the normaliser. A chunk of whole rows is the same pytree over ``C`` rows (:meth:`rows`).

    Attributes:
      mask: ``[B, T]`` bool; False for padding, masked tokens and sequences outside a chunk.
      advantages: ``[B]`` (one per row) or ``[B, T]`` (per token) float32.
      old_logps: ``[B, T]`` float32 or None (on-policy: ``old = stop_gradient(logp)``).
      ref_logps: ``[B, T]`` float32 or None (no KL term).
      rollout_is_ratio: ``[B, T]`` or ``[B, 1]`` float32 or None.
      ids: ``[B, T]`` int32 target ids, 0 at masked positions (any id may sit under the mask); None
        where only the objective is evaluated.
      num_items: float32 scalar or None: the dapo / cispo normaliser override.
      temperature: float32 scalar (``> 0``) dividing the logits, or None where only the objective runs.
      segment_ids: ``[B, T]`` int32 or None. None: row ``b`` is sequence ``b`` (the padded layout).
        Otherwise a packed batch: each maximal run of equal positive ids in a row is one sequence, id 0
        is padding (its tokens are masked).
      rollout_logps: ``[B, T]`` float32 sampler log-probs or None (no mismatch correction).
      rollout_correction: a :class:`RolloutCorrection` (with ``rollout_logps``) or None.
      token_select: ``[B, T]`` bool or None: the tokens that receive policy gradient
        (``top_entropy_quantile``, :func:`high_entropy_tokens`); None: all.
      entropy_coef: float32 scalar or None: the entropy term ``-entropy_coef * agg(H)`` of the loss
        (:meth:`Objective.entropy_weights`); None: no term.
    """

    mask: jax.Array
    advantages: jax.Array
    old_logps: jax.Array | None = None
    ref_logps: jax.Array | None = None
    rollout_is_ratio: jax.Array | None = None
    ids: jax.Array | None = None
    num_items: jax.Array | None = None
    temperature: jax.Array | None = None
    segment_ids: jax.Array | None = None
    rollout_logps: jax.Array | None = None
    rollout_correction: RolloutCorrection | None = None
    token_select: jax.Array | None = None
    entropy_coef: jax.Array | None = None

    def rows(self, start, size: int, live=None) -> PolicyInputs:
        """Rows ``[start, start + size)`` (``start`` may be traced); ``live`` (``[size]`` bool) masks rows
        out of the slice (those another chunk owns). A sequence never spans rows, so a chunk of rows
        holds whole sequences."""

        def cut(x):
            return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)

        mask = cut(self.mask) if live is None else cut(self.mask) & live[:, None]
        return self._replace(
            mask=mask,
            advantages=cut(self.advantages),
            old_logps=cut(self.old_logps),
            ref_logps=cut(self.ref_logps),
            rollout_is_ratio=cut(self.rollout_is_ratio),
            ids=cut(self.ids),
            segment_ids=cut(self.segment_ids),
            rollout_logps=cut(self.rollout_logps),
            token_select=cut(self.token_select),
        )

    def specs(self, rows, scalar) -> PolicyInputs:
        """The same pytree holding ``rows`` for every per-sequence field and ``scalar`` for the scalars
        (e.g. the ``jax.shard_map`` partition specs of a data-parallel call)."""
        return PolicyInputs(rows, rows, rows, rows, rows, rows, scalar, scalar, rows, rows, scalar, rows, scalar)

    def token_advantages(self) -> jax.Array:
        """``[B, T]`` float32: each token's advantage (a ``[B]`` advantage broadcast over its row)."""
        a = self.advantages.astype(jnp.float32)
        return a if a.ndim == 2 else jnp.broadcast_to(a[:, None], self.mask.shape)

    def token_policy_weights(self) -> jax.Array | None:
        """``[B, T]`` (or ``[B, 1]``) weight of each token's policy term known before the log-probs:
        ``rollout_is_ratio`` times the entropy selection ``token_select``; None without either."""
        w, sel = self.rollout_is_ratio, self.token_select
        if sel is None:
            return w
        sel = sel.astype(jnp.float32)
        return sel if w is None else w * sel

    def sequences(self) -> Sequences:
        """Where this batch's sequences lie (:class:`Sequences`)."""
        return Sequences.of(self.mask, self.segment_ids)


class Sequences(NamedTuple):
    """The sequences of a ``[B, T]`` batch, for the objectives' per-sequence reductions.

    Padded layout (``segment_ids`` None): row ``b`` is sequence ``b`` (``B`` of them, empty rows counted).
    Packed layout: each maximal run of equal positive ``segment_ids`` within a row is a sequence; the
    runs get slots ``0 .. B*T - 1`` in row-major order (runs of id 0, padding, get slots with no
    unmasked token). Per-sequence vectors have one entry per slot; a slot without an unmasked token
    contributes nothing to any objective.

    Attributes:
      index: ``[B, T]`` int32 slot of each token, or None (padded: the row).
      heads: ``[B, T]`` bool, the first token of each sequence (positive id), or None (padded).
      slots: number of slots (static): ``B`` padded, ``B * T`` packed.
    """

    index: jax.Array | None
    heads: jax.Array | None
    slots: int

    @staticmethod
    def of(mask: jax.Array, segment_ids: jax.Array | None) -> Sequences:
        if segment_ids is None:
            return Sequences(None, None, mask.shape[0])
        seg = segment_ids
        start = seg != jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # t = 0 starts a run
        index = (jnp.cumsum(start.reshape(-1), dtype=jnp.int32) - 1).reshape(seg.shape)
        return Sequences(index, start & (seg > 0), seg.size)

    def sum(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """Per-sequence sums ``[slots]`` of ``x`` over the unmasked tokens (float32)."""
        x = jnp.where(mask, x, 0.0)
        if self.index is None:
            return jnp.sum(x, axis=1)
        return jax.ops.segment_sum(x.reshape(-1), self.index.reshape(-1), self.slots, indices_are_sorted=True)

    def lengths(self, mask: jax.Array) -> jax.Array:
        """Unmasked tokens per sequence ``[slots]`` (float32, counted in int32)."""
        if self.index is None:
            return jnp.sum(mask, axis=1, dtype=jnp.int32).astype(jnp.float32)
        m = mask.reshape(-1).astype(jnp.int32)
        return jax.ops.segment_sum(m, self.index.reshape(-1), self.slots, indices_are_sorted=True).astype(jnp.float32)

    def tokens(self, v: jax.Array, shape) -> jax.Array:
        """A per-sequence vector ``[slots]`` spread over the tokens: ``[B, T]``."""
        return jnp.broadcast_to(v[:, None], shape) if self.index is None else v[self.index]

    def count(self) -> jax.Array:
        """The number of sequences (float32): ``B`` padded, the positive-id runs packed (at least 1, so
        that a packed batch of padding only has loss 0, not 0 / 0)."""
        if self.heads is None:
            return jnp.asarray(self.slots, jnp.float32)
        return jnp.maximum(jnp.sum(self.heads, dtype=jnp.int32), 1).astype(jnp.float32)

    def mean_advantages(self, inputs: PolicyInputs) -> jax.Array:
        """One advantage per sequence ``[slots]``: a ``[B]`` advantage as given (padded layout), else the
        mean of the sequence's unmasked tokens' advantages (0 for an empty sequence)."""
        if self.index is None and inputs.advantages.ndim == 1:
            return inputs.advantages.astype(jnp.float32)
        m = inputs.mask
        return self.sum(inputs.token_advantages(), m) / jnp.maximum(self.lengths(m), 1.0)


class MetricSums(NamedTuple):
    """Metric accumulators over a chunk; float32 scalars. The first :attr:`ADDITIVE` are sums (added over
    chunks, ``psum`` over devices), the log-ratio range a min / max.

    Attributes:
      kl: ``sum m kl`` (the per-token KL, bias-corrected where the loss is).
      kl_term: the numerator of the loss's KL part without ``beta``: the per-token KL aggregated as the loss
        aggregates it (per-sequence means summed for gmpo / grpo / sapo, the token sum otherwise).
      entropy: ``sum m H`` where the loss computes the entropies (``entropy_coef``), else 0.
    """

    kl: jax.Array
    kl_term: jax.Array
    entropy: jax.Array
    clipped: jax.Array
    clipped_low: jax.Array
    clipped_high: jax.Array
    log_ratio_min: jax.Array
    log_ratio_max: jax.Array

    ADDITIVE = 6  # the leading fields that are sums

    @staticmethod
    def zeros() -> MetricSums:
        z = jnp.zeros((), jnp.float32)
        return MetricSums(
            *(z,) * MetricSums.ADDITIVE, jnp.array(jnp.inf, jnp.float32), jnp.array(-jnp.inf, jnp.float32)
        )

    def combine(self, other: MetricSums) -> MetricSums:
        n = MetricSums.ADDITIVE
        return MetricSums(
            *(a + b for a, b in zip(self[:n], other[:n])),
            jnp.minimum(self.log_ratio_min, other.log_ratio_min),
            jnp.maximum(self.log_ratio_max, other.log_ratio_max),
        )

    def all_reduce(self, axis) -> MetricSums:
        """The sums over the devices of the mesh axis ``axis`` (inside ``jax.shard_map``)."""
        lax = jax.lax
        return MetricSums(
            *(lax.psum(x, axis) for x in self[: MetricSums.ADDITIVE]),
            lax.pmin(self.log_ratio_min, axis),
            lax.pmax(self.log_ratio_max, axis),
        )

    def with_entropy(self, entropy: jax.Array, mask: jax.Array) -> MetricSums:
        """These sums with ``entropy`` set to ``sum mask * entropy`` (no gradient; any shapes that match)."""
        e = jax.lax.stop_gradient(entropy).astype(jnp.float32).reshape(mask.shape)
        return self._replace(entropy=_masked_sum(e, mask))


def _concrete_value(x: Any) -> float | None:
    """The value of a concrete scalar hyper-parameter (Python / NumPy number, or a JAX scalar that is not
    being traced); None for tracers and anything else (e.g. the None leaves of a ``jax.tree.map``)."""
    if isinstance(x, bool) or isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, (np.ndarray, np.generic, jax.Array)) and np.shape(x) == ():
        try:
            return float(x)
        except (TypeError, jax.errors.ConcretizationTypeError):
            return None
    return None


def _check_type(name: str, value: Any) -> None:
    if isinstance(value, (str, bool)) or (hasattr(value, "shape") and np.shape(value) != ()):
        raise TypeError(f"{name} must be a real scalar (Python float or a JAX / NumPy scalar), got {name}={value!r}")


def _check_nonneg(name: str, value: Any) -> None:
    _check_type(name, value)
    v = _concrete_value(value)
    if v is not None and not v >= 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value!r}")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def _check_token_level(cls_name: str, level: Any) -> None:
    if level != "token":
        raise ValueError(
            f"{cls_name} is defined at token level only (sequence-level importance sampling with "
            f"{cls_name} is a configuration error), got importance_sampling_level={level!r}"
        )


def _check_pos(name: str, value: Any) -> None:
    _check_type(name, value)
    v = _concrete_value(value)
    if v is not None and not v > 0:
        raise ValueError(f"{name} must be > 0, got {name}={value!r}")


def _masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


def _k3_kl(logp: jax.Array, ref: jax.Array, mask: jax.Array) -> jax.Array:
    """Schulman's k3 estimator ``exp(d) - d - 1`` with ``d = ref - logp`` (0 on masked tokens).

    For ``|d| < 1/2`` it is the Taylor series ``sum_{n=2..8} d**n / n!`` (truncation below 5e-8 of the
    value): the plain form cancels there (float32 loses ``2**-24 / (d**2 / 2)`` of it: 1 % at
    ``d = 3e-3``, a typical KL). Elementwise jnp only (the fused kernel traces its gradient)."""
    d = jnp.where(mask, ref - logp, 0.0)
    near = (d > -0.5) & (d < 0.5)
    y = jnp.where(near, d, 0.0)
    series = 1.0 / 40320.0
    for n in range(7, 1, -1):
        series = 1.0 / math.factorial(n) + y * series
    return jnp.where(near, y * y * series, jnp.exp(d) - d - 1.0)


def _log_ratio(logp: jax.Array, data: PolicyInputs) -> jax.Array:
    """Per-token log importance ratio ``r = logp - old`` (0 on masked tokens; on-policy: value 0, slope 1)."""
    return _token_log_ratio(logp, data.old_logps, data.mask)


def _token_log_ratio(logp, old_logps, mask):
    """:func:`_log_ratio` of plain arrays (``old_logps`` None: on-policy)."""
    old = jax.lax.stop_gradient(logp) if old_logps is None else old_logps
    return jnp.where(mask, logp - old, 0.0)


def _log_ratio_range(r: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    r = jax.lax.stop_gradient(r)
    return (jnp.min(jnp.where(mask, r, jnp.inf)), jnp.max(jnp.where(mask, r, -jnp.inf)))


def _rollout_d(logp, data: PolicyInputs):
    """``old - rollout`` per token (0 on masked tokens; no gradient); ``old = logp`` on-policy."""
    old = logp if data.old_logps is None else data.old_logps
    return jax.lax.stop_gradient(jnp.where(data.mask, old - data.rollout_logps, 0.0))


def _positive_cap(cap):
    """The cap as float32; NaN where a traced cap is ``<= 0`` (a concrete one raised already): a NaN loss,
    never a weight of the wrong sign."""
    cap = jnp.asarray(cap, jnp.float32)
    return jnp.where(cap > 0, cap, jnp.nan)


def _capped(log_w, cap, mode: str):
    """``min(e^x, cap)`` (truncate) or ``e^x if e^x <= cap else 0`` (mask), elementwise, float32."""
    w = jnp.exp(log_w)
    cap = _positive_cap(cap)
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
        u = _capped(d, corr.cap, corr.mode)
        w = u if w is None else w * u
    return w


class Objective:
    """Interface shared by every objective (see module docstring)."""

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
        raise NotImplementedError

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
        gradient whatever its values (its loss is weighted by 0). Only for :attr:`token_local` objectives."""
        raise NotImplementedError(f"{type(self).__name__} is not token-local")

    def token_weights(self, mask, num_items_in_batch, segment_ids=None):
        """``[B, T]`` float32 weight of each token's :meth:`token_loss` in the loss (0 where masked)."""
        raise NotImplementedError(f"{type(self).__name__} is not token-local")

    # --- shared ---------------------------------------------------------------------------
    def entropy_weights(self, mask, segment_ids=None) -> jax.Array:
        """``[B, T]`` float32 weights ``w`` of the entropy term in the loss NUMERATOR:
        ``loss += -entropy_coef * sum_{b,t} w H / denominator``. The objective's own aggregation of a
        per-token quantity, the one its KL term has: the per-sequence mean (``w = m / max(n_b, 1)``) for
        grpo, sapo and gmpo, the token sum (``w = m``) for bnpo, dapo, dr_grpo and cispo. Local to a chunk
        of whole sequences (the denominator is the global one)."""
        m = mask.astype(jnp.float32)
        if self.loss_type not in ("grpo", "sapo", "gmpo"):
            return m
        seqs = Sequences.of(mask, segment_ids)
        return m / seqs.tokens(jnp.maximum(seqs.lengths(mask), 1.0), mask.shape)

    def __post_init__(self):
        self._check()
        # Static (pytree aux data): fixed here from the beta given at construction, restored as it is when
        # JAX rebuilds the objective from its leaves (:func:`_register`), never re-derived from a tracer.
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
        ``GMPO(beta=0.0)`` and ``GMPO(beta=0.1)`` differ in structure (one program each). An objective
        defined elsewhere without ``Objective.__post_init__`` gets it from its ``beta`` here."""
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

    def _kl_term(self, logp, data: PolicyInputs, log_weight) -> jax.Array | None:
        """Per-token KL (k3), optionally bias-corrected by ``exp(log_weight)``.

        None without a reference or without a KL term (:attr:`has_kl` False; SPEC: the KL term exists
        only if beta != 0). A traced beta that is 0 selects the KL away before it is formed, so an
        overflowing ``exp(ref - logp)`` cannot turn into ``0 * inf``.
        """
        return self._kl_values(logp, data.ref_logps, data.mask, log_weight)

    def _kl_values(self, logp, ref, mask, log_weight) -> jax.Array | None:
        """:meth:`_kl_term` on plain arrays (``mask`` may be the scalar True)."""
        if ref is None or not self.has_kl:
            return None
        beta = getattr(self, "beta", 0.0)
        live = mask if _concrete_value(beta) is not None else mask & (jnp.asarray(beta) != 0)
        kl = _k3_kl(logp, ref, live)
        if getattr(self, "use_bias_correction_kl", False):
            kl = kl * jnp.exp(jnp.where(live, log_weight, 0.0))
        return kl


_DERIVED = ("_has_kl",)  # an objective's static attributes set by Objective.__post_init__


def _register(cls, data_fields, meta_fields, derived=()):
    """``cls`` as a frozen dataclass registered as a pytree: ``data_fields`` are leaves, ``meta_fields`` and
    the ``derived`` attributes (set by ``__post_init__``, e.g. ``_has_kl``) static aux data.

    Unlike ``jax.tree_util.register_dataclass`` (whose unflatten calls ``cls(**fields)``, i.e. reruns
    ``__post_init__`` on whatever the leaves are: tracers under ``jit``), unflattening restores the derived
    attributes from the aux data and reruns only the checks (``_check``), so a static decision made from
    concrete values at construction survives ``jit`` / ``vmap`` / ``shard_map`` / ``jax.tree.map``."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    data_fields, static = tuple(data_fields), tuple(meta_fields) + tuple(derived)
    init_fields = {f.name for f in dataclasses.fields(cls) if f.init}
    assert init_fields == set(data_fields) | set(meta_fields), (cls, init_fields)

    def flatten(x):
        return tuple(getattr(x, n) for n in data_fields), tuple(getattr(x, n) for n in static)

    def flatten_with_keys(x):
        leaves, aux = flatten(x)
        return tuple(zip((jax.tree_util.GetAttrKey(n) for n in data_fields), leaves)), aux

    def unflatten(aux, leaves):
        x = object.__new__(cls)
        for name, value in (*zip(static, aux), *zip(data_fields, leaves)):
            object.__setattr__(x, name, value)
        x._check()
        return x

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


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


# ------------------------------------------------------------------------------------------------
# GMPO
# ------------------------------------------------------------------------------------------------
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
      beta: KL coefficient, ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference (``ref_logps`` or
        ``ref_hidden``/``ref_weight``) at call time.
      use_bias_correction_kl: multiply the per-token KL by the unclipped ratio ``exp(r)`` (static).
      importance_sampling_level: ``"token"`` only (static; the field exists for TRL / Liger signature
        compatibility; ``"sequence"`` raises).

    Raises:
      ValueError: a negative epsilon or beta given as a Python number.

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
        _check_nonneg("beta", self.beta)

    @property
    def loss_type(self) -> str:
        return "gmpo"

    def denominator(self, mask, num_items_in_batch, segment_ids=None):
        return Sequences.of(mask, segment_ids).count()

    def chunk_numerator(self, logp, data):
        m = data.mask
        seqs = data.sequences()
        adv = seqs.mean_advantages(data)
        a = seqs.tokens(adv, m.shape)
        r = _log_ratio(logp, data)
        r_v = jax.lax.stop_gradient(r)
        eh = jnp.asarray(self.epsilon_high, jnp.float32)
        el = jnp.asarray(self.epsilon_low, jnp.float32)
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
        numerator = jnp.sum(seq_term)
        kl = self._kl_term(logp, data, r)
        kl_sum = kl_term = jnp.zeros((), jnp.float32)
        if kl is not None:
            kl_seq = seqs.sum(kl, m) / jnp.maximum(seqs.lengths(m), 1.0)
            numerator = numerator + jnp.asarray(self.beta, jnp.float32) * jnp.sum(kl_seq)
            kl_sum = jax.lax.stop_gradient(_masked_sum(kl, m))
            kl_term = jax.lax.stop_gradient(jnp.sum(kl_seq))
        cl = m & low & (a < 0)
        ch = m & high & (a > 0)
        sums = MetricSums(
            kl=kl_sum,
            kl_term=kl_term,
            entropy=jnp.zeros((), jnp.float32),
            clipped=jnp.sum(cl | ch, dtype=jnp.int32).astype(jnp.float32),
            clipped_low=jnp.sum(cl, dtype=jnp.int32).astype(jnp.float32),
            clipped_high=jnp.sum(ch, dtype=jnp.int32).astype(jnp.float32),
            log_ratio_min=_log_ratio_range(r, m)[0],
            log_ratio_max=_log_ratio_range(r, m)[1],
        )
        return numerator, sums


def _gmpo_rollout(logp, data: PolicyInputs, seqs: Sequences):
    """GMPO's mismatch correction: ``(tokens of the geometric mean [B, T] bool, weight per sequence
    [slots] or None)``. ``rollout_is_ratio`` (``[B, T]``; ``[B, 1]`` per row) enters as the geometric
    mean of the sequence's token ratios (a 0 zeroes the sequence); the :class:`RolloutCorrection` as
    defined there."""
    m = data.mask
    log_w, keep = None, m
    if data.rollout_is_ratio is not None:
        ris = jnp.broadcast_to(data.rollout_is_ratio.astype(jnp.float32), m.shape)
        log_w = seqs.sum(jnp.log(jnp.where(m, ris, 1.0)), m) / jnp.maximum(seqs.lengths(m), 1.0)
    corr = data.rollout_correction
    if data.rollout_logps is None or corr is None:
        return keep, None if log_w is None else jnp.exp(log_w)
    d = _rollout_d(logp, data)
    cap = _positive_cap(corr.cap)
    if corr.mode == "token_truncate":
        u = jnp.exp(seqs.sum(jnp.minimum(d, jnp.log(cap)), m) / jnp.maximum(seqs.lengths(m), 1.0))
    elif corr.mode == "token_mask":
        keep = m & ~(jnp.exp(d) > cap)
        u = jnp.exp(seqs.sum(d, keep) / jnp.maximum(seqs.lengths(keep), 1.0))
    else:
        u = _capped(seqs.sum(d, m), cap, corr.mode)
    return keep, u if log_w is None else u * jnp.exp(log_w)


GMPO = _register(
    GMPO, ["epsilon_low", "epsilon_high", "beta"], ["use_bias_correction_kl", "importance_sampling_level"], _DERIVED
)


# ------------------------------------------------------------------------------------------------
# The GRPO family (ratio space): grpo, bnpo, dr_grpo, dapo; plus CISPO and SAPO
# ------------------------------------------------------------------------------------------------
_GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_IS_LEVELS = ("token", "sequence")


def _sequence_log_weight(r, mask, seqs: Sequences):
    """GSPO: the sequence-mean log ratio spread over its tokens."""
    return seqs.tokens(seqs.sum(r, mask) / jnp.maximum(seqs.lengths(mask), 1.0), r.shape)


def _reduce(loss_type, ptl, mask, seqs: Sequences):
    """Numerator of the loss type's reduction (SPEC.md "Reductions")."""
    if loss_type in ("grpo", "sapo"):
        return jnp.sum(seqs.sum(ptl, mask) / jnp.maximum(seqs.lengths(mask), 1.0))
    return _masked_sum(ptl, mask)


def _denominator(loss_type, mask, num_items_in_batch, max_completion_length, segment_ids=None):
    if loss_type in ("grpo", "sapo", "gmpo"):
        return Sequences.of(mask, segment_ids).count()
    if loss_type == "bnpo":
        return jnp.maximum(jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32), 1.0)
    if loss_type == "dr_grpo":
        return Sequences.of(mask, segment_ids).count() * max_completion_length
    # dapo, cispo
    n = jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32) if num_items_in_batch is None else num_items_in_batch
    return jnp.maximum(jnp.asarray(n, jnp.float32), 1.0)


def _token_tail(self_, ptl, logp, ref, ris, log_weight, mask):
    """Per token: the rollout IS correction and the KL term; returns (loss, kl or None)."""
    if ris is not None:
        ptl = ptl * ris.astype(jnp.float32)
    kl = self_._kl_values(logp, ref, mask, log_weight)
    if kl is not None:
        ptl = ptl + jnp.asarray(self_.beta, jnp.float32) * kl
    return ptl, kl


def _token_weights(loss_type, mask, num_items_in_batch, max_completion_length, segment_ids=None):
    """``[B, T]`` weights ``w`` with ``loss = sum w * ptl`` (SPEC.md "Reductions")."""
    w = mask.astype(jnp.float32) / _denominator(loss_type, mask, num_items_in_batch, max_completion_length, segment_ids)
    if loss_type in ("grpo", "sapo"):
        seqs = Sequences.of(mask, segment_ids)
        w = w / seqs.tokens(jnp.maximum(seqs.lengths(mask), 1.0), mask.shape)
    return w


def _finish(self_, ptl, logp, r, log_weight, data, clipped_low, clipped_high):
    """Shared tail: rollout IS correction, KL, reduction, metrics."""
    m = data.mask
    ptl, kl = _token_tail(self_, ptl, logp, data.ref_logps, _rollout_token_weights(logp, data), log_weight, m)
    seqs = data.sequences()
    kl_sum = kl_term = jnp.zeros((), jnp.float32)
    if kl is not None:
        kl_sum = jax.lax.stop_gradient(_masked_sum(kl, m))
        kl_term = jax.lax.stop_gradient(_reduce(self_.loss_type, kl, m, seqs))
    numerator = _reduce(self_.loss_type, ptl, m, seqs)
    cl = m & clipped_low
    ch = m & clipped_high
    lo, hi = _log_ratio_range(r, m)
    sums = MetricSums(
        kl=kl_sum,
        kl_term=kl_term,
        entropy=jnp.zeros((), jnp.float32),
        clipped=jnp.sum(cl | ch, dtype=jnp.int32).astype(jnp.float32),
        clipped_low=jnp.sum(cl, dtype=jnp.int32).astype(jnp.float32),
        clipped_high=jnp.sum(ch, dtype=jnp.int32).astype(jnp.float32),
        log_ratio_min=lo,
        log_ratio_max=hi,
    )
    return numerator, sums


class GRPO(Objective):
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
      epsilon_low: ``>= 0``; lower clip ``1 - epsilon_low`` of the ratio. Default 0.2.
      epsilon_high: ``>= 0``; upper clip ``1 + epsilon_high``. Default 0.2 (DAPO's clip-higher: 0.28).
      beta: KL coefficient ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference at call time.
      importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO) (static).
      delta: optional upper bound ``> 0`` on the unclipped ratio (two-sided clipping, TRL ``delta``).
      use_bias_correction_kl: multiply the KL by the unclipped ratio :math:`e^{w}` (static).
      max_completion_length: positive int, required for ``dr_grpo`` (static).

    Raises:
      ValueError: unknown ``loss_type`` / ``importance_sampling_level``, negative epsilon or beta,
        ``delta <= 0``, a ``max_completion_length`` that is not a positive int (``dr_grpo``
        requires one).

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
        _check_nonneg("beta", self.beta)
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

    def denominator(self, mask, num_items_in_batch, segment_ids=None):
        return _denominator(self.loss_type, mask, num_items_in_batch, self.max_completion_length, segment_ids)

    @property
    def token_local(self) -> bool:
        return self.importance_sampling_level == "token"

    def token_weights(self, mask, num_items_in_batch, segment_ids=None):
        return _token_weights(self.loss_type, mask, num_items_in_batch, self.max_completion_length, segment_ids)

    def token_loss(self, logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask=True):
        if not self.token_local:
            return super().token_loss(logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask)
        r = _token_log_ratio(logp, old_logps, mask)
        ptl, _, _ = self._surrogate(r, advantages, mask)
        return _token_tail(self, ptl, logp, ref_logps, rollout_is_ratio, r, mask)[0]

    def _surrogate(self, w, a, m):
        """Per token: ``-min(rho A, clip(rho) A)`` of the log weight ``w`` (+ delta), and the clip flags."""
        # branch decisions on values (no gradient)
        w_v = jax.lax.stop_gradient(w)
        coef_v = jnp.exp(w_v)
        lo = 1.0 - jnp.asarray(self.epsilon_low, jnp.float32)
        hi = 1.0 + jnp.asarray(self.epsilon_high, jnp.float32)
        low = coef_v < lo
        high = coef_v > hi
        coef2_v = jnp.where(low, lo, jnp.where(high, hi, coef_v))
        delta_clipped = None
        coef1_v = coef_v
        if self.delta is not None:
            delta = jnp.asarray(self.delta, jnp.float32)
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
        return -surrogate, low & (a < 0), high & (a > 0)

    def chunk_numerator(self, logp, data):
        m = data.mask
        a = data.token_advantages()
        r = _log_ratio(logp, data)
        w = _sequence_log_weight(r, m, data.sequences()) if self.importance_sampling_level == "sequence" else r
        ptl, clipped_low, clipped_high = self._surrogate(w, a, m)
        return _finish(self, ptl, logp, r, w, data, clipped_low, clipped_high)


GRPO = _register(
    GRPO,
    ["epsilon_low", "epsilon_high", "beta", "delta"],
    ["loss_type", "importance_sampling_level", "use_bias_correction_kl", "max_completion_length"],
    _DERIVED,
)


class CISPO(Objective):
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
        ``epsilon_high``, i.e. the 0.2 default trains at a fifth of the learning rate (measured in the
        demo task: reward 0.13 -> 0.29 in 60 steps at 0.2; the ``gmpo-jax train`` CLI uses 5.0).
      beta: KL coefficient ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference at call time.
      use_bias_correction_kl: multiply the KL by :math:`e^{r}` (static).
      importance_sampling_level: ``"token"`` only (static; the field exists for TRL / Liger signature
        compatibility; ``"sequence"`` raises).

    Raises:
      ValueError: negative ``epsilon_high`` or ``beta``.

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
        _check_nonneg("epsilon_high", self.epsilon_high)
        _check_nonneg("beta", self.beta)

    @property
    def loss_type(self) -> str:
        return "cispo"

    def denominator(self, mask, num_items_in_batch, segment_ids=None):
        return _denominator("cispo", mask, num_items_in_batch, None, segment_ids)

    token_local = True

    def token_weights(self, mask, num_items_in_batch, segment_ids=None):
        return _token_weights("cispo", mask, num_items_in_batch, None, segment_ids)

    def token_loss(self, logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask=True):
        r = _token_log_ratio(logp, old_logps, mask)
        ptl, _ = self._surrogate(logp, r, advantages, mask)
        return _token_tail(self, ptl, logp, ref_logps, rollout_is_ratio, r, mask)[0]

    def _surrogate(self, logp, r, a, m):
        coef_v = jnp.exp(jax.lax.stop_gradient(r))
        eh = jnp.asarray(self.epsilon_high, jnp.float32)
        high = coef_v > eh
        weight = jnp.where(high, eh, coef_v)
        return jnp.where(a != 0, -(weight * a) * jnp.where(m, logp, 0.0), 0.0), high

    def chunk_numerator(self, logp, data):
        m = data.mask
        a = data.token_advantages()
        r = _log_ratio(logp, data)
        ptl, high = self._surrogate(logp, r, a, m)
        return _finish(self, ptl, logp, r, r, data, jnp.zeros_like(high), high & (a > 0))


CISPO = _register(CISPO, ["epsilon_high", "beta"], ["use_bias_correction_kl", "importance_sampling_level"], _DERIVED)


class SAPO(Objective):
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
      beta: KL coefficient ``>= 0``; non-zero (or traced) at construction gives the loss a KL term
        (:attr:`Objective.has_kl`, static), which needs a reference at call time.
      use_bias_correction_kl: multiply the KL by :math:`e^{r}` (static).
      importance_sampling_level: ``"token"`` only (static; the field exists for TRL / Liger signature
        compatibility; ``"sequence"`` raises).

    Raises:
      ValueError: a temperature ``<= 0`` or a negative ``beta``.

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
        _check_nonneg("beta", self.beta)

    @property
    def loss_type(self) -> str:
        return "sapo"

    def denominator(self, mask, num_items_in_batch, segment_ids=None):
        return _denominator("sapo", mask, num_items_in_batch, None, segment_ids)

    token_local = True

    def token_weights(self, mask, num_items_in_batch, segment_ids=None):
        return _token_weights("sapo", mask, num_items_in_batch, None, segment_ids)

    def token_loss(self, logp, old_logps, ref_logps, advantages, rollout_is_ratio, mask=True):
        r = _token_log_ratio(logp, old_logps, mask)
        ptl = jnp.where(mask, self._surrogate(r, advantages), 0.0)
        return _token_tail(self, ptl, logp, ref_logps, rollout_is_ratio, r, mask)[0]

    def _surrogate(self, r, a):
        tau = jnp.where(
            a > 0, jnp.asarray(self.temperature_pos, jnp.float32), jnp.asarray(self.temperature_neg, jnp.float32)
        )
        capped = jax.lax.stop_gradient(r) > _SAPO_LOG_RATIO_CAP
        w = jnp.where(capped, _SAPO_LOG_RATIO_CAP, r)
        gate = jax.nn.sigmoid(tau * (jnp.exp(w) - 1.0)) * (4.0 / tau)
        return jnp.where(a != 0, -a * gate, 0.0)

    def chunk_numerator(self, logp, data):
        m = data.mask
        a = data.token_advantages()
        r = _log_ratio(logp, data)
        no = jnp.zeros_like(m)
        return _finish(self, self._surrogate(r, a), logp, r, r, data, no, no)


SAPO = _register(
    SAPO,
    ["temperature_pos", "temperature_neg", "beta"],
    ["use_bias_correction_kl", "importance_sampling_level"],
    _DERIVED,
)


class LossAux(NamedTuple):
    """Metrics returned beside the loss; float32 scalars, no gradient (SPEC.md "Metrics").

    Attributes:
      kl: ``sum m kl / max(sum m, 1)``: mean per-token k3 KL to the reference (0 without a reference).
      clip_fraction: fraction of unmasked tokens clipped on the side that matters for their advantage
        (low-clipped with ``A < 0`` or high-clipped with ``A > 0``; CISPO: high only; SAPO: 0).
      clip_fraction_low: the low-clipped part of ``clip_fraction``.
      clip_fraction_high: the high-clipped part of ``clip_fraction``.
      loss_numerator: the loss before normalisation; ``loss == loss_numerator / loss_denominator``.
        Sum numerators and denominators over micro-batches to re-normalise exactly. Like every field
        here it carries no gradient: to train on a re-normalised loss, differentiate
        ``loss * loss_denominator / global_denominator`` (``loss`` does carry the gradient).
      loss_denominator: the loss type's normaliser for this call (``B`` for grpo / sapo / gmpo, the token
        count for bnpo / dapo / cispo, ``B * max_completion_length`` for dr_grpo; ``B`` is the number of
        sequences: of a packed batch, its positive-id runs).
      log_ratio_min: smallest unmasked token log importance ratio ``logp - old`` (0 if all masked).
      log_ratio_max: largest unmasked token log importance ratio (0 if all masked).
      entropy_threshold: with ``top_entropy_quantile < 1``, the entropy at or above which a token received
        policy gradient (:func:`high_entropy_tokens`); else 0.
      kl_term: the KL term exactly as the loss aggregates it, without ``beta``: the numerator of the loss's
        KL part over ``loss_denominator``, so that ``loss = policy part + beta * kl_term`` (+ the entropy
        term), i.e. ``loss(beta) - loss(0) == beta * kl_term``. gmpo / grpo / sapo: the mean over
        sequences of each sequence's token-mean KL; bnpo / dapo / cispo: ``sum m kl`` over the normaliser
        (with ``num_items_in_batch``: over it); dr_grpo: over ``B * max_completion_length``. ``kl`` is
        TRL's token mean (the metric to compare with TRL); the two agree for bnpo and dapo / cispo
        without ``num_items_in_batch``. 0 without a KL term.
      entropy: ``sum m H / max(sum m, 1)``, the mean per-token entropy of ``softmax(z / temperature)`` over
        the unmasked tokens (TRL's ``entropy`` metric), where the loss computes the entropies anyway
        (``entropy_coef`` given, or ``top_entropy_quantile < 1``); else 0.
    """

    kl: jax.Array
    clip_fraction: jax.Array
    clip_fraction_low: jax.Array
    clip_fraction_high: jax.Array
    loss_numerator: jax.Array
    loss_denominator: jax.Array
    log_ratio_min: jax.Array
    log_ratio_max: jax.Array
    entropy_threshold: jax.Array
    kl_term: jax.Array
    entropy: jax.Array


def token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum mask * x / max(sum mask, 1)`` in float32, no gradient (e.g. :attr:`LossAux.entropy`)."""
    n = jnp.maximum(jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32), 1.0)
    return _masked_sum(jax.lax.stop_gradient(x).astype(jnp.float32), mask) / n


def high_entropy_tokens(
    entropy: jax.Array, mask: jax.Array, top_entropy_quantile: float
) -> tuple[jax.Array, jax.Array]:
    """The tokens whose entropy is in the top ``top_entropy_quantile`` of the unmasked tokens.

    ``threshold = quantile(entropy[mask], 1 - top_entropy_quantile)`` (linear interpolation, as
    ``numpy.quantile`` and TRL's ``get_high_entropy_mask``) and ``select = mask & (entropy >= threshold)``.

    Args:
      entropy: ``[B, T]`` float per-token entropies (of the temperature-scaled softmax).
      mask: ``[B, T]`` bool; only these tokens enter the quantile and may be selected.
      top_entropy_quantile: Python float in ``(0, 1]``; 1 selects every unmasked token.

    Returns:
      ``(select [B, T] bool, threshold float32 scalar)``; with no unmasked token, nothing is selected and
      the threshold is 0. On sharded inputs (data parallel) the quantile is over the global batch.

    References: Wang et al., "Beyond the 80/20 Rule", arXiv 2506.01939; TRL ``top_entropy_quantile``.
    """
    e = jnp.where(mask, entropy.astype(jnp.float32), jnp.nan)
    threshold = jnp.nanquantile(e, 1.0 - top_entropy_quantile)
    return mask & (e >= threshold), jnp.where(jnp.any(mask), threshold, 0.0)


def evaluate(
    objective: Objective, logp: jax.Array, inputs: PolicyInputs, denominator: jax.Array, *, with_grads: bool
) -> tuple[jax.Array, MetricSums, jax.Array | None]:
    """The objective on the log-probs ``[C, T]`` of whole sequences: ``(numerator, sums, dlogp)``.

    ``dlogp = d (numerator / denominator) / d logp`` (``jax.grad`` of :meth:`Objective.chunk_numerator`,
    whose selects implement SPEC.md's strict boundary rule), exactly 0 at masked tokens; None without
    ``with_grads``. ``denominator`` is the whole call's (global) normaliser, so chunks and shards give
    final per-token gradients. Shared by the LM-head scan, the logits VJP and the dense reference.
    """
    with jax.named_scope("gmpo_jax/objective"):
        if not with_grads:
            num, sums = objective.chunk_numerator(logp, inputs)
            return num, sums, None
        (num, sums), g = jax.value_and_grad(lambda lp: objective.chunk_numerator(lp, inputs), has_aux=True)(logp)
        return num, sums, jnp.where(inputs.mask, g / denominator, 0.0)


def loss_and_aux(
    numerator: jax.Array, denominator: jax.Array, sums: MetricSums, mask: jax.Array
) -> tuple[jax.Array, LossAux]:
    """``(numerator / denominator, LossAux)`` from the global sums and the whole call's mask (SPEC.md "Metrics")."""
    n = jnp.maximum(jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32), 1.0)
    any_tok = jnp.any(mask)
    aux = LossAux(
        kl=sums.kl / n,
        clip_fraction=sums.clipped / n,
        clip_fraction_low=sums.clipped_low / n,
        clip_fraction_high=sums.clipped_high / n,
        loss_numerator=jax.lax.stop_gradient(numerator),
        loss_denominator=denominator,
        log_ratio_min=jnp.where(any_tok, sums.log_ratio_min, 0.0),
        log_ratio_max=jnp.where(any_tok, sums.log_ratio_max, 0.0),
        entropy_threshold=jnp.zeros((), jnp.float32),
        kl_term=sums.kl_term / denominator,
        entropy=sums.entropy / n,
    )
    return numerator / denominator, aux
