"""The fused LM-head + policy-loss custom VJP, and the fused log-prob custom VJP.

Design decisions (and why):

* **Chunks of whole sequences.** ``lax.scan`` walks the batch ``chunk_size`` sequences at a time. A
  chunk never splits a sequence, so sequence-level quantities (GMPO's geometric mean, GSPO's sequence
  ratio, per-sequence normalisers) are exact inside the chunk, and the loss is a sum of chunk numerators
  over a *global* denominator computed once from the whole mask (SPEC.md: B, T and token counts are
  those of the whole call, never of a chunk).
* **No padding copies.** When ``chunk_size`` does not divide ``B`` the last chunk slides back to end at
  ``B`` (overlapping the previous one); the overlapped sequences are masked out of that chunk and their
  hidden-state gradient is kept from the chunk that owned them.
* **Gradients in the forward of the VJP.** The backward of a scalar loss is a scaling: the forward of
  the VJP computes the loss, ``d loss / d logp`` (``jax.grad`` of the objective's chunk numerator, whose
  selects implement SPEC.md's strict boundary rule), and then the LM-head gradients through the
  backend: the hidden-state gradient per chunk (in the hidden dtype, written into a ``[B, T, H]`` carry)
  and the weight / bias gradient accumulated in a float32 carry (never stacked per chunk). The backward
  multiplies these residuals by the cotangent. A call that is one chunk needs no accumulator: the
  backend returns that chunk's weight gradient. Plain evaluation (no differentiation) runs the primal,
  which computes only log-probs and the loss: no gradient work at all.
* **Memory.** Live at once: the inputs, one float32 copy of the weight (the ``dW`` accumulator), the
  ``[B, T, H]`` hidden gradient and one chunk's workspace (the backend's vocabulary block). Never a
  ``[chunk, T, V]`` or ``[B, T, V]`` array in float32. One exception, inside the same bound: a single
  chunk whose backend can keep its logits for the gradient pass (``logprobs_for_grads``: the Mosaic GPU
  kernels, in float16) may use the float32 weight copy it does not need plus ``SAVED_LOGITS_SLACK``
  for them, and then skips the second logits computation (``8 N H V`` -> ``6 N H V`` flops).
* **Masked tokens.** Their ids are replaced by 0 before the LM head (any id, e.g. -100 or >= V, is
  allowed under the mask) and every objective selects them out, so they influence nothing. An
  *unmasked* id outside ``[0, V)`` yields a NaN log-prob and therefore a NaN loss (loud by design).
* **Cotangents.** Only ``hidden``, ``weight`` and ``bias`` get gradients (in their own dtypes);
  advantages, old / reference log-probs, the IS ratio and the objective's hyper-parameters are data
  and get zero cotangents; integer and boolean inputs get none. The metrics carry no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax.backends.base import LMHeadBackend
from gmpo_jax.objectives import ChunkData, MetricSums, Objective, finalize_metrics

# What a single chunk may keep for its gradient pass beyond the float32 weight copy it does not make:
# the memory target's 512 MiB over the inputs, returned gradients and that copy, less 128 MiB for the rest.
SAVED_LOGITS_SLACK = 384 * 2**20

__all__ = ["FusedConfig", "policy_loss", "logprobs"]


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static configuration of one fused call (hashable: a ``nondiff_argnums`` argument)."""

    backend: Any  # LMHeadBackend, hashable
    chunk_size: int
    weight_layout: str
    weight_dtype: Any
    bias_dtype: Any = None
    with_entropy: bool = False  # fused_linear_logprobs(..., return_entropy=True)


def _chunk_plan(B: int, c: int):
    n = -(-B // c)

    def locate(i):
        start = jnp.minimum(i * c, B - c)
        fresh = (start + jnp.arange(c)) >= i * c  # sequences owned by this chunk
        return start, fresh

    return n, locate


def _slice(x, start, c):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, c, axis=0)


def _merge_rows(full, start, fresh, new):
    """Write ``new`` ([c, ...]) into ``full`` at ``start`` for the fresh sequences only."""
    c = new.shape[0]
    old = lax.dynamic_slice_in_dim(full, start, c, axis=0)
    sel = fresh.reshape((c,) + (1,) * (new.ndim - 1))
    return lax.dynamic_update_slice_in_dim(full, jnp.where(sel, new, old), start, axis=0)


def _chunk(cfg: FusedConfig, i, locate, hidden, ids, mask, adv, old, ref, ris):
    c = cfg.chunk_size
    B, T, H = hidden.shape
    start, fresh = locate(i)
    m = _slice(mask, start, c) & fresh[:, None]
    ids_c = jnp.where(m, _slice(ids, start, c), 0).reshape(c * T)
    h = _slice(hidden, start, c).reshape(c * T, H)
    data = ChunkData(m, _slice(adv, start, c), _slice(old, start, c), _slice(ref, start, c), _slice(ris, start, c))
    return start, fresh, h, ids_c, data


