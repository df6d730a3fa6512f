"""Pallas Mosaic GPU backend (Hopper and newer): adapts ``gmpo_jax.kernels`` to the backend seam.

``logprobs``: one kernel (``kernels.lm_head_logprob_mgpu``) computes the logits tiles with wgmma
and keeps an online log-sum-exp per row; the per-split statistics are merged in XLA.

``grads``: per vocabulary window (sized to a fixed workspace, ``workspace_bytes``) one kernel
(``kernels.lm_head_grad_mgpu``) recomputes the logits tiles and writes ``dz`` once in the inputs'
16-bit dtype; ``dh += dz W^T`` and ``dW[:, window] += h^T dz`` are XLA GEMMs with float32
accumulation, ``db += sum_rows dz``. Nothing is accumulated with atomics: bitwise deterministic.
The full windows run in a ``lax.scan`` (each step copies its weight columns and shifts the ids), so
one window's buffers are alive at a time and the accumulators are updated in place; the last,
partial window runs after it. Unrolled windows left that to XLA's scheduler, which kept up to all of
them alive (benchmarks/RESULTS.md, "second session").

Rows are padded to the kernels' row block (zero rows, zero cotangent); the bulk copies zero-fill
the tail of the last vocabulary tile and the kernels mask it (``-inf`` logits, zero gradient). The
weight is read in place when its vocabulary dimension suits the bulk copies (``V % 64 == 0`` for
``"hv"``, ``V % 8 == 0`` for ``"vh"``: every real head but GPT-2's 50257), else from a zero-padded copy.

Block sizes come from :func:`block_config` (a reviewed table, see ``benchmarks/KERNELS_NOTES.md``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import tuning
from gmpo_jax.backends.base import BackendUnavailableError, UnsupportedConfigError

__all__ = ["MosaicGpuBackend", "make_backend", "supported_on", "block_config"]

_H100_SMS = 132


def supported_on(device) -> bool:
  """True on a CUDA GPU of compute capability 9.0 (Hopper) or newer."""
  if getattr(device, "platform", None) != "gpu":
    return False
  cc = getattr(device, "compute_capability", None)
  try:
    return float(cc) >= 9.0
  except (TypeError, ValueError):
    return False


def block_config(*, rows: int, H: int, V: int, kind: str, interpret: bool = False, device_kind: str | None = None):
  """Block sizes of the kernel ``kind`` (``"logprob"`` / ``"grad"``) from the reviewed table
  ``gmpo_jax.tuning.MOSAIC_BLOCKS`` (keyed by GPU and head; ``device_kind`` defaults to the first
  device's). The gradient kernel runs 64-row warpgroup blocks when ``rows <= 128`` (less padding)."""
  from gmpo_jax.kernels._common import BlockConfig
  if interpret:  # small tiles: the interpreter's cost grows with the tile count and sizes
    return BlockConfig(block_m=64, block_n=128, block_k=64, num_stages=2)
  if device_kind is None:
    device_kind = getattr(jax.devices()[0], "device_kind", "")
  block_m, block_n, block_k, stages = tuning.mosaic_blocks(device_kind, H, V, kind)
  if kind == "grad" and rows <= 128:
    block_m = 64
  return BlockConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=stages)


