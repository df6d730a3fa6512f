"""Portable pure-JAX backend: vocabulary-blocked online log-sum-exp, logits recomputed for gradients.

The vocabulary is walked in blocks of ``vocab_block`` columns with ``lax.scan``; only one ``[R,
vocab_block]`` float32 logits block is live at a time, never ``[R, V]``. A vocabulary whose size is not a
multiple of the block is handled without padding or copying the weight: the last block is slid back to
end at ``V`` (``lax.dynamic_slice`` semantics) and its columns already seen by the previous block are
masked to ``-inf`` (so they add nothing to the sum-exp and receive exactly zero gradient).

Forward: per block and row its maximum ``m_j`` and sum-exp ``s_j = sum exp(z - m_j) - 1`` (excluding one
instance of the maximum, summed in windows: ``gmpo_jax._lse``, issue 31; scan outputs, ``[n, R]``), the
target logit picked from the block that holds it; after the scan the partials are merged at once
(``_lse.merge``: ``m = max_j m_j``, ``s = sum_j (s_j + 1) exp(m_j - m) - 1`` with the blocks at the maximum
counted exactly; one tree reduction, not a running rescale: order-independent to float32 rounding, issue
16); ``lse = m + log1p s``, ``logp = (z_id - m) - log1p s``. Gradients: per block, ``p = exp(z - lse)`` (no second max pass),
``dz = dlogp (onehot - p) / T``, ``dh += dz W_b^T`` and ``dW[:, block] += h^T dz`` in float32 (updated in
place in the carry). Matmuls take the inputs' dtype with float32 accumulation; float32 inputs use
``Precision.HIGHEST`` so GPUs do not silently drop to TF32. ``logits_precision`` (``"float32"`` or
``"bf16x3"``, alike here) keeps ``dz`` in float32 for the two gradient GEMMs (16-bit inputs are upcast there).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmpo_jax import _lse, tuning
from gmpo_jax._dispatch import UnsupportedConfigError
from gmpo_jax._lse import shifted  # re-exported: the logits path's name for it
from gmpo_jax.lm_head.backend import Capabilities, WithHeadSettings, cancel_rounding, logits_precision_of, stored_rowsum

__all__ = ["XlaChunkedBackend", "shifted"]


def _precision(*dtypes):
    return lax.Precision.HIGHEST if any(jnp.dtype(d) == jnp.float32 for d in dtypes) else lax.Precision.DEFAULT


def _weight_block(weight, start, size, layout):
    axis = 1 if layout == "hv" else 0
    return lax.dynamic_slice_in_dim(weight, start, size, axis=axis)


def _block_logits(hidden, w_blk, b_blk, temperature, layout, precision, softcap=None):
    """``(hidden @ W_blk + b_blk) / temperature`` as float32 ``[R, size]``, and None; with ``softcap``,
    ``cap tanh((hidden @ W_blk + b_blk) / cap) / temperature`` and the cap's derivative ``1 - tanh**2``."""
    contract = ((1,), (0,)) if layout == "hv" else ((1,), (1,))
    z = lax.dot_general(hidden, w_blk, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)
    if b_blk is not None:
        z = z + b_blk.astype(jnp.float32)[None, :]
    if softcap is None:
        return z / temperature, None
    t = jnp.tanh(z / softcap)
    z = jnp.where(z == -jnp.inf, -jnp.inf, softcap * t)  # a masked column (-inf bias) stays masked
    return z / temperature, 1.0 - t * t


