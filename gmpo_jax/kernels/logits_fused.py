"""The fused logits kernel (Pallas Mosaic GPU): log-sum-exp, token loss and dlogits of a row in one CTA.

Kernel file ``logits_fused.py`` (``<input>_<stage>``, see ``_common``): reads logits that already exist in
device memory, viewed as ``[R, V / w, w]`` slabs (:func:`slab_width`), and does both passes over a row
back to back (the forward of a token-local objective under differentiation); entry point
:func:`logits_lse_and_dlogits`, blocks :class:`FusedLogitsBlocks`, per-row input and output columns
:class:`RowData` / :class:`RowStats` (packed by :func:`pack_row_data`).

Per row the kernel runs these stages (named as in the code):

* ring bookkeeping (:class:`_Ring`): which rows this CTA (or cluster of CTAs) walks, which of a row's
  tiles are its own, and the ring of shared-memory slots that bulk tensor copies fill ahead of use;
* pass A (:func:`_pass_a`): the online log-sum-exp of the row's tiles, per slab row;
* cluster merge (:func:`_cluster_merge`): with ``cluster > 1`` the CTAs that share a row merge their
  per-slab-row statistics through distributed shared memory;
* token step (:func:`_token_step`): the row's log-sum-exp, the target's log-prob, the objective's per-token
  loss and its derivative, in registers;
* pass B (:func:`_pass_b`): ``dz = -c softmax`` tile by tile, from the tiles pass A left in the ring
  (resident rows) or fetched again (mostly from L2, as only a few dozen rows are in flight).

Rows are viewed as ``[V / w, w]`` slabs so that a tile is a TMA box of whole slab rows and a reduction
over a tile's columns stays within a quad of threads. The last tile of a row that does not fill a block
slides back to end at the row's last slab row; pass A masks what it has already seen.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from gmpo_jax.kernels import _common as C
from gmpo_jax.kernels._compat import iota, layout_cast, load_vector, plgpu

__all__ = [
    "FusedLogitsBlocks",
    "RowData",
    "RowStats",
    "ROW_WIDTH",
    "pack_row_data",
    "slab_width",
    "logits_lse_and_dlogits",
]

ROW_WIDTH = 32  # floats per row of ``row_data`` / ``stats``: a bulk copy moves a multiple of 128 bytes


class RowData(enum.IntEnum):
    """Columns of the kernel's per-row input ``row_data`` ``[R, ROW_WIDTH]`` float32 (the rest are 0)."""

    K = 0  # log2(e) / T
    TARGET_LOGIT = 1  # the target's raw logit x[id] (NaN: the row's log-prob is NaN)
    OLD = 2  # the objective's per-token data: old log-prob,
    REF = 3  #   reference log-prob,
    ADV = 4  #   advantage,
    RIS = 5  #   rollout importance-sampling ratio
    SCALE = 6  # the token's weight in the loss / T (0: no gradient, its dz is exactly 0)
    LIVE = 7  # 0 for a masked token or the dropped last position (skip_dead_rows: not read)
    WEIGHT = 8  # the token's weight in the loss


class RowStats(enum.IntEnum):
    """Columns of the kernel's per-row output ``stats`` ``[R, ROW_WIDTH]`` float32 (the rest are 0)."""

    LOGP = 0  # the target's log-prob (0 for a row skipped as dead)
    LSE = 1  # log-sum-exp of z / T (natural units)
    GRAD_SCALE = 2  # c = scale * d ptl / d logp (0 where scale == 0)
    LOSS_TERM = 3  # weight * ptl (0 where live == 0): the loss is their sum


def pack_row_data(columns: Mapping[RowData, jax.Array]) -> jax.Array:
    """``row_data`` ``[R, ROW_WIDTH]`` float32 from one ``[R]`` column per :class:`RowData` field."""
    if set(columns) != set(RowData):
        raise ValueError(f"row data needs exactly the columns {list(RowData)}, got {list(columns)}")
    cols = [jnp.asarray(columns[f], jnp.float32) for f in RowData]
    return jnp.stack(cols + [jnp.zeros_like(cols[0])] * (ROW_WIDTH - len(cols)), axis=1)


