"""How the LM head is computed (:class:`HeadOptions`) and laid out on a mesh (:class:`MeshAxes`): frozen, hashable
settings, checked when they are built (every error names the field), the one home of each setting."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Union

import numpy as np

from gmpo_jax._dispatch import check_implementation
from gmpo_jax._validation.arguments import (
    WEIGHT_LAYOUTS,
    check_chunk_size,
    check_logits_precision,
    check_softcap,
    grad_filter_threshold,
)

__all__ = ["HeadOptions", "MeshAxes", "as_head_options", "as_mesh_axes"]

AxisName = Union[str, tuple[str, ...]]


# The fused LM head's backends by name (``HeadOptions.implementation``), in the order the default dispatch tries
# them: "module.path:ClassName", built with its defaults (``gmpo_jax.lm_head.backend.resolve``).
LM_HEAD_IMPLEMENTATIONS: dict[str, str] = {
    "mosaic_gpu": "gmpo_jax.lm_head.mosaic_gpu:MosaicGpuBackend",
    "xla_chunked": "gmpo_jax.lm_head.xla_chunked:XlaChunkedBackend",
}


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """How the fused LM head computes: its weight's layout, its logits, its gradient and its implementation.

    Frozen and hashable: build it once and pass it to every call (``head=``; None means ``HeadOptions()``), or
    as a static argument of ``jax.jit``. Checked when built.

    Attributes:
      weight_layout: ``"hv"`` (the weight is ``[H, V]``, Flax ``Linear``'s kernel) or ``"vh"`` (``[V, H]``, a
        tied embedding table); the weight is never transposed or copied. ``gmpo_jax.lm_head_weight`` returns it.
      softcap: None, or the final-logit soft cap ``c > 0`` of Gemma-family models
        (``final_logit_softcapping``): the logits are ``c tanh((h W + b) / c) / temperature``, on every
        implementation and for a ``ReferenceHead`` too.
      logits_precision: None (default), ``"float32"`` or ``"bf16x3"``: how accurately the LM head's products
        are computed. None: in the inputs' dtype with float32 accumulation (16-bit products are exact; the
        logits' gradient is rounded to the inputs' 16-bit dtype before the two gradient GEMMs), and a float32
        ``hidden`` / ``weight`` runs the portable path at ``Precision.HIGHEST``. ``"float32"``: float32-accurate
        logits and gradients on every implementation; ``hidden`` and ``weight`` may then each be bf16, f16 or
        f32 (ScaleRL's float32 LM head, arXiv 2510.13786). ``"bf16x3"``: on the Mosaic GPU kernels up to
        ``3 * 2**-16`` of each product instead of float32's ``2**-24``, for half the work; the portable path
        computes it like ``"float32"``. How and what it costs: docs/DESIGN.md, docs/performance.md.
      grad_filter: ``"auto"`` (default: the threshold ``tuning.GRAD_FILTER_AUTO``), a real ``tau`` in ``[0, 1)``, or
        None (the exact gradient: every block computed): the LM head's gradient may skip, per token row, each vocabulary
        window of ``tuning.GRAD_FILTER_WINDOW`` columns whose score ``s = D sqrt(2 ln(n / n_eff))`` is ``<= tau`` (``D``
        the row's softmax mass off its target in the window, ``n`` the window's columns, ``n_eff`` its mass over its
        largest probability: ``s`` is 0 for a mass spread evenly, ``D sqrt(2 ln n)`` for a mass on one column; the
        target's own window is always kept), and corrects the hidden-state gradient by the dropped windows' mass times
        their mean weight column ``m_k``, its columns weighted by the softmax of the call's mean hidden state (over the
        rows with a cotangent). A row with cotangent ``c_r = d loss / d logp_r`` has its hidden-state gradient moved by
        at most ``|c_r| sum_k (min(D_rk, s_rk) max_(v in k) |W_v - mean_k(W)| + D_rk |m_k - mean_k(W)|) / temperature``
        over its dropped windows ``k`` (``mean_k(W)`` the even mean), each weight column ``v`` by at most ``sum_r |c_r|
        p_(r,v) |h_r| / temperature`` over the rows that dropped it. Only the ``mosaic_gpu`` implementation skips work;
        the others, vocabulary-parallel calls, calls with a ``softcap`` and rows with an entropy term compute the exact
        gradient. No effect on the loss, the metrics or evaluation without gradients. What the default gives up is that
        bound: on the workload family (``benchmarks/workloads.py``) its gradients' error against a float32 dense oracle
        stays within 1.5x of the exact path's, the rule the tests check; and some device memory (each window runs on
        every row of the chunk reordered, a fresh ``[rows, H]`` float32 block per window; docs/performance.md has the
        measurements). docs/SPEC.md states it exactly; docs/DESIGN.md "The gradient filter".
      chunk_size: sequences per chunk of the scan (``>= 1``; need not divide ``B``). None: about
        ``tuning.TARGET_ROWS`` tokens per chunk.
      vocab_size: the real vocabulary when the LM head is padded to ``V`` (e.g. to a multiple of the
        vocabulary shards): columns ``>= vocab_size`` are left out of the softmax and get zero gradient; an
        unmasked id in ``[vocab_size, V)`` is out of range (ValueError if concrete, else NaN). ``<= V``
        (checked at the call). None: all ``V`` columns are real.
      implementation: None (the best available: ``"mosaic_gpu"`` on Hopper GPUs, else ``"xla_chunked"``; a
        configuration Mosaic cannot serve falls back with one warning), an explicit name, which never falls
        back, or a backend instance with its own knobs (e.g. ``gmpo_jax.lm_head.MosaicGpuBackend(interpret=True)``
        runs the kernels in the Pallas interpreter). Which one ran is logged on the ``gmpo_jax`` logger (INFO).

    Raises:
      TypeError: a field of the wrong type (named), a backend class instead of an instance, an unhashable
        ``implementation``.
      ValueError: an unknown ``weight_layout``, ``logits_precision`` or implementation name; ``softcap`` not
        finite and ``> 0``;
        ``grad_filter`` neither ``"auto"`` nor in ``[0, 1)``; ``chunk_size`` or ``vocab_size`` ``< 1``.

    Example:
      >>> import gmpo_jax
      >>> gmpo_jax.HeadOptions(weight_layout="vh", softcap=30.0).softcap
      30.0
    """

    weight_layout: str = "hv"
    softcap: float | None = None
    logits_precision: str | None = None
    grad_filter: float | str | None = "auto"
    chunk_size: int | None = None
    vocab_size: int | None = None
    implementation: Any = None

    def __post_init__(self):
        if not isinstance(self.weight_layout, str) or self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got weight_layout={self.weight_layout!r}")
        check_softcap(self.softcap)
        check_logits_precision(self.logits_precision)
        grad_filter_threshold(self.grad_filter)
        check_chunk_size(self.chunk_size)
        vocab_size = self.vocab_size
        if vocab_size is not None:
            if isinstance(vocab_size, (bool, np.bool_)) or not isinstance(vocab_size, numbers.Integral):
                raise TypeError(f"vocab_size must be None or an int >= 1, got vocab_size={vocab_size!r}")
            if vocab_size < 1:
                raise ValueError(f"vocab_size must be >= 1, got vocab_size={vocab_size!r}")
        for name in ("softcap", "grad_filter"):  # plain, hashable Python values (a NumPy scalar is accepted)
            value = getattr(self, name)
            if isinstance(value, numbers.Real):
                object.__setattr__(self, name, float(value))
        for name in ("chunk_size", "vocab_size"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        impl = self.implementation
        check_implementation(impl, tuple(LM_HEAD_IMPLEMENTATIONS))
        if impl is not None and not isinstance(impl, str):
            try:
                hash(impl)
            except TypeError:
                raise TypeError(
                    f"implementation must be hashable (a frozen dataclass), got implementation={impl!r}"
                ) from None


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh axes a fused LM-head call is split over (``sharding=``; None: no explicit axes).

    Normalisers and metrics stay global: the result equals the unsharded one, and gradients come back sharded
    like the primals. With no explicit axes, inputs sharded over ``Explicit`` mesh axes have their axes read
    from ``hidden`` (batch) and ``weight`` (vocabulary). More: ``gmpo_jax.lm_head.sharding``, docs/guide.md.

    Attributes:
      mesh: the ``jax.sharding.Mesh`` of the axes (None: the one set with ``jax.set_mesh``). With ``mesh``,
        take gradients under ``jax.jit`` or inside ``jax.set_mesh(mesh)`` (JAX needs the mesh context to build
        the cotangent of a mesh-sharded scalar).
      data_axis: mesh axis name (or tuple of names) the batch ``B`` is split over: data parallel, ``B`` a
        multiple of its size.
      vocab_axis: mesh axis name(s) the weight's (and bias') vocabulary ``V`` is split over: vocabulary
        parallel, ``V`` a multiple of its size; the weight is never gathered.

    Raises:
      TypeError: an axis that is neither a name nor a non-empty tuple of names; a ``mesh`` that is not a mesh.
      ValueError: a ``mesh`` without an axis. At the call: an axis not in the mesh, an axis used twice, or
        ``B`` / ``V`` not a multiple of the axes' size.
    """

    mesh: Any = None
    data_axis: AxisName | None = None
    vocab_axis: AxisName | None = None

    def __post_init__(self):
        for name in ("data_axis", "vocab_axis"):
            axis = getattr(self, name)
            if axis is None:
                continue
            axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
            if not axes or not all(isinstance(a, str) for a in axes):
                raise TypeError(f"{name} must be a mesh axis name or a non-empty tuple of names, got {name}={axis!r}")
            object.__setattr__(self, name, axis if isinstance(axis, str) else axes)
        if self.mesh is not None:
            if not hasattr(self.mesh, "axis_names"):
                raise TypeError(f"mesh must be None or a jax.sharding.Mesh, got mesh={self.mesh!r}")
            if self.data_axis is None and self.vocab_axis is None:
                raise ValueError("mesh= needs data_axis= and / or vocab_axis= (the mesh axes to split B and V over)")


def as_head_options(head) -> HeadOptions:
    """``head`` (None: ``HeadOptions()``); TypeError naming it for anything else."""
    if head is None:
        return HeadOptions()
    if not isinstance(head, HeadOptions):
        raise TypeError(f"head must be None or a gmpo_jax.HeadOptions(...), got head={head!r:.80}")
    return head


def as_mesh_axes(sharding) -> MeshAxes:
    """``sharding`` (None: ``MeshAxes()``, no explicit axes); TypeError naming it for anything else."""
    if sharding is None:
        return MeshAxes()
    if not isinstance(sharding, MeshAxes):
        raise TypeError(f"sharding must be None or a gmpo_jax.MeshAxes(...), got sharding={sharding!r:.80}")
    return sharding
