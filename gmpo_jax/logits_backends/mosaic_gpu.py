"""Pallas Mosaic GPU backend of the policy loss from logits (Hopper or newer), adapting ``logits_mgpu``.

The logits ``[B, Tl, V]`` (``Tl = T`` or ``T + 1``) are handed to the kernels as ``[B * Tl, V]`` (a free
reshape). The forward kernel also reads the ``Tl - T`` extra positions (``1 / Tl`` of the bytes) rather
than splitting row blocks at sequence ends; their statistics are dropped. The backward kernel writes all
``B * Tl`` rows, zeros on the extra positions, so ``dlogits`` needs no padding or concatenation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gmpo_jax.backends.base import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.logits_backends import logits_mgpu as K

__all__ = ["MosaicGpuLogitsBackend", "make_backend"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
    """

    fwd: K.KernelConfig = K.KernelConfig(block_v=128, stages=4)
    bwd: K.KernelConfig = K.KernelConfig(block_v=128, stages=3, tiles_per_cta=32)
    num_splits: int | None = None
    interpret: bool = False
    name: str = "mosaic_gpu"

    def _interpret_params(self):
        if not self.interpret:
            return None
        from gmpo_jax.kernels._compat import interpret_params

        return interpret_params()

    def check_supported(self, *, dtype, B, T, Tl, V):
        if not self.interpret and not _hopper_or_newer():
            raise BackendUnavailableError("the Mosaic GPU logits kernels need a Hopper (sm_90) or newer GPU")
        dtype = jnp.dtype(dtype)
        if dtype not in _DTYPES:
            raise UnsupportedConfigError(f"logits dtype {dtype} (the Mosaic GPU kernels take bf16 / f16)")
        if B * Tl < K.BLOCK_ROWS:
            raise UnsupportedConfigError(f"B * T = {B * Tl} rows < {K.BLOCK_ROWS} (one row block)")
        for cfg in (self.fwd, self.bwd):
            if V < cfg.block_v:
                raise UnsupportedConfigError(f"V={V} < block_v={cfg.block_v}")
            if cfg.block_v % (128 // dtype.itemsize):
                raise UnsupportedConfigError(f"block_v={cfg.block_v} is not a multiple of 128 bytes of {dtype}")
        if (V * dtype.itemsize) % 16:
            raise UnsupportedConfigError(
                f"V={V}: a logits row of {V * dtype.itemsize} bytes is not a multiple of 16 bytes (TMA)")

    def _splits(self, R, V):
        if self.num_splits is not None:
            tiles = -(-V // self.fwd.block_v)
            tps = -(-tiles // min(self.num_splits, tiles))
            return -(-tiles // tps)
        return K.pick_splits(-(-R // K.BLOCK_ROWS), -(-V // self.fwd.block_v), _num_sms())

    def logprobs(self, logits, ids, *, T, temperature):
        B, Tl, V = logits.shape
        R = B * Tl
        x = logits.reshape(R, V)
        ids_r = jnp.pad(ids, ((0, 0), (0, Tl - T))).reshape(R)
        k = jnp.broadcast_to(jnp.float32(K.LOG2E) / temperature, (R,))
        with jax.named_scope("gmpo_jax/mosaic_gpu/logits_lse"):
            m2, l, t2 = K.lse_partials(x, ids_r, k, cfg=self.fwd, num_splits=self._splits(R, V),
                                       interpret=self._interpret_params())
            tgt, lse, lse2 = K.combine_partials(m2, l, t2)
        tgt, lse = tgt.reshape(B, Tl)[:, :T], lse.reshape(B, Tl)[:, :T]
        return tgt - lse, lse2.reshape(B, Tl)

    def dlogits(self, logits, ids, lse2, dlogp, *, T, temperature):
        B, Tl, V = logits.shape
        R = B * Tl
        pad = ((0, 0), (0, Tl - T))
        k = jnp.broadcast_to(jnp.float32(K.LOG2E) / temperature, (R,))
        c = jnp.pad(dlogp / temperature, pad).reshape(R)
        ids_r = jnp.pad(ids, pad).reshape(R)
        with jax.named_scope("gmpo_jax/mosaic_gpu/dlogits"):
            dz = K.dlogits(logits.reshape(R, V), ids_r, k, lse2.reshape(R), c, cfg=self.bwd,
                           interpret=self._interpret_params())
        return dz.reshape(B, Tl, V)


def make_backend(**kw) -> MosaicGpuLogitsBackend:
    return MosaicGpuLogitsBackend(**kw)