def _num_sms(interpret: bool) -> int:
  if interpret:
    return _H100_SMS
  try:
    return jax.devices()[0].core_count
  except Exception:  # pragma: no cover - some PJRT clients do not report it
    return _H100_SMS


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend:
  """Pallas Mosaic GPU kernels; ``interpret=True`` runs them in the interpreter (CPU tests).

  workspace_bytes bounds the temporaries of one vocabulary window of the gradient pass: the 16-bit
  ``dz [rows, window]``, the weight slice and the float32 dW block (one window is live at a time).
  """

  interpret: bool = False
  workspace_bytes: int = 256 * 2**20
  name: str = "mosaic_gpu"

  # -- seam -------------------------------------------------------------------------------------
  def check_supported(self, *, hidden_dtype, weight_dtype, H, V, rows, weight_layout, has_bias,
                      with_entropy=False):
    from gmpo_jax.kernels import _common as C
    if not self.interpret and not any(supported_on(d) for d in jax.devices()):
      raise BackendUnavailableError("Pallas Mosaic GPU kernels need a Hopper (sm_90) or newer GPU")
    if weight_layout not in ("hv", "vh"):
      raise UnsupportedConfigError(f"{weight_layout=} must be 'hv' or 'vh'")
    hd, wd = jnp.dtype(hidden_dtype), jnp.dtype(weight_dtype)
    if hd != wd or hd not in C.SUPPORTED_DTYPES:
      raise UnsupportedConfigError(
          f"mosaic_gpu needs hidden and weight of one 16-bit dtype (bf16/f16), got {hd}, {wd}")
    if H % 64 or H <= 0:
      raise UnsupportedConfigError(f"mosaic_gpu needs H a positive multiple of 64, got {H=}")
    if V <= 0 or rows <= 0:
      raise UnsupportedConfigError(f"empty problem: {V=}, {rows=}")
    if V >= 2**31 - 2**20 or rows >= 2**31 - 2**20:
      raise UnsupportedConfigError(f"{V=} / {rows=} overflow int32 indexing")
    item = hd.itemsize
    for kind in ("logprob", "grad"):
      cfg = block_config(rows=rows, H=H, V=V, kind=kind, interpret=self.interpret)
      extra = 2 * 4 * cfg.block_m * 4 if kind == "logprob" else 2 * cfg.block_m * cfg.block_n * item
      if cfg.smem_bytes(item, extra) > C.SMEM_BYTES:
        raise UnsupportedConfigError(
            f"{kind} kernel needs {cfg.smem_bytes(item, extra)} bytes of shared memory "
            f"(> {C.SMEM_BYTES}) with {cfg}")

  def logprobs(self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy=False):
    from gmpo_jax.kernels import _common as C
    from gmpo_jax.kernels.lm_head_logprob_mgpu import combine_splits, lse_partials
    R, H = hidden.shape
    V = _vocab(weight, weight_layout)
    self.check_supported(hidden_dtype=hidden.dtype, weight_dtype=weight.dtype, H=H, V=V, rows=R,
                         weight_layout=weight_layout, has_bias=bias is not None, with_entropy=with_entropy)
    cfg = block_config(rows=R, H=H, V=V, kind="logprob", interpret=self.interpret)
    with jax.named_scope("gmpo_jax/mosaic_gpu/logprobs"):
      hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
      n_tiles = C.cdiv(V, cfg.block_n)
      splits = C.pick_num_splits(Rp // cfg.rows_per_cta, n_tiles, _num_sms(self.interpret))
      stats = lse_partials(hp, _aligned(weight, weight_layout), bias_p, ids_p, scale,
                           weight_layout=weight_layout, vocab_size=V, cfg=cfg, num_splits=splits,
                           with_entropy=with_entropy, interpret=self._interpret_params())
      logp, lse, *ent = (x[:R] for x in combine_splits(*stats))
      valid = (ids >= 0) & (ids < V)
      logp = jnp.where(valid, logp, jnp.nan)
      if with_entropy:  # in [0, log V], as the XLA path's
        return logp, lse, jnp.clip(ent[0], 0.0, jnp.log(jnp.float32(V)))
    return logp, lse

  def grads(self, hidden, weight, bias, ids, dlogp, lse, temperature, *, weight_layout, dw_acc,
            db_acc):
    from gmpo_jax.kernels import _common as C
    from gmpo_jax.kernels.lm_head_grad_mgpu import dlogits_window
    R, H = hidden.shape
    V = _vocab(weight, weight_layout)
    self.check_supported(hidden_dtype=hidden.dtype, weight_dtype=weight.dtype, H=H, V=V, rows=R,
                         weight_layout=weight_layout, has_bias=bias is not None)
    cfg = block_config(rows=R, H=H, V=V, kind="grad", interpret=self.interpret)
    bn = cfg.block_n
    with jax.named_scope("gmpo_jax/mosaic_gpu/grads"):
      hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
      pad = Rp - R
      t = jnp.asarray(temperature, jnp.float32)
      coef = jnp.pad(dlogp.astype(jnp.float32) / t, (0, pad))
      lse2 = jnp.pad(lse.astype(jnp.float32) * C.LOG2E, (0, pad))
      n_tiles = C.cdiv(V, bn)
      # A window's temporaries: dz [Rp, w] and the weight slice [H, w] in 16 bits, the f32 dW block;
      # one window over the whole vocabulary when its dz alone fits (no slice, few rows: N = 512).
      item = hp.dtype.itemsize
      if self.workspace_bytes >= Rp * n_tiles * bn * item:
        window_tiles = n_tiles
      else:
        per_column = Rp * item + H * (item + 4)
        window_tiles = max(1, min(n_tiles, self.workspace_bytes // (per_column * bn)))
      wc = window_tiles * bn                                         # columns per window
      axis = 1 if weight_layout == "hv" else 0                       # the weight's vocabulary axis
      num_sms = _num_sms(self.interpret)
      splits = C.pick_num_splits(Rp // cfg.rows_per_cta, window_tiles, num_sms)

      w_kernel = _aligned(weight, weight_layout)                     # == weight unless V is unaligned

      def window(carry, w_blk, b_blk, ids_w, v0, width, wt, splits):
        """dz of one window (its weight columns ``w_blk``, ids relative to it) and the three GEMMs."""
        dh, dw_acc, db_acc = carry
        dz = dlogits_window(hp, w_blk, b_blk, ids_w, scale, lse2, coef,
                            weight_layout=weight_layout, vocab_size=width, window_start=0,
                            window_tiles=wt, cfg=cfg, num_splits=splits,
                            interpret=self._interpret_params())
        if dz.shape[1] != width:
          dz = dz[:, :width]
        if w_blk.shape[axis] != width:  # the aligned copy's padding columns
          w_blk = lax.slice_in_dim(w_blk, 0, width, axis=axis)
        dh = dh + lax.dot_general(dz, w_blk, (((1,), (axis,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # [Rp, H]
        a, b = (hp, dz) if axis == 1 else (dz, hp)                     # dW block in the weight's layout
        dw_blk = lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dw_acc = lax.dynamic_update_slice_in_dim(
            dw_acc, lax.dynamic_slice_in_dim(dw_acc, v0, width, axis=axis) + dw_blk, v0, axis=axis)
        if db_acc is not None:
          db_blk = jnp.sum(dz.astype(jnp.float32), axis=0)
          db_acc = lax.dynamic_update_slice_in_dim(
              db_acc, lax.dynamic_slice_in_dim(db_acc, v0, width) + db_blk, v0, axis=0)
        return dh, dw_acc, db_acc

      # Full windows in a loop: one dz buffer (and one copied weight slice) alive at a time by
      # construction, accumulators updated in place. A Python loop of windows left the order to
      # XLA's scheduler, which hoisted dz kernels or deferred accumulations (up to 5.95 GiB at
      # qwen 2 x 32768; KERNELS_NOTES.md).
      def body(carry, k):
        v0 = k * wc
        w_blk = lax.dynamic_slice_in_dim(w_kernel, v0, wc, axis=axis)
        b_blk = None if bias_p is None else lax.dynamic_slice_in_dim(bias_p, v0, wc)
        return window(carry, w_blk, b_blk, ids_p - v0, v0, wc, window_tiles, splits), None

      carry = (jnp.zeros((Rp, H), jnp.float32), dw_acc, db_acc)
      n_full = V // wc if window_tiles < n_tiles else 0  # one window: no loop, no weight slice
      if n_full:
        carry, _ = lax.scan(body, carry, jnp.arange(n_full, dtype=jnp.int32))
      v0 = n_full * wc
      if v0 < V:  # the last, partial window: static shapes, the kernel masks columns >= V - v0
        wt = C.cdiv(V - v0, bn)
        w_blk = lax.slice_in_dim(w_kernel, v0, w_kernel.shape[axis], axis=axis)
        b_blk = None if bias_p is None else bias_p[v0:]
        carry = window(carry, w_blk, b_blk, ids_p - v0, v0, V - v0, wt,
                       C.pick_num_splits(Rp // cfg.rows_per_cta, wt, num_sms))
      dh, dw_acc, db_acc = carry
      dhidden = dh[:R].astype(hidden.dtype)
    return dhidden, dw_acc, db_acc

  # -- helpers ----------------------------------------------------------------------------------
  def _interpret_params(self):
    if not self.interpret:
      return None
    from gmpo_jax.kernels._compat import interpret_params
    return interpret_params()


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


def make_backend(**kw) -> MosaicGpuBackend:
  return MosaicGpuBackend(**kw)
