"""Pallas Mosaic GPU backend of the policy loss from logits (Hopper or newer), adapting ``logits_mgpu``.

The logits ``[B, Tl, V]`` (``Tl = T`` or ``T + 1``) are handed to the kernels as ``[B * Tl * k, V / k]``
(a free reshape; ``k > 1`` only when ``B * Tl`` is not a multiple of 8, see ``_split``). The forward
kernel also reads the ``Tl - T`` extra positions (``1 / Tl`` of the bytes) rather than splitting row
blocks at sequence ends; their statistics are dropped. The backward kernel writes all
``B * Tl`` rows, zeros on the extra positions, so ``dlogits`` needs no padding or concatenation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gmpo_jax.backends.base import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.logits_backends import logits_mgpu as K

__all__ = ["MosaicGpuLogitsBackend", "make_backend"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 132) or 132)
    except Exception:  # pragma: no cover - no device info
        return 132


def _hopper_or_newer() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return False
    if dev.platform != "gpu":
        return False
    cc = getattr(dev, "compute_capability", None)
    try:
        return cc is not None and float(cc) >= 9.0
    except ValueError:  # pragma: no cover
        return False


@dataclasses.dataclass(frozen=True)
class MosaicGpuLogitsBackend:
    """Mosaic GPU kernels; ``interpret=True`` runs them in the Pallas GPU interpreter (CPU, tests).

    ``fwd`` / ``bwd``: block configurations of the two kernels; ``num_splits``: vocabulary splits of
    the forward (None: enough CTAs for about four waves, see ``logits_mgpu.pick_splits``).
    ``inplace``: the backward writes ``dlogits`` into the logits' buffer (Liger's ``inplace``): one
    ``[B, T(+1), V]`` buffer instead of two when the logits are dead after the loss (donated to the jit,
    or an intermediate of the same jit, as in a training step); otherwise XLA copies them first, which
    costs a read and a write of the logits. The logits the caller passed are never modified in a way
    it can observe (JAX values are immutable). Where the kernels' view of a row is not a multiple of
    ``bwd.block_v``, the backward runs with 128-byte tiles (64 bf16 columns). The in-place kernel takes
    a ``jax.Ref``, which ``jax.vmap`` cannot batch (use the default, which batches).
    Defaults from the H200 sweep of benchmarks/LOGITS_NOTES.md (2026-11-30): 128-column tiles; the
    forward without the in-kernel target pick (0.146 vs 0.165 ms at 2 x 1025 x 128256 bf16), 4 stages;
    the backward 3 stages, 32 tiles per CTA (block sizes within ~3 % of each other there). float32
    logits run the same blocks (128 KB of shared-memory ring in the forward, 192 KB in the backward);
    their speed has not been swept.
    """

    fwd: K.KernelConfig = K.KernelConfig(block_v=128, stages=4, pick_target=False)
    bwd: K.KernelConfig = K.KernelConfig(block_v=128, stages=3, tiles_per_cta=32)
    num_splits: int | None = None
    inplace: bool = False
    interpret: bool = False
    name: str = "mosaic_gpu"

    def _interpret_params(self):
        if not self.interpret:
            return None
        from gmpo_jax.kernels._compat import interpret_params

        return interpret_params()

    def _view_limits(self, dtype):
        """Columns of one 128-byte tile of ``dtype``, and the widest block of the two kernels."""
        return 128 // jnp.dtype(dtype).itemsize, max(self.fwd.block_v, self.bwd.block_v)

    def _split(self, dtype, R: int, V: int):
        """Rows of the kernels' view ``[R * k, V / k]`` of the logits (a free reshape), or None.

        The bulk copies tile shared memory in 8-row x 128-byte tiles, and a tensor copy needs every
        tiled dimension of the array to be a multiple of its tile: ``R * k % 8 == 0`` and
        ``(V / k) % (128 / itemsize) == 0``. Splitting each row into ``k`` equal pieces (``k`` in 1, 2,
        4, 8) meets the first when ``R`` is not a multiple of 8 (e.g. ``B * (T + 1) = 2050`` rows of
        Llama-3 logits: ``k = 4``, pieces of 32064 columns); the pieces' statistics are merged like
        the vocabulary splits'. Also ``R * k >= 64`` (one row block) and ``V / k >= block_v``. Odd ``R``
        needs ``k = 8``: ``V % 512 == 0`` (bf16; ``V % 256`` for f32) and ``V >= 8 block_v``. Otherwise None.
        """
        g, wide = self._view_limits(dtype)
        for k in (1, 2, 4, 8):
            if (R * k) % 8 == 0 and V % (k * g) == 0 and V // k >= wide and R * k >= K.BLOCK_ROWS:
                return k
        return None

    def check_supported(self, *, dtype, B, T, Tl, V):
        if not self.interpret and not _hopper_or_newer():
            raise BackendUnavailableError("the Mosaic GPU logits kernels need a Hopper (sm_90) or newer GPU")
        dtype = jnp.dtype(dtype)
        if dtype not in _DTYPES:
            raise UnsupportedConfigError(f"logits dtype {dtype} (the Mosaic GPU kernels take bf16 / f16 / f32)")
        for cfg in (self.fwd, self.bwd):
            if cfg.block_v % (128 // dtype.itemsize):
                raise UnsupportedConfigError(f"block_v={cfg.block_v} is not a multiple of 128 bytes of {dtype}")
        if self._split(dtype, B * Tl, V) is None:
            g, wide = self._view_limits(dtype)
            raise UnsupportedConfigError(
                f"B * T(+1) = {B * Tl} rows of V = {V} {dtype} logits: the kernels view them as [rows * k, V / k] "
                f"with k in (1, 2, 4, 8), and need rows * k a multiple of 8 and >= {K.BLOCK_ROWS} (one row "
                f"block), V / k a multiple of {g} (128 bytes) and >= {wide} (block_v); no k meets all four")

    def _splits(self, R, W):
        if self.num_splits is not None:
            tiles = -(-W // self.fwd.block_v)
            tps = -(-tiles // min(self.num_splits, tiles))
            return -(-tiles // tps)
        return K.pick_splits(-(-R // K.BLOCK_ROWS), -(-W // self.fwd.block_v), _num_sms())

    def _rows(self, logits, ids, T):
        """The ``[R * k, V / k]`` view and per-piece target columns (``id - j * V / k``: one piece holds it)."""
        B, Tl, V = logits.shape
        R = B * Tl
        k = self._split(logits.dtype, R, V)
        W = V // k
        ids_r = jnp.pad(ids, ((0, 0), (0, Tl - T))).reshape(R, 1) - W * jnp.arange(k, dtype=jnp.int32)[None]
        return logits.reshape(R * k, W), ids_r.reshape(R * k), R, k

    def logprobs(self, logits, ids, *, T, temperature):
        B, Tl, V = logits.shape
        x, ids_r, R, k = self._rows(logits, ids, T)
        kk = jnp.broadcast_to(jnp.float32(K.LOG2E) / temperature, (R * k,))
        with jax.named_scope("gmpo_jax/mosaic_gpu/logits_lse"):
            parts = K.lse_partials(x, ids_r, kk, cfg=self.fwd, num_splits=self._splits(R * k, x.shape[1]),
                                   interpret=self._interpret_params())
            # [S, R * k] -> [S * k, R]: the row pieces are more splits of the same row
            parts = [jnp.moveaxis(p.reshape(-1, R, k), 2, 1).reshape(-1, R) for p in parts]
            tgt, lse, lse2 = K.combine_partials(*parts)
        tgt, lse = tgt.reshape(B, Tl)[:, :T], lse.reshape(B, Tl)[:, :T]
        if not self.fwd.pick_target:  # a [B, T] gather from the full array (no slice of the logits)
            tgt = logits[jnp.arange(B)[:, None], jnp.arange(T)[None, :], jnp.clip(ids, 0, V - 1)]
            tgt = tgt.astype(jnp.float32) / temperature
        # logp <= 0 exactly: at tiny temperatures (|z| / T ~ 1e7) the target and the log-sum-exp reach
        # natural units through different roundings and could differ by an ulp (~0.5) the wrong way
        return jnp.minimum(tgt - lse, 0.0), lse2.reshape(B, Tl)

    def dlogits(self, logits, ids, lse2, dlogp, *, T, temperature):
        B, Tl, V = logits.shape
        x, ids_r, R, k = self._rows(logits, ids, T)
        rep = lambda v: jnp.repeat(v.reshape(R), k)
        kk = jnp.broadcast_to(jnp.float32(K.LOG2E) / temperature, (R * k,))
        c = rep(jnp.pad(dlogp / temperature, ((0, 0), (0, Tl - T))))
        cfg = self.bwd
        if self.inplace and x.shape[1] % cfg.block_v:  # no slid-back column tile in place
            cfg = dataclasses.replace(cfg, block_v=128 // jnp.dtype(logits.dtype).itemsize)
        with jax.named_scope("gmpo_jax/mosaic_gpu/dlogits"):
            dz = K.dlogits(x, ids_r, kk, rep(lse2), c, cfg=cfg, inplace=self.inplace,
                           interpret=self._interpret_params())
        return dz.reshape(B, Tl, V)


def make_backend(**kw) -> MosaicGpuLogitsBackend:
    return MosaicGpuLogitsBackend(**kw)

