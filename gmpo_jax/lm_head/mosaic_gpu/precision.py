"""Precision handling of the Mosaic LM head (``logits_precision``): the kernels' operands, plain or split.

``logits_precision`` (``"float32"`` / ``"bf16x3"``): float32 (or float16) operands are split into bfloat16 parts
(``backend.bf16_parts``) side by side along ``H``, and the kernels sum the leading products of the parts into
each logits tile (``kernels._lm_head_pipeline.split_terms``: six for ``"float32"``, three for ``"bf16x3"``); a bfloat16
operand is its own single part. The dz kernel then writes float32, and the two gradient GEMMs multiply its parts
the same way (``backend.split_dot``, in the gradient pass). The logits are never kept in this mode. None: the
16-bit inputs themselves (exact products in float32), ``dz`` rounded to their dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gmpo_jax.lm_head.backend import LOGITS_PRECISIONS, bf16_parts, num_parts

__all__ = ["Operands", "operands"]


class Operands(NamedTuple):
    """What the kernels multiply (:func:`operands`): ``hidden`` ``[Rp, P H]`` and ``weight`` (its
    parts along ``H``), the products ``terms`` to sum; for the gradient GEMMs the hidden parts, the weight's
    part count, the split order (None: plain 16-bit operands, 16-bit dz) and bytes per element of dz and of the
    weight."""

    hidden: jax.Array
    weight: jax.Array
    terms: tuple
    hidden_parts: list
    weight_parts: int | None
    order: int | None
    dz_bytes: int
    weight_bytes: int


def operands(hp, weight, weight_layout: str, logits_precision: str | None) -> Operands:
    """The kernels' operands of row-padded ``hp`` and ``weight``: themselves, or their bfloat16 parts side by
    side along ``H`` with the products to sum (``logits_precision``)."""
    if logits_precision is None:
        item = hp.dtype.itemsize
        return Operands(hp, weight, ((0, 0),), [hp], None, None, item, item)
    from gmpo_jax.kernels._lm_head_pipeline import split_terms

    order = LOGITS_PRECISIONS[logits_precision]
    h_parts = bf16_parts(hp, num_parts(hp.dtype, order))
    w_parts = bf16_parts(weight, num_parts(weight.dtype, order))
    k_axis = 0 if weight_layout == "hv" else 1
    return Operands(
        hidden=jnp.concatenate(h_parts, axis=1) if len(h_parts) > 1 else h_parts[0],
        weight=jnp.concatenate(w_parts, axis=k_axis) if len(w_parts) > 1 else w_parts[0],
        terms=split_terms(len(h_parts), len(w_parts), order),
        hidden_parts=h_parts,
        weight_parts=len(w_parts),
        order=order,
        dz_bytes=4 + 2 * (order + 1),  # float32 dz and its parts
        weight_bytes=2 * len(w_parts),
    )
