"""The custom VJP of :func:`gmpo_jax.fused_linear_policy_loss`: the fused policy loss over chunks of whole
sequences, its gradients computed in the forward and scaled by the cotangent in the backward.

``fused_policy_loss(cfg, objective, head, inputs) -> (loss, aux)``: ``loss`` a float32 scalar, ``aux`` a
:class:`~gmpo_jax.objectives.LossAux`; gradients w.r.t. ``head`` (:class:`Head`: ``hidden``, ``weight``,
``bias``) in those arrays' dtypes, zero for ``inputs`` and ``objective``. Arguments checked and normalised by
``gmpo_jax.lm_head.api``. The log-probs' own VJP is in ``logprobs_vjp.py``, the parts both share in
``chunks.py``; the design decisions (chunks of whole sequences, gradients in the forward, memory, kept logits,
devices) are in docs/DESIGN.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head import rows
from gmpo_jax.lm_head.backend import Forward
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
from gmpo_jax.lm_head.logprobs_vjp import fused_logprobs
from gmpo_jax.objectives import LossAux, MetricSums, Objective, PolicyInputs, evaluate, loss_and_aux

# What a single chunk may keep for its gradient pass beyond the float32 weight copy it does not make:
# the memory target's 512 MiB over the inputs, returned gradients and that copy, less 128 MiB for the rest.
SAVED_LOGITS_SLACK = 384 * 2**20

__all__ = ["LMHeadConfig", "Head", "fused_policy_loss", "fused_logprobs"]


# ------------------------------------------------------------------------------------------------
# The policy loss
# ------------------------------------------------------------------------------------------------
def _saved_budget(weight) -> int:
    """Device memory a single chunk may spend on kept logits: the float32 weight copy it does not make,
    plus ``SAVED_LOGITS_SLACK``."""
    return 4 * weight.size + SAVED_LOGITS_SLACK


def _forward(
    cfg: LMHeadConfig, head: Head, h, ids, t, *, keep: bool, with_entropy: bool = False, n_rows=None
) -> Forward:
    """The :class:`~gmpo_jax.lm_head.backend.Forward` of rows ``h [R, H]``; ``keep``: the backend may keep what
    its gradient pass can reuse (``logprobs_for_grads``, a single chunk's float32 weight copy as budget); with
    the gradient filter (``backend.filters``) it carries each row's window mass; ``n_rows``: only the first rows
    need work (``Capabilities.row_prefix``)."""
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
        n_rows=n_rows,
    )


def _entropy_term(objective, chunk: PolicyInputs, ent, denominator):
    """``(numerator part, gamma [R])`` of the entropy term ``-entropy_coef sum w H`` (None, None without one):
    ``gamma = d loss / d H`` per row (over the global ``denominator``)."""
    if chunk.entropy_coef is None:
        return None, None
    w = objective.entropy_weights(chunk.mask, chunk.segment_ids).reshape(-1)
    c = chunk.entropy_coef.astype(jnp.float32)
    return -c * jnp.sum(w * ent), -c * w / denominator


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
    passes share the forward's prefix (the kept logits hold those rows); with ``tuning.ROW_PREFIX_FORWARD`` the
    forward runs once, outside the prefix switch, on that prefix's rows (``_row_prefix``), and with
    ``tuning.ROW_PREFIX_GRADIENT`` too (``_row_prefix_grads``) both passes run once on the runtime prefix. The
    gradient filter picks each vocabulary window's rows itself (on the runtime prefix of each window's rows with
    ``ROW_PREFIX_GRADIENT``)."""
    t, buckets = chunk.temperature, cfg.row_buckets
    with_ent = chunk.entropy_coef is not None
    prefix, filters = _row_prefix(cfg), backend_lib.filters(cfg.backend)
    if keep:  # only under differentiation
        order = rows.order(chunk.mask)
        sizes = rows.prefix_sizes(ids.size, buckets)
        once = None
        one_program = prefix and _row_prefix_grads(cfg)  # (the filter: each window on its rows' runtime prefix)
        if prefix and not filters and not one_program:  # one forward program, on the unmasked rows' bucket, kept
            R = order.perm.size
            once = _forward(cfg, head, rows.take(h, order, R), rows.take(ids, order, R), t, keep=True,
                            with_entropy=with_ent, n_rows=rows.prefix_rows(order.n_live, sizes))  # fmt: skip

        def run(S, n_rows=None):  # n_rows: both passes on the first n_rows of all S rows, one program
            hs, ids_s = rows.take(h, order, S), rows.take(ids, order, S)
            if once is None:
                fwd = _forward(cfg, head, hs, ids_s, t, keep=True, with_entropy=with_ent, n_rows=n_rows)
            else:  # its first S rows; the backend reads the first S rows of the kept logits
                ent_s = None if once.entropy is None else once.entropy[:S]
                fwd = once._replace(logp=once.logp[:S], lse=once.lse[:S], entropy=ent_s)
            logp = rows.scatter_back(fwd.logp, order).reshape(chunk.mask.shape)
            num, sums, dlogp = evaluate(objective, logp, chunk, denominator, with_grads=True)
            entropy = None
            if with_ent:  # the entropy's cotangent is 0 off the prefix (masked rows): same rows
                ent = rows.scatter_back(fwd.entropy, order)
                ent_num, gamma = _entropy_term(objective, chunk, ent, denominator)
                num, entropy = num + ent_num, (rows.take(gamma, order, S), fwd.entropy)
                sums = sums.with_entropy(ent, chunk.mask)
            dlogp_s = rows.take(dlogp.reshape(-1), order, S)
            dh_s, dw_, db_ = _backward(cfg, head, hs, ids_s, dlogp_s, fwd.lse, t, None, db, fwd, entropy, n_rows)
            return num, sums, rows.scatter_back(dh_s, order), dw_, db_

        if one_program:
            return run(order.perm.size, n_rows=order.n_live)

        def empty():
            num, sums, _ = evaluate(objective, jnp.zeros(chunk.mask.shape), chunk, denominator, with_grads=False)
            return num, sums, jnp.zeros_like(h), jnp.zeros_like(head.weight), db

        return rows.on_prefix(order.n_live, sizes, run, empty)
    fwd = rows.on_live_rows(buckets, chunk.mask, lambda hs, ids_s, n_rows=None: _forward(cfg, head, hs, ids_s, t,
                            keep=False, with_entropy=with_ent, n_rows=n_rows), (h, ids), row_prefix=prefix)  # fmt: skip
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

    filter_prefix = filters and _row_prefix_grads(cfg)

    def backward(hs, ids_s, dlogp_s, lse_s, *rest, n_rows=None):
        mass_s, e_s = (rest[-1], rest[:-1]) if filters else (None, rest)
        if filter_prefix:  # every row may have work: the filter orders each window's rows, runs their runtime prefix
            n_rows = hs.shape[0]
        fwd_s = None if mass_s is None else Forward(None, None, window_mass=mass_s)
        return _backward(cfg, head, hs, ids_s, dlogp_s, lse_s, t, dw, db, fwd_s, tuple(e_s) or None, n_rows)

    grads = rows.on_live_rows(
        1 if filters else buckets,  # the filter picks each vocabulary window's rows itself
        live,
        backward,
        (h, ids, dlogp, lse, *extra) + ((mass,) if filters else ()),
        accumulators=(jnp.zeros_like(head.weight) if dw is None else dw, db),  # None: the chunk's own, any dtype
        row_prefix=_row_prefix_grads(cfg) and not filters,
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


def _fused_policy_loss_bwd(cfg, grads, cotangents):
    g, _ = cotangents  # the metrics carry no gradient
    return None, _scaled(cfg, grads, jnp.asarray(g, jnp.float32)), None  # a Python float from jax.vjp too


fused_policy_loss.defvjp(_fused_policy_loss_fwd, _fused_policy_loss_bwd)