@dataclasses.dataclass(frozen=True)
class FusedLogitsBlocks:
    """Blocks of :func:`logits_lse_and_dlogits` (hashable; a static argument).

    block_rows: slab rows per tile (a multiple of 64, at most 256: one TMA box); a tile is
      ``[block_rows, w]`` where ``w`` is the slab width of the logits' ``[R, V / w, w]`` view.
    stages: depth of the input ring (the output ring has ``out_stages``).
    num_ctas: the persistent grid ``G`` (None: one CTA per SM); cluster ``c`` walks rows ``c, c + G /
      cluster, ...``: fewer rows in flight keep more of each row in L2 between its two passes.
    cluster: CTAs that share a row (a thread-block cluster; they merge their statistics through
      distributed shared memory), so that ``num_ctas / cluster`` rows are in flight.
    reverse: the second pass walks the row's tiles backwards, so that it starts on the tiles the first
      pass read last (the likeliest still in L2).
    skip_dead_rows: rows with ``live == 0`` in the row data (masked tokens, the dropped last position) are
      not read, only written with zeros, and their log-prob is reported as 0 (it applies when the row is
      resident, or ``stages`` is at most the tiles a CTA has of each row). Measured on an H200: faster
      with ragged masks, slightly slower with none (docs/performance.md).
    resident: when a CTA's share of a row fits in the ring (``ceil(tiles / cluster) <= stages``), pass B
      reads the tiles pass A left in shared memory (slot ``t`` holds the CTA's tile ``t``, refilled with the
      next row's tile once pass B has written it) instead of fetching them again from L2; False re-reads
      them (the ring streams both passes; ``reverse`` applies). Measured faster on an H200 at B = 2 and
      B = 16 (docs/performance.md).
    """

    block_rows: int = 256
    stages: int = 4
    out_stages: int = 2
    num_ctas: int | None = None
    reverse: bool = True
    cluster: int = 1
    skip_dead_rows: bool = False
    resident: bool = True

    def __post_init__(self):
        if self.block_rows % C.BLOCK_ROWS or not C.BLOCK_ROWS <= self.block_rows <= 256:
            raise ValueError(f"{self.block_rows=} must be a multiple of {C.BLOCK_ROWS} in [{C.BLOCK_ROWS}, 256]")
        if self.stages < 1 or self.out_stages < 1 or self.cluster < 1:
            raise ValueError(f"stages, out_stages and cluster must be >= 1, got {self}")


def slab_width(V: int, dtype, min_rows: int = C.BLOCK_ROWS) -> int | None:
    """Columns ``w`` of the ``[R, V / w, w]`` view: the widest with ``w`` of 32, 64 or 128 bytes, ``V / w``
    a multiple of 8 (the 8-row tiling of the bulk copies) and at least ``min_rows`` (one tile); None when
    none fits."""
    itemsize = jnp.dtype(dtype).itemsize
    for nbytes in (128, 64, 32):
        w = nbytes // itemsize
        if V % (8 * w) == 0 and V // w >= min_rows:
            return w
    return None


class _FusedSizes(NamedTuple):
    """Static sizes of one call of :func:`logits_lse_and_dlogits` (Python ints and bools)."""

    R: int  # rows
    S: int  # slab rows per row
    bs: int  # slab rows per tile
    n_t: int  # tiles per row (the last one slid back to end at S)
    tpc: int  # tiles per CTA of a cluster (the last CTA may have fewer)
    n_loc_min: int  # the fewest tiles a CTA of a cluster has per row (the last CTA's)
    tail_seen: int  # slab rows of the last (slid-back) tile that the previous tile covered
    resident: bool  # a CTA's share of a row stays in the ring between the passes
    n_slots: int  # slots of the input ring
    skip: bool  # dead rows are not read
    n_rd: int  # row data buffers
    NC: int  # clusters: rows in flight
    cfg: FusedLogitsBlocks