def _scan_policy(cfg: FusedConfig, objective: Objective, hidden, weight, bias, ids, mask, adv, old, ref, ris,
                 denom, temperature, *, with_grads: bool):
    """``(numerator, MetricSums, (dh, dw, db f32))`` of these rows over a given denominator (the
    call's own, or the global one of a data-parallel call: ``gmpo_jax.sharding``). ``dw`` is float32,
    or the weight's dtype when a single chunk's backend kept its logits (``logprobs_for_grads``)."""
    B, T, H = hidden.shape
    backend: LMHeadBackend = cfg.backend
    n, locate = _chunk_plan(B, cfg.chunk_size)
    # One chunk: no weight-gradient accumulator (the backend returns the chunk's own), and a backend that
    # can keep its logits for the gradient pass may use the float32 copy of the weight it spares.
    single = with_grads and n == 1
    keep = single and callable(getattr(backend, "logprobs_for_grads", None))

    def body(carry, i):
        num, sums, dh, dw, db = carry
        start, fresh, h, ids_c, data = _chunk(cfg, i, locate, hidden, ids, mask, adv, old, ref, ris)
        saved = None
        if keep:
            logp, lse, saved = backend.logprobs_for_grads(
                h, weight, bias, ids_c, temperature, weight_layout=cfg.weight_layout,
                budget_bytes=4 * weight.size + SAVED_LOGITS_SLACK)
        else:
            logp, lse = backend.logprobs(h, weight, bias, ids_c, temperature, weight_layout=cfg.weight_layout)
        logp = logp.reshape(data.mask.shape)
        with jax.named_scope("gmpo_jax/objective"):
            if with_grads:
                (num_c, sums_c), g = jax.value_and_grad(
                    lambda lp: objective.chunk_numerator(lp, data), has_aux=True)(logp)
            else:
                num_c, sums_c = objective.chunk_numerator(logp, data)
        num = num + num_c
        sums = sums.combine(sums_c)
        if with_grads:
            dlogp = jnp.where(data.mask, g / denom, 0.0).reshape(-1)
            kw = {} if saved is None else {"saved": saved}
            dh_c, dw, db = backend.grads(h, weight, bias, ids_c, dlogp, lse, temperature,
                                         weight_layout=cfg.weight_layout, dw_acc=dw, db_acc=db, **kw)
            dh = _merge_rows(dh, start, fresh, dh_c.reshape(cfg.chunk_size, T, H))
        return (num, sums, dh, dw, db), None

    zero = jnp.zeros((), jnp.float32)
    if with_grads:
        dh0 = jnp.zeros_like(hidden)
        dw0 = None if single else jnp.zeros(weight.shape, jnp.float32)
        db0 = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    else:
        dh0 = dw0 = db0 = None
    init = (zero, MetricSums.zeros(), dh0, dw0, db0)
    with jax.named_scope(f"gmpo_jax/{backend.name}/policy_loss"):
        if single:
            (num, sums, dh, dw, db), _ = body(init, jnp.int32(0))
        else:
            (num, sums, dh, dw, db), _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return num, sums, (dh, dw, db)


def _run_policy(cfg: FusedConfig, objective: Objective, hidden, weight, bias, ids, mask, adv, old, ref, ris,
                num_items, temperature, *, with_grads: bool):
    denom = objective.denominator(mask, num_items).astype(jnp.float32)
    num, sums, (dh, dw, db) = _scan_policy(cfg, objective, hidden, weight, bias, ids, mask, adv, old, ref, ris,
                                           denom, temperature, with_grads=with_grads)
    loss = num / denom
    aux = dict(loss_numerator=num, loss_denominator=denom, **finalize_metrics(sums, mask))
    return loss, aux, (dh, dw, db)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def policy_loss(cfg, objective, hidden, weight, bias, ids, mask, adv, old, ref, ris, num_items, temperature):
    """Fused loss ``(loss, aux)``; arguments validated and normalised by ``gmpo_jax.api``."""
    loss, aux, _ = _run_policy(cfg, objective, hidden, weight, bias, ids, mask, adv, old, ref, ris,
                               num_items, temperature, with_grads=False)
    return loss, aux


def _policy_loss_fwd(cfg, objective, hidden, weight, bias, ids, mask, adv, old, ref, ris, num_items, temperature):
    loss, aux, grads = _run_policy(cfg, objective, hidden, weight, bias, ids, mask, adv, old, ref, ris,
                                   num_items, temperature, with_grads=True)
    return (loss, aux), grads


