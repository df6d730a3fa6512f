"""The LM-head backend seam: per-chunk log-probs and gradients of ``z = (h W + c) / tau``, and its registry.

Every LM-head loss shares one fused path (``gmpo_jax.lm_head.vjp``) that works on chunks of whole
sequences flattened to ``R`` rows. A backend supplies the two LM-head computations on such rows; the
objective math lives in ``gmpo_jax.objectives``, so a backend never sees a loss. Dispatch:
``gmpo_jax._dispatch``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax.numpy as jnp
from jax import lax

from gmpo_jax._dispatch import dispatch
from gmpo_jax._validation import LOGITS_PRECISIONS  # logits_precision -> split order (a leaf's constant)
from gmpo_jax.options import LM_HEAD_IMPLEMENTATIONS

__all__ = [
    "LMHeadBackend",
    "HeadSettings",
    "WithHeadSettings",
    "with_settings",
    "Capabilities",
    "capabilities",
    "Forward",
    "forward",
    "backward",
    "IMPLEMENTATIONS",
    "LOGITS_PRECISIONS",
    "resolve",
    "cancel_rounding",
    "stored_rowsum",
    "bf16_parts",
    "split_dot",
]


class HeadSettings(NamedTuple):
    """The call's settings a backend computes with, from :class:`~gmpo_jax.HeadOptions` (their one home): set by
    the op on a copy of the backend (``lm_head.config.resolve_config``), never by the user.

    Attributes:
      softcap: None or Gemma's final-logit cap ``c > 0``: ``z = c tanh((h W + b) / c) / T`` (static).
      logits_precision: None, ``"float32"`` or ``"bf16x3"`` (``LOGITS_PRECISIONS``).
      grad_filter: None (the exact gradient) or the gradient filter's threshold in ``[0, 1)`` (``"auto"``
        resolved).
    """

    softcap: float | None = None
    logits_precision: str | None = None
    grad_filter: float | None = None


@dataclasses.dataclass(frozen=True)
class WithHeadSettings:
    """Base of the backend dataclasses that take :class:`HeadSettings`: a private, keyword-only field read through
    the properties ``softcap``, ``logits_precision`` and ``grad_filter`` (what the backend declares in its
    :class:`Capabilities`). Left out of the repr: a call sets them from its ``HeadOptions`` after the backend is
    chosen (and logged), so an instance's own would mislead."""

    _settings: HeadSettings = dataclasses.field(default=HeadSettings(), kw_only=True, repr=False)

    @property
    def softcap(self) -> float | None:
        return self._settings.softcap

    @property
    def logits_precision(self) -> str | None:
        return self._settings.logits_precision

    @property
    def grad_filter(self) -> float | None:
        return self._settings.grad_filter


