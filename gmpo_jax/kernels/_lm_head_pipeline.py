"""The warp-specialised pipeline both LM-head kernels (``lm_head_lse``, ``lm_head_dlogits``) share: block sizes,
vocabulary splits, the logits-tile loop, where each CTA works (a static grid, or a runtime row prefix) and the launch.

Both LM-head kernels (log-prob forward, gradient of the logits) run the same loop: a CTA owns
``2 * block_m`` rows (one warpgroup per ``block_m`` rows) and a contiguous range of vocabulary
tiles; for every vocabulary tile it computes the ``[block_m, block_n]`` logits tile with wgmma,
streaming ``[2 * block_m, block_k]`` hidden tiles and ``[block_k, block_n]`` weight tiles through
a ``num_stages``-deep ring of shared-memory slots filled by a third (memory) warpgroup with bulk
tensor copies. What happens to the finished f32 tile (online log-sum-exp, or the gradient of
the logits) is the kernel's epilogue.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from gmpo_jax.kernels._common import SMEM_BYTES, _even_splits, call_in_place, cdiv, div, i32, rem, smem_transforms
from gmpo_jax.kernels._compat import load_tile, needs_value_matmul, plgpu, value_matmul, wgmma


def lm_head_num_splits(num_row_ctas: int, num_vocab_tiles: int, num_sms: int, min_tiles: int = 4) -> int:
    """Vocabulary splits per row block of the LM-head kernels so that the grid fills the GPU in whole waves.

    Deterministic and cheap: the fewest splits (at most 32) whose CTA count wastes the least of
    the last wave, counting only splits that leave at least ``min_tiles`` vocabulary tiles per split (the
    gradient kernel's windows pass 1: on few rows, the gradient filter's or a small batch's, the grid is what
    limits it; on many rows one split already fills the GPU).
    """
    best, best_eff = 1, 0.0
    for s in range(1, 33):
        if s > 1 and num_vocab_tiles / s < min_tiles:
            break
        ctas = num_row_ctas * s
        eff = ctas / (cdiv(ctas, num_sms) * num_sms)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
        if eff > 0.95:
            break
    return _even_splits(num_vocab_tiles, best)


@dataclasses.dataclass(frozen=True)
class LMHeadBlocks:
    """Block sizes of the LM-head kernels (``lm_head_lse``, ``lm_head_dlogits``; hashable, static).

    block_m: rows per compute warpgroup (the CTA owns ``2 * block_m`` rows); 64 or 128.
    block_n: vocabulary columns per logits tile; multiple of 64, at most 256.
    block_k: hidden columns per pipeline step; 64 (128-byte swizzle of 16-bit operands).
    num_stages: depth of the shared-memory ring.
    in_flight: wgmma products a compute warpgroup leaves running when it issues the next: 0 waits for each
      product before it releases its ring slot; 1 releases the previous step's slot once the next product is
      issued (the tensor cores never wait for the warpgroup between steps; one slot less of prefetch).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    in_flight: int = 0

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"{self.block_m=} must be 64 or 128")
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"{self.block_n=} must be a multiple of 64 in [64, 256]")
        if self.block_k != 64:
            raise ValueError(f"{self.block_k=} must be 64")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be at least 2")
        if self.in_flight not in (0, 1):
            raise ValueError(f"{self.in_flight=} must be 0 or 1")

    @property
    def rows_per_cta(self) -> int:
        """Rows of one CTA: two compute warpgroups of ``block_m`` rows."""
        return 2 * self.block_m

    def smem_bytes(self, itemsize: int, extra: int = 0) -> int:
        """Shared memory of a CTA: the operand ring of ``itemsize``-byte operands plus ``extra`` bytes."""
        ring = self.num_stages * (self.rows_per_cta + self.block_n) * self.block_k * itemsize
        return ring + extra + 1024  # barriers, alignment


