"""Shared pieces of the LM-head kernels: the block-size config and the logits-tile pipeline.

Both kernels (log-prob forward, gradient of the logits) run the same loop: a CTA owns
``2 * block_m`` rows (one warpgroup per ``block_m`` rows) and a contiguous range of vocabulary
tiles; for every vocabulary tile it computes the ``[block_m, block_n]`` logits tile with wgmma,
streaming ``[2 * block_m, block_k]`` hidden tiles and ``[block_k, block_n]`` weight tiles through
a ``num_stages``-deep ring of shared-memory slots filled by a third (memory) warpgroup with bulk
tensor copies. What happens to the finished f32 tile (online log-sum-exp, or the gradient of
the logits) is the kernel's epilogue.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl

from gmpo_jax.kernels._compat import (load_vector, needs_value_matmul, plgpu, value_matmul,
                                      wgmma)

# Hopper: 227 KiB of shared memory per block (232448 bytes).
SMEM_BYTES = 232448
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Block sizes of the LM-head kernels.

  block_m: rows per compute warpgroup (the CTA owns ``2 * block_m`` rows); 64 or 128.
  block_n: vocabulary columns per logits tile; multiple of 64, at most 256.
  block_k: hidden columns per pipeline step; 64 (128-byte swizzle of 16-bit operands).
  num_stages: depth of the shared-memory ring.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_stages: int = 4

  def __post_init__(self):
    if self.block_m not in (64, 128):
      raise ValueError(f"{self.block_m=} must be 64 or 128")
    if self.block_n % 64 or not 64 <= self.block_n <= 256:
      raise ValueError(f"{self.block_n=} must be a multiple of 64 in [64, 256]")
    if self.block_k != 64:
      raise ValueError(f"{self.block_k=} must be 64")
    if self.num_stages < 2:
      raise ValueError(f"{self.num_stages=} must be at least 2")

  @property
  def rows_per_cta(self) -> int:
    return 2 * self.block_m

  def smem_bytes(self, itemsize: int, extra: int = 0) -> int:
    ring = self.num_stages * (self.rows_per_cta + self.block_n) * self.block_k * itemsize
    return ring + extra + 1024  # barriers, alignment


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def operand_transforms(itemsize: int):
  swizzle = plgpu.find_swizzle(64 * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def pick_num_splits(num_row_ctas: int, num_vocab_tiles: int, num_sms: int) -> int:
  """Vocabulary splits per row block so that the grid fills the GPU in whole waves.

  Deterministic and cheap: the fewest splits (at most 32) whose CTA count wastes the least of
  the last wave, counting only splits that leave at least 4 vocabulary tiles per split.
  """
  best, best_eff = 1, 0.0
  for s in range(1, 33):
    if s > 1 and num_vocab_tiles / s < 4:
      break
    ctas = num_row_ctas * s
    eff = ctas / (cdiv(ctas, num_sms) * num_sms)
    if eff > best_eff + 1e-9:
      best, best_eff = s, eff
    if eff > 0.95:
      break
  tiles_per_split = cdiv(num_vocab_tiles, best)
  return cdiv(num_vocab_tiles, tiles_per_split)


def logits_tile_loop(
    *,
    hidden_ref,          # GMEM [Rp, H]
    weight_ref,          # GMEM [H, V] ("hv") or [V, H] ("vh")
    weight_layout: str,
    a_smem,              # SMEM [stages, 2*bm, bk]
    b_smem,              # SMEM [stages, bk, bn] or [stages, bn, bk]
    loaded,              # Barrier(num_arrivals=2, num_barriers=stages)
    consumed,            # Barrier(num_arrivals=2, num_barriers=stages)
    row0,                # first row of this CTA
    tile0,               # first vocabulary tile of this CTA
    num_tiles,           # vocabulary tiles of this CTA (traced int32)
    k_iters: int,
    cfg: BlockConfig,
    init_carry,          # () -> carry (compute warpgroups)
    epilogue,            # (tile_index, z f32[bm, bn] WGMMA layout, carry) -> carry
    finish,              # (carry) -> None
    interpret=None,
):
  """Runs the warp-specialised logits-tile pipeline inside a 3-warpgroup kernel."""
  bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
  wg = lax.axis_index("wg")

  @pl.when(wg == 2)
  def _memory_warpgroup():
    plgpu.set_max_registers(40, action="decrease")
    total = num_tiles * k_iters

    @pl.loop(0, total)
    def _step(step):
      slot = lax.rem(step, stages)
      n = tile0 + lax.div(step, k_iters)
      k = lax.rem(step, k_iters)

      @pl.when(step >= stages)
      def _():
        plgpu.barrier_wait(consumed.at[slot])

      plgpu.copy_gmem_to_smem(
          hidden_ref.at[pl.ds(row0, 2 * bm), pl.ds(k * bk, bk)], a_smem.at[slot], loaded.at[slot])
      if weight_layout == "hv":
        w_src = weight_ref.at[pl.ds(k * bk, bk), pl.ds(n * bn, bn)]
      else:
        w_src = weight_ref.at[pl.ds(n * bn, bn), pl.ds(k * bk, bk)]
      plgpu.copy_gmem_to_smem(w_src, b_smem.at[slot], loaded.at[slot])

    # Observe the last phases of the `consumed` barriers too (every phase of a barrier is
    # waited on by every thread that waits on it: the interpreter checks this; on the device
    # it is a no-op that keeps the memory warpgroup alive until the slots are released).
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(step):
      plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

  @pl.when(wg < 2)
  def _compute_warpgroup():
    plgpu.set_max_registers(232, action="increase")
    a_rows = pl.ds(wg * bm, bm)

    def tile_body(t, carry):
      transpose_b = weight_layout == "vh"

      def matmul(acc_ref):
        def k_body(k, _):
          slot = lax.rem(t * k_iters + k, stages)
          plgpu.barrier_wait(loaded.at[slot])
          wgmma(acc_ref, a_smem.at[slot].at[a_rows], b_smem.at[slot],
                transpose_b=transpose_b, interpret=interpret)
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[slot])
          return ()

        lax.fori_loop(0, k_iters, k_body, ())
        return acc_ref[...]

      def value_mm():
        def k_body(k, acc):
          slot = lax.rem(t * k_iters + k, stages)
          plgpu.barrier_wait(loaded.at[slot])
          acc = acc + value_matmul(a_smem.at[slot].at[a_rows], b_smem.at[slot],
                                   transpose_b=transpose_b)
          plgpu.barrier_arrive(consumed.at[slot])
          return acc

        return lax.fori_loop(0, k_iters, k_body, jnp.zeros((bm, bn), jnp.float32))

      if needs_value_matmul(transpose_b, interpret):
        z = value_mm()
      else:
        z = pl.run_scoped(matmul, plgpu.ACC((bm, bn), jnp.float32))
      return epilogue(tile0 + t, z, carry)

    carry = lax.fori_loop(0, num_tiles, tile_body, init_carry())
    finish(carry)


def cta_rows(block_m: int):
  """``(split, row0, my_rows)`` of this CTA and warpgroup: the vocabulary split (grid axis ``"split"``),
  the CTA's first row (it owns ``2 * block_m``) and this consumer warpgroup's first row."""
  row0 = lax.axis_index("rows") * (2 * block_m)
  return lax.axis_index("split"), row0, row0 + lax.axis_index("wg") * block_m


def launch(body, *, hidden, weight, bias, row_inputs, out_type, epilogue_smem, weight_layout: str,
           cfg: BlockConfig, num_splits: int, interpret=None):
  """Runs an LM-head kernel on the grid ``(num_splits, rows / (2 block_m))`` with three warpgroups
  (two consumers, one memory warpgroup: ``logits_tile_loop``).

  ``body(h_ref, w_ref, b_ref, row_refs, out_refs, smem)`` gets the references of ``hidden``, ``weight``,
  ``bias`` (None without one), the per-row inputs ``row_inputs`` and the outputs ``out_type`` (a tuple,
  or one ``ShapeDtypeStruct``), and ``smem = (a_smem, b_smem, epilogue, loaded, consumed)``: the
  operand rings of ``logits_tile_loop``, the scratch ``epilogue_smem`` (a ``plgpu.SMEM``) of the
  kernel's own epilogue, and the ring's two barriers.
  """
  dtype = hidden.dtype
  bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
  transforms = operand_transforms(jnp.dtype(dtype).itemsize)
  b_shape = (stages, bk, bn) if weight_layout == "hv" else (stages, bn, bk)
  has_bias = bias is not None
  n_rows = len(row_inputs)

  def kernel(h_ref, w_ref, *refs):
    b_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
    body(h_ref, w_ref, b_ref, refs[:n_rows], refs[n_rows:-1], refs[-1])

  scratch = [
      plgpu.SMEM((stages, 2 * bm, bk), dtype, transforms=transforms),
      plgpu.SMEM(b_shape, dtype, transforms=transforms),
      epilogue_smem,
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  ]
  call = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=[scratch],
      grid=(num_splits, hidden.shape[0] // (2 * bm)),
      grid_names=("split", "rows"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )
  return call(hidden, weight, *((bias,) if has_bias else ()), *row_inputs)


def row_vector(ref, start, size, interpret):
  """Loads ``ref[start:start+size]`` (GMEM) as a per-row vector of the WGMMA layout."""
  return load_vector(ref.at[pl.ds(start, size)], plgpu.Layout.WGMMA.reduce(1), interpret)


def col_vector(ref, start, size, interpret):
  """Loads ``ref[start:start+size]`` (GMEM) as a per-column vector of the WGMMA layout."""
  return load_vector(ref.at[pl.ds(start, size)], plgpu.Layout.WGMMA.reduce(0), interpret)


def bcast_rows(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


def bcast_cols(v, shape):
  return lax.broadcast_in_dim(v, shape, [1])


LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# |d| <= 3 * 2**-23 |lse2| is 3 to 6 float32 ulps of the log-sum-exp: what its roundings can move it
# by (about 2.5 ulps: the forward's fused multiply-add residual, the trip through natural-log units, the
# backward's residual).
SNAP_RELATIVE = 3 * 2.0 ** -23


def snap_tolerance(lse2):
  """Per-row tolerance under which a backward kernel treats ``z2 - lse2`` as exactly 0 (``p = 1``).

  The gradient kernels recompute ``z2 = z * scale`` and subtract a log-sum-exp that reached them
  through other roundings (natural-log units in between, a fused multiply-add of ``z * scale - lse2``
  that skips the rounding of ``z * scale``): up to about 2.5 ulps of ``lse2``. At ordinary temperatures
  that is a relative error of ~1e-7 in one probability; at tiny temperatures (``|z| / T ~ 1e7``) an
  ulp of ``lse2`` is ~1, so the argmax of a one-hot softmax got ``p = 2**(+-0.5)`` and a gradient of
  ``~0.4 / T`` instead of 0 (measured on an H200 at ``T = 1e-6``, 2026-11-30). Snapping
  ``|z2 - lse2| <= SNAP_RELATIVE |lse2| = 3 * 2**-23 |lse2|`` to 0 restores ``p = 1`` there; the XLA paths get the same by
  setting ``z - ref`` to exactly 0 where ``z == ref`` (``gmpo_jax.backends.xla_chunked.shifted``).

  Limit: a logit whose probability differs from 1 by less than the snap (``|log2 p| <= 3 * 2**-23
  |lse2|``) counts as the maximum. That is below float32's resolution unless ``|lse2| >= 2**23 / 3``
  (``|z| / T`` above ~1.9e6 nats), where it also covers exact ties (``p = 1/2``, ``log2 p = -1``): there two tied
  maxima both get ``p = 1``. At such temperatures float32 cannot resolve those probabilities anyway (the
  XLA path's are off by ~50 %); a tie at ``|z| / T = 8e4`` is exact (tests).
  """
  return jnp.abs(lse2) * SNAP_RELATIVE
