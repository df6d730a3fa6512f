"""The gradient pass of ``MosaicGpuBackend.grads``: vocabulary windows of ``dz`` and three GEMMs.

Per vocabulary window (sized to a fixed workspace, ``workspace_bytes``) one kernel (``kernels.lm_head_dlogits``)
recomputes the logits tiles and writes ``dz`` once in the inputs' 16-bit dtype (or ``dz`` is formed in XLA from
the kept logits); ``dh += dz W^T`` and ``dW[:, window] += h^T dz`` are XLA GEMMs with float32 accumulation,
``db += sum_rows dz``. Nothing is accumulated with atomics: bitwise deterministic. The full windows run in a
``lax.scan`` (each step copies its weight columns and shifts the ids), so one window's buffers are alive at a
time and the accumulators are updated in place; the last, partial window runs after it. With the gradient
filter, :meth:`_GradPass.filtered_windows` executes a :class:`~.grad_filter.FilterPlan`. On a runtime row prefix
(``n_rows``: the rows with work are the first ``n_rows``), the dz kernel runs on a ``RowPrefixGrid`` and the two
GEMMs are Pallas kernels that take the row count at run time (``kernels.lm_head_dhidden``, ``lm_head_dweight``):
one program serves every number of live rows (with the filter: of each window's live rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import tuning
from gmpo_jax._device import num_sms
from gmpo_jax.lm_head import rows as rows_lib
from gmpo_jax.lm_head.backend import bf16_parts, stored_rowsum
from gmpo_jax.lm_head.mosaic_gpu.grad_filter import FilterPlan, _filter_sizes
from gmpo_jax.lm_head.mosaic_gpu.kept_logits import SavedLogits, _dz_from_saved
from gmpo_jax.lm_head.mosaic_gpu.layout import window_tiles
from gmpo_jax.lm_head.mosaic_gpu.precision import Operands

__all__ = ["_GradPass"]


def _split_dot(*args):
    """``backend.split_dot`` looked up on the package at call time (a probe may replace
    ``gmpo_jax.lm_head.mosaic_gpu.split_dot``: ``benchmarks/precision_probe.py``)."""
    from gmpo_jax.lm_head import mosaic_gpu

    return mosaic_gpu.split_dot(*args)


@dataclasses.dataclass
class _GradPass:
    """One ``grads`` call's vocabulary windows: per window, ``dz`` (the kernel, or the kept logits) and
    ``dh += dz W^T``, ``dW[:, window] (+)= h^T dz``, ``db[window] += sum_rows dz``. Rows padded to ``Rp``."""

    backend: Any  # the MosaicGpuBackend
    cfg: Any  # the gradient kernel's block configuration
    V: int
    layout: str
    hp: jax.Array  # [Rp, H] hidden, row-padded
    ops: Operands  # the kernels' operands (split parts with logits_precision)
    ids_p: jax.Array  # [Rp] int32 (-1 on padding rows)
    scale: jax.Array  # [Rp] log2(e) / temperature
    bias_p: Any  # [tiles * block_n] float32 or None
    w_kernel: jax.Array  # the weight as the bulk copies read it (_aligned)
    coef: jax.Array  # [Rp] dlogp / temperature
    lse2: jax.Array  # [Rp] log-sum-exp in base 2
    saved: Any  # SavedLogits or None
    fresh: bool  # dW blocks are written, not accumulated (a single chunk)
    dw_dtype: Any  # the weight-gradient accumulator's dtype (a fresh one's blocks are written in it)
    entropy: Any = None  # ([Rp] gamma / temperature, [Rp] entropy) of an entropy term, or None
    saved_rows: Any = None  # [S] the rows of ``saved`` this pass reads (``subset``), or None: all of them
    n_rows: Any = None  # int32 scalar: only the first n_rows rows have work (the row-prefix kernels), or None

    @property
    def axis(self) -> int:
        return 1 if self.layout == "hv" else 0  # the weight's vocabulary axis

    def dz(self, w_blk, b_blk, ids_w, v0, width, wt, kept):
        """dz of one window, ``[Rp, wt * block_n]`` (its weight columns ``w_blk``, ids relative to it), and
        the row sums ``[Rp]`` of its stored entries (see ``backend.cancel_rounding``)."""
        from gmpo_jax.kernels import _lm_head_pipeline as P
        from gmpo_jax.kernels.lm_head_dlogits import lm_head_dlogits_window

        if kept:
            softcap, saved, bn = self.backend.softcap, self.saved, self.cfg.block_n
            if self.saved_rows is not None:  # the window's tiles of this subset's rows only
                d = jnp.take(lax.dynamic_slice_in_dim(saved.d, v0, wt * bn, axis=1), self.saved_rows, axis=0)
                m = jnp.take(lax.dynamic_slice_in_dim(saved.m, v0 // bn, wt, axis=0), self.saved_rows, axis=1)
                saved, v0 = SavedLogits(d, m), 0
            dz, exact = _dz_from_saved(
                saved, v0, wt, ids_w, self.lse2, self.coef, width, self.hp.dtype, softcap, self.scale, self.entropy
            )
            rowsum = stored_rowsum(dz)  # not dz.astype(f32).sum(): XLA folds the conversions
            return dz, rowsum if exact is None else rowsum - exact
        cfg = self.cfg
        Rp, sms = self.hp.shape[0], num_sms(self.backend.interpret)
        splits = P.lm_head_num_splits(Rp // cfg.rows_per_cta, wt, sms, min_tiles=1)
        grid = None
        if self.n_rows is not None:
            grid = P.RowPrefixGrid.balanced(cfg.rows_per_cta, Rp // cfg.rows_per_cta, wt, sms, min_tiles=1)
        dz, rowsum = lm_head_dlogits_window(
            self.ops.hidden,
            w_blk,
            b_blk,
            ids_w,
            self.scale,
            self.lse2,
            self.coef,
            self.entropy,
            weight_layout=self.layout,
            vocab_size=width,
            window_start=0,
            window_tiles=wt,
            cfg=cfg,
            num_splits=splits,
            softcap=self.backend.softcap,
            terms=self.ops.terms,
            dz_dtype=None if self.ops.order is None else jnp.float32,
            row_grid=grid,
            n_rows=self.n_rows,
            interpret=self.backend._interpret_params(),
        )
        return dz, jnp.sum(rowsum, axis=0)

    def window(self, carry, v0, width, wt, kept, w_blk=None, b_blk=None):
        """One window (columns ``[v0, v0 + width)``): its dz and the three GEMMs (float32 accumulation)."""
        dh, dw_acc, db_acc, rowsum = carry
        dh, dw_blk, db_blk, rowsum_w = self.window_grads(v0, width, wt, kept, w_blk, b_blk, dh=dh)
        dw_acc, db_acc = self.accumulate(dw_acc, db_acc, v0, width, dw_blk, db_blk)
        return dh, dw_acc, db_acc, rowsum + rowsum_w

    def window_grads(self, v0, width, wt, kept, w_blk=None, b_blk=None, dh=None):
        """One window's own ``(dh [Rp, H], dW block, db block or None, row sums [Rp])``, float32; with ``dh`` (the
        running sum) the first is ``dh`` plus the window's (on a runtime row prefix added by the kernel in place)."""
        axis, bn = self.axis, self.cfg.block_n
        if w_blk is None:  # a full window inside the loop: dynamic slices of static width
            w_blk = lax.dynamic_slice_in_dim(self.w_kernel, v0, wt * bn, axis=axis)
            b_blk = None if self.bias_p is None else lax.dynamic_slice_in_dim(self.bias_p, v0, wt * bn)
        dz, rowsum = self.dz(w_blk, b_blk, self.ids_p - v0, v0, width, wt, kept)
        if self.n_rows is not None:
            return self.prefix_gemms(dz, w_blk, width, rowsum, dh)
        if dz.shape[1] != width:
            dz = dz[:, :width]
        if w_blk.shape[axis] != width:  # the aligned copy's padding columns
            w_blk = lax.slice_in_dim(w_blk, 0, width, axis=axis)
        ops = self.ops
        if ops.order is None:
            dz_parts, w_parts = [dz], [w_blk]
        else:  # float32 dz: its parts times the weight's parts (split along H, the other axis)
            dz_parts = bf16_parts(dz, ops.order + 1)
            w_parts = jnp.split(w_blk, ops.weight_parts, axis=1 - axis)
        dh_w = _split_dot(dz_parts, w_parts, (((1,), (axis,)), ((), ())), ops.order or 0)
        dh = dh_w if dh is None else dh + dh_w
        a, b = (ops.hidden_parts, dz_parts) if axis == 1 else (dz_parts, ops.hidden_parts)  # dW in the weight's layout
        dw_blk = _split_dot(a, b, (((0,), (0,)), ((), ())), ops.order or 0)
        db_blk = None if self.bias_p is None else jnp.sum(dz.astype(jnp.float32), axis=0)
        return dh, dw_blk, db_blk, rowsum

    def prefix_gemms(self, dz, w_blk, width, rowsum, dh=None):
        """:meth:`window_grads` on the first ``n_rows`` rows by the row-prefix GEMM kernels: ``dz`` ``[Rp, Kw]`` (the
        window's tiles, zero past ``V``), ``w_blk`` its weight columns (the partial window's fewer: zero-padded);
        ``dh``: None (the window's own ``dh``, its rows past the prefix undefined: the one caller, the filter's head
        windows, drops them in its scatter), or the running ``[Rp, H]`` float32 sum the kernel adds the window's into
        (its rows past the prefix are kept, not written)."""
        from gmpo_jax.kernels.lm_head_dhidden import dhidden_blocks, lm_head_dhidden_window
        from gmpo_jax.kernels.lm_head_dweight import dweight_blocks, lm_head_dweight_window

        axis, (Rp, Kw), H = self.axis, dz.shape, self.hp.shape[1]
        if w_blk.shape[axis] != Kw:
            w_blk = jnp.pad(w_blk, [(0, Kw - w_blk.shape[axis]) if a == axis else (0, 0) for a in range(2)])
        sms, interpret = num_sms(self.backend.interpret), self.backend._interpret_params()
        live = jnp.arange(Rp) < self.n_rows  # the rows past the prefix: undefined in the kernels' outputs
        dh_out = lm_head_dhidden_window(
            dz,
            w_blk,
            weight_layout=self.layout,
            n_rows=self.n_rows,
            cfg=dhidden_blocks(H, tuning.DHIDDEN_BLOCKS, tuning.WGMMA_IN_FLIGHT),
            acc=dh,
            interpret=interpret,
        )
        lhs, rhs = (self.hp, dz) if axis == 1 else (dz, self.hp)
        out_dtype = self.dw_dtype if self.fresh else jnp.float32  # a fresh block is written once: rounded once
        dw_cfg = dweight_blocks(
            rhs.shape[1], out_dtype, tuning.DWEIGHT_BLOCKS_16, tuning.DWEIGHT_BLOCKS_32, tuning.WGMMA_IN_FLIGHT
        )
        dw_blk = lm_head_dweight_window(
            lhs, rhs, n_rows=self.n_rows, cfg=dw_cfg, num_sms=sms, out_dtype=out_dtype, interpret=interpret
        )
        if Kw != width:
            dw_blk = lax.slice_in_dim(dw_blk, 0, width, axis=axis)
        db_blk = None
        if self.bias_p is not None:
            db_blk = jnp.sum(jnp.where(live[:, None], dz[:, :width].astype(jnp.float32), 0.0), axis=0)
        return dh_out, dw_blk, db_blk, jnp.where(live, rowsum, 0.0)

    def accumulate(self, dw_acc, db_acc, v0, width, dw_blk, db_blk):
        """``dW[:, window] += dw_blk`` (written once when the accumulator is fresh), ``db[window] += db_blk``."""
        axis = self.axis
        if not self.fresh:
            dw_blk = lax.dynamic_slice_in_dim(dw_acc, v0, width, axis=axis) + dw_blk
        dw_acc = lax.dynamic_update_slice_in_dim(dw_acc, dw_blk.astype(dw_acc.dtype), v0, axis=axis)
        if db_acc is not None:
            db_acc = lax.dynamic_update_slice_in_dim(
                db_acc, lax.dynamic_slice_in_dim(db_acc, v0, width) + db_blk, v0, axis=0
            )
        return dw_acc, db_acc

    def windows(self, carry, tile0, tile1, wt, kept):
        """Tiles ``[tile0, tile1)`` in windows of ``wt``: the full ones in a loop (one dz buffer and one
        weight slice alive at a time by construction, accumulators updated in place; a Python loop left
        the order to XLA's scheduler, which hoisted dz kernels and took several times the memory:
        docs/performance.md), then the partial one, with static shapes (columns past V are masked)."""
        from gmpo_jax.kernels import _common as C

        bn = self.cfg.block_n
        c0, c1 = tile0 * bn, min(tile1 * bn, self.V)
        n_full = (c1 - c0) // (wt * bn) if wt < tile1 - tile0 else 0  # one window: no loop, no slice
        if n_full:
            carry, _ = lax.scan(
                lambda c, k: (self.window(c, c0 + k * (wt * bn), wt * bn, wt, kept), None),
                carry,
                jnp.arange(n_full, dtype=jnp.int32),
            )
        v0 = c0 + n_full * wt * bn
        if v0 < c1:
            tail = C.cdiv(c1 - v0, bn)
            carry = self.window(carry, v0, c1 - v0, tail, kept, *self.tail_blocks(v0, tail))
        return carry

    def tail_blocks(self, v0: int, wt: int):
        """The weight (and bias) columns of the partial window of ``wt`` tiles at static ``v0``: static slices
        (the aligned weight's padding columns included, up to its end)."""
        end = min(v0 + wt * self.cfg.block_n, self.w_kernel.shape[self.axis])
        w_blk = lax.slice_in_dim(self.w_kernel, v0, end, axis=self.axis)
        return w_blk, None if self.bias_p is None else self.bias_p[v0 : v0 + wt * self.cfg.block_n]

    def subset(self, idx, keep) -> _GradPass:
        """The pass over rows ``idx`` only (``[S]``, a multiple of the CTA rows; None: every row, in place), the rows
        where ``keep`` is False given a zero cotangent (their ``dz`` is exactly 0); kept logits are read at those
        rows (``saved_rows``)."""
        if idx is None:
            take = lambda x: x  # noqa: E731
        else:
            take = lambda x: None if x is None else jnp.take(x, idx, axis=0)  # noqa: E731
        ops = self.ops._replace(hidden=take(self.ops.hidden), hidden_parts=[take(p) for p in self.ops.hidden_parts])
        entropy = None if self.entropy is None else (jnp.where(keep, take(self.entropy[0]), 0.0), take(self.entropy[1]))
        return dataclasses.replace(
            self,
            hp=take(self.hp),
            ops=ops,
            ids_p=take(self.ids_p),
            scale=take(self.scale),
            coef=jnp.where(keep, take(self.coef), 0.0),
            lse2=take(self.lse2),
            entropy=entropy,
            saved_rows=None if idx is None or self.saved is None else idx,
        )

    def filtered_windows(self, carry, fplan: FilterPlan, save_tiles: int = 0):
        """The gradient filter's pass (``fplan``) over vocabulary windows of ``fplan.tiles`` tiles, ``fplan.live``
        ``[n_windows, Rp]`` bool.
        The ``n_head`` full windows of the head, in a ``lax.scan``, each on the static prefix of its rows reordered
        live first that holds all of them (``_filter_sizes``, one ``lax.switch`` per window; no live row: nothing
        runs; all ``Rp`` rows: in place, no gather); their ``dh`` and row sums scattered back (each window's rows are
        distinct: deterministic), the weight's accumulators updated outside the switch. Then the tail (the columns
        after the head, ``live`` the same for each of its windows) in one step: one switch on its rows' prefix, and
        in it the exact pass's windows (``windows``; each window's dz, weight slice and float32 dW block within the
        workspace for that prefix) over the tail's columns, adding into the accumulators in place (a block of the
        tail's own, added after the switch, would cost a zero fill and a copy of ``[H, V - tail]``:
        docs/performance.md). The head holds the frequent tokens, where rows differ in which windows
        they need; in the tail few rows need any window and mostly the same rows (docs/performance.md).
        ``save_tiles``: the leading tiles ``saved`` holds; the head windows inside them and the tail's columns
        inside them take dz from the kept logits (``kept``), the others recompute it. On a runtime row prefix
        (``n_rows`` set: the row-prefix kernels serve this pass) each window and the tail run instead on every row
        reordered live first, the kernels on the runtime prefix of the live ones: one program, no switch."""
        from gmpo_jax.kernels import _common as C

        live, tiles, n_head = fplan.live, fplan.tiles, fplan.n_head
        bn, Rp = self.cfg.block_n, self.hp.shape[0]
        width = tiles * bn
        sizes = _filter_sizes(Rp)
        one_program = self.n_rows is not None  # each window on the runtime prefix of its rows (the row-prefix GEMMs)

        def rows_of(live_w, order, S):  # the pass over the prefix S of a window's rows, and their indices
            idx = None if S == Rp else order.perm[:S]  # every row: in place, no gather or scatter
            return idx, self.subset(idx, live_w if idx is None else jnp.take(live_w, idx))

        def put(x, idx, y):  # the prefix's dh / row sums into the whole
            return x + y if idx is None else x.at[idx].add(y, mode="drop", unique_indices=True)

        def on_rows(live_w, order, run, empty):
            """``run(idx, sub)`` on the window's rows: one program on every row reordered live first, the kernels on
            the runtime prefix of the live ones (``n_rows``: ``idx`` sends the rows past it out of bounds, dropped
            by ``put``), or one ``lax.switch`` branch per static prefix size (``empty()`` when no row is live)."""
            if one_program:
                sub = self.subset(order.perm, jnp.take(live_w, order.perm))
                pos = jnp.arange(Rp, dtype=jnp.int32)
                idx = jnp.where(pos < order.n_live, order.perm, Rp + pos)
                return run(idx, dataclasses.replace(sub, n_rows=order.n_live))
            return rows_lib.on_prefix(order.n_live, sizes, lambda S: run(*rows_of(live_w, order, S)), empty)

        def head(kept):
            def step(carry, w):  # window w: columns [w width, (w + 1) width)
                dh, dw_acc, db_acc, rowsum = carry
                live_w, order = live[w], jax.tree.map(lambda x: x[w], orders)
                v0 = w * width
                shape = (dh.shape[1], width) if self.axis == 1 else (width, dh.shape[1])
                no_db = None if self.bias_p is None else jnp.zeros((width,), jnp.float32)
                nothing = (dh, rowsum, jnp.zeros(shape, jnp.float32), no_db)

                def run(idx, sub):
                    dh_s, dw_blk, db_blk, rowsum_s = sub.window_grads(v0, width, tiles, kept)
                    return put(dh, idx, dh_s), put(rowsum, idx, rowsum_s), dw_blk, db_blk

                dh, rowsum, dw_blk, db_blk = on_rows(live_w, order, run, lambda: nothing)
                dw_acc, db_acc = self.accumulate(dw_acc, db_acc, v0, width, dw_blk, db_blk)
                return (dh, dw_acc, db_acc, rowsum), None

            return step

        if n_head:
            orders = jax.vmap(rows_lib.order)(live[:n_head])  # every window's row order at once, before the loop
            n_kept = min(n_head, save_tiles // tiles)  # the head windows inside the kept tiles
            for kept, w0, w1 in ((True, 0, n_kept), (False, n_kept, n_head)):
                if w1 > w0:
                    carry, _ = lax.scan(head(kept), carry, jnp.arange(w0, w1, dtype=jnp.int32))
        tile0, n_tiles = n_head * tiles, C.cdiv(self.V, bn)
        if tile0 == n_tiles:
            return carry
        live_t = live[n_head]
        order = rows_lib.order(live_t)
        H = self.hp.shape[1]
        item = self.ops.dz_bytes, self.ops.weight_bytes

        split = min(max(save_tiles, tile0), n_tiles)  # the tail's tiles [tile0, split) are kept

        def tail(idx, sub):  # the accumulators go through the switch: each window adds into them in place
            S = sub.hp.shape[0]
            dh, dw_acc, db_acc, rowsum = carry
            own = (
                carry if idx is None else (jnp.zeros((S, H), jnp.float32), dw_acc, db_acc, jnp.zeros((S,), jnp.float32))
            )
            for kept, t0, t1 in ((True, tile0, split), (False, split, n_tiles)):
                if t1 > t0:
                    wt = window_tiles(self.backend.workspace_bytes, S, H, t1 - t0, bn, *item, kept=kept, whole=False)
                    own = sub.windows(own, t0, t1, wt, kept)
            if idx is None:
                return own
            dh_s, dw_acc, db_acc, rowsum_s = own
            return put(dh, idx, dh_s), dw_acc, db_acc, put(rowsum, idx, rowsum_s)

        return on_rows(live_t, order, tail, lambda: carry)