def with_settings(backend, *, softcap=None, logits_precision=None, grad_filter=None):
    """``backend`` (a :class:`WithHeadSettings`) computing with these :class:`HeadSettings` (``grad_filter``: a
    threshold, already resolved); what ``lm_head.config.resolve_config`` does with a call's ``HeadOptions``."""
    settings = HeadSettings(softcap=softcap, logits_precision=logits_precision, grad_filter=grad_filter)
    return dataclasses.replace(backend, _settings=settings)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond the required seam, declared as its class attribute ``capabilities``
    (a backend that declares none has none).

    Attributes:
      keeps_logits: it has ``logprobs_for_grads`` (and its ``keeps_logits`` hint), and its ``grads`` takes
        ``saved=``: a single chunk may keep what the gradient pass reuses.
      grad_filter: it runs the gradient filter (:class:`HeadSettings`); when its ``grad_filter`` is set, its
        ``logprobs`` / ``logprobs_for_grads`` take ``with_window_mass=True`` and its ``grads`` takes ``window_mass=``.
      cancel_rounding: it has a ``cancel_rounding`` field (switched off per vocabulary shard).
      softcap: it computes ``HeadSettings.softcap`` (a :class:`WithHeadSettings`).
      logits_precision: it computes ``HeadSettings.logits_precision`` (a :class:`WithHeadSettings`).
      row_prefix: its ``logprobs`` / ``logprobs_for_grads`` take ``n_rows=`` (an int32 scalar, traced: only the
        first ``n_rows`` rows need work; the others' log-probs, log-sum-exps, entropies and window masses are 0 and
        their kept logits unspecified) and serve every ``n_rows`` with one compiled program (the forward's exact
        row skipping without a program per prefix size); its ``grads`` then reads ``saved`` of more rows than it
        is given (their first rows).
      row_prefix_grads: its ``grads`` takes ``n_rows=`` (an int32 scalar, traced: only the first ``n_rows`` rows
        have a cotangent; the others' ``dh`` is 0) and serves every ``n_rows`` with one compiled program where it
        can (else it runs every row: the same result).
    """

    keeps_logits: bool = False
    grad_filter: bool = False
    cancel_rounding: bool = False
    softcap: bool = False
    logits_precision: bool = False
    row_prefix: bool = False
    row_prefix_grads: bool = False


def capabilities(backend) -> Capabilities:
    """The backend's declared :class:`Capabilities` (none when it declares none)."""
    return getattr(type(backend), "capabilities", _NONE)


_NONE = Capabilities()


def logits_precision_of(backend, requested=None):
    """The precision a backend call runs at: ``requested`` (``check_supported``'s keyword) or the backend's own
    ``logits_precision`` setting; raises ``UnsupportedConfigError`` for a value not in ``LOGITS_PRECISIONS``."""
    from gmpo_jax._dispatch import UnsupportedConfigError

    precision = requested or (backend.logits_precision if capabilities(backend).logits_precision else None)
    if precision is not None and precision not in LOGITS_PRECISIONS:
        raise UnsupportedConfigError(f"logits_precision={precision!r} is not one of {tuple(LOGITS_PRECISIONS)}")
    return precision


def num_parts(dtype, order: int) -> int:
    """bfloat16 parts of an operand of ``dtype`` at split ``order``: 1 for bfloat16 (itself), at most 2 for
    float16 (exact), ``order + 1`` for float32."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return 1
    return min(order + 1, 2) if dtype == jnp.float16 else order + 1


@runtime_checkable
class LMHeadBackend(Protocol):
    """Per-chunk LM-head computations (rows = flattened tokens of a chunk).

    ``z = (hidden @ W + bias) / temperature`` in float32, ``W`` being ``[H, V]`` for
    ``weight_layout="hv"`` and ``[V, H]`` (used as ``W^T``) for ``"vh"``. Implementations must be
    hashable (they are static arguments of the custom VJP) and bitwise deterministic.
    """

    name: str

    def check_supported(
        self,
        *,
        hidden_dtype,
        weight_dtype,
        H: int,
        V: int,
        rows: int,
        weight_layout: str,
        has_bias: bool,
        with_entropy: bool = False,
    ) -> None:
        """Raise ``UnsupportedConfigError`` / ``BackendUnavailableError`` if this call cannot be served."""

    def logprobs(self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy=False):
        """``(logp [R] f32, lse [R] f32)`` with ``logp = z[id] - logsumexp(z)``; NaN for ids outside [0, V).

        With ``with_entropy``, a third output: the softmax entropy ``lse - sum_v p_v z_v`` ``[R]`` f32."""

    def grads(self, hidden, weight, bias, ids, dlogp, lse, temperature, *, weight_layout, dw_acc, db_acc, entropy=None):
        """``(dhidden [R, H] hidden.dtype, dw_acc, db_acc)`` for ``dz = dlogp (onehot(id) - softmax(z)) / T``.

        ``entropy``: None, or ``(gamma [R], H [R])`` float32, the cotangent of each row's softmax entropy and
        that entropy (from ``logprobs(with_entropy=True)``): ``dz`` then also holds
        ``gamma dH/dz = -gamma p (log p + H) / T`` (an entropy term of the loss). Still sums to 0 per row.

        ``dw_acc`` (float32, ``weight.shape``) and ``db_acc`` (float32 ``[V]`` or None) are accumulated
        into and returned: ``dw_acc + hidden^T dz`` (laid out like the weight), ``db_acc + sum_rows dz``.
        ``dw_acc=None`` (a call of one chunk): return ``hidden^T dz`` itself, float32 or rounded once to the
        weight's dtype (``gmpo_jax.lm_head.mosaic_gpu``).

        Optional, per the backend's :class:`Capabilities`: ``keeps_logits``: ``logprobs_for_grads(hidden, weight,
        bias, ids, temperature, *, weight_layout, budget_bytes[, with_entropy]) -> (logp, lse[, entropy], saved)``
        keeping what its gradient pass can reuse within ``budget_bytes`` of device memory (``saved`` None when it
        keeps nothing; ``grads`` then gets ``saved=``), and ``keeps_logits(*, rows, H, V, weight_dtype,
        budget_bytes) -> bool``; ``grad_filter``: with its ``grad_filter`` set, ``with_window_mass=True`` appends
        the window mass to the log-prob outputs and ``grads`` gets ``window_mass=``. Callers use
        :func:`forward` and :func:`backward`, which hide the optional outputs behind :class:`Forward`.
        """


class Forward(NamedTuple):
    """What the forward of one chunk's rows hands its backward (:func:`forward`): ``logp`` and ``lse`` ``[R]``
    float32, the softmax ``entropy`` ``[R]`` float32 (None without an entropy term), what the backend kept for
    its gradient pass (``saved``; None: recomputed) and the gradient filter's ``window_mass`` (the backend's
    per-window statistics, ``[R, n_windows, 2]`` for ``mosaic_gpu``; None without the filter)."""

    logp: Any
    lse: Any
    entropy: Any = None
    saved: Any = None
    window_mass: Any = None


def forward(
    backend,
    hidden,
    weight,
    bias,
    ids,
    temperature,
    *,
    weight_layout,
    with_entropy,
    with_window_mass,
    budget_bytes,
    n_rows=None,
) -> Forward:
    """The seam's log-probs of rows ``hidden`` as a :class:`Forward`: ``backend.logprobs``, or, with
    ``budget_bytes`` (a backend that ``keeps_logits``), ``backend.logprobs_for_grads`` keeping what its
    gradient pass may reuse; ``with_window_mass``: the gradient filter's masses (a backend whose ``grad_filter``
    is set); ``n_rows``: only the first rows need work (a backend that declares ``row_prefix``)."""
    kw = {"with_entropy": True} if with_entropy else {}  # a backend without an entropy term needs no flag
    if with_window_mass:
        kw["with_window_mass"] = True
    if n_rows is not None:
        kw["n_rows"] = n_rows
    keep = budget_bytes is not None
    if keep:
        out = backend.logprobs_for_grads(
            hidden, weight, bias, ids, temperature, weight_layout=weight_layout, budget_bytes=budget_bytes, **kw
        )
    else:
        out = backend.logprobs(hidden, weight, bias, ids, temperature, weight_layout=weight_layout, **kw)
    out = list(out)
    mass = out.pop() if with_window_mass else None  # the window mass comes last, after what is kept
    saved = out.pop() if keep else None
    return Forward(out[0], out[1], out[2] if with_entropy else None, saved, mass)


def backward(
    backend,
    hidden,
    weight,
    bias,
    ids,
    dlogp,
    lse,
    temperature,
    *,
    weight_layout,
    dw_acc,
    db_acc,
    fwd=None,
    entropy=None,
    n_rows=None,
):
    """The seam's ``grads`` given what the forward kept (``fwd``, a :class:`Forward` or None): ``(dhidden, dw_acc,
    db_acc)``; ``entropy``: ``(gamma, H)`` of an entropy term; ``n_rows``: the rows with work are the first ``n_rows``
    (``Capabilities.row_prefix_grads``)."""
    kw = {}
    if n_rows is not None:
        kw["n_rows"] = n_rows
    if fwd is not None and fwd.window_mass is not None:
        kw["window_mass"] = fwd.window_mass
    if fwd is not None and fwd.saved is not None:
        kw["saved"] = fwd.saved
    if entropy is not None:
        kw["entropy"] = entropy
    return backend.grads(
        hidden,
        weight,
        bias,
        ids,
        dlogp,
        lse,
        temperature,
        weight_layout=weight_layout,
        dw_acc=dw_acc,
        db_acc=db_acc,
        **kw,
    )


def filters(backend) -> bool:
    """Whether ``backend`` runs the gradient filter: it declares one (:class:`Capabilities`) and its
    ``grad_filter`` is set."""
    return capabilities(backend).grad_filter and backend.grad_filter is not None


IMPLEMENTATIONS = LM_HEAD_IMPLEMENTATIONS  # (declared beside HeadOptions, which checks a name against it when built)


def resolve(implementation, **config) -> LMHeadBackend:
    """The LM-head backend for a call (see :func:`dispatch`); ``config`` goes to ``check_supported``."""
    return dispatch(implementation, IMPLEMENTATIONS, "fused LM head", required=("logprobs", "grads"), **config)


def cancel_rounding(dh, rowsum, weight, ids, weight_layout: str):
    """``dh - rowsum * W[:, id]``: the hidden-state gradient with the rounding of the stored ``dz`` cancelled.

    The exact ``dz`` row sums to 0 (``sum_v softmax = 1``), so ``dh = dz W^T = sum_v dz_v (W_v - W_id)``.
    Backends round ``dz`` to 16 bits before the ``dz W^T`` GEMM, and every rounding error then multiplies a
    whole column ``W_v``: on a trained LM head, whose columns share a large direction, ``W_v - W_id`` is
    far smaller than ``W_v`` and the error is amplified (docs/performance.md). With
    ``rowsum = sum_v stored dz_v`` (the sum of the rounding errors), ``dh - rowsum W_id`` is the GEMM on
    ``W_v - W_id``: the shared direction cancels. One gather of ``W[:, id]`` per row (``4 R H`` flops).
    Needs the whole vocabulary's row sum: not applied per vocabulary shard.

    Args: ``dh`` ``[R, H]`` float32; ``rowsum`` ``[R]`` float32; ``weight`` ``[H, V]`` / ``[V, H]``;
    ``ids`` ``[R]`` int32 (clipped into ``[0, V)``: rows outside have ``rowsum == 0`` or a NaN gradient).
    """
    vocab_axis = 1 if weight_layout == "hv" else 0
    safe = jnp.clip(ids, 0, weight.shape[vocab_axis] - 1)
    cols = jnp.take(weight, safe, axis=vocab_axis)
    cols = cols.T if weight_layout == "hv" else cols
    return dh - rowsum[:, None] * cols.astype(jnp.float32)


def stored_rowsum(dz, axis: int = 1):
    """The float32 sums along ``axis`` of a 16-bit ``dz`` exactly as stored: :func:`cancel_rounding`'s ``rowsum``.

    Not ``jnp.sum(dz.astype(jnp.float32))``: where ``dz = x.astype(bfloat16)`` in the same computation, XLA's
    ``SimplifyFPConversions`` (run on GPUs under the default ``xla_allow_excess_precision``; not on the CPU,
    so CPU tests cannot see it) folds the ``f32 -> bf16 -> f32`` chain and sums ``x``, whose row sum is
    about 0, and the cancellation does nothing. bfloat16 is widened with integer operations (no conversion
    to fold); float16 passes an optimization barrier first; float32 is summed as it is."""
    if dz.dtype == jnp.float32:
        return jnp.sum(dz, axis=axis)
    if dz.dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(dz, jnp.uint16).astype(jnp.uint32) << 16
        return jnp.sum(lax.bitcast_convert_type(bits, jnp.float32), axis=axis)
    return jnp.sum(lax.optimization_barrier(dz).astype(jnp.float32), axis=axis)


def bf16_parts(x, n: int) -> list:
    """``x`` (any float dtype) as ``n`` bfloat16 arrays whose float32 sum approximates it: part ``k`` is the
    round-to-nearest bfloat16 of what the parts before it left, so ``|x - sum| <= 2**(-8 n) |x|`` in the normal
    range (half a bfloat16 ulp per part; three parts hold a float32's 24 significand bits exactly). A bfloat16 ``x`` is its own single part.

    The rounding is done on the bits (integer operations), not by ``astype``: on GPUs XLA's
    ``SimplifyFPConversions`` may fold an ``f32 -> bf16 -> f32`` chain and leave the next remainder 0
    (:func:`stored_rowsum`). A NaN stays NaN in every part (its bits are replaced by the quiet NaN's first:
    rounding a NaN's payload could carry into the sign and give 0); ``+-inf`` stays ``+-inf`` in the first part
    (NaN after it), and finite ``|x| >= 2**128 (1 - 2**-9)`` rounds to ``inf``. A float16 ``x`` needs two parts
    to be exact (11 significand bits): pass ``n <= 2``."""
    if x.dtype == jnp.bfloat16:
        return [x]
    rest = x.astype(jnp.float32)
    parts = []
    for _ in range(n):
        bits = lax.bitcast_convert_type(rest, jnp.uint32)
        bits = jnp.where(jnp.isnan(rest), jnp.uint32(0x7FC00000), bits)
        bits = (bits + (jnp.uint32(0x7FFF) + ((bits >> 16) & 1))) & jnp.uint32(0xFFFF0000)  # nearest, ties to even
        hi = lax.bitcast_convert_type(bits, jnp.float32)
        parts.append(lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16))
        rest = rest - hi  # exact
    return parts


def split_dot(a_parts, b_parts, dimension_numbers, order: int):
    """``sum_(i, j) dot(a_i, b_j)`` over the split-bfloat16 products ``i + j <= order`` (``kernels.
    _lm_head_pipeline.split_terms``), float32 accumulation: the GEMM of the two split operands to about ``2**(-8 (order + 1))``
    relative (each product of bfloat16 parts is exact in float32)."""
    from gmpo_jax.kernels._lm_head_pipeline import split_terms

    out = None
    for i, j in split_terms(len(a_parts), len(b_parts), order):
        d = lax.dot_general(a_parts[i], b_parts[j], dimension_numbers, preferred_element_type=jnp.float32)
        out = d if out is None else out + d
    return out