def logits_tile_loop(
    *,
    hidden_ref,  # GMEM [Rp, H] (with transpose_a: [H, Rp])
    weight_ref,  # GMEM [H, V] ("hv") or [V, H] ("vh")
    weight_layout: str,
    a_smem,  # SMEM [stages, 2*bm, bk] (with transpose_a: [stages, 2, bk, bm])
    b_smem,  # SMEM [stages, bk, bn] or [stages, bn, bk]
    loaded,  # Barrier(num_arrivals=2 (3 with transpose_a), num_barriers=stages)
    consumed,  # Barrier(num_arrivals=2, num_barriers=stages)
    row0,  # first row of this CTA
    tile0,  # first vocabulary tile of this CTA
    num_tiles,  # vocabulary tiles of this CTA (traced int32)
    k_iters,  # pipeline steps along the contraction (a static int, or traced int32 with one term)
    cfg: LMHeadBlocks,
    init_carry,  # () -> carry (compute warpgroups)
    epilogue,  # (tile_index, z f32[bm, bn] WGMMA layout, carry) -> carry
    finish,  # (carry) -> None
    interpret=None,
    terms: tuple[tuple[int, int], ...] = ((0, 0),),
    transpose_a: bool = False,
):
    """Runs the warp-specialised logits-tile pipeline inside a 3-warpgroup kernel.

    ``terms``: the products summed into each logits tile, ``(i, j)`` = hidden part ``i`` times weight part
    ``j``, each part ``k_iters * block_k`` wide along the contraction, side by side in ``hidden_ref`` and
    ``weight_ref`` (split-bfloat16 operands, :func:`split_terms`); ``((0, 0),)``: the plain product.

    ``transpose_a``: ``hidden_ref`` holds the left operand transposed (``[K, M]``: the contraction runs over its
    rows, the CTA's ``2 * block_m`` "rows" are its columns ``[row0, row0 + 2 block_m)``), each warpgroup's
    ``[block_k, block_m]`` half staged by its own bulk copy (the weight-gradient GEMM, ``lm_head_dweight``)."""
    bm, bn, bk, stages, in_flight = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.in_flight
    wg = lax.axis_index("wg")
    steps = len(terms) * k_iters  # pipeline steps per vocabulary tile

    @pl.when(wg == 2)
    def _memory_warpgroup():
        plgpu.set_max_registers(40, action="decrease")
        total = num_tiles * steps

        @pl.loop(0, total)
        def _step(step):
            slot = rem(step, stages)
            n = tile0 + div(step, steps)
            k = rem(step, steps)
            hk = wk = k
            if len(terms) > 1:  # which parts this step multiplies, and where along their contraction
                term, k_in = div(k, k_iters), rem(k, k_iters)
                hk = _static_lookup([i for i, _ in terms], term) * k_iters + k_in
                wk = _static_lookup([j for _, j in terms], term) * k_iters + k_in

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            if transpose_a:
                for half in range(2):
                    a_src = hidden_ref.at[pl.ds(hk * bk, bk), pl.ds(row0 + half * bm, bm)]
                    plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot, half], loaded.at[slot])
            else:
                a_src = hidden_ref.at[pl.ds(row0, 2 * bm), pl.ds(hk * bk, bk)]
                plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot], loaded.at[slot])
            if weight_layout == "hv":
                w_src = weight_ref.at[pl.ds(wk * bk, bk), pl.ds(n * bn, bn)]
            else:
                w_src = weight_ref.at[pl.ds(n * bn, bn), pl.ds(wk * bk, bk)]
            plgpu.copy_gmem_to_smem(w_src, b_smem.at[slot], loaded.at[slot])

        # Observe the last phases of the `consumed` barriers too (every phase of a barrier is
        # waited on by every thread that waits on it: the interpreter checks this; on the device
        # it is a no-op that keeps the memory warpgroup alive until the slots are released).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(step):
            plgpu.barrier_wait(consumed.at[rem(step, stages)])

    @pl.when(wg < 2)
    def _compute_warpgroup():
        plgpu.set_max_registers(232, action="increase")
        a_rows = pl.ds(wg * bm, bm)

        def a_tile(slot):  # this warpgroup's [block_m, block_k] (transposed: [block_k, block_m]) operand
            return a_smem.at[slot].at[wg] if transpose_a else a_smem.at[slot].at[a_rows]

        def tile_body(t, carry):
            transpose_b = weight_layout == "vh"

            def matmul(acc_ref):
                def k_body(k, _):
                    slot = rem(t * steps + k, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    wgmma(
                        acc_ref,
                        a_tile(slot),
                        b_smem.at[slot],
                        transpose_a=transpose_a,
                        transpose_b=transpose_b,
                        interpret=interpret,
                    )
                    plgpu.wgmma_wait(in_flight)  # the products before the last `in_flight` are done
                    if in_flight:  # release the previous step's slot (the first step has none)
                        pl.when(k > 0)(lambda: plgpu.barrier_arrive(consumed.at[rem(t * steps + k - 1, stages)]))
                    else:
                        plgpu.barrier_arrive(consumed.at[slot])
                    return ()

                lax.fori_loop(0, i32(steps), k_body, ())
                if in_flight:  # the last step's product, and its slot (a runtime contraction may have no step)
                    plgpu.wgmma_wait(0)
                    release = lambda: plgpu.barrier_arrive(consumed.at[rem(t * steps + steps - 1, stages)])  # noqa: E731
                    if isinstance(steps, jax.Array):
                        pl.when(steps > 0)(release)
                    elif steps:
                        release()
                return acc_ref[...]

            def value_mm():
                def k_body(k, acc):
                    slot = rem(t * steps + k, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    acc = acc + value_matmul(
                        a_tile(slot), b_smem.at[slot], transpose_a=transpose_a, transpose_b=transpose_b
                    )
                    plgpu.barrier_arrive(consumed.at[slot])
                    return acc

                return lax.fori_loop(0, i32(steps), k_body, jnp.zeros((bm, bn), jnp.float32))

            if needs_value_matmul(transpose_a or transpose_b, interpret):
                z = value_mm()
            else:
                z = pl.run_scoped(matmul, plgpu.ACC((bm, bn), jnp.float32))
            return epilogue(tile0 + t, z, carry)

        carry = lax.fori_loop(0, num_tiles, tile_body, init_carry())
        finish(carry)


def _static_lookup(values, index):
    """``values[index]`` of a static list of ints at a traced int32 ``index`` (a chain of selects)."""
    out = i32(values[0])
    for i, v in enumerate(values[1:], 1):
        out = jnp.where(index == i, i32(v), out)
    return out


def split_terms(parts_a: int, parts_b: int, order: int) -> tuple[tuple[int, int], ...]:
    """The products ``(i, j)`` of a split-bfloat16 product ``a b = sum_ij a_i b_j`` that are kept: ``i + j
    <= order`` (part ``i`` of an operand is about ``2**(-8 i)`` of it, so a dropped product is at most about
    ``2**(-8 (order + 1))`` of ``|a| |b|``), the largest first. ``parts_*``: the operands' part counts (1 for a
    bfloat16 operand: it is its own single part). ``order`` 2 with three parts each is XLA's
    ``BF16_BF16_F32_X6`` (float32-accurate), 1 with two parts its ``BF16_BF16_F32_X3``."""
    return tuple((i, s - i) for s in range(order + 1) for i in range(parts_a) if 0 <= s - i < parts_b)


def part_k_iters(hidden, weight, weight_layout: str, terms, block_k: int) -> int:
    """Pipeline steps along one operand part's contraction (``H / block_k``), checking that ``hidden``
    (``[Rp, P H]``) and ``weight`` (``[Q H, V]`` / ``[V, Q H]``) hold the parts ``terms`` names."""
    n_h, n_w = 1 + max(i for i, _ in terms), 1 + max(j for _, j in terms)
    hdim = hidden.shape[1] // n_h
    w_k = weight.shape[0] if weight_layout == "hv" else weight.shape[1]
    assert hidden.shape[1] == n_h * hdim and w_k == n_w * hdim and hdim % block_k == 0, (hidden.shape, weight.shape)
    return hdim // block_k


class CtaBlock(NamedTuple):
    """Where this CTA and warpgroup of an LM-head kernel work (traced int32 scalars)."""

    split: jax.Array  # the vocabulary split (grid axis ``"split"``)
    row0: jax.Array  # the CTA's first row (it owns ``2 * block_m``)
    my_rows: jax.Array  # this consumer warpgroup's first row
    tile0: jax.Array  # the split's first vocabulary tile (of ``num_tiles``)
    n_tiles: jax.Array  # the split's vocabulary tiles (the last split may have fewer)
    wg: jax.Array  # this warpgroup (grid axis ``"wg"``)
    info: Any = None  # the launch's runtime int32 vector in shared memory, ``[3, INFO_WORDS]`` (a row per warpgroup)

    def word(self, i: int):
        """Word ``i`` of the launch's runtime ``info`` vector (as this warpgroup staged it)."""
        return self.info[self.wg, i]


def cta_block(block_m: int, tiles_per_split: int, num_tiles: int) -> CtaBlock:
    """This CTA's rows and vocabulary tiles: split ``s`` walks tiles ``[s * tiles_per_split, ...)`` of
    ``num_tiles``."""
    row0 = lax.axis_index("rows") * (2 * block_m)
    split, my_rows = lax.axis_index("split"), row0 + lax.axis_index("wg") * block_m
    tile0 = split * tiles_per_split
    return CtaBlock(split, row0, my_rows, tile0, jnp.minimum(tiles_per_split, num_tiles - tile0), lax.axis_index("wg"))


# A bulk copy moves a multiple of a warpgroup's 128 threads' bytes: a launch's runtime info is 32 int32 (words 0-2:
# RowPrefixGrid's; word CONTRACTION_WORD: the weight-gradient GEMM's contraction steps).
INFO_WORDS = 32
CONTRACTION_WORD = 3


@dataclasses.dataclass(frozen=True)
class RowPrefixGrid:
    """The grid of an LM-head kernel whose live rows are a prefix of a runtime length (exact row skipping).

    The kernel is compiled once for ``num_row_ctas`` row blocks of ``rows_per_cta`` rows; at run time only the
    first ``nb = cdiv(n_rows, rows_per_cta)`` blocks have work, and each is dealt ``splits[nb]`` vocabulary
    splits of ``tiles[nb]`` tiles (the last split may have fewer or none), so that a short prefix still fills
    the GPU (``lm_head_num_splits`` per prefix length). The grid is ``(1, num_ctas)``: CTA ``i`` takes row block
    ``i % nb`` and split ``i // nb``, as the static grid ``(splits, rows)`` orders its CTAs (Mosaic GPU launches the
    last grid axis fastest): the CTAs that run together are many row blocks of few splits and share those splits'
    weight columns through L2 (``rows_fastest``); or, with ``rows_fastest=False``, row block ``i // s`` and split
    ``i % s``: a row block's splits together, sharing its rows (``dz W^T``, whose "splits" are ``H``'s column tiles
    and whose rows, ``dz``, are the large operand). CTAs ``i >= nb * s`` return at once. The kernel reads
    ``(nb, s, tiles)`` from a small int32 vector (:meth:`info`) staged through shared memory, so one compiled
    kernel serves every prefix length (one ``lax.switch`` branch per length would compile one kernel each).

    Outputs of the blocks past ``nb`` and of splits ``>= s`` are not written: :meth:`written` says which entries
    of a per-split output hold values; callers read only the first ``nb * rows_per_cta`` rows.
    """

    rows_per_cta: int
    num_row_ctas: int
    splits: tuple[int, ...]  # per number of live row blocks nb in [0, num_row_ctas]
    tiles: tuple[int, ...]  # vocabulary tiles per split, per nb
    rows_fastest: bool = True  # consecutive CTAs take consecutive row blocks (else consecutive splits)

    @classmethod
    def balanced(cls, rows_per_cta: int, num_row_ctas: int, num_tiles: int, num_sms: int, min_tiles: int = 4):
        """Splits per prefix length from :func:`lm_head_num_splits` (as a kernel compiled for that length)."""
        splits = tuple(lm_head_num_splits(max(nb, 1), num_tiles, num_sms, min_tiles) for nb in range(num_row_ctas + 1))
        return cls(rows_per_cta, num_row_ctas, splits, tuple(cdiv(num_tiles, s) for s in splits))

    @classmethod
    def fixed(cls, rows_per_cta: int, num_row_ctas: int, num_tiles: int, tiles_per_split: int, rows_fastest=True):
        """The same splits of ``tiles_per_split`` tiles for every prefix length (the gradient filter's windows)."""
        s, n = cdiv(num_tiles, tiles_per_split), num_row_ctas + 1
        return cls(rows_per_cta, num_row_ctas, (s,) * n, (tiles_per_split,) * n, rows_fastest)

    @property
    def max_splits(self) -> int:
        """Rows of the per-split outputs."""
        return max(self.splits)

    @property
    def num_ctas(self) -> int:
        """The grid's CTAs: the most any prefix length has work for."""
        return max(1, max(nb * s for nb, s in enumerate(self.splits)))

    def info(self, n_rows) -> jax.Array:
        """``[nb, s, tiles per split, 0, ...]``: ``INFO_WORDS`` int32 for ``n_rows`` live rows (traced or not)."""
        nb = jnp.clip(cdiv(jnp.asarray(n_rows, jnp.int32), self.rows_per_cta), 0, self.num_row_ctas)
        s = jnp.asarray(self.splits, jnp.int32)[nb]
        t = jnp.asarray(self.tiles, jnp.int32)[nb]
        return jnp.zeros((INFO_WORDS,), jnp.int32).at[:3].set(jnp.stack([nb, s, t]).astype(jnp.int32))

    def written(self, info) -> jax.Array:
        """``[max_splits, rows]`` bool: which entries of a per-split, per-row output the kernel wrote (its splits
        below ``s``, its rows in the first ``nb`` blocks)."""
        splits = jnp.arange(self.max_splits, dtype=jnp.int32) < info[1]
        rows = jnp.arange(self.num_row_ctas * self.rows_per_cta, dtype=jnp.int32) < info[0] * self.rows_per_cta
        return splits[:, None] & rows[None, :]


def cta_assignment(i, nb, s, rows_fastest: bool):
    """``(row block, split, has work)`` of CTA ``i`` of a :class:`RowPrefixGrid` for ``nb`` live row blocks of ``s``
    splits each (int32 scalars, traced or not): every ``(block < nb, split < s)`` pair goes to one CTA ``i < nb s``."""
    if rows_fastest:
        per = jnp.maximum(nb, 1)  # nb = 0: no CTA has work
        block, split = rem(i, per), div(i, per)
        return block, split, (split < s) & (nb > 0)
    block, split = div(i, s), rem(i, s)
    return block, split, block < nb


def _dynamic_cta_block(block_m: int, num_tiles: int, info_smem, rows_fastest: bool) -> tuple[CtaBlock, jax.Array]:
    """This CTA's block under a :class:`RowPrefixGrid` (its ``info`` in this warpgroup's shared memory), and
    whether it has work."""
    wg = lax.axis_index("wg")
    nb, s, tps = info_smem[wg, 0], info_smem[wg, 1], info_smem[wg, 2]
    block, split, live = cta_assignment(i32(lax.axis_index("rows")), nb, s, rows_fastest)
    row0 = block * (2 * block_m)
    tile0 = split * tps
    n_tiles = jnp.clip(num_tiles - tile0, 0, tps)
    return CtaBlock(split, row0, row0 + wg * block_m, tile0, n_tiles, wg, info_smem), live


def launch(
    body,
    *,
    name: str,
    hidden,
    weight,
    bias,
    row_inputs,
    out_type,
    epilogue_smem,
    weight_layout: str,
    cfg: LMHeadBlocks,
    num_splits: int,
    tiles_per_split: int,
    num_tiles: int,
    row_grid: RowPrefixGrid | None = None,
    info=None,
    transpose_a: bool = False,
    acc=None,
    interpret=None,
):
    """Runs an LM-head kernel with three warpgroups (two consumers, one memory warpgroup:
    ``logits_tile_loop``) on the grid ``(num_splits, rows / (2 block_m))`` (split ``s`` walks tiles
    ``[s * tiles_per_split, ...)`` of ``num_tiles``), or, with ``row_grid`` and its ``info`` (:class:`RowPrefixGrid`),
    on the grid that serves a runtime row prefix (``num_splits`` then ``row_grid.max_splits``). ``info`` without
    ``row_grid``: a runtime int32 vector of ``INFO_WORDS`` staged for the body (``CtaBlock.word``) on the static grid.
    ``name``: the kernel's name in profiles and HLO (``lm_head_lse``, ...).
    ``transpose_a``: ``hidden`` is the left operand transposed, ``[K, M]`` (``logits_tile_loop``); the grid's rows
    are then its ``M`` columns.

    ``body(h_ref, w_ref, b_ref, row_refs, out_refs, smem, cta)`` gets the references of ``hidden``, ``weight``,
    ``bias`` (None without one), the per-row inputs ``row_inputs`` and the outputs ``out_type`` (a tuple,
    or one ``ShapeDtypeStruct``), ``smem = (a_smem, b_smem, epilogue, loaded, consumed)``: the
    operand rings of ``logits_tile_loop``, the scratch ``epilogue_smem`` (a ``plgpu.SMEM``, or a tuple of scratch
    types) of the kernel's own epilogue, and the ring's two barriers; and its :class:`CtaBlock`. Under ``row_grid`` a CTA
    without work does not run ``body``. ``acc``: an array the kernel updates in place (``out_type`` None; its one
    output reference reads and writes ``acc``'s buffer; returns the updated array).
    """
    dtype = hidden.dtype
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
    transforms = smem_transforms(jnp.dtype(dtype).itemsize)
    b_shape = (stages, bk, bn) if weight_layout == "hv" else (stages, bn, bk)
    has_bias = bias is not None
    n_rows = len(row_inputs)
    dynamic = row_grid is not None
    staged = info is not None
    assert staged or not dynamic, "a RowPrefixGrid needs its info"

    def kernel(h_ref, w_ref, *refs):
        b_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
        row_refs, refs = refs[:n_rows], refs[n_rows:]
        info_ref, refs = (refs[0], refs[1:]) if staged else (None, refs)
        outs, smem = refs[:-1], refs[-1]
        if not staged:
            body(h_ref, w_ref, b_ref, row_refs, outs, smem, cta_block(bm, tiles_per_split, num_tiles))
            return
        *smem, info_smem, info_bar = smem
        wg = lax.axis_index("wg")  # each warpgroup stages its own copy of the info
        plgpu.copy_gmem_to_smem(info_ref, info_smem.at[wg], info_bar.at[wg])
        plgpu.barrier_wait(info_bar.at[wg])
        if not dynamic:
            cta = cta_block(bm, tiles_per_split, num_tiles)._replace(info=info_smem)
            body(h_ref, w_ref, b_ref, row_refs, outs, tuple(smem), cta)
            return
        cta, live = _dynamic_cta_block(bm, num_tiles, info_smem, row_grid.rows_fastest)
        pl.when(live)(lambda: body(h_ref, w_ref, b_ref, row_refs, outs, tuple(smem), cta))

    a_shape = (stages, 2, bk, bm) if transpose_a else (stages, 2 * bm, bk)
    scratch = [
        plgpu.SMEM(a_shape, dtype, transforms=transforms),
        plgpu.SMEM(b_shape, dtype, transforms=transforms),
        epilogue_smem,
        plgpu.Barrier(num_arrivals=3 if transpose_a else 2, num_barriers=stages),  # one per bulk copy of a stage
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    if staged:
        scratch += [plgpu.SMEM((3, INFO_WORDS), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=3)]
    m = hidden.shape[1] if transpose_a else hidden.shape[0]
    if dynamic:
        assert row_grid.rows_per_cta == 2 * bm and row_grid.num_row_ctas * 2 * bm == m
        grid = (1, row_grid.num_ctas)
    else:
        grid = (num_splits, m // (2 * bm))
    inputs = (hidden, weight, *((bias,) if has_bias else ()), *row_inputs, *((info,) if staged else ()))
    kernel.__name__ = name
    if acc is not None:
        assert out_type is None, "an in-place kernel has no other output"
        mesh = dict(grid=grid, grid_names=("split", "rows"), num_threads=3, thread_name="wg")
        return call_in_place(kernel, [scratch], mesh, interpret, acc, *inputs)
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[scratch],
        grid=grid,
        grid_names=("split", "rows"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return call(*inputs)


def tile_gemm(
    lhs,
    rhs,
    *,
    name: str,
    out_shape: tuple[int, int],
    out_dtype,
    rhs_layout: str,
    cfg: LMHeadBlocks,
    k_iters: int | None,
    num_splits: int,
    tiles_per_split: int,
    num_tiles: int,
    row_grid: RowPrefixGrid | None = None,
    info=None,
    transpose_a: bool = False,
    acc=None,
    interpret=None,
):
    """A GEMM on the LM-head pipeline (the gradient GEMMs ``lm_head_dhidden``, ``lm_head_dweight``): each CTA's
    ``2 * block_m`` rows of ``out = lhs rhs`` (``lhs`` ``[M, K]``, or ``[K, M]`` with ``transpose_a``; ``rhs`` as the
    pipeline's weight in ``rhs_layout``), its ``block_n``-column tiles accumulated in float32 by wgmma and written
    once in ``out_dtype`` (each warpgroup's tile staged in shared memory, stored by a bulk copy while the next one
    is computed). ``k_iters``: the contraction's ``block_k`` steps, or None: read at run time from ``info``'s word
    ``CONTRACTION_WORD``. The grid, splits, ``info`` and ``name`` as :func:`launch`'s. Raises ValueError (naming the
    kernel) unless ``lhs`` and ``rhs`` are both bfloat16 or both float16.

    ``acc``: None, or an ``out_shape`` array in ``out_dtype`` that the product is added to in place (``acc + lhs
    rhs`` on the tiles the grid computes; the others keep ``acc``'s values), on a ``row_grid`` that gives each CTA
    one output tile: each warpgroup's tile of ``acc`` is fetched into its staging buffer while the contraction runs
    and added to the float32 sums before the store (an XLA add of the whole array after the kernel would read it
    twice and write it once more).

    Where the ring and two whole output tiles would not fit shared memory (``SMEM_BYTES``: a float32 128 x 256 tile
    beside a 3-deep ring), each warpgroup stages its tile in two column halves, one after the other (with ``acc``
    the second half's fetch waits for the first half's store)."""
    if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"{name}: both operands must be bfloat16 or both float16, got {lhs.dtype} and {rhs.dtype}")
    bm, bn = cfg.block_m, cfg.block_n
    out_dtype = jnp.dtype(out_dtype)
    accumulate = acc is not None
    whole = cfg.smem_bytes(jnp.dtype(lhs.dtype).itemsize, 2 * bm * bn * out_dtype.itemsize + 64)
    pieces = 1 if whole <= SMEM_BYTES else 2
    pn = bn // pieces  # columns of one staged piece

    def body(a_ref, b_ref, bias_ref, row_refs, outs, smem, cta):
        del bias_ref, row_refs
        (out,) = outs
        a_smem, b_smem, out_smem, loaded, consumed = smem
        out_smem, fetched = out_smem if accumulate else (out_smem, None)

        def out_tile(tile, piece=0):  # this warpgroup's rows of an output tile (a column piece of it)
            return out.at[pl.ds(cta.my_rows, bm), pl.ds(tile * bn + piece * pn, pn)]

        def fetch(tile, piece):  # acc's tile (piece) into this warpgroup's staging buffer
            plgpu.copy_gmem_to_smem(out_tile(tile, piece), out_smem.at[cta.wg], fetched.at[cta.wg])

        if accumulate:  # the first piece while the contraction runs
            pl.when((cta.wg < 2) & (cta.n_tiles > 0))(lambda: fetch(cta.tile0, 0))

        def epilogue(tile, z, carry):
            for piece in range(pieces):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store left SMEM
                zp = z if pieces == 1 else z[:, piece * pn : (piece + 1) * pn]
                if accumulate:  # the CTA's one tile
                    if piece:
                        fetch(tile, piece)
                    plgpu.barrier_wait(fetched.at[cta.wg])
                    zp = zp + load_tile(out_smem.at[cta.wg], plgpu.Layout.WGMMA, interpret)
                out_smem[cta.wg] = zp.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[cta.wg], out_tile(tile, piece))
            return carry

        logits_tile_loop(
            hidden_ref=a_ref,
            weight_ref=b_ref,
            weight_layout=rhs_layout,
            a_smem=a_smem,
            b_smem=b_smem,
            loaded=loaded,
            consumed=consumed,
            row0=cta.row0,
            tile0=cta.tile0,
            num_tiles=cta.n_tiles,
            k_iters=cta.word(CONTRACTION_WORD) if k_iters is None else k_iters,
            cfg=cfg,
            init_carry=lambda: (),
            epilogue=epilogue,
            finish=lambda carry: plgpu.wait_smem_to_gmem(0),
            interpret=interpret,
            transpose_a=transpose_a,
        )

    epilogue_smem = plgpu.SMEM((2, bm, pn), out_dtype, transforms=smem_transforms(out_dtype.itemsize))
    if accumulate:
        assert acc.shape == tuple(out_shape) and acc.dtype == out_dtype, (acc.shape, acc.dtype, out_shape, out_dtype)
        assert row_grid is not None and set(row_grid.tiles) == {1}, "in place: one output tile per CTA"
        epilogue_smem = (epilogue_smem, plgpu.Barrier(num_arrivals=1, num_barriers=2))  # a fetch barrier per wg
    return launch(
        body,
        name=name,
        hidden=lhs,
        weight=rhs,
        bias=None,
        row_inputs=(),
        out_type=None if accumulate else jax.ShapeDtypeStruct(out_shape, out_dtype),
        epilogue_smem=epilogue_smem,
        weight_layout=rhs_layout,
        cfg=cfg,
        num_splits=num_splits,
        tiles_per_split=tiles_per_split,
        num_tiles=num_tiles,
        row_grid=row_grid,
        info=info,
        transpose_a=transpose_a,
        acc=acc,
        interpret=interpret,
    )