def _policy_loss_bwd(cfg, grads, cotangents):
    g, _ = cotangents  # the metrics carry no gradient
    dh, dw, db = grads
    g = g.astype(jnp.float32)
    d_hidden = (dh.astype(jnp.float32) * g).astype(dh.dtype)
    d_weight = (dw * g).astype(cfg.weight_dtype)
    d_bias = None if db is None else (db * g).astype(cfg.bias_dtype)
    return (None, d_hidden, d_weight, d_bias, None, None, None, None, None, None, None, None)


policy_loss.defvjp(_policy_loss_fwd, _policy_loss_bwd)


# ------------------------------------------------------------------------------------------------
# Log-probs alone (rollout-time old / reference log-probs; composable into any user loss)
# ------------------------------------------------------------------------------------------------
def _run_logprobs(cfg: FusedConfig, hidden, weight, bias, ids, mask, temperature):
    """``(logp, lse)`` ``[B, T]`` float32, and the entropy as a third output with ``cfg.with_entropy``."""
    B, T, H = hidden.shape
    backend: LMHeadBackend = cfg.backend
    n, locate = _chunk_plan(B, cfg.chunk_size)
    kw = {"with_entropy": True} if cfg.with_entropy else {}

    def body(carry, i):
        start, fresh = locate(i)
        c = cfg.chunk_size
        m = _slice(mask, start, c)
        ids_c = jnp.where(m, _slice(ids, start, c), 0).reshape(c * T)
        h = _slice(hidden, start, c).reshape(c * T, H)
        out = backend.logprobs(h, weight, bias, ids_c, temperature, weight_layout=cfg.weight_layout, **kw)
        new = [jnp.where(m, out[0].reshape(c, T), 0.0), out[1].reshape(c, T)]
        if cfg.with_entropy:
            new.append(jnp.where(m, out[2].reshape(c, T), 0.0))
        return tuple(_merge_rows(a, start, fresh, x) for a, x in zip(carry, new)), None

    init = tuple(jnp.zeros((B, T), jnp.float32) for _ in range(3 if cfg.with_entropy else 2))
    with jax.named_scope(f"gmpo_jax/{backend.name}/logprobs"):
        out, _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return out


def primal_logprobs(cfg: FusedConfig, out):
    """The custom VJP's output from ``_run_logprobs``' ``(logp, lse[, entropy])``."""
    return (out[0], out[2]) if cfg.with_entropy else out[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def logprobs(cfg, hidden, weight, bias, ids, mask, temperature):
    """Fused per-token log-probs ``[B, T]`` float32 (0 where ``mask`` is False); with
    ``cfg.with_entropy`` the pair ``(logp, entropy)`` (the entropy gets no gradient)."""
    return primal_logprobs(cfg, _run_logprobs(cfg, hidden, weight, bias, ids, mask, temperature))


def _logprobs_fwd(cfg, hidden, weight, bias, ids, mask, temperature):
    out = _run_logprobs(cfg, hidden, weight, bias, ids, mask, temperature)
    return primal_logprobs(cfg, out), (hidden, weight, bias, ids, mask, out[1], temperature)


def _logprobs_grads(cfg, res, g):
    """``(dh, dw f32, db f32 | None)`` for the cotangent ``g`` of the log-probs."""
    hidden, weight, bias, ids, mask, lse, temperature = res
    B, T, H = hidden.shape
    backend: LMHeadBackend = cfg.backend
    n, locate = _chunk_plan(B, cfg.chunk_size)
    c = cfg.chunk_size

    def body(carry, i):
        dh, dw, db = carry
        start, fresh = locate(i)
        m = _slice(mask, start, c) & fresh[:, None]
        ids_c = jnp.where(m, _slice(ids, start, c), 0).reshape(c * T)
        h = _slice(hidden, start, c).reshape(c * T, H)
        dlogp = jnp.where(m, _slice(g, start, c).astype(jnp.float32), 0.0).reshape(-1)
        lse_c = _slice(lse, start, c).reshape(-1)
        dh_c, dw, db = backend.grads(h, weight, bias, ids_c, dlogp, lse_c, temperature,
                                     weight_layout=cfg.weight_layout, dw_acc=dw, db_acc=db)
        dh = _merge_rows(dh, start, fresh, dh_c.reshape(c, T, H))
        return (dh, dw, db), None

    init = (jnp.zeros_like(hidden), jnp.zeros(weight.shape, jnp.float32),
            None if bias is None else jnp.zeros(bias.shape, jnp.float32))
    with jax.named_scope(f"gmpo_jax/{backend.name}/logprobs_grad"):
        (dh, dw, db), _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return dh, dw, db


def _logprobs_bwd(cfg, res, g):
    g = g[0] if cfg.with_entropy else g  # the entropy is a metric: no gradient
    dh, dw, db = _logprobs_grads(cfg, res, g)
    d_bias = None if db is None else db.astype(cfg.bias_dtype)
    return (dh, dw.astype(cfg.weight_dtype), d_bias, None, None, None)


logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)
