"""Pallas Mosaic GPU backend of the policy loss from logits (Hopper or newer), adapting ``gmpo_jax.kernels.logits_*``.

The logits ``[B, Tl, V]`` (``Tl = T`` or ``T + 1``) are handed to the kernels as ``[B * Tl * k, V / k]``
(a free reshape; ``k > 1`` only when ``B * Tl`` is not a multiple of 8, see ``_split``). The forward
kernel also reads the ``Tl - T`` extra positions (``1 / Tl`` of the bytes) rather than splitting row
blocks at sequence ends; their statistics are dropped. The backward kernel writes all
``B * Tl`` rows, zeros on the extra positions, so ``dlogits`` needs no padding or concatenation.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from gmpo_jax import kernels as K
from gmpo_jax import tuning
from gmpo_jax._device import num_sms, supported_on
from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.logits.backend import Capabilities

__all__ = ["MosaicGpuLogitsBackend"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MosaicGpuLogitsBackend:
    """Mosaic GPU kernels; ``interpret=True`` runs them in the Pallas GPU interpreter (CPU, tests).

    ``fwd`` / ``bwd``: block configurations of the two kernels; ``num_splits``: vocabulary splits of
    the forward (None: enough CTAs for about four waves, see ``kernels.logits_num_splits``).
    ``fused``: for token-local objectives (``objective.token_local``: the GRPO family at token level,
    CISPO, SAPO), the forward of ``jax.grad`` / ``jax.value_and_grad`` writes ``dlogits`` in the same
    kernel that computes the log-sum-exp (``kernels.logits_lse_and_dlogits``: two passes over each row,
    the second from shared memory, so one read and one write of the logits), and the backward only
    scales it by the cotangent (a cotangent other than 1 rounds a bf16 gradient twice, about one ulp);
    see :meth:`fused_plan` for when it
    applies (bf16 / f32, not with ``inplace``).
    ``skip_masked_rows``: rows that need no work are not read where the kernels can skip them. The fused
    kernel skips the rows of masked tokens (and the dropped last position of ``[B, T + 1, V]`` logits),
    writing only their zero gradient, when its plan allows (``FusedLogitsBlocks.skip_dead_rows``: a CTA's
    share of a row resident in its ring, or ``stages`` at most its tiles of a row; the device plan is);
    the three-pass path (GMPO, GSPO) skips whole 64-row blocks of the kernels' row view: the forward those
    whose rows are all masked (or dropped), the backward those whose rows all carry a zero gradient
    (masked tokens, zero-advantage sequences), which it fills with zeros. A skipped or masked token's
    log-prob is reported as 0 (the objective ignores it). Exact either way. On by default: RL batches
    (ragged completions, zero-advantage groups) save most of the skipped rows' bytes, a fully live batch pays
    a little for the bookkeeping (measurements: docs/performance.md, "Exact work skipping in the logits
    path"). False reads every row.
    ``resident_rows`` (fused path only): when a CTA's share of a row fits in its shared-memory ring (the
    device plan: a quarter of a Llama-3 or Qwen row per CTA of a cluster), the kernel's second pass reads
    the row from shared memory instead of fetching it again (docs/performance.md); False re-reads
    it (mostly from L2), the earlier kernel (kept for A / B runs and the tests).
    ``inplace``: the backward writes ``dlogits`` into the logits' buffer (Liger's ``inplace``): one
    ``[B, T(+1), V]`` buffer instead of two when the logits are dead after the loss (donated to the jit,
    or an intermediate of the same jit, as in a training step); otherwise XLA copies them first, which
    costs a read and a write of the logits. The logits the caller passed are never modified in a way
    it can observe (JAX values are immutable). Where the kernels' view of a row is not a multiple of
    ``bwd.block_v``, the backward runs with 128-byte tiles (64 bf16 columns). The in-place kernel takes
    a ``jax.Ref``, which ``jax.vmap`` cannot batch (use the default, which batches).
    ``fwd`` / ``bwd`` default to ``tuning.LOGITS_FWD`` / ``tuning.LOGITS_BWD`` (a reviewed sweep; the
    forward leaves the target pick to a gather outside the kernel: docs/performance.md). float32 logits run the
    same blocks (128 KB of shared-memory ring in the forward, 192 KB in the backward); their speed has not
    been swept.
    """

    fwd: K.LogitsBlocks = K.LogitsBlocks(**tuning.LOGITS_FWD)
    bwd: K.LogitsBlocks = K.LogitsBlocks(**tuning.LOGITS_BWD)
    num_splits: int | None = None
    inplace: bool = False
    fused: bool = True
    skip_masked_rows: bool = True
    resident_rows: bool = True
    interpret: bool = False
    name: str = "mosaic_gpu"
    capabilities: ClassVar[Capabilities] = Capabilities(fused_dlogits=True)

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
        if not self.interpret and not supported_on(jax.devices()[0]):
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
                f"block), V / k a multiple of {g} (128 bytes) and >= {wide} (block_v); no k meets all four"
            )

    def _splits(self, R, W):
        if self.num_splits is not None:
            tiles = -(-W // self.fwd.block_v)
            tps = -(-tiles // min(self.num_splits, tiles))
            return -(-tiles // tps)
        return K.logits_num_splits(-(-R // K.BLOCK_ROWS), -(-W // self.fwd.block_v), num_sms())

    def _rows(self, logits, ids, T):
        """The ``[R * k, V / k]`` view and per-piece target columns (``id - j * V / k``: one piece holds it)."""
        B, Tl, V = logits.shape
        R = B * Tl
        k = self._split(logits.dtype, R, V)
        W = V // k
        ids_r = jnp.pad(ids, ((0, 0), (0, Tl - T))).reshape(R, 1) - W * jnp.arange(k, dtype=jnp.int32)[None]
        return logits.reshape(R * k, W), ids_r.reshape(R * k), R, k

    def _row_flags(self, rows_live, Tl: int, T: int, k: int):
        """``kernels.row_block_flags`` of the kernels' row view (``[B, T]`` bool, padded with False to ``Tl``
        positions, each row repeated for its ``k`` pieces), or None without ``skip_masked_rows``."""
        if not self.skip_masked_rows:
            return None
        live = jnp.pad(rows_live, ((0, 0), (0, Tl - T))).reshape(-1)
        return K.row_block_flags(jnp.repeat(live, k))

    def logprobs(self, logits, ids, *, T, temperature, mask=None):
        """``(logp [B, T], lse2 [B, Tl])``; with ``skip_masked_rows`` and a ``mask`` (``[B, T]`` bool), the
        blocks of masked rows are not read and every masked token's ``logp`` and ``lse2`` are 0."""
        B, Tl, V = logits.shape
        x, ids_r, R, k = self._rows(logits, ids, T)
        kk = jnp.broadcast_to(jnp.float32(K.LOG2E) / temperature, (R * k,))
        flags = None if mask is None else self._row_flags(mask, Tl, T, k)
        with jax.named_scope("gmpo_jax/mosaic_gpu/logits_lse"):
            parts = K.logits_lse_partials(
                x,
                ids_r,
                kk,
                cfg=self.fwd,
                num_splits=self._splits(R * k, x.shape[1]),
                block_live=flags,
                interpret=self._interpret_params(),
            )
            # [S, R * k] -> [S * k, R]: the row pieces are more splits of the same row
            parts = [jnp.moveaxis(p.reshape(-1, R, k), 2, 1).reshape(-1, R) for p in parts]
            tgt, lse, lse2 = K.logits_merge_splits(*parts)
        tgt, lse = tgt.reshape(B, Tl)[:, :T], lse.reshape(B, Tl)[:, :T]
        if not self.fwd.pick_target:  # a [B, T] gather from the full array (no slice of the logits)
            tgt = logits[
                jnp.arange(B, dtype=jnp.int32)[:, None],
                jnp.arange(T, dtype=jnp.int32)[None, :],
                jnp.clip(ids, 0, V - 1),
            ]
            tgt = tgt.astype(jnp.float32) / temperature
        # logp <= 0 exactly: at tiny temperatures (|z| / T ~ 1e7) the target and the log-sum-exp reach
        # natural units through different roundings and could differ by an ulp (~0.5) the wrong way
        logp, lse2 = jnp.minimum(tgt - lse, 0.0), lse2.reshape(B, Tl)
        if flags is not None:  # skipped blocks' statistics mean nothing: every masked token gets 0
            logp = jnp.where(mask, logp, 0.0)
            lse2 = jnp.where(jnp.pad(mask, ((0, 0), (0, Tl - T))), lse2, 0.0)
        return logp, lse2

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
            dz = K.logits_dlogits(
                x,
                ids_r,
                kk,
                rep(lse2),
                c,
                cfg=cfg,
                inplace=self.inplace,
                block_live=self._row_flags(dlogp != 0.0, Tl, T, k),
                interpret=self._interpret_params(),
            )
        return dz.reshape(B, Tl, V)

    def fused_plan(self, *, dtype, R: int, V: int) -> tuple[int, K.FusedLogitsBlocks] | None:
        """``(w, config)`` of the fused kernel for ``R`` rows of ``V`` logits, or None (then the three-pass
        path runs): the rows must view as ``[R, V / w, w]`` slabs (``V`` a multiple of 128 bf16 / 64 f32
        columns, see ``kernels.slab_width``) at least 64 slab rows long (bf16 ``V = 2048``: 64 rows
        of 32 columns; ``V = 1088``: none), ``inplace`` off, and bf16 or f32 logits:
        the kernel stores ``dlogits`` of a unit cotangent, which the backward then scales, and float16
        would round its small entries to subnormals or zero before a loss scale could lift them.

        Blocks (``tuning.LOGITS_FUSED``, a reviewed sweep): 16 KB tiles, 4 input and 2 output stages (96 KB of
        shared memory: two CTAs per SM), clusters of 4 CTAs per row, 62 clusters on 132 SMs (64 do not all
        fit at once and the last ones would run in a second wave). A CTA's share of a row is 4 tiles, so
        the row stays in its 4-slot ring between the two passes (``resident``). The interpreter has no
        clusters: there each CTA owns its rows (``cluster=1``).
        """
        if self.inplace or not self.fused or jnp.dtype(dtype) == jnp.float16:
            return None
        w = K.slab_width(V, dtype)
        if w is None:
            return None
        S = V // w
        itemsize = jnp.dtype(dtype).itemsize
        plan = tuning.LOGITS_FUSED
        bs = min(256, plan["tile_bytes"] // (w * itemsize), S) // K.BLOCK_ROWS * K.BLOCK_ROWS
        if bs < K.BLOCK_ROWS:
            return None
        n_t = -(-S // bs)
        cluster = 1 if self.interpret else max(c for c in (1, 2, 4) if c <= n_t and (c - 1) * -(-n_t // c) < n_t)
        stages = plan["stages"]
        if self.interpret:  # 3 CTAs, each walking several rows; 2 stages, so that the tests' rows of 2
            num_ctas, stages = 3, 2  # tiles skip masked rows (which needs stages <= tiles per CTA)
        else:
            sms = num_sms()
            clusters = {4: sms * plan["clusters_of_4_per_132_sms"] // 132, 2: sms, 1: 2 * sms}[cluster]
            num_ctas = cluster * clusters
        return w, K.FusedLogitsBlocks(
            block_rows=bs,
            stages=stages,
            out_stages=plan["out_stages"],
            cluster=cluster,
            num_ctas=num_ctas,
            skip_dead_rows=self.skip_masked_rows,
            resident=self.resident_rows,
        )

    def logprobs_and_dlogits(
        self,
        logits,
        ids,
        *,
        T,
        temperature,
        objective,
        old_logps,
        ref_logps,
        advantages,
        rollout_is_ratio,
        weights,
        mask,
        id_ok,
    ):
        """Log-probs and, for a unit cotangent, ``dlogits`` of a token-local objective in one kernel.

        ``advantages``: ``[B]`` or ``[B, T]`` (per token);
        ``weights``: ``[B, T]`` token weights of the loss (``objective.token_weights``; 0 = no gradient);
        ``mask``: ``[B, T]`` bool completion mask: a masked token's ``dlogits`` are zeros; with
        ``skip_masked_rows`` the kernel does not read its row (its log-prob is reported as 0), nor the
        dropped last position of ``[B, T + 1, V]`` logits;
        ``id_ok``: ``[B, T]`` bool, False where an unmasked id is out of range (its log-prob is NaN).
        Returns ``(logp [B, T] f32, loss f32 scalar, dlogits [B, Tl, V] logits.dtype)`` with
        ``loss = sum(where(mask, w * token_loss, 0))`` (each token's term formed in the kernel) and
        ``dlogits = w / tau * d token_loss / d logp * (onehot - softmax(z / tau))``.
        """
        B, Tl, V = logits.shape
        R = B * Tl
        w, cfg = self.fused_plan(dtype=logits.dtype, R=R, V=V)
        pad = lambda a: jnp.pad(jnp.broadcast_to(a, (B, T)).astype(jnp.float32), ((0, 0), (0, Tl - T))).reshape(R)
        safe = jnp.clip(ids, 0, V - 1)
        x_t = logits[jnp.arange(B, dtype=jnp.int32)[:, None], jnp.arange(T, dtype=jnp.int32)[None, :], safe].astype(
            jnp.float32
        )
        x_t = jnp.where(id_ok, x_t, jnp.nan)
        zeros = jnp.zeros((R,), jnp.float32)
        F = K.RowData
        row_data = K.pack_row_data(
            {
                F.K: jnp.broadcast_to(jnp.float32(K.LOG2E) / temperature, (R,)),
                F.TARGET_LOGIT: pad(x_t),
                F.OLD: zeros if old_logps is None else pad(old_logps),
                F.REF: zeros if ref_logps is None else pad(ref_logps),
                F.ADV: pad(advantages if advantages.ndim == 2 else advantages[:, None]),
                F.RIS: zeros if rollout_is_ratio is None else pad(rollout_is_ratio),
                F.SCALE: pad(weights) / temperature,
                F.LIVE: pad(mask),
                F.WEIGHT: pad(weights),
            }
        )
        # hyper-parameters enter the kernel as constants (the caller checked they are concrete)
        obj = jax.tree.map(float, objective)
        has = (old_logps is not None, ref_logps is not None, rollout_is_ratio is not None)

        def token_fn(logp, old, ref, adv, ris, live):
            args = [v if h else None for v, h in zip((old, ref, ris), has)]
            fn = jax.value_and_grad(lambda lp: obj.token_loss(lp, args[0], args[1], adv, args[2], mask=live))
            return tuple(_inline(jax.make_jaxpr(fn)(logp), logp))

        with jax.named_scope("gmpo_jax/mosaic_gpu/lse_and_dlogits"):
            dz, stats = K.logits_lse_and_dlogits(
                logits.reshape(R, V // w, w),
                row_data,
                token_fn,
                cfg=cfg,
                num_sms=num_sms(),
                interpret=self._interpret_params(),
            )
            S_ = K.RowStats
            logp, c, loss = stats[:, S_.LOGP], stats[:, S_.GRAD_SCALE], jnp.sum(stats[:, S_.LOSS_TERM])
            # the one-hot's term at the target: c (1 - p) with p = exp(logp), in float32 (the kernel wrote -c p)
            hit = jnp.where(c != 0.0, c * -jnp.expm1(logp), 0.0).astype(logits.dtype)
            tgt = jnp.pad(safe, ((0, 0), (0, Tl - T))).reshape(R)
            dz = dz.reshape(R, V).at[jnp.arange(R, dtype=jnp.int32), tgt].set(hit, unique_indices=True)
        return logp.reshape(B, Tl)[:, :T], loss, dz.reshape(B, Tl, V)


def _inline(closed, *args):
    """Evaluates a closed jaxpr (a list of its outputs) for tracing inside a kernel: nested ``jit`` calls
    inlined, ``stop_gradient`` as the identity and ``add_any`` as ``add`` (what they are on values; the
    Mosaic GPU lowering implements neither)."""
    env = {}
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
    for var, val in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = val
    for var, val in zip(closed.jaxpr.invars, args):
        env[var] = val
    for eqn in closed.jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "stop_gradient":
            outs = vals
        elif eqn.primitive.name == "add_any":  # the adjoint's accumulation: a plain add
            outs = [jax.lax.add(*vals)]
        elif "jaxpr" in eqn.params and isinstance(eqn.params["jaxpr"], jex_core.ClosedJaxpr):
            outs = _inline(eqn.params["jaxpr"], *vals)
        else:
            outs = eqn.primitive.bind(*vals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(v) for v in closed.jaxpr.outvars]
