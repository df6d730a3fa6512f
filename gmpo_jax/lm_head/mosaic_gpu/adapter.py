"""The backend adapter: :class:`MosaicGpuBackend`, the dataclass the dispatcher resolves, behind the seam of
``gmpo_jax.lm_head.backend``.

``logprobs``: one kernel (``kernels.lm_head_lse``) computes the logits tiles with wgmma and keeps an online
log-sum-exp per row; the per-split statistics are merged in XLA. ``grads``: the gradient pass
(``grad_pass``), optionally with the gradient filter's plan (``grad_filter``) and the kept logits
(``kept_logits``). A single chunk's weight gradient (``grads(dw_acc=None)``) is returned in the weight's dtype
(float32 for float16 weights without kept logits), written once per window. Block sizes come from
``layout.block_config`` (the reviewed table ``gmpo_jax.tuning.MOSAIC_BLOCKS``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from gmpo_jax import tuning
from gmpo_jax._device import num_sms
from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.lm_head.backend import Capabilities, WithHeadSettings, cancel_rounding, logits_precision_of
from gmpo_jax.lm_head.mosaic_gpu import grad_filter as filter_lib
from gmpo_jax.lm_head.mosaic_gpu import kept_logits
from gmpo_jax.lm_head.mosaic_gpu.grad_pass import _GradPass
from gmpo_jax.lm_head.mosaic_gpu.kept_logits import SavedLogits
from gmpo_jax.lm_head.mosaic_gpu.layout import _aligned, _prepare, _vocab, block_config, epilogue_bytes, window_tiles
from gmpo_jax.lm_head.mosaic_gpu.precision import operands

__all__ = ["MosaicGpuBackend"]


def _supported_on(device) -> bool:
    """``_device.supported_on`` looked up on the package at call time (tests replace
    ``gmpo_jax.lm_head.mosaic_gpu.supported_on`` to lower for CUDA on a CPU host)."""
    from gmpo_jax.lm_head import mosaic_gpu

    return mosaic_gpu.supported_on(device)


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend(WithHeadSettings):
    """Pallas Mosaic GPU kernels; ``interpret=True`` runs them in the interpreter (CPU tests).

    workspace_bytes bounds the temporaries of one vocabulary window of the gradient pass: the 16-bit
    ``dz [rows, window]``, the weight slice and the float32 dW block (one window is live at a time).
    When the whole ``dz`` fits it, one window covers the vocabulary (no weight slice) and its float32
    dW block is ``[H, V]``: the float32 weight copy the memory target allows.
    save_logits: let ``logprobs_for_grads`` keep the logits (all, or the leading vocabulary tiles that fit
    its budget) for the gradient pass (False: always recompute them), for hidden sizes
    ``H >= save_min_hidden`` (``tuning.SAVED_LOGITS_MIN_H``; docs/DESIGN.md).
    filter_window: the gradient filter's vocabulary windows, a multiple of the gradient kernel's tile width
    (else ``UnsupportedConfigError`` when the filter runs); filter_tail: the column from which its windows (and
    always the last, partial one) form one tail, kept or dropped together per row and run on the union of their
    rows in one step (a positive int: else ``TypeError`` / ``ValueError`` here; a multiple of ``filter_window``,
    else ``UnsupportedConfigError`` when the filter runs).

    The call's settings come from ``HeadOptions`` (:class:`~gmpo_jax.lm_head.backend.HeadSettings`): ``softcap``
    (the kernels compute ``c tanh(x / c)`` of each logit ``x = h W + b`` before the temperature, and the gradient
    passes take its derivative), ``logits_precision`` (split-bfloat16 products for float32 / float16 operands and
    a float32 ``dz``; then the inputs may be bf16, f16 or f32, each its own) and ``grad_filter`` (the threshold of
    the gradient filter, ``grad_filter.py``; None with a ``softcap``: the dropped windows' correction does not
    carry the cap's ``1 - tanh^2`` factor).
    """

    interpret: bool = False
    workspace_bytes: int = 256 * 2**20
    save_logits: bool = True
    save_min_hidden: int = tuning.SAVED_LOGITS_MIN_H
    row_buckets: int | None = None  # exact work skipping (gmpo_jax.lm_head.rows); None: tuning.row_buckets
    cancel_rounding: bool = True  # backend.cancel_rounding on dh (off under vocabulary parallelism)
    filter_window: int = tuning.GRAD_FILTER_WINDOW  # its vocabulary windows, columns (a multiple of the tiles)
    filter_tail: int = tuning.GRAD_FILTER_TAIL  # its windows from this column on are kept together
    name: str = "mosaic_gpu"
    capabilities: ClassVar[Capabilities] = Capabilities(
        keeps_logits=True, grad_filter=True, cancel_rounding=True, softcap=True, logits_precision=True, row_prefix=True,
        row_prefix_grads=True,
    )  # fmt: skip

    def __post_init__(self):
        for name in ("filter_window", "filter_tail"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int (columns), got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    # -- seam -------------------------------------------------------------------------------------
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
        from gmpo_jax.kernels import _common as C

        if not self.interpret and not any(_supported_on(d) for d in jax.devices()):
            raise BackendUnavailableError("Pallas Mosaic GPU kernels need a Hopper (sm_90) or newer GPU")
        if weight_layout not in ("hv", "vh"):
            raise UnsupportedConfigError(f"{weight_layout=} must be 'hv' or 'vh'")
        precision = logits_precision_of(self, logits_precision)
        hd, wd = jnp.dtype(hidden_dtype), jnp.dtype(weight_dtype)
        if precision is not None:
            if not {hd, wd} <= {*C.SUPPORTED_DTYPES, jnp.dtype(jnp.float32)}:
                raise UnsupportedConfigError(f"mosaic_gpu needs bf16 / f16 / f32 hidden and weight, got {hd}, {wd}")
        elif hd != wd or hd not in C.SUPPORTED_DTYPES:
            raise UnsupportedConfigError(
                f"mosaic_gpu needs hidden and weight of one 16-bit dtype (bf16/f16), got {hd}, {wd} "
                "(float32 heads: logits_precision='float32')"
            )
        if H % 64 or H <= 0:
            raise UnsupportedConfigError(f"mosaic_gpu needs H a positive multiple of 64, got {H=}")
        if V <= 0 or rows <= 0:
            raise UnsupportedConfigError(f"empty problem: {V=}, {rows=}")
        if V >= 2**31 - 2**20 or rows >= 2**31 - 2**20:
            raise UnsupportedConfigError(f"{V=} / {rows=} overflow int32 indexing")
        item = 2 if precision is not None else hd.itemsize  # the kernels' operands: bfloat16 parts
        kinds = ("logprob", "grad_f32") if precision is not None else ("logprob", "grad")
        for kind in kinds + (("logprob_saved",) if self.save_logits and precision is None else ()):
            cfg = block_config(rows=rows, H=H, V=V, kind=kind, interpret=self.interpret)
            extra = epilogue_bytes(kind, cfg, item)
            if cfg.smem_bytes(item, extra) > C.SMEM_BYTES:
                raise UnsupportedConfigError(
                    f"{kind} kernel needs {cfg.smem_bytes(item, extra)} bytes of shared memory "
                    f"(> {C.SMEM_BYTES}) with {cfg}"
                )

    def logprobs(
        self,
        hidden,
        weight,
        bias,
        ids,
        temperature,
        *,
        weight_layout,
        with_entropy=False,
        with_window_mass=False,
        n_rows=None,
    ):
        """The seam's ``logprobs``; ``with_window_mass`` (the gradient filter, ``grad_filter`` set) appends each
        row's softmax mass off its target per vocabulary window and the window's score (how unevenly it spreads that
        mass), ``[R, cdiv(V, filter_window), 2]`` float32 (``grad_filter._window_mass``), for :meth:`grads`'
        ``window_mass``; ``n_rows`` (``Capabilities.row_prefix``): only the first ``n_rows`` rows are
        computed (one compiled kernel for every ``n_rows``), the others' outputs are 0."""
        R, H, V = self._check_call(hidden, weight, bias, weight_layout, with_entropy=with_entropy)
        with jax.named_scope("gmpo_jax/mosaic_gpu/logprobs"):
            out, _, mass = self._logprobs(
                hidden,
                weight,
                bias,
                ids,
                temperature,
                weight_layout=weight_layout,
                with_entropy=with_entropy,
                save_tiles=0,
                window_mass=with_window_mass,
                n_rows=n_rows,
            )
        return (*out, mass) if with_window_mass else out

    def save_plan(self, *, rows: int, H: int, V: int, budget_bytes: int) -> int:
        """How many leading vocabulary tiles of the logits :meth:`logprobs_for_grads` keeps (0: none): the most
        whose peak extra memory (:meth:`saved_bytes`) fits ``budget_bytes`` (``kept_logits.save_plan``)."""
        return kept_logits.save_plan(self, rows=rows, H=H, V=V, budget_bytes=budget_bytes)

    def keeps_logits(self, *, rows: int, H: int, V: int, weight_dtype, budget_bytes: int) -> bool:
        """Whether :meth:`logprobs_for_grads` would keep any logits tile of ``rows`` rows (a bfloat16 weight and
        :meth:`save_plan` > 0): the seam's hint, so that a caller that cannot use kept logits (row skipping with
        separate forward and backward prefixes) takes the plain path when nothing is kept."""
        return kept_logits.keeps_logits(self, rows=rows, H=H, V=V, weight_dtype=weight_dtype, budget_bytes=budget_bytes)

    def saved_bytes(self, *, rows: int, H: int, V: int, save_tiles: int) -> int:
        """Peak device memory beyond the inputs and the returned gradients with ``save_tiles`` leading tiles of
        the logits kept (``kept_logits.saved_bytes``)."""
        return kept_logits.saved_bytes(self, rows=rows, H=H, V=V, save_tiles=save_tiles)

    def logprobs_for_grads(
        self,
        hidden,
        weight,
        bias,
        ids,
        temperature,
        *,
        weight_layout,
        budget_bytes,
        with_entropy=False,
        with_window_mass=False,
        n_rows=None,
    ):
        """``(logp, lse, saved)`` as :meth:`logprobs`, plus what :meth:`grads` may reuse: the leading logits
        tiles that fit ``budget_bytes`` (:meth:`save_plan`), or None when none do (``grads`` recomputes).
        With ``with_entropy``, ``(logp, lse, entropy, saved)`` (the entropy as :meth:`logprobs` returns it;
        ``grads`` then takes ``entropy=`` with the same ``saved``). With ``with_window_mass`` (the gradient
        filter), the window mass is appended as in :meth:`logprobs` (``grads`` takes ``saved=`` and
        ``window_mass=``: the filter's kept windows in the saved tiles read them instead of recomputing).

        Only for a bfloat16 weight: with ``saved``, ``grads`` returns the weight gradient in the weight's
        dtype, and the custom VJP multiplies it by the loss's cotangent afterwards. bfloat16 has float32's
        range, so a scaled loss (a loss weight, microbatch averaging, loss scaling) cannot overflow or
        underflow there as float16 could (a 1e-3-scaled loss gave inf in float16); a float16 weight keeps
        the float32 accumulator and recomputes.

        ``n_rows``: as in :meth:`logprobs`; the logits of the rows after them are not kept (:meth:`grads` reads the
        first rows of ``saved``)."""
        R, H, V = self._check_call(hidden, weight, bias, weight_layout)
        save_tiles = 0
        if jnp.dtype(weight.dtype) == jnp.dtype(jnp.bfloat16):
            save_tiles = self.save_plan(rows=R, H=H, V=V, budget_bytes=budget_bytes)
        with jax.named_scope("gmpo_jax/mosaic_gpu/logprobs"):
            stats, saved, mass = self._logprobs(
                hidden,
                weight,
                bias,
                ids,
                temperature,
                weight_layout=weight_layout,
                with_entropy=with_entropy,
                save_tiles=save_tiles,
                window_mass=with_window_mass,
                n_rows=n_rows,
            )
        return (*stats, saved, mass) if with_window_mass else (*stats, saved)

    def _logprobs(
        self,
        hidden,
        weight,
        bias,
        ids,
        temperature,
        *,
        weight_layout,
        with_entropy,
        save_tiles,
        window_mass=False,
        n_rows=None,
    ):
        """``((logp, lse[, entropy]), saved, mass)``: ``saved`` the kept tiles (``SavedLogits``, or None without
        ``save_tiles``), ``mass`` the gradient filter's ``[R, n_windows, 2]`` window masses and scores with
        ``window_mass`` (one split per window; ``grad_filter._window_mass``), else None. ``n_rows``: the kernel on
        a row-prefix grid (``kernels.RowPrefixGrid``), every output 0 past the first ``n_rows`` rows (kept tiles
        there not written)."""
        from gmpo_jax.kernels import _common as C
        from gmpo_jax.kernels import _lm_head_pipeline as P
        from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials, lm_head_merge_splits

        R, H = hidden.shape
        V = _vocab(weight, weight_layout)
        kind = "logprob_saved" if save_tiles else "logprob"
        cfg = block_config(rows=R, H=H, V=V, kind=kind, interpret=self.interpret)
        hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
        n_tiles = C.cdiv(V, cfg.block_n)
        tiles_per_split, grid = None, None
        if window_mass:  # one split per filter window, so that its statistics are the window's
            tiles_per_split = filter_lib.filter_tiles(self, cfg.block_n)
            splits = C.cdiv(n_tiles, tiles_per_split)
        else:
            splits = P.lm_head_num_splits(Rp // cfg.rows_per_cta, n_tiles, num_sms(self.interpret))
        if n_rows is not None:
            rpc, blocks = cfg.rows_per_cta, Rp // cfg.rows_per_cta
            grid = (
                P.RowPrefixGrid.fixed(rpc, blocks, n_tiles, tiles_per_split)
                if window_mass
                else P.RowPrefixGrid.balanced(rpc, blocks, n_tiles, num_sms(self.interpret))
            )
        ops = operands(hp, weight, weight_layout, self.logits_precision)
        out = lm_head_lse_partials(
            ops.hidden,
            _aligned(ops.weight, weight_layout),
            bias_p,
            ids_p,
            scale,
            weight_layout=weight_layout,
            vocab_size=V,
            cfg=cfg,
            num_splits=splits,
            tiles_per_split=tiles_per_split,
            with_entropy=with_entropy,
            save_tiles=save_tiles,
            softcap=self.softcap,
            terms=ops.terms,
            row_grid=grid,
            n_rows=n_rows,
            interpret=self._interpret_params(),
        )
        stats, saved = (out[:-2], SavedLogits(*out[-2:])) if save_tiles else (out, None)
        logp, lse, *ent = (x[:R] for x in lm_head_merge_splits(*stats))
        mass = (
            filter_lib._window_mass(*(x[:, :R] for x in stats[:3]), lse, ids, self.filter_window, V)
            if window_mass
            else None
        )
        valid = (ids >= 0) & (ids < V)
        logp = jnp.where(valid, logp, jnp.nan)
        out = (logp, lse, jnp.clip(ent[0], 0.0, jnp.log(jnp.float32(V)))) if with_entropy else (logp, lse)
        if n_rows is not None:  # the rows past the prefix: 0, as the rows a prefix of a static size leaves out
            live = jnp.arange(R) < n_rows
            out = tuple(jnp.where(live, x, 0.0) for x in out)
            mass = None if mass is None else jnp.where(live[:, None, None], mass, 0.0)
        return out, saved, mass

    def grads(
        self,
        hidden,
        weight,
        bias,
        ids,
        dlogp,
        lse,
        temperature,
        *,
        weight_layout,
        dw_acc,
        db_acc,
        saved=None,
        entropy=None,
        window_mass=None,
        n_rows=None,
    ):
        """The seam's ``grads``; ``saved`` (from :meth:`logprobs_for_grads`) replaces the logits recompute for
        the vocabulary tiles it holds (the leading ones); the rest are recomputed, after it.

        ``window_mass`` (``[R, n_windows, 2]``, from ``logprobs`` or ``logprobs_for_grads``
        ``(with_window_mass=True)``; only with ``grad_filter``): the gradient filter (module docstring): each
        vocabulary window runs on the rows that need it, reading dz from ``saved`` in the head windows it holds
        whole and in the tail's tiles it holds.

        ``dw_acc=None``: no accumulator, the chunk's own weight gradient is returned in the weight's dtype
        (float32 for a float16 weight without ``saved``: its range), each window's block written once (a float32 GEMM result
        rounded once: what the caller's final cast would give, without a float32 weight-sized buffer).

        ``saved`` may hold more rows than ``hidden`` (kept by a forward on a row prefix, ``Capabilities.row_prefix``):
        the first ones are read.

        ``n_rows`` (``Capabilities.row_prefix_grads``): only the first ``n_rows`` rows have a cotangent; without
        ``logits_precision`` and with ``H`` a multiple of 128, the pass runs on that prefix with one program
        (``_GradPass.prefix_gemms``; ``dz`` from ``saved`` is formed on every row, the rows past the prefix unread),
        and the gradient filter runs each window on the runtime prefix of its own rows; otherwise on every row."""
        from gmpo_jax.kernels import _common as C

        R, H, V = self._check_call(hidden, weight, bias, weight_layout)
        precise = self.logits_precision is not None
        cfg = block_config(rows=R, H=H, V=V, kind="grad_f32" if precise else "grad", interpret=self.interpret)
        bn = cfg.block_n
        with jax.named_scope("gmpo_jax/mosaic_gpu/grads"):
            hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
            # a row prefix's forward may have kept more rows: the first Rp are read where dz is formed (a slice here
            # would be a copy of [Rp, V] float16: the window loop takes it as a buffer)
            if saved is not None and (saved.block_n != bn or saved.d.shape[0] < Rp):
                raise ValueError(
                    f"saved logits of {saved.block_n}-column tiles over {saved.d.shape[0]} rows do "
                    f"not match the gradient kernel's {bn} / {Rp} (see save_plan)"
                )
            if saved is not None and precise:
                raise ValueError("logits_precision needs the recomputed logits (no kept logits: saved=None)")
            if window_mass is not None and self.grad_filter is None:
                raise ValueError("window_mass needs grad_filter set (HeadOptions(grad_filter=...))")
            n_windows = C.cdiv(V, self.filter_window)
            if window_mass is not None and tuple(window_mass.shape) != (R, n_windows, 2):
                raise ValueError(
                    f"window_mass must be [rows, n_windows, 2] = [{R}, {n_windows}, 2] (logprobs(with_window_mass="
                    f"True) of the same rows), got shape {tuple(window_mass.shape)}"
                )
            t = jnp.asarray(temperature, jnp.float32)
            fresh = dw_acc is None
            if fresh:  # every window's block is written once: rounded once, as the caller's cast would
                f16 = saved is None and weight.dtype == jnp.float16  # (kept logits: only ever for 16-bit results)
                dw_acc = jnp.zeros(weight.shape, jnp.float32 if f16 else weight.dtype)
            ops = operands(hp, weight, weight_layout, self.logits_precision)
            on_prefix = not precise and H % 128 == 0  # the row-prefix GEMMs' conditions
            gp = _GradPass(
                backend=self,
                cfg=cfg,
                V=V,
                layout=weight_layout,
                hp=hp,
                ops=ops,
                ids_p=ids_p,
                scale=scale,
                bias_p=bias_p,
                w_kernel=_aligned(ops.weight, weight_layout),
                coef=jnp.pad(dlogp.astype(jnp.float32) / t, (0, Rp - R)),
                lse2=jnp.pad(lse.astype(jnp.float32) * C.LOG2E, (0, Rp - R)),
                saved=saved,
                fresh=fresh,
                dw_dtype=dw_acc.dtype,
                n_rows=n_rows if on_prefix else None,
                entropy=None
                if entropy is None
                else tuple(jnp.pad(x.astype(jnp.float32), (0, Rp - R)) for x in (entropy[0] / t, entropy[1])),
            )
            n_tiles, save_tiles = C.cdiv(V, bn), 0 if saved is None else saved.m.shape[0]
            item = ops.dz_bytes, ops.weight_bytes
            carry = (jnp.zeros((Rp, H), jnp.float32), dw_acc, db_acc, jnp.zeros((Rp,), jnp.float32))
            if window_mass is not None:  # the filter's plan, executed by the pass, then its correction
                fplan = filter_lib.plan(self, window_mass, gp, bn, V)
                carry = gp.filtered_windows(carry, fplan, save_tiles)
                carry = filter_lib.correct(
                    carry, fplan, gp.coef, hp, weight, bias, t, weight_layout, self.filter_window
                )
            if window_mass is None and save_tiles:
                carry = gp.windows(
                    carry,
                    0,
                    save_tiles,
                    window_tiles(self.workspace_bytes, Rp, H, save_tiles, bn, *item, kept=True),
                    True,
                )
            if window_mass is None and save_tiles < n_tiles:
                carry = gp.windows(
                    carry,
                    save_tiles,
                    n_tiles,
                    window_tiles(self.workspace_bytes, Rp, H, n_tiles - save_tiles, bn, *item),
                    False,
                )
            dh, dw_acc, db_acc, rowsum = carry
            if self.cancel_rounding and not precise:  # a float32 dz is not rounded to 16 bits
                dh = cancel_rounding(dh, rowsum, weight, ids_p, weight_layout)
        return dh[:R].astype(hidden.dtype), dw_acc, db_acc

    # -- helpers ----------------------------------------------------------------------------------
    def _check_call(self, hidden, weight, bias, weight_layout: str, with_entropy: bool = False):
        """``(R, H, V)`` of a seam call, after :meth:`check_supported` accepted it."""
        R, H = hidden.shape
        V = _vocab(weight, weight_layout)
        self.check_supported(
            hidden_dtype=hidden.dtype,
            weight_dtype=weight.dtype,
            H=H,
            V=V,
            rows=R,
            weight_layout=weight_layout,
            has_bias=bias is not None,
            with_entropy=with_entropy,
        )
        return R, H, V

    def _interpret_params(self):
        if not self.interpret:
            return None
        from gmpo_jax.kernels._compat import interpret_params

        return interpret_params()
