"""What both custom VJPs of the LM-head op share: the static configuration, the differentiable inputs, the
chunk plan over whole sequences, the backward call of the seam and the cotangent scaling."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import tuning
from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head.backend import Forward
from gmpo_jax.lm_head.sharding import ShardingPlan
from gmpo_jax.objectives import PolicyInputs

__all__ = ["LMHeadConfig", "Head"]


@dataclasses.dataclass(frozen=True)
class LMHeadConfig:
    """Static configuration of one fused LM-head call (hashable: the custom VJPs' ``nondiff_argnums``).

    Attributes:
      backend: the :class:`~gmpo_jax.lm_head.backend.LMHeadBackend` each device runs.
      chunk_size: sequences per chunk of the scan (``>= 1``; the local batch's with a plan).
      weight_layout: ``"hv"`` or ``"vh"``.
      weight_dtype, bias_dtype: the dtypes the gradients are returned in.
      with_entropy: :func:`logprobs` also returns the per-token entropy (a metric).
      plan: the mesh layout (data / vocabulary parallel), or None on one device.
      row_buckets: > 1: exact work skipping with this many static row prefixes (``gmpo_jax.lm_head.rows``);
        1: every row of a chunk goes through the backend.
    """

    backend: Any
    chunk_size: int
    weight_layout: str
    weight_dtype: Any
    bias_dtype: Any = None
    with_entropy: bool = False
    plan: ShardingPlan | None = None
    row_buckets: int = 1


class Head(NamedTuple):
    """The differentiable inputs: ``hidden [B, T, H]``, ``weight`` (``[H, V]`` / ``[V, H]``), ``bias [V]`` or
    None. Its gradients come back as a ``Head`` too."""

    hidden: jax.Array
    weight: jax.Array
    bias: jax.Array | None = None


def _chunk_plan(B: int, c: int):
    """``(number of chunks, locate)``; ``locate(i) -> (start, fresh)``: the last chunk slides back to end at
    ``B``, and ``fresh`` marks the sequences it owns (not already done by the previous chunk)."""
    n = -(-B // c)

    def locate(i):
        start = jnp.minimum(i * c, B - c)
        fresh = (start + jnp.arange(c, dtype=jnp.int32)) >= i * c
        return start, fresh

    return n, locate


def _merge_rows(full, start, fresh, new):
    """Write ``new`` ([c, ...]) into ``full`` at ``start`` for the fresh sequences only."""
    c = new.shape[0]
    old = lax.dynamic_slice_in_dim(full, start, c, axis=0)
    sel = fresh.reshape((c,) + (1,) * (new.ndim - 1))
    return lax.dynamic_update_slice_in_dim(full, jnp.where(sel, new, old), start, axis=0)


def _chunk_rows(cfg: LMHeadConfig, hidden, inputs: PolicyInputs, locate, i):
    """Chunk ``i``: ``(start, fresh, h [c T, H], ids [c T], the chunk's inputs)``; masked rows of ``h`` and ``ids``
    are 0 (whatever they held, NaN included: their zero cotangent times a NaN would poison ``dW``)."""
    c = cfg.chunk_size
    start, fresh = locate(i)
    chunk = inputs.rows(start, c, fresh)
    h = lax.dynamic_slice_in_dim(hidden, start, c, axis=0).reshape(-1, hidden.shape[-1])
    h = jnp.where(chunk.mask.reshape(-1, 1), h, jnp.zeros((), h.dtype))
    return start, fresh, h, jnp.where(chunk.mask, chunk.ids, 0).reshape(-1), chunk


def _backward(
    cfg: LMHeadConfig, head: Head, h, ids, dlogp, lse, t, dw, db, fwd: Forward | None, entropy=None, n_rows=None
):
    """``(dh [R, H], dw, db)`` of rows ``h``: the backend's ``grads`` into the accumulators ``dw`` / ``db``
    (``entropy``: ``(gamma, H)`` of an entropy term, see the seam; ``fwd``: what :func:`_forward` kept; ``n_rows``:
    only the first ``n_rows`` rows have work, :func:`_row_prefix_grads`)."""
    return backend_lib.backward(
        cfg.backend, h, head.weight, head.bias, ids, dlogp, lse, t,
        weight_layout=cfg.weight_layout, dw_acc=dw, db_acc=db, fwd=fwd, entropy=entropy, n_rows=n_rows,
    )  # fmt: skip


def _one_program(flag, cfg: LMHeadConfig) -> bool:
    """A ``tuning.ROW_PREFIX_*`` setting for this call: True / False, or None: on where the call runs the gradient
    filter (``backend.filters``: the policy loss with ``grad_filter`` set; the log-probs op's backend carries none),
    whose per-window switches make its per-prefix program the slowest to compile.

    Raises:
      TypeError: ``flag`` neither a bool nor None (a string such as ``"False"`` would otherwise read as on).
    """
    if flag is None:
        return backend_lib.filters(cfg.backend)
    if not isinstance(flag, bool):
        raise TypeError(f"tuning.ROW_PREFIX_FORWARD / ROW_PREFIX_GRADIENT must be True, False or None, got {flag!r}")
    return bool(flag)


def _row_prefix(cfg: LMHeadConfig) -> bool:
    """Whether the forward runs on a runtime row prefix with one program: the backend serves one
    (``Capabilities.row_prefix``) and ``tuning.ROW_PREFIX_FORWARD`` is on (:func:`_one_program`)."""
    return _one_program(tuning.ROW_PREFIX_FORWARD, cfg) and backend_lib.capabilities(cfg.backend).row_prefix


def _row_prefix_grads(cfg: LMHeadConfig) -> bool:
    """Whether the backward runs on a runtime row prefix with one program: the backend serves one
    (``Capabilities.row_prefix_grads``) and ``tuning.ROW_PREFIX_GRADIENT`` is on (:func:`_one_program`)."""
    return _one_program(tuning.ROW_PREFIX_GRADIENT, cfg) and backend_lib.capabilities(cfg.backend).row_prefix_grads


def _scaled(cfg: LMHeadConfig, grads: Head, g) -> Head:
    """The stored gradients times the cotangent ``g``, in the primal dtypes."""
    g = g.astype(jnp.float32)
    return Head(
        (grads.hidden.astype(jnp.float32) * g).astype(grads.hidden.dtype),
        (grads.weight * g).astype(cfg.weight_dtype),
        None if grads.bias is None else (grads.bias * g).astype(cfg.bias_dtype),
    )
