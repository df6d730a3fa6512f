"""Pallas Mosaic GPU backend (Hopper and newer): adapts ``gmpo_jax.kernels`` to the backend seam.

``logprobs``: one kernel (``kernels.lm_head_logprob_mgpu``) computes the logits tiles with wgmma
and keeps an online log-sum-exp per row; the per-split statistics are merged in XLA.

``grads``: per vocabulary window (sized to a fixed workspace, ``workspace_bytes``) one kernel
(``kernels.lm_head_grad_mgpu``) recomputes the logits tiles and writes ``dz`` once in the inputs'
16-bit dtype; ``dh += dz W^T`` and ``dW[:, window] += h^T dz`` are XLA GEMMs with float32
accumulation, ``db += sum_rows dz``. Nothing is accumulated with atomics: bitwise deterministic.

Rows are padded to the kernels' row block (zero rows, zero cotangent); the weight is never
copied or padded: the bulk copies zero-fill the tail of the last vocabulary tile and the kernels
mask it (``-inf`` logits, zero gradient).

Block sizes come from :func:`block_config` (a reviewed table, see ``benchmarks/KERNELS_NOTES.md``).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

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


def block_config(*, rows: int, H: int, V: int, kind: str, interpret: bool = False):
  """The reviewed block-size table (kernels ``"logprob"`` / ``"grad"``); see KERNELS_NOTES.md."""
  from gmpo_jax.kernels._common import BlockConfig
  if interpret:  # small tiles: the interpreter's cost grows with the tile count and sizes
    return BlockConfig(block_m=64, block_n=128, block_k=64, num_stages=2)
  if kind == "logprob":
    # H200, 2026-11-30: [8192, 896] x [896, 151936]: 64x256 3.56 ms vs 128x128 3.70 ms;
    # [8192, 4096] x [4096, 128256]: 12.8 ms vs 14.4 ms (XLA matmul 12.5 ms).
    return BlockConfig(block_m=64, block_n=256, block_k=64, num_stages=4)
  block_m = 64 if rows <= 128 else 128
  # grad: the 2 x [block_m, block_n] output staging tiles take shared memory from the ring;
  # H200, 2026-11-30, dz of [8192, 896] x [896, 151936]: 128x128x3 3.84 ms, 64x128x6 4.03 ms.
  return BlockConfig(block_m=block_m, block_n=128, block_k=64, num_stages=3)


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

  workspace_bytes bounds one ``[rows, window]`` 16-bit ``dz`` buffer of the gradient pass;
  windows_in_flight bounds how many of them are alive at once (0: no bound, XLA schedules them).
  """

  interpret: bool = False
  workspace_bytes: int = 256 * 2**20
  windows_in_flight: int = 1
  name: str = "mosaic_gpu"

  # -- seam -------------------------------------------------------------------------------------
  def check_supported(self, *, hidden_dtype, weight_dtype, H, V, rows, weight_layout, has_bias):
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
    v_align = 64 if weight_layout == "hv" else 8
    if V % v_align:
      # Bulk tensor copies of the weight need its vocabulary dimension a multiple of the
      # shared-memory tiling along it: (8, 64) tiles, V minor in "hv", major in "vh".
      # GPT-2's 50257 falls back to xla_chunked.
      raise UnsupportedConfigError(
          f"mosaic_gpu with {weight_layout=} needs V a multiple of {v_align}, got {V=}")
    for kind in ("logprob", "grad"):
      cfg = block_config(rows=rows, H=H, V=V, kind=kind, interpret=self.interpret)
      extra = 2 * 3 * cfg.block_m * 4 if kind == "logprob" else 2 * cfg.block_m * cfg.block_n * item
      if cfg.smem_bytes(item, extra) > C.SMEM_BYTES:
        raise UnsupportedConfigError(
            f"{kind} kernel needs {cfg.smem_bytes(item, extra)} bytes of shared memory "
            f"(> {C.SMEM_BYTES}) with {cfg}")

  def logprobs(self, hidden, weight, bias, ids, temperature, *, weight_layout):
    from gmpo_jax.kernels import _common as C
    from gmpo_jax.kernels.lm_head_logprob_mgpu import combine_splits, lse_partials
    R, H = hidden.shape
    V = _vocab(weight, weight_layout)
    self.check_supported(hidden_dtype=hidden.dtype, weight_dtype=weight.dtype, H=H, V=V, rows=R,
                         weight_layout=weight_layout, has_bias=bias is not None)
    cfg = block_config(rows=R, H=H, V=V, kind="logprob", interpret=self.interpret)
    with jax.named_scope("gmpo_jax/mosaic_gpu/logprobs"):
      hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
      n_tiles = C.cdiv(V, cfg.block_n)
      splits = C.pick_num_splits(Rp // cfg.rows_per_cta, n_tiles, _num_sms(self.interpret))
      m2, l, t2 = lse_partials(hp, weight, bias_p, ids_p, scale, weight_layout=weight_layout,
                               vocab_size=V, cfg=cfg, num_splits=splits,
                               interpret=self._interpret_params())
      tgt, lse = combine_splits(m2, l, t2)
      tgt, lse = tgt[:R], lse[:R]
      valid = (ids >= 0) & (ids < V)
      logp = jnp.where(valid, tgt - lse, jnp.nan)
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
      window_tiles = max(1, min(n_tiles, self.workspace_bytes // (Rp * bn * hp.dtype.itemsize)))
      num_sms = _num_sms(self.interpret)
      dh = jnp.zeros((Rp, H), jnp.float32)
      in_flight = collections.deque()  # per window: values computed once it is accumulated
      for first in range(0, n_tiles, window_tiles):
        if self.windows_in_flight and len(in_flight) == self.windows_in_flight:
          # At most `windows_in_flight` dz buffers live: this window's kernel inputs pass through a
          # barrier with values that exist only once the window that many steps back is accumulated.
          # Without it XLA hoists every window's dz kernel (each depends only on the inputs) and keeps
          # all dz buffers alive (qwen 2 x 32768: 5.95 GiB); tied to the GEMM outputs only, it defers
          # the accumulations and keeps every window's f32 dh / dW block instead (2.12 GiB at 8 x 2048);
          # passing the accumulators themselves through it costs 15 % of the time (KERNELS_NOTES.md).
          hp, weight, bias_p, ids_p, scale, lse2, coef, _ = lax.optimization_barrier(
              (hp, weight, bias_p, ids_p, scale, lse2, coef, in_flight.popleft()))
        wt = min(window_tiles, n_tiles - first)
        v0 = first * bn
        v1 = min(V, v0 + wt * bn)
        splits = C.pick_num_splits(Rp // cfg.rows_per_cta, wt, num_sms)
        dz = dlogits_window(hp, weight, bias_p, ids_p, scale, lse2, coef,
                            weight_layout=weight_layout, vocab_size=V, window_start=v0,
                            window_tiles=wt, cfg=cfg, num_splits=splits,
                            interpret=self._interpret_params())
        if v1 - v0 != wt * bn:
          dz = dz[:, : v1 - v0]
        axis = 1 if weight_layout == "hv" else 0                       # the weight's vocabulary axis
        w_blk = lax.slice_in_dim(weight, v0, v1, axis=axis)            # [H, w] / [w, H]
        dh_blk = lax.dot_general(dz, w_blk, (((1,), (axis,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [Rp, H]
        a, b = (hp, dz) if axis == 1 else (dz, hp)                     # dW block in the weight's layout
        dw_blk = lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        db_blk = None if db_acc is None else jnp.sum(dz.astype(jnp.float32), axis=0)
        dh = dh + dh_blk
        dw_acc = lax.dynamic_update_slice_in_dim(
            dw_acc, lax.slice_in_dim(dw_acc, v0, v1, axis=axis) + dw_blk, v0, axis=axis)
        if db_acc is not None:
          db_acc = lax.dynamic_update_slice_in_dim(
              db_acc, lax.slice_in_dim(db_acc, v0, v1) + db_blk, v0, axis=0)
        in_flight.append((dh, _straddle(dw_acc, v0, v1, axis),
                          None if db_acc is None else _straddle(db_acc, v0, v1, 0)))
      dhidden = dh[:R].astype(hidden.dtype)
    return dhidden, dw_acc, db_acc

  # -- helpers ----------------------------------------------------------------------------------
  def _interpret_params(self):
    if not self.interpret:
      return None
    from gmpo_jax.kernels._compat import interpret_params
    return interpret_params()


def _straddle(acc, v0, v1, axis):
  """A 2-wide slice of ``acc`` across the edge of the just-updated block ``[v0, v1)``: it depends on the
  update, and XLA cannot simplify it into a slice of the update alone (so the update must be done)."""
  n = acc.shape[axis]
  lo = v1 - 1 if v1 < n else v0 - 1
  lo = max(lo, 0)
  return lax.slice_in_dim(acc, lo, min(lo + 2, n), axis=axis)


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