def _fused_sizes(R: int, S: int, cfg: FusedLogitsBlocks, num_sms: int) -> _FusedSizes:
    """The static sizes of ``R`` rows of ``S`` slab rows under ``cfg`` on ``num_sms`` SMs."""
    bs, stages, cl = cfg.block_rows, cfg.stages, cfg.cluster
    assert S >= bs and S % 8 == 0, (S, bs)
    n_t = C.cdiv(S, bs)
    tpc = C.cdiv(n_t, cl)
    assert (cl - 1) * tpc < n_t, (n_t, cl)
    n_loc_min = n_t - (cl - 1) * tpc
    # Resident rows: a CTA's share of a row fits in the ring, so slot t holds the CTA's tile t from pass A
    # to pass B (no second read) and is refilled with the next row's tile t right after pass B wrote it.
    resident = cfg.resident and tpc <= stages
    # With ``skip_dead_rows``, dead rows (``live == 0``: masked tokens, the dropped last position) are not
    # read, only written with zeros. The ring's fetches then depend on the rows' liveness. Resident rows
    # fetch exactly one row ahead, from pass B. Re-read rows fetch at most ``stages`` steps ahead, i.e.
    # within the row's own pass B or, from its pass B, into the next row's pass A; that needs ``stages <=
    # n_loc_min`` (otherwise every row is read). Either way the next row's liveness is known once its data
    # has arrived, which is waited for at the end of pass A.
    skip = cfg.skip_dead_rows and (resident or stages <= n_loc_min)
    G = cfg.num_ctas or num_sms
    return _FusedSizes(
        R=R,
        S=S,
        bs=bs,
        n_t=n_t,
        tpc=tpc,
        n_loc_min=n_loc_min,
        tail_seen=n_t * bs - S,
        resident=resident,
        n_slots=tpc if resident else stages,
        skip=skip,
        n_rd=3 if skip else 2,
        NC=max(1, min(R, G // cl)),
        cfg=cfg,
    )


def logits_lse_and_dlogits(x, row_data, token_fn, *, cfg: FusedLogitsBlocks, num_sms: int = 132, interpret=None):
    """Per row of ``x``: log-sum-exp, log-prob, ``d loss / d logp`` and the row's ``dlogits``, in one kernel.

    Pass A streams the row's tiles (online max / sum of ``exp2((x - m) k)`` per slab row, merged at the
    end); the token's ``logp``, weighted loss and gradient scale ``c`` follow in registers; pass B reads
    the same tiles again (from shared memory when the row is resident in the ring, see
    :class:`FusedLogitsBlocks`, else from L2 if they are still there) and writes
    ``dz = -c exp2((x - m) k - log2 l)``. With
    ``cfg.cluster > 1`` the row's tiles are split among the CTAs of a cluster, which merge their per-slab-row
    ``(m, l)`` through distributed shared memory between the passes (not in the interpreter). The
    softmax is formed relative to the row's maximum ``m`` (``x - m`` is exact), so the maximum's
    probability is exactly ``1 / l`` at any temperature (no tolerance is needed).

    Args:
      x: ``[R, S, w]`` bf16 / f32 logits (``S * w = V``; a free reshape of ``[R, V]``, see :func:`slab_width`).
      row_data: ``[R, ROW_WIDTH]`` float32, the columns of :class:`RowData` (:func:`pack_row_data`).
      token_fn: ``f(logp, old, ref, adv, ris, live) -> (ptl, d ptl / d logp)``, the per-token loss and its
        derivative, elementwise jnp on scalars (traced in the kernel; ``live`` is ``scale != 0``, a traced
        bool: the lowering takes no boolean constants).
      cfg: the blocks; num_sms: the grid when ``cfg.num_ctas`` is None.

    Returns:
      ``(dz [R, S, w] x.dtype, stats [R, ROW_WIDTH] float32)``: ``dz = -c softmax`` (the caller adds the
      one-hot's ``c`` at the target) with ``c = scale * d ptl / d logp``; ``stats`` the columns of
      :class:`RowStats`.
    """
    R, S, w = x.shape
    plan = _fused_sizes(R, S, cfg, num_sms)
    bs, dtype = cfg.block_rows, x.dtype
    transforms = C.smem_transforms(jnp.dtype(dtype).itemsize, w * jnp.dtype(dtype).itemsize)
    scratch = [
        plgpu.SMEM((plan.n_slots, bs, w), dtype, transforms=transforms),
        plgpu.SMEM((cfg.out_stages, bs, w), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=plan.n_slots),
        plgpu.SMEM((plan.n_rd, ROW_WIDTH), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=plan.n_rd),
        plgpu.SMEM((bs,), jnp.float32),
    ]
    cluster = {}
    if cfg.cluster > 1:
        scratch += [
            plgpu.SMEM((bs,), jnp.float32),
            plgpu.SMEM((bs,), jnp.float32),
            plgpu.ClusterBarrier(collective_axes=("cl",), num_barriers=2, num_arrivals=1),
        ]
        cluster = dict(cluster=(cfg.cluster,), cluster_names=("cl",))
    body = functools.partial(_fused_kernel, plan=plan, token_fn=token_fn, interpret=interpret)
    body.__name__ = "logits_fused"  # its name in profiles
    call = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((R, S, w), dtype), jax.ShapeDtypeStruct((R, ROW_WIDTH), jnp.float32)),
        scratch_types=scratch,
        grid=(plan.NC,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        **cluster,
    )
    return call(x, row_data)


def _fused_kernel(
    x_ref,
    rd_ref,
    o_ref,
    st_ref,
    x_smem,
    o_smem,
    loaded,
    rd_smem,
    rd_bar,
    st_smem,
    *xchg,
    plan: _FusedSizes,
    token_fn: Callable,
    interpret,
):
    """The kernel: one CTA (of a cluster) walks its rows; per row the stages of the module docstring."""
    ring = _Ring(plan, x_ref, rd_ref, x_smem, loaded, rd_smem, rd_bar)
    ring.start()
    bs = plan.bs
    neg_inf = layout_cast(jnp.full((bs,), -jnp.inf, jnp.float32), C.ROW, interpret)
    minus_one = layout_cast(jnp.full((bs,), -1.0, jnp.float32), C.ROW, interpret)  # l of an empty slab row

    @pl.loop(0, ring.n_rows)
    def _row(i):
        rd, k, live = ring.start_row(i)
        m, l = _pass_a(ring, i, k, live, (neg_inf, minus_one), interpret)
        live_next = ring.row_live(ring.row_data(i + 1))  # (stale after the last row: no fetch uses it)
        if plan.cfg.cluster > 1:
            m, l = _cluster_merge(xchg, plan.cfg.cluster, i, m, l, k, interpret)
        tok = _token_step(rd, k, m, l, token_fn, live)
        _pass_b(ring, i, k, tok, live, live_next, o_smem, o_ref, interpret)
        _store_stats(ring, i, tok, st_smem, st_ref, interpret)

    plgpu.wait_smem_to_gmem(0)


class _Ring:
    """Ring bookkeeping of one CTA: its rows ``cid, cid + NC, ...``, its tiles ``t0 .. t0 + n_loc - 1`` of
    every row, the input ring's steps (re-read rows: ``2 n_loc`` per row, both passes fetch; resident rows
    ``n_loc``) and the row data, copied one row ahead (two buffers) so that no row waits on its own copy;
    with skipping the next row's data is also waited for at the end of a row's pass A (for its liveness),
    so it is copied two rows ahead (three buffers)."""

    def __init__(self, plan: _FusedSizes, x_ref, rd_ref, x_smem, loaded, rd_smem, rd_bar):
        self.plan, self.x_ref, self.rd_ref, self.x_smem = plan, x_ref, rd_ref, x_smem
        self.loaded, self.rd_smem, self.rd_bar = loaded, rd_smem, rd_bar
        self.cid = lax.axis_index("cta")
        self.rank = lax.axis_index("cl") if plan.cfg.cluster > 1 else 0  # 0: `pl.when(rank == 0)` is static
        self.t0 = self.rank * plan.tpc
        self.n_loc = C.i32(jnp.minimum(plan.tpc, plan.n_t - self.t0))  # int32 also from Python ints (x64)
        self.n_rows = (plan.R - 1 - self.cid) // plan.NC + 1
        self.steps_per_row = self.n_loc if plan.resident else 2 * self.n_loc
        self.n_steps = self.n_rows * self.steps_per_row

    def tile_start(self, t):
        """First slab row of tile ``t`` of a row (the last tile slid back to end at ``S``)."""
        return jnp.minimum(t * self.plan.bs, self.plan.S - self.plan.bs)

    def tile_b(self, t):
        """Re-read rows: pass B's step ``t`` walks backwards, starting on the freshest tile in L2."""
        return self.t0 + (self.n_loc - 1 - t if self.plan.cfg.reverse else t)

    def copy_tile(self, i, t, slot):
        """The CTA's local tile ``t`` of its row ``i`` into ``slot``."""
        src = self.x_ref.at[self.cid + i * self.plan.NC, pl.ds(self.tile_start(self.t0 + t), self.plan.bs)]
        plgpu.copy_gmem_to_smem(src, self.x_smem.at[slot], self.loaded.at[slot])

    def fetch(self, f, slot):
        """The ring's step ``f``."""
        i = f // self.steps_per_row
        j = C.rem(f, self.steps_per_row)
        if self.plan.resident:
            self.copy_tile(i, j, slot)
        else:
            self.copy_tile(i, jnp.where(j >= self.n_loc, self.tile_b(j - self.n_loc) - self.t0, j), slot)

    def copy_row_data(self, i):
        """Row ``i``'s row data into its buffer (arrives on that buffer's barrier)."""
        b = C.rem(i, self.plan.n_rd)
        plgpu.copy_gmem_to_smem(self.rd_ref.at[self.cid + i * self.plan.NC], self.rd_smem.at[b], self.rd_bar.at[b])

    def row_data(self, i):
        """Row ``i``'s ``[ROW_WIDTH]`` row data in shared memory (its copy waited for separately)."""
        return self.rd_smem.at[C.rem(i, self.plan.n_rd)]

    def row_live(self, rd):
        """A traced bool, or None: every row is read."""
        return rd[RowData.LIVE] != 0.0 if self.plan.skip else None

    def start(self):
        """The first rows' data; the prologue: row 0's first tiles (with skipping, all of them are row 0's)."""
        self.copy_row_data(0)
        if self.plan.skip:

            @pl.when(self.n_rows > 1)
            def _():
                self.copy_row_data(1)

            plgpu.barrier_wait(self.rd_bar.at[0])

        live0 = self.row_live(self.rd_smem.at[0])
        for s in range(self.plan.n_slots):
            first = s < self.n_loc if self.plan.resident else s < self.n_steps

            @pl.when(first if live0 is None else first & live0)
            def _():
                self.fetch(s, s)

    def start_row(self, i):
        """Waits for row ``i``'s data (without skipping), copies a later row's; ``(rd, k, live)`` of row ``i``."""
        rd_ahead = self.plan.n_rd - 1  # the row whose data is copied now: its buffer was last read by row i - 1
        if not self.plan.skip:
            plgpu.barrier_wait(self.rd_bar.at[C.rem(i, self.plan.n_rd)])

        @pl.when(i + rd_ahead < self.n_rows)
        def _():
            self.copy_row_data(i + rd_ahead)

        rd = self.row_data(i)
        k = rd[RowData.K]
        return rd, k, self.row_live(rd)


def _both(live, x):
    """``x`` where the row is live (every row without skipping), else 0."""
    return x if live is None else jnp.where(live, x, 0)


def _pass_a(ring: _Ring, i, k, live, init, interpret):
    """Pass A: the online log-sum-exp of row ``i``'s tiles, per slab row: ``(m, l)`` ``[bs]`` float32 with
    ``m`` the running max of the raw logits and ``l = sum exp2((x - m) k) - 1`` (one instance of the maximum
    excluded, ``gmpo_jax._lse``). A dead row (skipping) reads nothing: ``m = -inf``, ``l = -1``."""
    plan = ring.plan
    stages, f0, shape = plan.cfg.stages, i * ring.steps_per_row, (plan.bs, ring.x_smem.shape[-1])

    def step(t, carry, masked=False):
        m, l = carry
        slot = t if plan.resident else C.rem(f0 + t, stages)
        plgpu.barrier_wait(ring.loaded.at[slot])
        xr = ring.x_smem.at[slot][...].astype(jnp.float32)
        if masked:  # the row's slid-back last tile: its first rows the previous tile already saw
            seen = jnp.where(ring.t0 + t == plan.n_t - 1, plan.tail_seen, 0)
            xr = jnp.where(iota(jnp.int32, shape, 0, plgpu.Layout.WGMMA, interpret) >= seen, xr, -jnp.inf)
        m_new = jnp.maximum(m, xr.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # an all -inf slab row so far: no NaN
        # (x - m) k, not x k - m k: the compiler contracts the latter into a multiply-add, which leaves the
        # maximum the rounding error of m k (2**+-0.5 when m k ~ 1e7, i.e. tiny temperatures)
        d = xr - C.bcast_rows(m_safe, shape)  # exactly 0 at the maximum
        p = jnp.exp2(d * k)
        # l excludes one instance of the maximum: the tail is not rounded to ulps of its 1 (issue 31)
        l = C.online_merge(m, l, m_new, jnp.exp2((m - m_safe) * k), *C.tile_tail(p, d == 0.0))
        if not plan.resident:  # refill the slot (resident: pass B reads it again, and refills it)
            plgpu.commit_smem()  # every thread has read x_smem[slot] before it is refilled

            @pl.when(f0 + t + stages < ring.n_steps)
            def _():
                ring.fetch(f0 + t + stages, slot)

        return m_new, l

    masked_last = functools.partial(step, masked=plan.tail_seen > 0)
    if live is None:
        carry = lax.fori_loop(0, ring.n_loc - 1, step, init)
        return masked_last(ring.n_loc - 1, carry)
    n_a = _both(live, ring.n_loc)
    n_a1 = jnp.maximum(n_a - 1, 0)  # the unmasked tiles; then the last tile, if the row is live
    carry = lax.fori_loop(0, n_a1, step, init)
    m, l = lax.fori_loop(n_a1, n_a, masked_last, carry)

    @pl.when(i + 1 < ring.n_rows)
    def _():
        plgpu.barrier_wait(ring.rd_bar.at[C.rem(i + 1, plan.n_rd)])  # the next row's data, for its liveness

    return m, l


def _cluster_merge(xchg, cluster: int, i, m, l, k, interpret):
    """Merges the cluster's per-slab-row ``(m, l)`` through distributed shared memory: every CTA gets the
    statistics of the whole row (the online log-sum-exp merge: ``l = sum_j l_j exp2((m_j - m) k)``)."""
    m_part, l_part, bars = xchg
    ready, read = bars.at[0], bars.at[1]  # (num_barriers=1 is a 0-d ref on jax 0.11)

    @pl.when(i > 0)
    def _():
        plgpu.barrier_wait(read)  # every peer has read this CTA's previous row

    m_part[...] = m
    l_part[...] = l
    plgpu.barrier_arrive(ready)
    plgpu.barrier_wait(ready)
    # whole-reference loads (a scalar load of a peer's reference does not lower on jax 0.11)
    ms = [load_vector(plgpu.cluster_ref(m_part, {"cl": j}), C.ROW, interpret) for j in range(cluster)]
    ls = [load_vector(plgpu.cluster_ref(l_part, {"cl": j}), C.ROW, interpret) for j in range(cluster)]
    plgpu.barrier_arrive(read)
    m = functools.reduce(jnp.maximum, ms)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    # the parts at the maximum keep their l and are counted; the others' whole sums l + 1 are rescaled
    terms = [jnp.where(mj == m, lj, (lj + 1.0) * jnp.exp2((mj - m_safe) * k)) for mj, lj in zip(ms, ls)]
    ties = [jnp.where(mj == m, C.ONE, C.ZERO) for mj in ms]
    return m, sum(terms) + (sum(ties) - 1.0)


class _Token(NamedTuple):
    """The token step's per-row scalars (float32)."""

    m_all: jax.Array  # the row's maximum raw logit (0 where it is -inf)
    log2_l: jax.Array  # log2 of the row's sum of exp2((x - m_all) k) (log2(1 + l_all), C.log2_1p)
    lse: jax.Array  # log-sum-exp of z / T
    logp: jax.Array  # the target's log-prob (0 for a dead row with skipping)
    c: jax.Array  # the gradient scale scale * d ptl / d logp (0 where scale == 0)
    loss_term: jax.Array  # weight * ptl (0 where live == 0)


def _token_step(rd, k, m, l, token_fn, live) -> _Token:
    """The token step: the row's log-sum-exp from its per-slab-row ``(m, l)``, the target's log-prob and
    the objective's per-token loss and derivative (``token_fn``) from the row data ``rd``."""
    # the slab rows merged (``_lse.merge``; l excludes one instance of the maximum): lse = (m_all k +
    # log2(1 + l_all)) ln 2
    m_max = m.max()
    m_all = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    same = m == m_max
    l_all = jnp.where(same, l, (l + 1.0) * jnp.exp2((m - m_all) * k)).sum() + (
        jnp.where(same, C.ONE, C.ZERO).sum() - 1.0
    )
    log2_l = C.log2_1p(l_all)
    lse = (m_all * k + log2_l) * C.LN2
    # the target relative to the row's maximum: exact for the argmax (logp = -ln l) at any temperature
    logp = jnp.minimum(((rd[RowData.TARGET_LOGIT] - m_all) * k - log2_l) * C.LN2, 0.0)
    scale = rd[RowData.SCALE]
    ptl, g = token_fn(logp, rd[RowData.OLD], rd[RowData.REF], rd[RowData.ADV], rd[RowData.RIS], scale != 0.0)
    c = jnp.where(scale != 0.0, scale * g, 0.0)
    loss_term = jnp.where(rd[RowData.LIVE] != 0.0, rd[RowData.WEIGHT] * ptl, 0.0)
    if live is not None:
        logp = jnp.where(live, logp, 0.0)
    return _Token(m_all, log2_l, lse, logp, c, loss_term)


def _pass_b(ring: _Ring, i, k, tok: _Token, live, live_next, o_smem, o_ref, interpret):
    """Pass B: ``dz = -c exp2((x - m_all) k - log2 l)`` of row ``i``'s tiles in ``x.dtype`` (exactly 0 on a row
    without gradient, whatever ``x`` holds), each stored through the output ring, each input slot refilled:
    resident rows with the next row's tile, re-read rows with the ring's step ``stages`` ahead. A dead row
    (skipping) is written with zeros, nothing read."""
    plan = ring.plan
    stages, ost, f0 = plan.cfg.stages, plan.cfg.out_stages, i * ring.steps_per_row
    shape, dtype = (plan.bs, ring.x_smem.shape[-1]), ring.x_smem.dtype
    row = ring.cid + i * plan.NC
    neg_c = -tok.c
    dz_live = jnp.broadcast_to(tok.c != 0.0, shape)  # rows without gradient: exactly 0, whatever x holds

    def store_and_fetch(t, dz):  # pass B's step t: store its tile, refill its slot
        fo = i * ring.n_loc + t  # the output ring's step
        oslot = C.rem(fo, ost)
        plgpu.wait_smem_to_gmem(ost - 1, wait_read_only=True)
        o_smem.at[oslot][...] = dz
        plgpu.commit_smem()  # also: every thread has read x_smem[slot]
        dst = ring.tile_start(ring.t0 + t if plan.resident else ring.tile_b(t))
        plgpu.copy_smem_to_gmem(o_smem.at[oslot], o_ref.at[row, pl.ds(dst, plan.bs)])
        if plan.resident:  # the next row's tile t into slot t
            ahead = i + 1 < ring.n_rows
            if live is not None:
                ahead &= live_next
            refill = lambda: ring.copy_tile(i + 1, t, t)
        else:  # the ring's step stages ahead into this step's slot
            f = f0 + ring.n_loc + t
            ahead = f + stages < ring.n_steps
            if live is not None:  # the step ahead is in this row's pass B, or in the next row's pass A
                ahead &= jnp.where(t + stages < ring.n_loc, live, live_next)
            refill = lambda: ring.fetch(f + stages, C.rem(f, stages))
        pl.when(ahead)(refill)

    @pl.loop(0, _both(live, ring.n_loc))
    def _live_b(t):
        slot = t if plan.resident else C.rem(f0 + ring.n_loc + t, stages)
        if not plan.resident:
            plgpu.barrier_wait(ring.loaded.at[slot])
        z2 = (ring.x_smem.at[slot][...].astype(jnp.float32) - tok.m_all) * k - tok.log2_l
        store_and_fetch(t, jnp.where(dz_live, neg_c * jnp.exp2(z2), 0.0).astype(dtype))

    if live is not None:

        @pl.loop(0, ring.n_loc - _both(live, ring.n_loc))
        def _dead_b(t):  # a dead row: zeros, nothing read
            store_and_fetch(t, layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA, interpret))


def _store_stats(ring: _Ring, i, tok: _Token, st_smem, st_ref, interpret):
    """Writes row ``i``'s :class:`RowStats` (the cluster's first CTA)."""
    plan = ring.plan

    @pl.when(ring.rank == 0)
    def _():
        idx = iota(jnp.int32, (plan.bs,), 0, C.ROW, interpret)
        st = jnp.where(idx == RowStats.LOSS_TERM, tok.loss_term, 0.0)
        st = jnp.where(
            idx == RowStats.LOGP,
            tok.logp,
            jnp.where(idx == RowStats.LSE, tok.lse, jnp.where(idx == RowStats.GRAD_SCALE, tok.c, st)),
        )
        # the previous row's stats have left st_smem: at most the n_loc_min copies of this row's pass B,
        # which came after them, are still reading (waiting for all of them would stall the next row)
        plgpu.wait_smem_to_gmem(plan.n_loc_min, wait_read_only=True)
        st_smem[...] = st
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_smem.at[pl.ds(0, ROW_WIDTH)], st_ref.at[ring.cid + i * plan.NC])
