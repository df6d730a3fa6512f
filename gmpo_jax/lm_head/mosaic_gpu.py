"""Pallas Mosaic GPU backend (Hopper and newer): adapts ``gmpo_jax.kernels`` to the backend seam.

``logprobs``: one kernel (``kernels.lm_head_lse``) computes the logits tiles with wgmma
and keeps an online log-sum-exp per row; the per-split statistics are merged in XLA.

``grads``: per vocabulary window (sized to a fixed workspace, ``workspace_bytes``) one kernel
(``kernels.lm_head_dlogits``) recomputes the logits tiles and writes ``dz`` once in the inputs'
16-bit dtype; ``dh += dz W^T`` and ``dW[:, window] += h^T dz`` are XLA GEMMs with float32
accumulation, ``db += sum_rows dz``. Nothing is accumulated with atomics: bitwise deterministic.
The full windows run in a ``lax.scan`` (each step copies its weight columns and shifts the ids), so
one window's buffers are alive at a time and the accumulators are updated in place; the last,
partial window runs after it. Unrolled windows left that to XLA's scheduler, which kept up to all of
them alive (docs/performance.md, "LM head: mosaic_gpu").

``logprobs_for_grads`` (the policy loss's single-chunk call, where no float32 weight-gradient accumulator
is needed): when the chunk's logits fit the memory it is given, the log-prob kernel also writes them
(float16, relative to each row's running maximum: ``kernels.lm_head_lse``) and ``grads`` forms
``dz`` from them window by window in XLA instead of recomputing the logits: ``6 N H V`` flops in all
instead of ``8 N H V``. A single chunk's weight gradient (``grads(dw_acc=None)``, kept logits or not) is
returned in the weight's dtype (float32 for float16 weights without kept logits), written once per window.

The gradient filter (``grad_filter``; docs/DESIGN.md, docs/SPEC.md): the log-prob kernel runs one vocabulary split
per ``filter_window`` so that its statistics give each row's softmax mass off its target per window; ``grads``
then runs each window of the head (the columns before ``filter_tail``) on the static prefix of its rows reordered
live first (one ``lax.switch`` per window), and the tail (the rest, its windows kept together) in one step on the
prefix of the union of its rows. Skipped (row, window) blocks are never recomputed; where the chunk keeps its
logits (as above), the kept windows read their ``dz`` from them (the rows' tiles gathered) instead.

Rows are padded to the kernels' row block (zero rows, zero cotangent); the bulk copies zero-fill
the tail of the last vocabulary tile and the kernels mask it (``-inf`` logits, zero gradient). The
weight is read in place when its vocabulary dimension suits the bulk copies (``V % 64 == 0`` for
``"hv"``, ``V % 8 == 0`` for ``"vh"``: every real head but GPT-2's 50257), else from a zero-padded copy.

``logits_precision`` (``"float32"`` / ``"bf16x3"``): float32 (or float16) operands are split into bfloat16
parts (``backend.bf16_parts``) side by side along ``H``, and the kernels sum the leading products of the parts
into each logits tile (``kernels._common.split_terms``: six for ``"float32"``, three for ``"bf16x3"``); a
bfloat16 operand is its own single part. The dz kernel writes float32, and the two gradient GEMMs multiply
its parts the same way (``backend.split_dot``). The logits are never kept in this mode.

Block sizes come from :func:`block_config` (the reviewed table ``gmpo_jax.tuning.MOSAIC_BLOCKS``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import tuning
from gmpo_jax._device import num_sms, supported_on
from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.lm_head import rows as rows_lib
from gmpo_jax.lm_head.backend import (
    LOGITS_PRECISIONS,
    bf16_parts,
    cancel_rounding,
    logits_precision_of,
    num_parts,
    split_dot,
    stored_rowsum,
)

__all__ = ["MosaicGpuBackend", "supported_on", "block_config"]


def block_config(*, rows: int, H: int, V: int, kind: str, interpret: bool = False, device_kind: str | None = None):
    """Block sizes of the kernel ``kind`` (``"logprob"``, ``"logprob_saved"``, ``"grad"``, ``"grad_f32"``: float32
    ``dz``) from the reviewed table
    ``gmpo_jax.tuning.MOSAIC_BLOCKS`` (keyed by GPU and head; ``device_kind`` defaults to the first
    device's). The gradient kernel runs 64-row warpgroup blocks when ``rows <= 128`` (less padding)."""
    from gmpo_jax.kernels._common import LMHeadBlocks

    if interpret:  # small tiles: the interpreter's cost grows with the tile count and sizes
        return LMHeadBlocks(block_m=64, block_n=128, block_k=64, num_stages=2)
    if device_kind is None:
        device_kind = getattr(jax.devices()[0], "device_kind", "")
    block_m, block_n, block_k, stages = tuning.mosaic_blocks(device_kind, H, V, kind)
    if kind in ("grad", "grad_f32") and rows <= 128:
        block_m = 64
    return LMHeadBlocks(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=stages)


def epilogue_bytes(kind: str, cfg, itemsize: int) -> int:
    """Shared memory of a kernel's epilogue beyond its operand ring (``kind`` as in :func:`block_config`)."""
    from gmpo_jax.kernels.lm_head_lse import lm_head_lse_epilogue_bytes

    if kind in ("logprob", "logprob_saved"):  # up to four statistics (entropy); the saved tiles
        return lm_head_lse_epilogue_bytes(cfg, n_stats=4, save=kind == "logprob_saved")
    dz_item = 4 if kind == "grad_f32" else itemsize
    return 2 * cfg.block_m * (cfg.block_n * dz_item + 4)  # the dz kernel's two output tiles and row sums


class SavedLogits(NamedTuple):
    """The logits of a chunk as the log-prob kernel saved them (``save_logits``): ``d = z2 - m`` ``[Rp,
    n_tiles * block_n]`` float16 and the running maxima ``m`` ``[n_tiles, Rp]`` float32, ``z2`` in base-2
    units (``z * log2(e) / T``)."""

    d: jax.Array
    m: jax.Array

    @property
    def block_n(self) -> int:
        return self.d.shape[1] // self.m.shape[0]


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend:
    """Pallas Mosaic GPU kernels; ``interpret=True`` runs them in the interpreter (CPU tests).

    workspace_bytes bounds the temporaries of one vocabulary window of the gradient pass: the 16-bit
    ``dz [rows, window]``, the weight slice and the float32 dW block (one window is live at a time).
    When the whole ``dz`` fits it, one window covers the vocabulary (no weight slice) and its float32
    dW block is ``[H, V]``: the float32 weight copy the memory target allows.
    save_logits: let ``logprobs_for_grads`` keep the logits (all, or the leading vocabulary tiles that fit
    its budget) for the gradient pass (False: always recompute them), for hidden sizes
    ``H >= save_min_hidden`` (``tuning.SAVED_LOGITS_MIN_H``: below it keeping was measured no faster).
    softcap: None, or Gemma's final-logit soft cap ``c > 0``: the kernels compute ``c tanh(x / c)`` of each
    logit ``x = h W + b`` before the temperature, and the gradient passes take its derivative.
    logits_precision: None (products of the 16-bit inputs, exact in float32; ``dz`` rounded to their dtype
    before the gradient GEMMs), or ``"float32"`` / ``"bf16x3"``: split-bfloat16 products for float32 / float16
    operands and a float32 ``dz`` (module docstring); then the inputs may be bf16, f16 or f32, each its own.
    grad_filter: None (exact), ``"auto"`` or a threshold in ``[0, 1)``: the gradient filter (module docstring;
    ``fused_linear_policy_loss(grad_filter=...)`` replaces it when given there), validated here
    (``ValueError`` / ``TypeError`` naming it), and None (the exact gradient) with a ``softcap`` (the dropped
    windows' correction, ``_window_means``, does not carry the cap's ``1 - tanh^2`` factor); filter_window: its vocabulary windows, a multiple of the
    gradient kernel's tile width (else ``UnsupportedConfigError`` when the filter runs); filter_tail: the column
    from which its windows (and always the last, partial one) form one tail, kept or dropped together per row and run
    on the union of their rows in one step (a positive int: else ``TypeError`` / ``ValueError`` here; a multiple of
    ``filter_window``, else ``UnsupportedConfigError`` when the filter runs).
    """

    interpret: bool = False
    workspace_bytes: int = 256 * 2**20
    save_logits: bool = True
    save_min_hidden: int = tuning.SAVED_LOGITS_MIN_H
    row_buckets: int | None = None  # exact work skipping (gmpo_jax.lm_head.rows); None: tuning.row_buckets
    cancel_rounding: bool = True  # backend.cancel_rounding on dh (off under vocabulary parallelism)
    softcap: float | None = None  # Gemma's final-logit cap: z = cap tanh((h W + b) / cap) / T (static)
    logits_precision: str | None = None  # None, "float32" or "bf16x3" (backend.LOGITS_PRECISIONS)
    grad_filter: float | None = None  # the gradient filter's threshold (module docstring); None: exact
    filter_window: int = tuning.GRAD_FILTER_WINDOW  # its vocabulary windows, columns (a multiple of 256)
    filter_tail: int = tuning.GRAD_FILTER_TAIL  # its windows from this column on are kept together
    name: str = "mosaic_gpu"

    def __post_init__(self):
        from gmpo_jax._validation import grad_filter_threshold

        object.__setattr__(self, "grad_filter", grad_filter_threshold(self.grad_filter))
        if self.softcap is not None:  # the dropped windows' correction has no (1 - tanh^2) factor: exact gradient
            object.__setattr__(self, "grad_filter", None)
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

        if not self.interpret and not any(supported_on(d) for d in jax.devices()):
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
        self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy=False, with_window_mass=False
    ):
        """The seam's ``logprobs``; ``with_window_mass`` (the gradient filter, ``grad_filter`` set) appends each
        row's softmax mass off its target per vocabulary window, ``[R, cdiv(V, filter_window)]`` float32, for
        :meth:`grads`' ``window_mass``."""
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
            )
        return (*out, mass) if with_window_mass else out

    def save_plan(self, *, rows: int, H: int, V: int, budget_bytes: int) -> int:
        """How many leading vocabulary tiles of the logits ``logprobs_for_grads`` keeps (0: none): the most
        whose peak extra memory (:meth:`saved_bytes`) fits ``budget_bytes``; 0 without ``save_logits``, for
        ``H < save_min_hidden``, or when the log-prob kernel's saved tiles and the dz kernel's tiles differ in
        shape (table entries)."""
        from gmpo_jax.kernels import _common as C

        cfg = block_config(rows=rows, H=H, V=V, kind="logprob_saved", interpret=self.interpret)
        grad = block_config(rows=rows, H=H, V=V, kind="grad", interpret=self.interpret)
        if (
            not self.save_logits
            or self.logits_precision is not None  # float16 tiles would undo the float32 logits
            or H < self.save_min_hidden
            or (cfg.block_m, cfg.block_n) != (grad.block_m, grad.block_n)
        ):
            return 0
        Rp = C.cdiv(rows, cfg.rows_per_cta) * cfg.rows_per_cta
        n_tiles = C.cdiv(V, cfg.block_n)
        for t in range(n_tiles, 0, -1):  # not monotone in t: the recomputed rest's window shrinks as t grows
            if self._saved_bytes(Rp, H, n_tiles, cfg.block_n, t) <= budget_bytes:
                return t
        return 0

    def keeps_logits(self, *, rows: int, H: int, V: int, weight_dtype, budget_bytes: int) -> bool:
        """Whether :meth:`logprobs_for_grads` would keep any logits tile of ``rows`` rows (a bfloat16 weight and
        :meth:`save_plan` > 0): the seam's optional hint, so that a caller that cannot use kept logits (row
        skipping with separate forward and backward prefixes) takes the plain path when nothing is kept."""
        return (
            jnp.dtype(weight_dtype) == jnp.dtype(jnp.bfloat16)
            and self.save_plan(rows=rows, H=H, V=V, budget_bytes=budget_bytes) > 0
        )

    def saved_bytes(self, *, rows: int, H: int, V: int, save_tiles: int) -> int:
        """Peak device memory that ``logprobs_for_grads`` and ``grads`` use beyond the inputs and the
        returned gradients when ``save_tiles`` leading tiles of the logits are kept: the float32 hidden-state
        gradient plus the larger of (the float16 tiles and their per-tile maxima, with one window of the
        saved part) and (one window of the recomputed rest, after the kept tiles are freed)."""
        from gmpo_jax.kernels import _common as C

        cfg = block_config(rows=rows, H=H, V=V, kind="logprob_saved", interpret=self.interpret)
        Rp = C.cdiv(rows, cfg.rows_per_cta) * cfg.rows_per_cta
        return self._saved_bytes(Rp, H, C.cdiv(V, cfg.block_n), cfg.block_n, save_tiles)

    def _saved_bytes(self, Rp: int, H: int, n_tiles: int, bn: int, save_tiles: int) -> int:
        per_column = _per_column(Rp, H, 2, 2)
        kept = (
            Rp * save_tiles * (bn * 2 + 4)
            + self._window_tiles(Rp, H, save_tiles, bn, 2, 2, kept=True) * bn * per_column
        )
        rest = (
            self._window_tiles(Rp, H, n_tiles - save_tiles, bn, 2, 2) * bn * per_column if save_tiles < n_tiles else 0
        )
        return Rp * H * 4 + max(kept, rest)

    def _window_tiles(
        self, Rp: int, H: int, n_tiles: int, bn: int, dz_bytes: int, w_bytes: int, *, kept: bool = False, whole=True
    ) -> int:
        """Vocabulary tiles per gradient window over ``n_tiles`` tiles: all when their dz fits
        ``workspace_bytes`` (no weight slice, few rows: N = 512), else as many as the workspace holds (dz,
        weight slice, dW), or half of it for the kept tiles (room for the kept logits: Llama-3 at 8192 rows).
        ``dz_bytes`` / ``w_bytes``: bytes per element of dz (with its split parts) and of the weight slice.
        ``whole=False``: no whole-range window when only dz fits (the gradient filter's tail, where that window's
        float32 dW block ``[H, V - filter_tail]`` is not the weight copy the memory target allows: 0.96 GiB at
        Llama-3)."""
        if whole and self.workspace_bytes >= Rp * n_tiles * bn * dz_bytes:
            return n_tiles
        workspace = self.workspace_bytes // 2 if kept else self.workspace_bytes
        return max(1, min(n_tiles, workspace // (_per_column(Rp, H, dz_bytes, w_bytes) * bn)))

    def _operands(self, hp, weight, weight_layout) -> Operands:
        """The kernels' operands of row-padded ``hp`` and ``weight``: themselves, or their bfloat16 parts side by
        side along ``H`` with the products to sum (``logits_precision``)."""
        if self.logits_precision is None:
            item = hp.dtype.itemsize
            return Operands(hp, weight, ((0, 0),), [hp], None, None, item, item)
        from gmpo_jax.kernels._common import split_terms

        order = LOGITS_PRECISIONS[self.logits_precision]
        h_parts = bf16_parts(hp, num_parts(hp.dtype, order))
        w_parts = bf16_parts(weight, num_parts(weight.dtype, order))
        k_axis = 0 if weight_layout == "hv" else 1
        return Operands(
            hidden=jnp.concatenate(h_parts, axis=1) if len(h_parts) > 1 else h_parts[0],
            weight=jnp.concatenate(w_parts, axis=k_axis) if len(w_parts) > 1 else w_parts[0],
            terms=split_terms(len(h_parts), len(w_parts), order),
            hidden_parts=h_parts,
            weight_parts=len(w_parts),
            order=order,
            dz_bytes=4 + 2 * (order + 1),  # float32 dz and its parts
            weight_bytes=2 * len(w_parts),
        )

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
        the float32 accumulator and recomputes."""
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
            )
        return (*stats, saved, mass) if with_window_mass else (*stats, saved)

    def _logprobs(
        self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy, save_tiles, window_mass=False
    ):
        """``((logp, lse[, entropy]), saved, mass)``: ``saved`` the kept tiles (``SavedLogits``, or None without
        ``save_tiles``), ``mass`` the gradient filter's ``[R, n_windows]`` window mass with ``window_mass`` (one
        split per window), else None."""
        from gmpo_jax.kernels import _common as C
        from gmpo_jax.kernels.lm_head_lse import lm_head_lse_partials, lm_head_merge_splits

        R, H = hidden.shape
        V = _vocab(weight, weight_layout)
        kind = "logprob_saved" if save_tiles else "logprob"
        cfg = block_config(rows=R, H=H, V=V, kind=kind, interpret=self.interpret)
        hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
        n_tiles = C.cdiv(V, cfg.block_n)
        tiles_per_split = None
        if window_mass:  # one split per filter window, so that its statistics are the window's
            tiles_per_split = self._filter_tiles(cfg.block_n)
            splits = C.cdiv(n_tiles, tiles_per_split)
        else:
            splits = C.lm_head_num_splits(Rp // cfg.rows_per_cta, n_tiles, num_sms(self.interpret))
        ops = self._operands(hp, weight, weight_layout)
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
            interpret=self._interpret_params(),
        )
        stats, saved = (out[:-2], SavedLogits(*out[-2:])) if save_tiles else (out, None)
        logp, lse, *ent = (x[:R] for x in lm_head_merge_splits(*stats))
        mass = _window_mass(*(x[:, :R] for x in stats[:3]), lse, ids, self.filter_window) if window_mass else None
        valid = (ids >= 0) & (ids < V)
        logp = jnp.where(valid, logp, jnp.nan)
        if with_entropy:  # in [0, log V], as the XLA path's
            return (logp, lse, jnp.clip(ent[0], 0.0, jnp.log(jnp.float32(V)))), saved, mass
        return (logp, lse), saved, mass

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
    ):
        """The seam's ``grads``; ``saved`` (from :meth:`logprobs_for_grads`) replaces the logits recompute for
        the vocabulary tiles it holds (the leading ones); the rest are recomputed, after it.

        ``window_mass`` (``[R, n_windows]``, from ``logprobs`` or ``logprobs_for_grads`` ``(with_window_mass=True)``;
        only with ``grad_filter``): the gradient filter (module docstring): each vocabulary window runs on the rows
        that need it, reading dz from ``saved`` in the head windows it holds whole and in the tail's tiles it holds.

        ``dw_acc=None``: no accumulator, the chunk's own weight gradient is returned in the weight's dtype
        (float32 for a float16 weight without ``saved``: its range), each window's block written once (a float32 GEMM result
        rounded once: what the caller's final cast would give, without a float32 weight-sized buffer)."""
        from gmpo_jax.kernels import _common as C

        R, H, V = self._check_call(hidden, weight, bias, weight_layout)
        precise = self.logits_precision is not None
        cfg = block_config(rows=R, H=H, V=V, kind="grad_f32" if precise else "grad", interpret=self.interpret)
        bn = cfg.block_n
        with jax.named_scope("gmpo_jax/mosaic_gpu/grads"):
            hp, ids_p, scale, bias_p, Rp = _prepare(hidden, ids, bias, temperature, cfg, V)
            if saved is not None and (saved.block_n != bn or saved.d.shape[0] != Rp):
                raise ValueError(
                    f"saved logits of {saved.block_n}-column tiles over {saved.d.shape[0]} rows do "
                    f"not match the gradient kernel's {bn} / {Rp} (see save_plan)"
                )
            if saved is not None and precise:
                raise ValueError("logits_precision needs the recomputed logits (no kept logits: saved=None)")
            if window_mass is not None and self.grad_filter is None:
                raise ValueError("window_mass needs grad_filter set (MosaicGpuBackend(grad_filter=...))")
            n_windows = C.cdiv(V, self.filter_window)
            if window_mass is not None and tuple(window_mass.shape) != (R, n_windows):
                raise ValueError(
                    f"window_mass must be [rows, n_windows] = [{R}, {n_windows}] (logprobs(with_window_mass=True) "
                    f"of the same rows), got shape {tuple(window_mass.shape)}"
                )
            t = jnp.asarray(temperature, jnp.float32)
            fresh = dw_acc is None
            if fresh:  # every window's block is written once: rounded once, as the caller's cast would
                f16 = saved is None and weight.dtype == jnp.float16  # (kept logits: only ever for 16-bit results)
                dw_acc = jnp.zeros(weight.shape, jnp.float32 if f16 else weight.dtype)
            ops = self._operands(hp, weight, weight_layout)
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
                entropy=None
                if entropy is None
                else tuple(jnp.pad(x.astype(jnp.float32), (0, Rp - R)) for x in (entropy[0] / t, entropy[1])),
            )
            n_tiles, save_tiles = C.cdiv(V, bn), 0 if saved is None else saved.m.shape[0]
            item = ops.dz_bytes, ops.weight_bytes
            carry = (jnp.zeros((Rp, H), jnp.float32), dw_acc, db_acc, jnp.zeros((Rp,), jnp.float32))
            if window_mass is not None:
                mass = jnp.pad(window_mass, ((0, Rp - R), (0, 0)))  # padding rows: no mass, no cotangent
                n_head = self._filter_head(bn, V)
                live = _filter_live(mass, gp, self.grad_filter, self.filter_window, n_head)
                carry = gp.filtered_windows(carry, live, self._filter_tiles(bn), n_head, save_tiles)
                dh, dw_acc, db_acc, rowsum = carry
                dropped = _dropped_mass(mass, live)  # [Rp, n_windows]
                means = _window_means(weight, bias, weight_layout, self.filter_window)
                dh = dh - gp.coef[:, None] * jnp.dot(dropped, means, precision=lax.Precision.HIGHEST)
                carry = dh, dw_acc, db_acc, rowsum - gp.coef * jnp.sum(dropped, axis=1)
            if window_mass is None and save_tiles:
                carry = gp.windows(
                    carry, 0, save_tiles, self._window_tiles(Rp, H, save_tiles, bn, *item, kept=True), True
                )
            if window_mass is None and save_tiles < n_tiles:
                carry = gp.windows(
                    carry, save_tiles, n_tiles, self._window_tiles(Rp, H, n_tiles - save_tiles, bn, *item), False
                )
            dh, dw_acc, db_acc, rowsum = carry
            if self.cancel_rounding and not precise:  # a float32 dz is not rounded to 16 bits
                dh = cancel_rounding(dh, rowsum, weight, ids_p, weight_layout)
        return dh[:R].astype(hidden.dtype), dw_acc, db_acc

    # -- helpers ----------------------------------------------------------------------------------
    def _filter_tiles(self, block_n: int) -> int:
        """Vocabulary tiles of ``block_n`` columns per gradient-filter window."""
        if self.filter_window % block_n:  # (positive: checked when constructed)
            raise UnsupportedConfigError(
                f"filter_window={self.filter_window} must be a multiple of the kernels' {block_n}-column tiles"
            )
        return self.filter_window // block_n

    def _filter_head(self, block_n: int, V: int) -> int:
        """The gradient filter's head: its full windows before ``filter_tail`` (each run on its own rows); the
        columns after them are the tail (``_GradPass.filtered_windows``)."""
        tiles = self._filter_tiles(block_n)
        if self.filter_tail % self.filter_window:  # (positive: checked when constructed)
            raise UnsupportedConfigError(
                f"filter_tail={self.filter_tail} must be a multiple of filter_window={self.filter_window}"
            )
        return min(self.filter_tail // self.filter_window, V // (tiles * block_n))

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


class Operands(NamedTuple):
    """What the kernels multiply (``MosaicGpuBackend._operands``): ``hidden`` ``[Rp, P H]`` and ``weight`` (its
    parts along ``H``), the products ``terms`` to sum; for the gradient GEMMs the hidden parts, the weight's
    part count, the split order (None: plain 16-bit operands, 16-bit dz) and bytes per element of dz and of the
    weight."""

    hidden: jax.Array
    weight: jax.Array
    terms: tuple
    hidden_parts: list
    weight_parts: int | None
    order: int | None
    dz_bytes: int
    weight_bytes: int


@dataclasses.dataclass
class _GradPass:
    """One ``grads`` call's vocabulary windows: per window, ``dz`` (the kernel, or the kept logits) and
    ``dh += dz W^T``, ``dW[:, window] (+)= h^T dz``, ``db[window] += sum_rows dz``. Rows padded to ``Rp``."""

    backend: MosaicGpuBackend
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
    entropy: Any = None  # ([Rp] gamma / temperature, [Rp] entropy) of an entropy term, or None
    saved_rows: Any = None  # [S] the rows of ``saved`` this pass reads (``subset``), or None: all of them

    @property
    def axis(self) -> int:
        return 1 if self.layout == "hv" else 0  # the weight's vocabulary axis

    def dz(self, w_blk, b_blk, ids_w, v0, width, wt, kept):
        """dz of one window, ``[Rp, wt * block_n]`` (its weight columns ``w_blk``, ids relative to it), and
        the row sums ``[Rp]`` of its stored entries (see ``backend.cancel_rounding``)."""
        from gmpo_jax.kernels import _common as C
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
        splits = C.lm_head_num_splits(
            self.hp.shape[0] // cfg.rows_per_cta, wt, num_sms(self.backend.interpret), min_tiles=1
        )
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
            interpret=self.backend._interpret_params(),
        )
        return dz, jnp.sum(rowsum, axis=0)

    def window(self, carry, v0, width, wt, kept, w_blk=None, b_blk=None):
        """One window (columns ``[v0, v0 + width)``): its dz and the three GEMMs (float32 accumulation)."""
        dh, dw_acc, db_acc, rowsum = carry
        dh_w, dw_blk, db_blk, rowsum_w = self.window_grads(v0, width, wt, kept, w_blk, b_blk)
        dw_acc, db_acc = self.accumulate(dw_acc, db_acc, v0, width, dw_blk, db_blk)
        return dh + dh_w, dw_acc, db_acc, rowsum + rowsum_w

    def window_grads(self, v0, width, wt, kept, w_blk=None, b_blk=None):
        """One window's own ``(dh [Rp, H], dW block, db block or None, row sums [Rp])``, float32."""
        axis, bn = self.axis, self.cfg.block_n
        if w_blk is None:  # a full window inside the loop: dynamic slices of static width
            w_blk = lax.dynamic_slice_in_dim(self.w_kernel, v0, wt * bn, axis=axis)
            b_blk = None if self.bias_p is None else lax.dynamic_slice_in_dim(self.bias_p, v0, wt * bn)
        dz, rowsum = self.dz(w_blk, b_blk, self.ids_p - v0, v0, width, wt, kept)
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
        dh = split_dot(dz_parts, w_parts, (((1,), (axis,)), ((), ())), ops.order or 0)
        a, b = (ops.hidden_parts, dz_parts) if axis == 1 else (dz_parts, ops.hidden_parts)  # dW in the weight's layout
        dw_blk = split_dot(a, b, (((0,), (0,)), ((), ())), ops.order or 0)
        db_blk = None if self.bias_p is None else jnp.sum(dz.astype(jnp.float32), axis=0)
        return dh, dw_blk, db_blk, rowsum

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

    def filtered_windows(self, carry, live, tiles: int, n_head: int, save_tiles: int = 0):
        """The gradient filter's pass over vocabulary windows of ``tiles`` tiles, ``live`` ``[n_windows, Rp]`` bool.
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
        inside them take dz from the kept logits (``kept``), the others recompute it."""
        from gmpo_jax.kernels import _common as C

        bn, Rp = self.cfg.block_n, self.hp.shape[0]
        width = tiles * bn
        sizes = _filter_sizes(Rp)

        def rows_of(live_w, order, S):  # the pass over the prefix S of a window's rows, and their indices
            idx = None if S == Rp else order.perm[:S]  # every row: in place, no gather or scatter
            return idx, self.subset(idx, live_w if idx is None else jnp.take(live_w, idx))

        def put(x, idx, y):  # the prefix's dh / row sums into the whole
            return x + y if idx is None else x.at[idx].add(y, unique_indices=True)

        def head(kept):
            def step(carry, w):  # window w: columns [w width, (w + 1) width)
                dh, dw_acc, db_acc, rowsum = carry
                live_w, order = live[w], jax.tree.map(lambda x: x[w], orders)
                v0 = w * width
                shape = (dh.shape[1], width) if self.axis == 1 else (width, dh.shape[1])
                no_db = None if self.bias_p is None else jnp.zeros((width,), jnp.float32)
                nothing = (dh, rowsum, jnp.zeros(shape, jnp.float32), no_db)

                def run(S):
                    idx, sub = rows_of(live_w, order, S)
                    dh_s, dw_blk, db_blk, rowsum_s = sub.window_grads(v0, width, tiles, kept)
                    return put(dh, idx, dh_s), put(rowsum, idx, rowsum_s), dw_blk, db_blk

                dh, rowsum, dw_blk, db_blk = rows_lib.on_prefix(order.n_live, sizes, run, lambda: nothing)
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

        def tail(S):  # the accumulators go through the switch: each window adds into them in place
            idx, sub = rows_of(live_t, order, S)
            dh, dw_acc, db_acc, rowsum = carry
            own = (
                carry if idx is None else (jnp.zeros((S, H), jnp.float32), dw_acc, db_acc, jnp.zeros((S,), jnp.float32))
            )
            for kept, t0, t1 in ((True, tile0, split), (False, split, n_tiles)):
                if t1 > t0:
                    wt = self.backend._window_tiles(S, H, t1 - t0, bn, *item, kept=kept, whole=False)
                    own = sub.windows(own, t0, t1, wt, kept)
            if idx is None:
                return own
            dh_s, dw_acc, db_acc, rowsum_s = own
            return put(dh, idx, dh_s), dw_acc, db_acc, put(rowsum, idx, rowsum_s)

        return rows_lib.on_prefix(order.n_live, sizes, tail, lambda: carry)


