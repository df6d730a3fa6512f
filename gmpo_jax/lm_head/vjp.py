"""The LM-head op's custom VJPs: the fused policy loss and the fused log-probs, one each.

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
* **Memory.** Live at once: the inputs, one float32 copy of the weight (the ``dW`` accumulator; a single
  chunk on ``mosaic_gpu`` writes its weight gradient in the weight's dtype instead), the
  ``[B, T, H]`` hidden gradient and one chunk's workspace (the backend's vocabulary block). Never a
  ``[chunk, T, V]`` or ``[B, T, V]`` array in float32. One exception, inside the same bound: a single
  chunk whose backend can keep its logits for the gradient pass (``logprobs_for_grads``: the Mosaic GPU
  kernels, in float16) may use the float32 weight copy it does not need plus ``SAVED_LOGITS_SLACK``
  for them, and then skips the second logits computation (``8 N H V`` -> ``6 N H V`` flops).
* **Masked tokens.** Their ids are replaced by 0 before the LM head (any id, e.g. -100 or >= V, is
  allowed under the mask) and every objective selects them out, so they influence nothing. An
  *unmasked* id outside ``[0, V)`` yields a NaN log-prob and therefore a NaN loss (loud by design).
* **Cotangents.** Only the :class:`Head` (``hidden``, ``weight``, ``bias``) gets gradients (in its own
  dtypes); the :class:`~gmpo_jax.objectives.PolicyInputs` (advantages, old / reference log-probs, the IS
  ratio, temperature) and the objective's hyper-parameters are data and get zero cotangents. The metrics
  carry no gradient.
* **Devices.** A :class:`~gmpo_jax.lm_head.sharding.ShardingPlan` in the configuration runs the same
  scan per device inside ``jax.shard_map`` (data and / or vocabulary parallel); the normaliser comes from
  the global mask, so every device's per-token gradients are final, and the loss numerator, metric sums
  and weight gradients are summed over the data axis once. Without a plan nothing changes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head import rows
from gmpo_jax.lm_head.backend import Forward, LMHeadBackend
from gmpo_jax.lm_head.sharding import ShardingPlan
from gmpo_jax.objectives import LossAux, MetricSums, Objective, PolicyInputs, evaluate, loss_and_aux

# What a single chunk may keep for its gradient pass beyond the float32 weight copy it does not make:
# the memory target's 512 MiB over the inputs, returned gradients and that copy, less 128 MiB for the rest.
SAVED_LOGITS_SLACK = 384 * 2**20

__all__ = ["LMHeadConfig", "Head", "fused_policy_loss", "fused_logprobs"]


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
    """Chunk ``i``: ``(start, fresh, h [c T, H], ids [c T], the chunk's inputs)``."""
    c = cfg.chunk_size
    start, fresh = locate(i)
    chunk = inputs.rows(start, c, fresh)
    h = lax.dynamic_slice_in_dim(hidden, start, c, axis=0).reshape(-1, hidden.shape[-1])
    return start, fresh, h, jnp.where(chunk.mask, chunk.ids, 0).reshape(-1), chunk


# ------------------------------------------------------------------------------------------------
# The policy loss
# ------------------------------------------------------------------------------------------------
def _saved_budget(weight) -> int:
    """Device memory a single chunk may spend on kept logits: the float32 weight copy it does not make,
    plus ``SAVED_LOGITS_SLACK``."""
    return 4 * weight.size + SAVED_LOGITS_SLACK


def _forward(cfg: LMHeadConfig, head: Head, h, ids, t, *, keep: bool, with_entropy: bool = False) -> Forward:
    """The :class:`~gmpo_jax.lm_head.backend.Forward` of rows ``h [R, H]``; ``keep``: the backend may keep what
    its gradient pass can reuse (``logprobs_for_grads``, a single chunk's float32 weight copy as budget); with
    the gradient filter (``backend.filters``) it carries each row's window mass."""
    return backend_lib.forward(
        cfg.backend,
        h,
        head.weight,
        head.bias,
        ids,
        t,
        weight_layout=cfg.weight_layout,
        with_entropy=with_entropy,
        with_window_mass=backend_lib.filters(cfg.backend),
        budget_bytes=_saved_budget(head.weight) if keep else None,
    )


def _entropy_term(objective, chunk: PolicyInputs, ent, denominator):
    """``(numerator part, gamma [R])`` of the entropy term ``-entropy_coef sum w H`` (None, None without one):
    ``gamma = d loss / d H`` per row (over the global ``denominator``)."""
    if chunk.entropy_coef is None:
        return None, None
    w = objective.entropy_weights(chunk.mask, chunk.segment_ids).reshape(-1)
    c = chunk.entropy_coef.astype(jnp.float32)
    return -c * jnp.sum(w * ent), -c * w / denominator


def _backward(cfg: LMHeadConfig, head: Head, h, ids, dlogp, lse, t, dw, db, fwd: Forward | None, entropy=None):
    """``(dh [R, H], dw, db)`` of rows ``h``: the backend's ``grads`` into the accumulators ``dw`` / ``db``
    (``entropy``: ``(gamma, H)`` of an entropy term, see the seam; ``fwd``: what :func:`_forward` kept)."""
    return backend_lib.backward(
        cfg.backend, h, head.weight, head.bias, ids, dlogp, lse, t,
        weight_layout=cfg.weight_layout, dw_acc=dw, db_acc=db, fwd=fwd, entropy=entropy,
    )  # fmt: skip


def _chunk_step(
    cfg: LMHeadConfig,
    objective,
    head: Head,
    h,
    ids,
    chunk: PolicyInputs,
    denominator,
    dw,
    db,
    *,
    with_grads: bool,
    keep: bool,
):
    """One chunk on all its rows: ``(numerator, sums, dh [R, H] or None, dw, db)``."""
    t = chunk.temperature
    with_ent = chunk.entropy_coef is not None
    fwd = _forward(cfg, head, h, ids, t, keep=keep, with_entropy=with_ent)
    ent = fwd.entropy
    num, sums, dlogp = evaluate(
        objective, fwd.logp.reshape(chunk.mask.shape), chunk, denominator, with_grads=with_grads
    )
    ent_num, gamma = _entropy_term(objective, chunk, ent, denominator)
    if with_ent:
        num, sums = num + ent_num, sums.with_entropy(ent, chunk.mask)
    if not with_grads:
        return num, sums, None, dw, db
    entropy = (gamma, ent) if with_ent else None
    return (num, sums, *_backward(cfg, head, h, ids, dlogp.reshape(-1), fwd.lse, t, dw, db, fwd, entropy))


def _chunk_step_skipping(
    cfg: LMHeadConfig,
    objective,
    head: Head,
    h,
    ids,
    chunk: PolicyInputs,
    denominator,
    dw,
    db,
    *,
    with_grads: bool,
    keep: bool,
):
    """:func:`_chunk_step` on static prefixes of the reordered rows (``gmpo_jax.lm_head.rows``): the forward
    on the unmasked rows, the backward on the rows with a non-zero ``d loss / d logp``. With ``keep`` both
    passes share the forward's prefix (the kept logits hold those rows)."""
    t, buckets = chunk.temperature, cfg.row_buckets
    with_ent = chunk.entropy_coef is not None
    if keep:  # only under differentiation
        order = rows.order(chunk.mask)

        def run(S):
            hs, ids_s = rows.take(h, order, S), rows.take(ids, order, S)
            fwd = _forward(cfg, head, hs, ids_s, t, keep=True, with_entropy=with_ent)
            logp = rows.scatter_back(fwd.logp, order).reshape(chunk.mask.shape)
            num, sums, dlogp = evaluate(objective, logp, chunk, denominator, with_grads=True)
            entropy = None
            if with_ent:  # the entropy's cotangent is 0 off the prefix (masked rows): same rows
                ent = rows.scatter_back(fwd.entropy, order)
                ent_num, gamma = _entropy_term(objective, chunk, ent, denominator)
                num, entropy = num + ent_num, (rows.take(gamma, order, S), fwd.entropy)
                sums = sums.with_entropy(ent, chunk.mask)
            dlogp_s = rows.take(dlogp.reshape(-1), order, S)
            dh_s, dw_, db_ = _backward(cfg, head, hs, ids_s, dlogp_s, fwd.lse, t, None, db, fwd, entropy)
            return num, sums, rows.scatter_back(dh_s, order), dw_, db_

        def empty():
            num, sums, _ = evaluate(objective, jnp.zeros(chunk.mask.shape), chunk, denominator, with_grads=False)
            return num, sums, jnp.zeros_like(h), jnp.zeros_like(head.weight), db

        return rows.on_prefix(order.n_live, rows.prefix_sizes(ids.size, buckets), run, empty)
    filters = backend_lib.filters(cfg.backend)
    fwd = rows.on_live_rows(buckets, chunk.mask, lambda hs, ids_s: _forward(cfg, head, hs, ids_s, t, keep=False,
                            with_entropy=with_ent), (h, ids))  # fmt: skip
    logp, lse, ent, mass = fwd.logp, fwd.lse, [fwd.entropy] if with_ent else [], fwd.window_mass
    num, sums, dlogp = evaluate(objective, logp.reshape(chunk.mask.shape), chunk, denominator, with_grads=with_grads)
    extra = ()
    if with_ent:
        ent_num, gamma = _entropy_term(objective, chunk, ent[0], denominator)
        num, sums = num + ent_num, sums.with_entropy(ent[0], chunk.mask)
        extra = (gamma, ent[0])
    if not with_grads:
        return num, sums, None, dw, db
    dlogp = dlogp.reshape(-1)
    live = dlogp != 0
    if with_ent:  # a row with an entropy cotangent has work even where d loss / d logp is 0
        live = live | (extra[0] != 0)

    def backward(hs, ids_s, dlogp_s, lse_s, *rest):
        mass_s, e_s = (rest[-1], rest[:-1]) if filters else (None, rest)
        fwd_s = None if mass_s is None else Forward(None, None, window_mass=mass_s)
        return _backward(cfg, head, hs, ids_s, dlogp_s, lse_s, t, dw, db, fwd_s, tuple(e_s) or None)

    grads = rows.on_live_rows(
        1 if filters else buckets,  # the filter picks each vocabulary window's rows itself
        live,
        backward,
        (h, ids, dlogp, lse, *extra) + ((mass,) if filters else ()),
        accumulators=(jnp.zeros_like(head.weight) if dw is None else dw, db),  # None: the chunk's own, any dtype
    )
    return (num, sums, *grads)


def _keeps_logits(backend, rows: int, H: int, weight) -> bool:
    """Whether the backend keeps logits for a single chunk's gradient pass (its declared ``keeps_logits``
    capability, and its ``keeps_logits`` hint for these rows)."""
    if not backend_lib.capabilities(backend).keeps_logits:
        return False
    V = weight.size // H
    return backend.keeps_logits(rows=rows, H=H, V=V, weight_dtype=weight.dtype, budget_bytes=_saved_budget(weight))


def _scan_policy(
    cfg: LMHeadConfig, objective: Objective, head: Head, inputs: PolicyInputs, denominator, *, with_grads: bool
):
    """``(numerator, MetricSums, Head of gradients)`` of these rows over the given (global) denominator.

    The weight gradient is float32, or what a single chunk's backend returns (``grads(dw_acc=None)``: the
    Mosaic GPU backend rounds it to the weight's dtype once; data parallel without kept logits, a float32
    accumulator instead, so that the devices' sum is rounded once); without ``with_grads`` the gradients are
    None."""
    hidden, weight, bias = head
    T, H = hidden.shape[1:]
    n, locate = _chunk_plan(hidden.shape[0], cfg.chunk_size)
    # One chunk: no weight-gradient accumulator (the backend returns the chunk's own), and a backend that
    # can keep its logits for the gradient pass may use the float32 copy of the weight it spares.
    single = with_grads and n == 1
    keep = single and _keeps_logits(cfg.backend, cfg.chunk_size * T, H, weight)
    summed = cfg.plan is not None and cfg.plan.data_axis is not None  # the weight gradient is summed over devices
    step = _chunk_step_skipping if cfg.row_buckets > 1 else _chunk_step

    def body(carry, i):
        num, sums, dh, dw, db = carry
        start, fresh, h, ids, chunk = _chunk_rows(cfg, hidden, inputs, locate, i)
        num_c, sums_c, dh_c, dw, db = step(
            cfg, objective, head, h, ids, chunk, denominator, dw, db, with_grads=with_grads, keep=keep
        )
        if with_grads:
            dh = _merge_rows(dh, start, fresh, dh_c.reshape(cfg.chunk_size, T, H))
        return (num + num_c, sums.combine(sums_c), dh, dw, db), None

    dh = dw = db = None
    if with_grads:
        dh = jnp.zeros_like(hidden)
        dw = None if single and (keep or not summed) else jnp.zeros(weight.shape, jnp.float32)
        db = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    init = (jnp.zeros((), jnp.float32), MetricSums.zeros(), dh, dw, db)
    with jax.named_scope(f"gmpo_jax/{cfg.backend.name}/policy_loss"):
        if single:
            (num, sums, dh, dw, db), _ = body(init, jnp.int32(0))
        else:
            (num, sums, dh, dw, db), _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return num, sums, Head(dh, dw, db) if with_grads else None


def _sharded_policy(cfg: LMHeadConfig, objective, head: Head, inputs: PolicyInputs, denominator, *, with_grads):
    """:func:`_scan_policy` per device of ``cfg.plan``, its sums reduced over the data axis."""
    plan = cfg.plan

    def local(objective, head, inputs, denominator):
        num, sums, grads = _scan_policy(cfg, objective, head, inputs, denominator, with_grads=with_grads)
        if plan.data_axis is None:
            return num, sums, grads
        with jax.named_scope("gmpo_jax/data_parallel/reduce"):
            if grads is not None:  # summed in float32 (a single chunk that kept its logits returns 16 bits)
                dw = None if grads.weight is None else plan.sum_data(grads.weight.astype(jnp.float32))
                grads = grads._replace(weight=dw, bias=plan.sum_data(grads.bias))
            return plan.sum_data(num), sums.all_reduce(plan.data_axis), grads

    specs = Head(*plan.head)
    return plan.run(
        local,
        (objective, head, inputs, denominator),
        in_specs=(P(), specs, inputs.specs(plan.batch, P()), P()),
        out_specs=(P(), P(), specs if with_grads else P()),
    )


def _run_policy(cfg: LMHeadConfig, objective, head: Head, inputs: PolicyInputs, *, with_grads: bool):
    denominator = objective.denominator(inputs.mask, inputs.num_items, inputs.segment_ids).astype(
        jnp.float32
    )  # the whole call's
    run = _scan_policy if cfg.plan is None else _sharded_policy
    num, sums, grads = run(cfg, objective, head, inputs, denominator, with_grads=with_grads)
    loss, aux = loss_and_aux(num, denominator, sums, inputs.mask)
    return loss, aux, grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_policy_loss(
    cfg: LMHeadConfig, objective: Objective, head: Head, inputs: PolicyInputs
) -> tuple[jax.Array, LossAux]:
    """Fused loss ``(loss, aux)``; arguments checked and normalised by ``gmpo_jax.lm_head.api``."""
    loss, aux, _ = _run_policy(cfg, objective, head, inputs, with_grads=False)
    return loss, aux


def _fused_policy_loss_fwd(cfg, objective, head, inputs):
    loss, aux, grads = _run_policy(cfg, objective, head, inputs, with_grads=True)
    return (loss, aux), grads


def _scaled(cfg: LMHeadConfig, grads: Head, g) -> Head:
    """The stored gradients times the cotangent ``g``, in the primal dtypes."""
    g = g.astype(jnp.float32)
    return Head(
        (grads.hidden.astype(jnp.float32) * g).astype(grads.hidden.dtype),
        (grads.weight * g).astype(cfg.weight_dtype),
        None if grads.bias is None else (grads.bias * g).astype(cfg.bias_dtype),
    )


def _fused_policy_loss_bwd(cfg, grads, cotangents):
    g, _ = cotangents  # the metrics carry no gradient
    return None, _scaled(cfg, grads, g), None


fused_policy_loss.defvjp(_fused_policy_loss_fwd, _fused_policy_loss_bwd)


# ------------------------------------------------------------------------------------------------
# Log-probs alone (rollout-time old / reference log-probs; composable into any user loss)
# ------------------------------------------------------------------------------------------------
def _scan_logprobs(cfg: LMHeadConfig, head: Head, inputs: PolicyInputs):
    """``(logp, lse[, entropy])``, each ``[B, T]`` float32 (0 at masked tokens but ``lse``)."""
    hidden, weight, bias = head
    B, T = hidden.shape[:2]
    backend: LMHeadBackend = cfg.backend
    n, locate = _chunk_plan(B, cfg.chunk_size)

    def logprobs(hs, ids_s):  # (logp, lse[, entropy])
        fwd = backend_lib.forward(
            backend, hs, weight, bias, ids_s, inputs.temperature, weight_layout=cfg.weight_layout,
            with_entropy=cfg.with_entropy, with_window_mass=False, budget_bytes=None,
        )  # fmt: skip
        return (fwd.logp, fwd.lse, fwd.entropy) if cfg.with_entropy else (fwd.logp, fwd.lse)

    def body(carry, i):
        start, fresh, h, ids, chunk = _chunk_rows(cfg, hidden, inputs, locate, i)
        out = rows.on_live_rows(cfg.row_buckets, chunk.mask, logprobs, (h, ids))
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
            lambda hs, ids_s, dlogp_s, lse_s: _backward(
                cfg, head, hs, ids_s, dlogp_s, lse_s, inputs.temperature, dw, db, None
            ),
            (h, ids, dlogp, cut(lse).reshape(-1)),
            accumulators=(dw, db),
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