def _blocks(V, vocab_block):
    size = min(vocab_block, V)
    n = -(-V // size)
    return size, n


def _block_start(j, size, V):
    nominal = j * size
    return jnp.minimum(nominal, V - size), nominal


def _vocab_block(j, hidden, weight, bias, temperature, *, size, V, layout, precision, softcap=None):
    """Logits of vocabulary block ``j``: ``(start, w_blk, z [R, size] f32, cols [size], fresh [size], dcap)``
    (``dcap``: the soft cap's derivative ``[R, size]``, or None without ``softcap``).

    The last block slides back to end at ``V``; its columns already seen by the previous block are not
    ``fresh`` and their logits are ``-inf`` (no sum-exp mass, zero probability, zero gradient).
    """
    start, nominal = _block_start(j, size, V)
    w_blk = _weight_block(weight, start, size, layout)
    b_blk = None if bias is None else lax.dynamic_slice_in_dim(bias, start, size)
    z, dcap = _block_logits(hidden, w_blk, b_blk, temperature, layout, precision, softcap)
    cols = start + jnp.arange(size, dtype=jnp.int32)
    fresh = cols >= nominal
    return start, w_blk, jnp.where(fresh[None, :], z, -jnp.inf), cols, fresh, dcap


@dataclasses.dataclass(frozen=True)
class XlaChunkedBackend(WithHeadSettings):
    """Portable backend; ``vocab_block=None`` takes the tuning table's value for the call's shape;
    ``row_buckets`` (None: ``tuning.row_buckets``) sets exact work skipping (``gmpo_jax.lm_head.rows``). The call's
    ``softcap`` and ``logits_precision`` (``"float32"`` / ``"bf16x3"``: float32 dz and ``Precision.HIGHEST`` GEMMs)
    come from ``HeadOptions`` (:class:`~gmpo_jax.lm_head.backend.HeadSettings`)."""

    vocab_block: int | None = None
    row_buckets: int | None = None  # exact work skipping (gmpo_jax.lm_head.rows); None: tuning.row_buckets
    cancel_rounding: bool = True  # backend.cancel_rounding on dh (off under vocabulary parallelism)
    name: str = "xla_chunked"
    capabilities: ClassVar[Capabilities] = Capabilities(cancel_rounding=True, softcap=True, logits_precision=True)

    def check_supported(
        self,
        *,
        hidden_dtype,
        weight_dtype,
        H,
        V,
        rows,
        weight_layout,
        has_bias,
        with_entropy=False,
        logits_precision=None,
    ):
        if weight_layout not in ("hv", "vh"):
            raise UnsupportedConfigError(f"weight_layout={weight_layout!r}")
        logits_precision_of(self, logits_precision)

    def _vocab_block(self, rows, V):
        return self.vocab_block or tuning.xla_vocab_block(rows, V)

    def logprobs(self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy=False):
        R = hidden.shape[0]
        V = weight.shape[1] if weight_layout == "hv" else weight.shape[0]
        size, n = _blocks(V, self._vocab_block(R, V))
        prec = _precision(hidden.dtype, weight.dtype)

        def body(tgt, j):
            _, _, z, cols, fresh, _ = _vocab_block(
                j, hidden, weight, bias, temperature, size=size, V=V, layout=weight_layout, precision=prec,
                softcap=self.softcap,
            )  # fmt: skip
            # this block's partials, relative to its OWN maximum (merged after the scan, see below); s_j
            # excludes one instance of the maximum (gmpo_jax._lse: the tail is not rounded to ulps of 1)
            m_j = jnp.max(z, axis=1)
            s_j, d, q = _lse.tail(z, m_j[:, None], axis=1)
            e_j = _lse.window_sum(jnp.where(q > 0, q * d, 0.0), axis=1) if with_entropy else None
            hit = (cols[None, :] == ids[:, None]) & fresh[None, :]
            tgt = tgt + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
            return tgt, (m_j, s_j, e_j)

        with jax.named_scope("gmpo_jax/xla_chunked/logprobs"):
            tgt, (m_b, s_b, e_b) = lax.scan(body, jnp.zeros((R,), jnp.float32), jnp.arange(n, dtype=jnp.int32))
            # Merge the [n, R] block partials at once (issue 16): a running merge rescales the sum at
            # every new maximum and adds block sums one after another, an error growing with the number
            # of blocks and depending on the vocabulary's order; here each partial is rescaled once to
            # the global maximum and the n terms are summed by one reduction (a tree).
            m, s, w = _lse.merge(m_b, s_b, axis=0)
            m_ref = jnp.where(jnp.isneginf(m), 0.0, m)
            empty = jnp.isneginf(m)
            l1 = jnp.log1p(jnp.where(empty, s, jnp.maximum(s, 0.0)))  # exactly >= 0 with a finite logit
            lse = m + l1
            valid = (ids >= 0) & (ids < V)
            # relative to the maximum: exact for the argmax (logp = -log1p(s)); exactly <= 0
            logp = jnp.where(valid, jnp.minimum((tgt - m_ref) - l1, 0.0), jnp.nan)
            if not with_entropy:
                return logp, lse
            # e = sum_v q_v (z_v - m): each block's e_j moved from its maximum to m (0 where the block is
            # all -inf, s_j = -1); H = lse - E[z] = log1p(s) - e / (1 + s), in [0, log V]
            shift = jnp.where(jnp.isneginf(m_b), 0.0, m_b - m_ref)
            e = jnp.sum(w * (e_b + (s_b + 1.0) * shift), axis=0)
            ent = jnp.where(empty, 0.0, jnp.clip(l1 - e / jnp.where(empty, 1.0, 1.0 + s), 0.0, np.float32(np.log(V))))
        return logp, lse, ent

    def grads(self, hidden, weight, bias, ids, dlogp, lse, temperature, *, weight_layout, dw_acc, db_acc, entropy=None):
        R, H = hidden.shape
        V = weight.shape[1] if weight_layout == "hv" else weight.shape[0]
        size, n = _blocks(V, self._vocab_block(R, V))
        prec = _precision(hidden.dtype, weight.dtype)
        cdt = jnp.result_type(hidden.dtype, weight.dtype)
        if self.logits_precision is not None:  # dz kept in float32, the GEMMs at float32 (not TF32)
            prec, cdt = lax.Precision.HIGHEST, jnp.float32
        axis = 1 if weight_layout == "hv" else 0
        h_c = hidden.astype(cdt)  # the gradient GEMMs' hidden, converted once (a no-op unless dtypes differ)
        scale = (dlogp / temperature)[:, None]
        if entropy is not None:
            ent_scale, ent_h = (entropy[0] / temperature)[:, None], entropy[1][:, None]

        def body(carry, j):
            dh, dw, db, rowsum = carry
            start, w_blk, z, cols, fresh, dcap = _vocab_block(
                j, hidden, weight, bias, temperature, size=size, V=V, layout=weight_layout, precision=prec,
                softcap=self.softcap,
            )  # fmt: skip
            logp_v = shifted(z, lse[:, None])
            p = jnp.where(fresh[None, :], jnp.exp(logp_v), 0.0)
            onehot = ((cols[None, :] == ids[:, None]) & fresh[None, :]).astype(jnp.float32)
            dz = scale * (onehot - p)  # [R, size] f32
            if entropy is not None:  # + gamma dH/dz = -gamma p (log p + H) / T (0 where p = 0)
                dz = dz - ent_scale * jnp.where(p > 0, p * (logp_v + ent_h), 0.0)
            if dcap is not None:  # through the soft cap; the exact row sum is no longer 0
                dz = dz * jnp.where(fresh[None, :], dcap, 0.0)
                rowsum = rowsum - jnp.sum(dz, axis=1)
            dz_c = dz.astype(cdt)
            rowsum = rowsum + stored_rowsum(dz_c)  # the stored dz's rounding error
            w_blk = w_blk.astype(cdt)  # a no-op unless dtypes differ or logits_precision upcasts
            if weight_layout == "hv":  # dh += dz W_b^T ; dW_b = h^T dz  ([H, size])
                dh = dh + lax.dot_general(
                    dz_c, w_blk, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
                )
                dw_blk = lax.dot_general(
                    h_c, dz_c, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
                )
            else:  # W_b is [size, H]: dh += dz W_b ; dW_b = dz^T h ([size, H])
                dh = dh + lax.dot_general(
                    dz_c, w_blk, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
                )
                dw_blk = lax.dot_general(
                    dz_c, h_c, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
                )
            dw = lax.dynamic_update_slice_in_dim(
                dw, lax.dynamic_slice_in_dim(dw, start, size, axis=axis) + dw_blk, start, axis=axis
            )
            if db is not None:
                db = lax.dynamic_update_slice_in_dim(
                    db, lax.dynamic_slice_in_dim(db, start, size) + jnp.sum(dz, axis=0), start, axis=0
                )
            return (dh, dw, db, rowsum), None

        if dw_acc is None:  # the seam's "no accumulator": this chunk's own gradient
            dw_acc = jnp.zeros(weight.shape, jnp.float32)
        init = (jnp.zeros((R, H), jnp.float32), dw_acc, db_acc, jnp.zeros((R,), jnp.float32))
        with jax.named_scope("gmpo_jax/xla_chunked/grads"):
            (dh, dw, db, rowsum), _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
            if self.cancel_rounding and jnp.dtype(cdt).itemsize < 4:  # float32 dz is not rounded
                dh = cancel_rounding(dh, rowsum, weight, ids, weight_layout)
        return dh.astype(hidden.dtype), dw, db
