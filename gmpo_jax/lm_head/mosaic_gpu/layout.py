"""The kernels' geometry: block sizes, shared-memory epilogues, row padding, the weight as the bulk copies read
it, and the vocabulary windows of the gradient pass.

Rows are padded to the kernels' row block (zero rows, zero cotangent); the bulk copies zero-fill the tail of the
last vocabulary tile and the kernels mask it (``-inf`` logits, zero gradient). The weight is read in place when
its vocabulary dimension suits the bulk copies (``V % 64 == 0`` for ``"hv"``, ``V % 8 == 0`` for ``"vh"``), else
from a zero-padded copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gmpo_jax import tuning

__all__ = ["block_config", "epilogue_bytes", "window_tiles"]


def block_config(*, rows: int, H: int, V: int, kind: str, interpret: bool = False, device_kind: str | None = None):
    """Block sizes of the kernel ``kind`` (``"logprob"``, ``"logprob_saved"``, ``"grad"``, ``"grad_f32"``: float32
    ``dz``) from the reviewed table
    ``gmpo_jax.tuning.MOSAIC_BLOCKS`` (keyed by GPU and head; ``device_kind`` defaults to the first
    device's). The gradient kernel runs 64-row warpgroup blocks when ``rows <= 128`` (less padding)."""
    from gmpo_jax.kernels._lm_head_pipeline import LMHeadBlocks

    if interpret:  # small tiles: the interpreter's cost grows with the tile count and sizes
        return LMHeadBlocks(64, 128, 64, 2, in_flight=tuning.WGMMA_IN_FLIGHT)
    if device_kind is None:
        device_kind = getattr(jax.devices()[0], "device_kind", "")
    block_m, block_n, block_k, stages = tuning.mosaic_blocks(device_kind, H, V, kind)
    if kind in ("grad", "grad_f32") and rows <= 128:
        block_m = 64
    return LMHeadBlocks(block_m, block_n, block_k, stages, in_flight=tuning.WGMMA_IN_FLIGHT)


def epilogue_bytes(kind: str, cfg, itemsize: int) -> int:
    """Shared memory of a kernel's epilogue beyond its operand ring (``kind`` as in :func:`block_config`)."""
    from gmpo_jax.kernels.lm_head_lse import lm_head_lse_epilogue_bytes

    if kind in ("logprob", "logprob_saved"):  # up to four statistics (entropy); the saved tiles
        return lm_head_lse_epilogue_bytes(cfg, n_stats=4, save=kind == "logprob_saved")
    dz_item = 4 if kind == "grad_f32" else itemsize
    return 2 * cfg.block_m * (cfg.block_n * dz_item + 4)  # the dz kernel's two output tiles and row sums


def window_tiles(
    workspace_bytes: int,
    Rp: int,
    H: int,
    n_tiles: int,
    bn: int,
    dz_bytes: int,
    w_bytes: int,
    *,
    kept: bool = False,
    whole: bool = True,
) -> int:
    """Vocabulary tiles per gradient window over ``n_tiles`` tiles of ``bn`` columns for ``Rp`` rows: all when
    their dz fits ``workspace_bytes`` (no weight slice), else as many as the workspace holds (dz, weight slice,
    dW), or half of it for the kept tiles (room for the kept logits). ``dz_bytes`` / ``w_bytes``: bytes per
    element of dz (with its split parts) and of the weight slice. ``whole=False``: no whole-range window when
    only dz fits (the gradient filter's tail, whose float32 dW block would be ``[H, V - filter_tail]``)."""
    if whole and workspace_bytes >= Rp * n_tiles * bn * dz_bytes:
        return n_tiles
    workspace = workspace_bytes // 2 if kept else workspace_bytes
    return max(1, min(n_tiles, workspace // (_per_column(Rp, H, dz_bytes, w_bytes) * bn)))


def _aligned(weight, weight_layout):
    """The weight as the kernels' bulk copies can read it: its vocabulary dimension a multiple of the
    shared-memory tiling along it ((8, 64) tiles: V minor in ``"hv"`` needs ``V % 64 == 0``, major in
    ``"vh"`` ``V % 8 == 0``). Real heads (151936, 128256, 32000) are the weight itself; others (GPT-2's
    50257) get a zero-padded copy, whose extra columns the kernels mask as ``>= vocab_size``."""
    axis = 1 if weight_layout == "hv" else 0
    align = 64 if weight_layout == "hv" else 8
    V = _vocab(weight, weight_layout)
    if V % align == 0:
        return weight
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, -V % align)
    return jnp.pad(weight, pad)


def _per_column(Rp: int, H: int, dz_bytes: int, w_bytes: int) -> int:
    """Bytes per vocabulary column of a gradient window: dz ``[Rp]`` (``dz_bytes`` per element), the weight slice
    ``[H]`` (``w_bytes``) and the float32 dW block ``[H]``."""
    return Rp * dz_bytes + H * (w_bytes + 4)


def _vocab(weight, weight_layout):
    return weight.shape[1] if weight_layout == "hv" else weight.shape[0]


def _prepare(hidden, ids, bias, temperature, cfg, V):
    """Row padding to the CTA row block and the per-row / per-column vectors the kernels read."""
    from gmpo_jax.kernels import _common as C

    R = hidden.shape[0]
    Rp = C.cdiv(R, cfg.rows_per_cta) * cfg.rows_per_cta
    pad = Rp - R
    hp = jnp.pad(hidden, ((0, pad), (0, 0))) if pad else hidden
    ids_p = jnp.pad(ids.astype(jnp.int32), (0, pad), constant_values=-1)
    t = jnp.asarray(temperature, jnp.float32)
    scale = jnp.broadcast_to(jnp.float32(C.LOG2E) / t, (Rp,)).astype(jnp.float32)
    bias_p = None
    if bias is not None:
        n_cols = C.cdiv(V, cfg.block_n) * cfg.block_n
        bias_p = jnp.pad(bias.astype(jnp.float32), (0, n_cols - V))
    return hp, ids_p, scale, bias_p, Rp
