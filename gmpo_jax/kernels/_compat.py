"""The one place that absorbs Pallas Mosaic GPU API differences between jax releases.

CI runs jax 0.10.2 on CPU (kernels in interpret mode); the GPU machine runs jax 0.11.2.
Both releases accept ``out_type=`` / ``scratch_types=`` in ``plgpu.kernel``; what moved is
the interpret-mode parameters class (private on 0.10.2, public ``plgpu.InterpretGPUParams``
on 0.11.2).
"""

from __future__ import annotations

import inspect

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = [
    "plgpu",
    "interpret_params",
    "load_vector",
    "load_tile",
    "layout_cast",
    "iota",
    "wgmma",
    "needs_value_matmul",
    "value_matmul",
]


def _interpret_params_cls():
    """The interpreter's parameters class (public on 0.11.2, private on 0.10.2)."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:  # jax <= 0.10.x
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls  # noqa: N813
    return cls


def interpret_params():
    """Interpret-mode parameters that mirror the hardware on out-of-bounds TMA reads.

    A bulk tensor copy that runs past the end of an array fills the tail of the tile with zeros
    on the GPU; the interpreter is asked to do the same (instead of raising), so that the tail
    handling of the kernels is exercised on the CPU exactly as it runs on the device.
    """
    return _interpret_params_cls()(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


# 0.10.2's ``plgpu.load(src, idx, ...)`` requires the index; 0.11.2 deprecates passing it (index the
# reference with ``.at`` instead) and gives it a default.
_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_NEEDS_IDX = _IDX is not None and _IDX.default is inspect.Parameter.empty


def load_vector(ref, layout, interpret):
    """``plgpu.load(ref, layout=layout)`` of a whole (already indexed) reference; the interpreter has no
    ``load`` yet (0.10.2)."""
    if interpret:
        return ref[...]
    # GMEM: only the unoptimised (per-element) transfer supports the WGMMA row/column layouts.
    if _LOAD_NEEDS_IDX:
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def load_tile(ref, layout, interpret):
    """A whole shared-memory tile in ``layout`` (the optimised, swizzle-aware load); ``ref[...]`` in the
    interpreter."""
    if interpret:
        return ref[...]
    if _LOAD_NEEDS_IDX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def layout_cast(x, layout, interpret):
    """``plgpu.layout_cast``; layouts are meaningless (and unsupported) in the interpreter."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(dtype, shape, dimension, layout, interpret):
    """``plgpu.broadcasted_iota`` with a layout; a plain iota in the interpreter."""
    if interpret:
        return jax.lax.broadcasted_iota(dtype, shape, dimension)
    return plgpu.broadcasted_iota(dtype, shape, dimension, layout=layout)


def wgmma(acc_ref, a, b, *, transpose_a=False, transpose_b=False, interpret=False):
    """``plgpu.wgmma(acc, a[^T], b[^T])`` on shared-memory operands."""
    if transpose_a:
        a = a.transpose((1, 0))
    if transpose_b:
        b = b.transpose((1, 0))  # plgpu.transpose_ref is deprecated on 0.11.2; the same transform on 0.10.2
    plgpu.wgmma(acc_ref, a, b)


def needs_value_matmul(transposed, interpret):
    """The interpreter (0.10.2) ignores the transposed view of wgmma operands and cannot
    store into an accumulator; there a transposed product is computed from the loaded tiles with
    a float32 ``jnp.dot`` (16-bit operands, float32 accumulation: the same arithmetic)."""
    return bool(interpret) and transposed


def value_matmul(a, b, *, transpose_a=False, transpose_b=False):
    """``a[^T] @ b[^T]`` of two loaded 16-bit shared-memory tiles in float32 (the interpreter's wgmma, see
    :func:`needs_value_matmul`)."""
    av = a[...].astype(jax.numpy.float32)
    bv = b[...].astype(jax.numpy.float32)
    av, bv = av.T if transpose_a else av, bv.T if transpose_b else bv
    return jax.numpy.dot(av, bv, precision=jax.lax.Precision.HIGHEST)
