"""The custom VJP of :func:`gmpo_jax.fused_linear_logprobs`: per-token log-probs (and entropies) through the
LM head, for rollout-time old / reference log-probs or any loss of the caller's own.

The forward scans over chunks of whole sequences and keeps each token's log-sum-exp; the backward recomputes
the logits block by block through the backend's ``grads`` with each token's cotangent. The entropy is a metric:
it carries no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head import rows
from gmpo_jax.lm_head.backend import LMHeadBackend
from gmpo_jax.lm_head.chunks import (
    Head,
    LMHeadConfig,
    _backward,
    _chunk_plan,
    _chunk_rows,
    _merge_rows,
    _row_prefix,
    _row_prefix_grads,
    _scaled,
)
from gmpo_jax.objectives import PolicyInputs

__all__ = ["fused_logprobs"]


def _scan_logprobs(cfg: LMHeadConfig, head: Head, inputs: PolicyInputs):
    """``(logp, lse[, entropy])``, each ``[B, T]`` float32 (0 at masked tokens but ``lse``)."""
    hidden, weight, bias = head
    B, T = hidden.shape[:2]
    backend: LMHeadBackend = cfg.backend
    n, locate = _chunk_plan(B, cfg.chunk_size)

    def logprobs(hs, ids_s, n_rows=None):  # (logp, lse[, entropy])
        fwd = backend_lib.forward(
            backend, hs, weight, bias, ids_s, inputs.temperature, weight_layout=cfg.weight_layout,
            with_entropy=cfg.with_entropy, with_window_mass=False, budget_bytes=None, n_rows=n_rows,
        )  # fmt: skip
        return (fwd.logp, fwd.lse, fwd.entropy) if cfg.with_entropy else (fwd.logp, fwd.lse)

    def body(carry, i):
        start, fresh, h, ids, chunk = _chunk_rows(cfg, hidden, inputs, locate, i)
        out = rows.on_live_rows(cfg.row_buckets, chunk.mask, logprobs, (h, ids), row_prefix=_row_prefix(cfg))
        m = chunk.mask
        new = [jnp.where(m, x.reshape(m.shape), 0.0) if k != 1 else x.reshape(m.shape) for k, x in enumerate(out)]
        return tuple(_merge_rows(a, start, fresh, x) for a, x in zip(carry, new)), None

    init = tuple(jnp.zeros((B, T), jnp.float32) for _ in range(3 if cfg.with_entropy else 2))
    with jax.named_scope(f"gmpo_jax/{backend.name}/logprobs"):
        out, _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return out


def _scan_logprob_grads(cfg: LMHeadConfig, head: Head, inputs: PolicyInputs, lse, g) -> Head:
    """The float32 gradients (``hidden`` in its dtype) of ``sum(g * logp)``."""
    hidden, weight, bias = head
    backend: LMHeadBackend = cfg.backend
    n, locate = _chunk_plan(hidden.shape[0], cfg.chunk_size)
    c = cfg.chunk_size

    def body(carry, i):
        dh, dw, db = carry
        start, fresh, h, ids, chunk = _chunk_rows(cfg, hidden, inputs, locate, i)
        cut = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=c, axis=0)
        dlogp = jnp.where(chunk.mask, cut(g).astype(jnp.float32), 0.0).reshape(-1)
        dh_c, dw, db = rows.on_live_rows(
            cfg.row_buckets,
            dlogp != 0,
            lambda hs, ids_s, dlogp_s, lse_s, n_rows=None: _backward(
                cfg, head, hs, ids_s, dlogp_s, lse_s, inputs.temperature, dw, db, None, n_rows=n_rows
            ),
            (h, ids, dlogp, cut(lse).reshape(-1)),
            accumulators=(dw, db),
            row_prefix=_row_prefix_grads(cfg),
        )
        return (_merge_rows(dh, start, fresh, dh_c.reshape(c, *hidden.shape[1:])), dw, db), None

    init = (
        jnp.zeros_like(hidden),
        jnp.zeros(weight.shape, jnp.float32),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    with jax.named_scope(f"gmpo_jax/{backend.name}/logprobs_grad"):
        grads, _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return Head(*grads)


def _run_logprobs(cfg: LMHeadConfig, head: Head, inputs: PolicyInputs):
    plan = cfg.plan
    if plan is None:
        return _scan_logprobs(cfg, head, inputs)
    out_specs = (plan.batch,) * (3 if cfg.with_entropy else 2)
    return plan.run(
        functools.partial(_scan_logprobs, cfg),
        (head, inputs),
        in_specs=(Head(*plan.head), inputs.specs(plan.batch, P())),
        out_specs=out_specs,
    )


def _logprob_grads(cfg: LMHeadConfig, head: Head, inputs: PolicyInputs, lse, g) -> Head:
    plan = cfg.plan
    if plan is None:
        return _scan_logprob_grads(cfg, head, inputs, lse, g)

    def local(head, inputs, lse, g):
        grads = _scan_logprob_grads(cfg, head, inputs, lse, g)
        return grads._replace(weight=plan.sum_data(grads.weight), bias=plan.sum_data(grads.bias))

    specs = Head(*plan.head)
    return plan.run(
        local,
        (head, inputs, lse, g),
        in_specs=(specs, inputs.specs(plan.batch, P()), plan.batch, plan.batch),
        out_specs=specs,
    )


def _primal(cfg: LMHeadConfig, out):
    """The custom VJP's output from ``(logp, lse[, entropy])``."""
    return (out[0], out[2]) if cfg.with_entropy else out[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_logprobs(cfg: LMHeadConfig, head: Head, inputs: PolicyInputs):
    """Fused per-token log-probs ``[B, T]`` float32 (0 where ``inputs.mask`` is False); with
    ``cfg.with_entropy`` the pair ``(logp, entropy)`` (the entropy gets no gradient). ``inputs`` needs
    ``mask``, ``ids`` and ``temperature`` only."""
    return _primal(cfg, _run_logprobs(cfg, head, inputs))


def _fused_logprobs_fwd(cfg, head, inputs):
    out = _run_logprobs(cfg, head, inputs)
    return _primal(cfg, out), (head, inputs, out[1])


def _fused_logprobs_bwd(cfg, res, g):
    head, inputs, lse = res
    g = g[0] if cfg.with_entropy else g  # the entropy is a metric: no gradient
    grads = _logprob_grads(cfg, head, inputs, lse, g)
    return _scaled(cfg, grads, jnp.ones((), jnp.float32)), None


fused_logprobs.defvjp(_fused_logprobs_fwd, _fused_logprobs_bwd)