def _window_mass(m2, l, t2, lse, ids, window: int):
    """Each row's softmax mass off its target per vocabulary window, ``[R, n_windows]`` float32, from the log-prob
    kernel's per-split statistics (one split per window, ``[n_windows, R]``): ``(l + 1) 2^(m2 - lse2)`` less the
    target's ``2^(t2 - lse2)`` in its own window (float32 rounding: about ``1e-7`` of the row's largest
    probability)."""
    from gmpo_jax.kernels import _common as C

    lse2 = (lse * C.LOG2E)[None]
    total = jnp.where(l >= 0, (l + 1.0) * jnp.exp2(m2 - lse2), 0.0)  # l: one instance of the max excluded
    own = jnp.arange(m2.shape[0], dtype=jnp.int32)[:, None] == (ids.astype(jnp.int32) // window)[None]
    target = jnp.where(own, jnp.exp2(t2 - lse2), 0.0)
    return jnp.maximum(total - target, 0.0).T


def _filter_live(mass, gp: _GradPass, tau: float, window: int, n_head: int):
    """``[n_windows, Rp]`` bool from ``mass`` ``[Rp, n_windows]``: the (row, window) blocks the filter keeps:
    rows with a cotangent, in their target's window, in every window whose mass off the target exceeds
    ``tau``, and in every window when the row has an entropy term's cotangent (kept exact); the windows from
    ``n_head`` on (the tail) are kept together: all of them where any one is."""
    Rp, n_w = mass.shape
    has_coef = gp.coef != 0
    ent = jnp.zeros((Rp,), bool) if gp.entropy is None else gp.entropy[0] != 0
    own = jnp.arange(n_w, dtype=jnp.int32)[:, None] == (gp.ids_p // window)[None]
    live = (has_coef | ent)[None] & ((mass.T > tau) | own | ent[None])
    if n_head < n_w:
        live = live.at[n_head:].set(jnp.any(live[n_head:], axis=0))
    return live


def _dropped_mass(mass, live):
    """``[Rp, n_windows]``: each row's softmax mass in the windows the filter drops (``mass`` ``[Rp, n_windows]``,
    ``live`` ``[n_windows, Rp]``), 0 in the kept ones. The dropped entries of row ``r`` would have added
    ``-c_r sum_(v dropped) p_v W_v`` to its ``dh`` (``c_r``: its cotangent over the temperature); ``grads`` adds
    ``-c_r sum_k D_rk mean_k(W)`` instead (``_window_means``), exact for what every column of a window shares (a
    direction shared by all columns, as trained heads have, adds up coherently over thousands of dropped columns:
    left out, it dominated the error on heavy-tailed rows, docs/performance.md). And the kept ``dz`` of a row then
    sums to ``c_r sum_k D_rk`` instead of 0 (its target is kept), so the rounding that ``cancel_rounding`` removes is
    the stored row sum less that: cancelling the stored sum alone would also move ``dh`` by ``c_r D_r W[:, id]``,
    which on a trained head (large target columns) is many times the dropped entries' own ``sum_v dz_v W_v``."""
    return jnp.where(live.T, 0.0, mass)


def _window_means(weight, bias, weight_layout: str, window: int):
    """The mean weight column of each vocabulary window, ``[n_windows, H]`` float32, over the columns that can
    hold softmax mass (a bias of ``-inf``, as ``vocab_size`` padding sets, leaves a column out; a window with none
    gets 0). One read of the weight, float32 sums."""
    V = _vocab(weight, weight_layout)
    w = weight if weight_layout == "vh" else weight.T  # [V, H] (a transposed read inside the reduction)
    valid = None if bias is None else jnp.isfinite(bias.astype(jnp.float32))
    n_full, rest = divmod(V, window)

    def sums(lo: int, hi: int, n: int):  # [n, H] column sums and [n] counts of the windows in [lo, hi)
        blk = lax.slice_in_dim(w, lo, hi, axis=0).astype(jnp.float32).reshape(n, (hi - lo) // n, -1)
        if valid is None:
            return jnp.sum(blk, axis=1), jnp.full((n,), (hi - lo) // n, jnp.float32)
        ok = valid[lo:hi].reshape(n, -1)
        return jnp.sum(jnp.where(ok[:, :, None], blk, 0.0), axis=1), jnp.sum(ok, axis=1).astype(jnp.float32)

    parts = ([sums(0, n_full * window, n_full)] if n_full else []) + ([sums(n_full * window, V, 1)] if rest else [])
    total = jnp.concatenate([p[0] for p in parts], axis=0)
    count = jnp.concatenate([p[1] for p in parts], axis=0)
    return total / jnp.maximum(count, 1.0)[:, None]


def _filter_sizes(Rp: int) -> tuple[int, ...]:
    """The gradient filter's static row prefixes of a window: ``Rp / 2**k`` for ``k < tuning.GRAD_FILTER_LEVELS``,
    rounded up to ``tuning.ROW_ALIGN`` rows, ``Rp`` included."""
    from gmpo_jax.kernels._common import cdiv

    align = tuning.ROW_ALIGN
    return tuple(sorted({min(Rp, cdiv(cdiv(Rp, 2**k), align) * align) for k in range(tuning.GRAD_FILTER_LEVELS)}))


def _aligned(weight, weight_layout):
    """The weight as the kernels' bulk copies can read it: its vocabulary dimension a multiple of the
    shared-memory tiling along it ((8, 64) tiles: V minor in ``"hv"`` needs ``V % 64 == 0``, major in
    ``"vh"`` ``V % 8 == 0``). Real heads (151936, 128256, 32000) are the weight itself; others (GPT-2's
    50257) get a zero-padded copy, whose extra columns the kernels mask as ``>= vocab_size``."""
    axis = 1 if weight_layout == "hv" else 0
    align = 64 if weight_layout == "hv" else 8
    V = _vocab(weight, weight_layout)
    if V % align == 0:
        return weight
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, -V % align)
    return jnp.pad(weight, pad)


def _dz_from_saved(
    saved: SavedLogits, v0, wt: int, ids_w, lse2, coef, width, dtype, softcap=None, scale=None, entropy=None
):
    """``dz = coef (onehot - exp2(d + m - lse2))`` of the window of ``wt`` saved tiles from column ``v0``
    (one XLA fusion: the float16 tiles read once, ``dz`` written once), ``[Rp, wt * block_n]``; columns
    ``>= width`` and ``-inf`` logits give 0, and ``|z2 - lse2|`` within ``snap_tolerance`` counts as 0
    (``p = 1``) as in the dz kernel. ``entropy``: ``(gamma / T, H)`` ``[Rp]`` of an entropy term, which adds
    ``-(gamma / T) p (ln p + H)`` as the dz kernel does. Returns ``(dz, None)``; with ``softcap``, ``dz``
    times ``1 - t**2`` (``t = z / cap``, ``z = (d + m) / scale`` the capped logit) and, second, its float32
    row sums (the exact row no longer sums to 0; ``cancel_rounding`` takes the stored minus these)."""
    from gmpo_jax.kernels import _common as C

    bn = saved.block_n
    Rp = saved.d.shape[0]
    d = lax.dynamic_slice_in_dim(saved.d, v0, wt * bn, axis=1).reshape(Rp, wt, bn).astype(jnp.float32)
    m = lax.dynamic_slice_in_dim(saved.m, v0 // bn, wt, axis=0).T  # [Rp, wt]
    z = d + (m - lse2[:, None])[:, :, None]
    z = jnp.where(jnp.abs(z) <= C.snap_tolerance(lse2)[:, None, None], 0.0, z).reshape(Rp, wt * bn)
    col = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    p = jnp.where(col < width, jnp.exp2(z), 0.0)
    onehot = jnp.where(col == ids_w[:, None], 1.0, 0.0)
    dz = coef[:, None] * (onehot - p)
    if entropy is not None:  # ln p = z2 ln 2, clamped where p underflows to 0 (the dz kernel's epilogue)
        gamma, ent = entropy
        dz = dz - gamma[:, None] * p * (jnp.maximum(z, -256.0) * C.LN2 + ent[:, None])
    if softcap is None:
        return dz.astype(dtype), None
    zc = (d + m[:, :, None]).reshape(Rp, wt * bn) / scale[:, None]  # the capped logit (before the temperature)
    t = jnp.where(col < width, zc / softcap, 0.0)
    dz = dz * (1.0 - t * t)
    return dz.astype(dtype), jnp.sum(dz, axis=1)


def _per_column(Rp: int, H: int, dz_bytes: int, w_bytes: int) -> int:
    """Bytes per vocabulary column of a gradient window: dz ``[Rp]`` (``dz_bytes`` per element), the weight slice
    ``[H]`` (``w_bytes``) and the float32 dW block ``[H]``."""
    return Rp * dz_bytes + H * (w_bytes + 4)


def _vocab(weight, weight_layout):
    return weight.shape[1] if weight_layout == "hv" else weight.shape[0]


def _prepare(hidden, ids, bias, temperature, cfg, V):
    """Row padding to the CTA row block and the per-row / per-column vectors the kernels read."""
    from gmpo_jax.kernels import _common as C

    R = hidden.shape[0]
    Rp = C.cdiv(R, cfg.rows_per_cta) * cfg.rows_per_cta
    pad = Rp - R
    hp = jnp.pad(hidden, ((0, pad), (0, 0))) if pad else hidden
    ids_p = jnp.pad(ids.astype(jnp.int32), (0, pad), constant_values=-1)
    t = jnp.asarray(temperature, jnp.float32)
    scale = jnp.broadcast_to(jnp.float32(C.LOG2E) / t, (Rp,)).astype(jnp.float32)
    bias_p = None
    if bias is not None:
        n_cols = C.cdiv(V, cfg.block_n) * cfg.block_n
        bias_p = jnp.pad(bias.astype(jnp.float32), (0, n_cols - V))
    return hp, ids_p, scale, bias_p, Rp
