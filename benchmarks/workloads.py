"""Seeded benchmark batches: a workload family (``MEMBERS``: ``light``, ``peaked``, ``heavy``, ``heavy-shared``,
``heavy-rough``, ``unsure``, ``flat``; ``NAME-live`` all live), its knobs in `Workload`.

    from benchmarks.workloads import make_lm_head_batch, batch_stats
    batch = make_lm_head_batch(B=8, T=2048, H=896, V=151936, data="peaked", seed=0)
    print(batch_stats(batch))  # mean entropy, masked / zero-advantage / clipped fractions

Pure JAX (+ NumPy for the statistics), so tests, the JAX worker and the PyTorch worker (through
``python -m benchmarks.workloads --save``) all see the same arrays.

``flat`` (what every table measured before the family)
    hidden ~ N(0, 1), weight ~ N(0, 1 / H), uniform ids, full mask, advantages ~ N(0, 1) and
    ``old_logps = logp + 0.2 N(0, 1)``. Its softmax rows are nearly uniform (entropy ~ log V, 11.4 nats
    at V = 151936): no trained model looks like this, and a kernel that skips negligible probability
    blocks (Cut Cross-Entropy's gradient filter) finds nothing to skip.

``peaked`` (the first row of every table)
    Built so that the statistics a fused LM-head kernel is sensitive to match a trained policy:

    * **Zipf prior over ids.** BPE vocabularies number frequent tokens first; unigram frequency falls
      roughly as ``rank^-1``. One hidden direction ``u`` carries a bias-like term: every hidden state
      has ``u . h = 1`` and the weight holds ``-zipf_s * log(1 + v)`` along ``u``, so frequent (low-id)
      tokens are the runners-up of every row.
    * **Low-rank structure.** Token embeddings ``E [rank, V]`` live in a ``rank``-dimensional subspace
      ``P`` of the hidden space (plus small full-rank noise, as real heads are full rank). Each
      position has an intended token ``k`` (drawn from the Zipf prior) and a confidence ``a`` (uniform in
      [0, 1]); its hidden state points at ``E[:, k]`` with margin ``a * margin`` plus context noise.
      Confident rows put almost all mass on one token, unconfident rows spread it over the frequent
      tokens, as a trained LM's rows do.
    * **Temperature by bisection.** Logits are linear in the hidden states, so one global scale
      ``tau`` (applied to hidden) sets the mean entropy; it is found by bisection on a sample of rows
      so that the mean softmax entropy hits ``entropy`` (default 2.0 nats; 0.5-3 is typical of policies
      during RL fine-tuning).
    * **Targets from the model's own softmax** (Gumbel-max, chunked), as sampled completions are; so
      their log-probs are high, as in on-policy RL.
    * **Ragged completions**: lengths uniform over ``[min_len_frac * T, T]`` (about 40 % of the tokens
      masked at the default 0.2).
    * **Group-normalised advantages**: groups of ``group_size`` completions with binary rewards,
      ``round(zero_adv_frac * groups)`` groups all-equal (their advantages are exactly 0), the others
      with at least one success and one failure, ``(r - mean) / (std + 1e-6)``. ``group_size`` is 2 by
      default: a benchmark micro-batch holds 2-20 sequences, and what a kernel sees is the fraction of
      zero-advantage sequences (30 % exactly at B = 20, 25 % at B = 8, none at B = 2).
    * **Old log-probs near the current ones**: exact current log-probs plus noise whose scale grows
      with the token's uncertainty, ``ratio_noise * (1 - p) * N(0, 1)`` (confident tokens barely move,
      as between two nearby policy versions), so a few tokens clip at GMPO's eps 0.4 and more at
      GRPO's 0.2 (``batch_stats`` reports both).

The family (issue 32) varies what the first generator held fixed: the tail (``tail="harmonic"``: a share
``tail_mass`` of each row's mass spread as ``1 / rank`` over the whole vocabulary, through a prior logit
``log((1 + v)^-head_s + rho (1 + v)^-1)`` that the temperature does not scale, ``rho`` and the temperature set
together by a nested bisection), a weight direction shared by every column (``shared``, units of ``log V``), the
mix of confident and unsure rows (``confidence``), the entropy, ragged lengths and zero-advantage sequences.
``heavy-shared`` is the 2026-12-03 trained-LM-like batch on which the gradient filter failed (issue 32);
``heavy-rough`` jitters its tail per token (``tail_jitter``), so that no vocabulary window holds an even share.

``peaked-live``: the same batch with every token live (full mask) and no all-equal group: the pair
(peaked, peaked-live) shows what masked tokens and zero-advantage sequences save.

Memory: nothing ``[N, V]`` is materialised in float32. Logits are formed ``chunk_rows`` rows at a time
(at most ``2**25`` float32 elements per chunk) for the bisection sample, the target sampling, the
exact log-probs and the entropies; the weight is built in bf16 from a bf16 matmul. At real shapes
(H = 4096, V = 128256, N = 8192) a batch takes a few seconds on an H200, mostly compilation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks._common import cache_path  # noqa: F401 - re-exported: where batches are kept

CHUNK_ELEMENTS = 2**25  # float32 logits elements per chunk (128 MiB)
TOP_K = 16  # batch_stats' off_top16: each row's mass outside its 16 most probable tokens

# The family's members: name -> (one-line description, Workload fields). "NAME-live" is NAME with every token live
# and no zero-advantage group (full mask), for every member but flat.
MEMBERS: dict[str, tuple[str, dict[str, Any]]] = {
    "light": ("confident rows, a light (tempered Zipf) tail, no shared direction; entropy 1 nat", dict(entropy=1.0)),
    "peaked": ("the first generator: tempered Zipf tail, no shared direction; entropy 2 nats", {}),
    "heavy": (
        "harmonic tail with 12 % of each row's mass over the whole vocabulary; entropy 2.3-2.4 nats",
        dict(tail="harmonic", tail_mass=0.12, entropy=2.4),
    ),
    "heavy-shared": (
        "heavy plus a weight direction of size log V shared by every column (the 2026-12-03 batch)",
        dict(tail="harmonic", tail_mass=0.12, entropy=2.4, shared=1.0),
    ),
    "heavy-rough": (
        "heavy-shared with each token's prior logit jittered by N(0, 1.5^2) nats: a tail uneven inside every "
        "vocabulary window, as BPE ids follow frequency only roughly",
        dict(tail="harmonic", tail_mass=0.12, entropy=2.4, shared=1.0, tail_jitter=1.5),
    ),
    "unsure": (
        "mostly unsure rows, 20 % harmonic tail, shared direction log V; entropy 3 nats, half the sequences at "
        "advantage 0",
        dict(tail="harmonic", tail_mass=0.2, entropy=3.0, shared=1.0, confidence=2.0, zero_adv_frac=0.5),
    ),
    "flat": ("hidden N(0, 1), weight N(0, 1 / H): nearly uniform rows (entropy ~ log V), full mask", {}),
}
DATA = tuple(MEMBERS) + tuple(f"{m}-live" for m in MEMBERS if m != "flat")
# the heavy-tailed members (the gradient filter's hard cases)
HEAVY = ("heavy", "heavy-shared", "heavy-rough", "unsure")
_FAMILY_DEFAULTS: dict[str, Any] = dict(
    entropy=2.0,
    tail="tempered",
    tail_mass=0.0,
    tail_jitter=0.0,
    shared=0.0,
    confidence=1.0,
    min_len_frac=0.2,
    zero_adv_frac=0.3,
)


def describe(name: str) -> str:
    """The one-line description of the family member ``name`` (``DATA``)."""
    base, live = (name[:-5], True) if name.endswith("-live") else (name, False)
    return MEMBERS[base][0] + ("; every token live, no zero advantage" if live else "")


@dataclasses.dataclass(frozen=True)
class Workload:
    """How a batch is drawn. ``data``: a family member (``DATA``, e.g. ``"heavy-shared"``); the family's knobs
    left None take the member's value (``MEMBERS``), else ``_FAMILY_DEFAULTS``. The knobs apply to every member
    but flat:

    * ``entropy``: target mean softmax entropy, nats (0.5-3 typical of RL fine-tuning).
    * ``tail``: ``"tempered"`` (the Zipf prior ``-zipf_s log(1 + v)`` scaled by the temperature: an exponentially
      light tail, the ``peaked`` generator) or ``"harmonic"``: the prior's logit is
      ``log((1 + v)^-head_s + rho (1 + v)^-1)``, not tempered, a steep head plus a harmonic (``1 / rank``) tail
      over the whole vocabulary, ``rho`` set by bisection so that the mean tail mass (each row's softmax mass
      attributed to the harmonic part, ``batch_stats``' ``tail_mass``) is ``tail_mass`` (0.001-0.2).
    * ``tail_jitter``: harmonic only: each token's prior logit plus ``N(0, tail_jitter^2)`` nats, fixed per token (0:
      a smooth tail, each window's mass nearly even over its columns; 1-2: uneven, as real vocabularies' ids
      follow frequency only roughly).
    * ``shared``: strength of a weight direction shared by every column, in units of ``log V``: each column gets
      ``+ shared log(V) u`` for one unit hidden direction ``u``, along which every hidden state has component 1
      (a per-row logit shift: the softmax is unchanged, the gradient's dropped ``sum_v p_v W_v`` is not).
    * ``confidence``: rows' confidence ``a = U^confidence``, ``U`` uniform: 1 uniform (the ``peaked`` mix), > 1
      mostly unsure rows, < 1 mostly confident ones.
    * ``min_len_frac`` (ragged lengths over ``[min_len_frac T, T]``), ``zero_adv_frac`` (sequences at
      advantage 0), ``live`` (every token live and no zero advantage: the ``-live`` members).
    """

    data: str = "peaked"
    seed: int = 0
    entropy: float | None = None  # target mean softmax entropy, nats
    tail: str | None = None  # "tempered" or "harmonic"
    tail_mass: float | None = None  # harmonic: mean softmax mass in the harmonic tail
    tail_jitter: float | None = None  # harmonic: per-token N(0, tail_jitter^2) nats on the prior logit
    shared: float | None = None  # shared weight direction, units of log V
    confidence: float | None = None  # a = U^confidence
    min_len_frac: float | None = None  # completion lengths uniform over [min_len_frac * T, T]
    zero_adv_frac: float | None = None  # fraction of groups whose rewards are all equal
    live: bool | None = None  # full mask, no zero advantage
    zipf_s: float = 1.0  # tempered prior logit -zipf_s * log(1 + v)
    head_s: float = 1.5  # harmonic: the head's exponent (1 + v)^-head_s
    rank: int = 64  # dimension of the token-embedding subspace
    margin: float = 12.0  # logit margin of a fully confident row (before the temperature)
    group_size: int = 2  # completions per prompt (clipped to B); see below
    ratio_noise: float = 0.2  # old_logps = logp + ratio_noise * (1 - p) * N(0, 1)   (flat: ratio_noise * N(0, 1))
    logit_scale: float = 1.0  # flat only: weight ~ N(0, logit_scale^2 / H)

    def __post_init__(self):
        if self.data not in DATA:
            raise ValueError(f"{self.data=} not in {DATA}")
        base = self.data[:-5] if self.data.endswith("-live") else self.data
        member = dict(_FAMILY_DEFAULTS, live=base != self.data, **MEMBERS[base][1])
        for k, v in member.items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)
        if not 0.0 < self.entropy:
            raise ValueError(f"{self.entropy=} must be > 0")
        if not 0.0 <= self.zero_adv_frac <= 1.0 or not 0.0 < self.min_len_frac <= 1.0:
            raise ValueError(f"{self.zero_adv_frac=} must be in [0, 1], {self.min_len_frac=} in (0, 1]")
        if self.tail not in ("tempered", "harmonic"):
            raise ValueError(f"{self.tail=} must be 'tempered' or 'harmonic'")
        if self.tail == "harmonic" and not 0.0 < self.tail_mass < 0.5:
            raise ValueError(f"{self.tail_mass=} must be in (0, 0.5) with a harmonic tail")
        if not self.tail_jitter >= 0.0 or (self.tail_jitter and self.tail != "harmonic"):
            raise ValueError(f"{self.tail_jitter=} must be >= 0, and 0 without a harmonic tail")
        if not self.shared >= 0.0 or not self.confidence > 0.0:
            raise ValueError(f"{self.shared=} must be >= 0 and {self.confidence=} > 0")

    @property
    def member(self) -> str:
        """The member's name without ``-live``."""
        return self.data[:-5] if self.data.endswith("-live") else self.data


class LMHeadBatch(NamedTuple):
    hidden: jax.Array  # [B, T, H] bf16
    weight: jax.Array  # [H, V] bf16
    ids: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T] bool
    advantages: jax.Array  # [B] float32
    old_logps: jax.Array  # [B, T] float32
    logps: jax.Array  # [B, T] float32, exact current log-probs of ids (bf16 inputs, f32 math)
    entropy: jax.Array  # [B, T] float32, softmax entropy per position
    tail_mass: Any = None  # [B, T] float32, softmax mass in the harmonic tail (None: no harmonic tail)
    off_top: Any = None  # [B, T] float32, softmax mass outside the row's TOP_K most probable tokens


class LogitsBatch(NamedTuple):
    logits: jax.Array  # [B, T + 1, V] bf16
    ids: jax.Array
    mask: jax.Array
    advantages: jax.Array
    old_logps: jax.Array
    logps: jax.Array
    entropy: jax.Array
    tail_mass: Any = None
    off_top: Any = None


# ----------------------------------------------------------------------------------------------------
# Index-hashed normals: elementwise from the index, so creating large arrays needs no temporaries.


def _mix32(x):
    """lowbias32 integer hash (uint32 -> uint32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _hash_bits(seed: int, stream: int, shape: tuple[int, ...]):
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    salt = (seed * 0x9E3779B9 + stream * 0x85EBCA6B + 0x68E31DA4) % 2**32
    return _mix32(_mix32(idx ^ jnp.uint32(salt)) + jnp.uint32(salt))


def hashed_normal(seed: int, stream: int, shape: tuple[int, ...], dtype, scale: float = 1.0):
    """N(0, scale^2) samples (Box-Muller on two hashes), computed elementwise from the index."""
    a = _hash_bits(seed, stream, shape)
    b = _mix32(a ^ jnp.uint32(0x5BD1E995))
    u1 = (a >> 8).astype(jnp.float32) * (1.0 / 2**24) + (0.5 / 2**24)  # (0, 1)
    u2 = (b >> 8).astype(jnp.float32) * (1.0 / 2**24)
    z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * np.pi * u2)
    return (scale * z).astype(dtype)


def hashed_randint(seed: int, stream: int, shape: tuple[int, ...], high: int):
    return (_hash_bits(seed, stream, shape) % jnp.uint32(high)).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------
# Chunked row statistics: sample a target, its exact log-prob, the entropy; one [C, V] block at a time


def chunk_rows(R: int, V: int, cap_elements: int = CHUNK_ELEMENTS) -> int:
    """The largest divisor of ``R`` with ``rows * V <= cap_elements`` (at least 1)."""
    cap = max(1, min(R, cap_elements // max(V, 1)))
    return max(d for d in range(1, cap + 1) if R % d == 0)


def _row_stats(z_block, key, ids_block=None, share=None):
    """[C, V] float32 logits -> (ids, logp, entropy, tail mass, mass off the top ``TOP_K``); ids sampled
    (Gumbel-max) unless given; tail mass ``sum_v p_v share_v`` (0 without ``share``)."""
    lse = jax.nn.logsumexp(z_block, axis=-1)
    p = jnp.exp(z_block - lse[:, None])
    ent = lse - jnp.sum(p * z_block, axis=-1)
    if ids_block is None:
        g = jax.random.gumbel(key, z_block.shape, jnp.float32)
        ids_block = jnp.argmax(z_block + g, axis=-1).astype(jnp.int32)
    logp = jnp.take_along_axis(z_block, ids_block[:, None], axis=-1)[:, 0] - lse
    tail = jnp.zeros_like(lse) if share is None else jnp.sum(p * share[None, :], axis=-1)
    off_top = 1.0 - jnp.sum(lax.top_k(p, min(TOP_K, p.shape[-1]))[0], axis=-1)
    return ids_block, logp, ent, tail, off_top


@functools.partial(jax.jit, static_argnames=("rows", "sample"))
def _lm_head_row_stats(h2, weight, ids, key, share=None, *, rows: int, sample: bool):
    """h2 [R, H] bf16, weight [H, V] bf16 -> ids, logp, entropy, tail mass, off-top mass [R] (f32 logits of the
    bf16 inputs)."""
    R, H = h2.shape

    def step(i):
        h = lax.dynamic_slice(h2, (i * rows, 0), (rows, H))
        z = jnp.dot(h, weight, preferred_element_type=jnp.float32)
        blk = None if sample else lax.dynamic_slice(ids, (i * rows,), (rows,))
        return _row_stats(z, jax.random.fold_in(key, i), blk, share)

    out = lax.map(step, jnp.arange(R // rows))
    return tuple(x.reshape(R) for x in out)


@functools.partial(jax.jit, static_argnames=("rows", "sample"))
def _logits_row_stats(z2, ids, key, *, rows: int, sample: bool):
    R, V = z2.shape

    def step(i):
        z = lax.dynamic_slice(z2, (i * rows, 0), (rows, V)).astype(jnp.float32)
        blk = None if sample else lax.dynamic_slice(ids, (i * rows,), (rows,))
        return _row_stats(z, jax.random.fold_in(key, i), blk)

    out = lax.map(step, jnp.arange(R // rows))
    return tuple(x.reshape(R) for x in out)


# ----------------------------------------------------------------------------------------------------
# The peaked model


def _zipf_prior(V: int, s: float):
    return -s * jnp.log1p(jnp.arange(V, dtype=jnp.float32))


@functools.partial(jax.jit, static_argnames=("H", "V", "rank", "shared"))
def _embeddings(key, *, H: int, V: int, rank: int, shared: bool):
    """The head's geometry: an orthonormal basis ``q [H, rank + 1]`` (column 0 the prior direction, the rest the
    embedding subspace ``P``), embeddings ``E [rank, V]``, and (``shared``) a unit direction orthogonal to both."""
    kq, ke = jax.random.split(key)
    q, _ = jnp.linalg.qr(jax.random.normal(kq, (H, rank + 1), jnp.float32))
    E = jax.random.normal(ke, (rank, V), jnp.float32) / math.sqrt(rank)
    u = None
    if shared:
        r = jax.random.normal(jax.random.fold_in(kq, 1), (H,), jnp.float32)
        r = r - q @ (q.T @ r)
        u = r / jnp.linalg.norm(r)
    return q, E, u


@functools.partial(jax.jit, static_argnames=("seed", "shared_s"))
def _family_weight(q, E, prior, u, *, seed: int, shared_s: float):
    """weight [H, V] bf16 = P @ E + q_0 (x) prior (centred) [+ shared_s u (x) 1] + small noise."""
    H, V = q.shape[0], E.shape[1]
    prior = prior - prior.mean()
    lhs = jnp.concatenate([q[:, 1:], q[:, :1]], axis=1)  # [H, rank + 1]
    rhs = jnp.concatenate([E, prior[None, :]], axis=0)  # [rank + 1, V]
    if u is not None:
        lhs = jnp.concatenate([lhs, u[:, None]], axis=1)
        rhs = jnp.concatenate([rhs, jnp.full((1, V), shared_s, jnp.float32)], axis=0)
    w = jnp.dot(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16)
    noise = hashed_normal(seed, 9, (H, V), jnp.bfloat16, 0.05 / math.sqrt(H))  # full rank, fused
    return (w + noise).astype(jnp.bfloat16)


def _harmonic_prior(V: int, head_s: float, log_rho, jitter=None):
    """(prior logit ``log((1 + v)^-head_s + rho (1 + v)^-1)`` [+ ``jitter`` [V]], the harmonic part's share of each
    column) [V]. The jitter scales a column's two parts alike: their shares stay."""
    lv = jnp.log1p(jnp.arange(V, dtype=jnp.float32))
    prior = jnp.logaddexp(-head_s * lv, log_rho - lv)
    return prior if jitter is None else prior + jitter, jax.nn.sigmoid(log_rho + (head_s - 1.0) * lv)


@functools.partial(jax.jit, static_argnames=("N", "margin", "zipf_s", "confidence"))
def _peaked_hidden_unit(key, q, E, *, N: int, margin: float, zipf_s: float, confidence: float = 1.0):
    """Hidden states before the temperature, [N, H] float32: ``P c`` (``P^T h = a * margin * E_k + noise``,
    ``a = U^confidence``) plus small full-rank noise; the prior direction's component (1) is added by the caller."""
    rank, V = E.shape
    kk, ka, kn, ki = jax.random.split(key, 4)
    p = jax.nn.softmax(_zipf_prior(V, zipf_s))
    k = jnp.clip(jnp.searchsorted(jnp.cumsum(p), jax.random.uniform(kk, (N,))), 0, V - 1)
    a = jax.random.uniform(ka, (N,))
    if confidence != 1.0:
        a = a**confidence
    Ek = E[:, k].T  # [N, rank]
    Ek = Ek / jnp.sum(Ek * Ek, axis=-1, keepdims=True)  # E_k . c = a * margin
    coords = a[:, None] * margin * Ek + jax.random.normal(kn, (N, rank)) * (0.5 / math.sqrt(rank))
    h = coords @ q[:, 1:].T
    H = q.shape[0]
    return h + jax.random.normal(ki, (N, H)) * (0.05 / math.sqrt(H))


@functools.partial(jax.jit, static_argnames=("target", "iters"))
def _bisect_temperature(h_sample, weight, *, target: float, iters: int = 40):
    """tau with mean entropy of softmax((tau h) W) == target over the sample (entropy falls with tau)."""
    z0 = jnp.dot(h_sample.astype(jnp.bfloat16), weight, preferred_element_type=jnp.float32)

    def mean_entropy(log_tau):
        z = jnp.exp(log_tau) * z0
        lse = jax.nn.logsumexp(z, axis=-1)
        p = jnp.exp(z - lse[:, None])
        return jnp.mean(lse - jnp.sum(p * z, axis=-1))

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        too_flat = mean_entropy(mid) > target
        return jnp.where(too_flat, mid, lo), jnp.where(too_flat, hi, mid)

    lo, hi = lax.fori_loop(0, iters, body, (jnp.float32(-8.0), jnp.float32(8.0)))
    return jnp.exp(0.5 * (lo + hi))


def _sample_rows(N: int, V: int) -> int:
    """Rows the bisections sample: 256, fewer at large V (at most 2**23 logits, at least 64), at most N."""
    return min(N, max(64, min(256, 2**23 // max(V, 1))))


@functools.partial(jax.jit, static_argnames=("head_s", "iters"))
def _bisect_harmonic(A, entropy, tail_mass, jitter=None, *, head_s: float, iters: int = 20):
    """``(tau, log_rho)``: logits ``tau A + prior(rho)`` (``_harmonic_prior``) of the sample ``A [S, V]`` with mean
    entropy ``entropy`` and mean harmonic-tail mass ``tail_mass``: bisection on ``log rho`` (the tail mass grows
    with it), each step with a bisection on ``log tau`` for the entropy (which falls with ``tau``)."""
    V = A.shape[1]

    def stats(log_tau, log_rho):
        prior, share = _harmonic_prior(V, head_s, log_rho, jitter)
        z = jnp.exp(log_tau) * A + prior[None]
        lse = jax.nn.logsumexp(z, axis=-1)
        p = jnp.exp(z - lse[:, None])
        return jnp.mean(lse - jnp.sum(p * z, axis=-1)), jnp.mean(jnp.sum(p * share[None], axis=-1))

    def tau_for(log_rho):
        def body(_, lohi):
            lo, hi = lohi
            mid = 0.5 * (lo + hi)
            too_flat = stats(mid, log_rho)[0] > entropy
            return jnp.where(too_flat, mid, lo), jnp.where(too_flat, hi, mid)

        lo, hi = lax.fori_loop(0, iters, body, (jnp.float32(-8.0), jnp.float32(8.0)))
        return 0.5 * (lo + hi)

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        too_light = stats(tau_for(mid), mid)[1] < tail_mass
        return jnp.where(too_light, mid, lo), jnp.where(too_light, hi, mid)

    lo, hi = lax.fori_loop(0, iters, body, (jnp.float32(-30.0), jnp.float32(10.0)))
    log_rho = 0.5 * (lo + hi)
    return jnp.exp(tau_for(log_rho)), log_rho


# ----------------------------------------------------------------------------------------------------
# Masks, advantages, old log-probs


def ragged_mask(key, B: int, T: int, min_len_frac: float):
    lo = max(1, int(math.ceil(min_len_frac * T)))
    lengths = jax.random.randint(key, (B,), lo, T + 1)
    return jnp.arange(T)[None, :] < lengths[:, None]


def group_advantages(key, B: int, group_size: int, zero_adv_frac: float):
    """[B] float32: groups of ``group_size`` (the last may be shorter), binary rewards, normalised per group;
    ``round(zero_adv_frac * groups)`` randomly chosen groups have all-equal rewards (advantage exactly 0)."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    G = max(1, min(group_size, B))
    groups = [list(range(s, min(s + G, B))) for s in range(0, B, G)]
    n_zero = int(round(zero_adv_frac * len(groups)))
    zero = set(rng.choice(len(groups), size=n_zero, replace=False).tolist()) if n_zero else set()
    adv = np.zeros(B, np.float32)
    for g, members in enumerate(groups):
        if g in zero or len(members) == 1:
            continue  # all-equal rewards: advantage 0
        r = rng.integers(0, 2, len(members)).astype(np.float32)
        if r.min() == r.max():  # at least one success and one failure
            r[rng.integers(len(members))] = 1.0 - r[0]
        adv[members] = (r - r.mean()) / (r.std() + 1e-6)
    return jnp.asarray(adv)


def _old_logps(key, logp, ratio_noise: float, peaked: bool):
    z = jax.random.normal(key, logp.shape, jnp.float32)
    scale = ratio_noise * (1.0 - jnp.exp(logp)) if peaked else ratio_noise
    return logp + scale * z


# ----------------------------------------------------------------------------------------------------
# Public constructors


def make_lm_head_batch(
    B: int, T: int, H: int, V: int, data: str | Workload = "peaked", seed: int = 0, **overrides: Any
) -> LMHeadBatch:
    """A seeded LM-head batch (see the module docstring). ``data``: a name or a `Workload`; ``overrides``
    set `Workload` fields (``entropy=1.0``, ``zero_adv_frac=0.5`` ...)."""
    wl = data if isinstance(data, Workload) else Workload(data=data, seed=seed, **overrides)
    N, key = B * T, jax.random.key(wl.seed)
    k_w, k_h, k_ids, k_mask, k_adv, k_old = jax.random.split(key, 6)
    if wl.data == "flat":
        hidden = jax.jit(lambda: hashed_normal(wl.seed, 1, (B, T, H), jnp.bfloat16))()
        weight = jax.jit(lambda: hashed_normal(wl.seed, 2, (H, V), jnp.bfloat16, wl.logit_scale / math.sqrt(H)))()
        ids = jax.jit(lambda: hashed_randint(wl.seed, 3, (B, T), V))()
        _, logp, ent, _, off = _lm_head_row_stats(
            hidden.reshape(N, H), weight, ids.reshape(N), k_ids, rows=chunk_rows(N, V), sample=False
        )
        mask = jnp.ones((B, T), jnp.bool_)
        adv = jax.jit(lambda: hashed_normal(wl.seed, 4, (B,), jnp.float32))()
        logp = logp.reshape(B, T)
        old = jax.jit(lambda lp: lp + wl.ratio_noise * hashed_normal(wl.seed, 5, (B, T), jnp.float32))(logp)
        return LMHeadBatch(hidden, weight, ids, mask, adv, old, logp, ent.reshape(B, T), None, off.reshape(B, T))

    rank = min(wl.rank, H // 2)
    q, E, u = _embeddings(k_w, H=H, V=V, rank=rank, shared=wl.shared > 0)
    h_unit = _peaked_hidden_unit(k_h, q, E, N=N, margin=wl.margin, zipf_s=wl.zipf_s, confidence=wl.confidence)
    sample, share = _sample_rows(N, V), None
    if wl.tail == "tempered":  # the prior direction is scaled with the rest: an exponentially light tail
        prior = _zipf_prior(V, wl.zipf_s)
        weight = _family_weight(q, E, prior, u, seed=wl.seed, shared_s=wl.shared * math.log(V))
        tau = _bisect_temperature(h_unit[:sample] + q[:, 0], weight, target=wl.entropy)
        t_scaled, t_prior = tau, tau
    else:  # the prior direction (1) is not: its head's exponent and its harmonic tail stay as built
        A = (h_unit[:sample] @ q[:, 1:]) @ E  # the sample's tempered logits before the temperature (float32)
        jitter = None
        if wl.tail_jitter > 0:
            jitter = jax.jit(lambda: hashed_normal(wl.seed, 10, (V,), jnp.float32, wl.tail_jitter))()
        tail_mass = jnp.float32(wl.tail_mass)
        tau, log_rho = _bisect_harmonic(A, jnp.float32(wl.entropy), tail_mass, jitter, head_s=wl.head_s)
        del A
        prior, share = _harmonic_prior(V, wl.head_s, log_rho, jitter)
        weight = _family_weight(q, E, prior, u, seed=wl.seed, shared_s=wl.shared * math.log(V))
        t_scaled, t_prior = tau, jnp.float32(1.0)

    @jax.jit
    def make_hidden(h, t, t0, q0, u):
        h = h * t + t0 * q0[None]
        if u is not None:  # every hidden state has component 1 along the shared direction
            h = h + u[None]
        return h.astype(jnp.bfloat16).reshape(B, T, H)

    hidden = make_hidden(h_unit, t_scaled, t_prior, q[:, 0], u)
    del h_unit, q, E
    ids, logp, ent, tail, off = _lm_head_row_stats(
        hidden.reshape(N, H), weight, jnp.zeros((N,), jnp.int32), k_ids, share, rows=chunk_rows(N, V), sample=True
    )
    ids, logp, ent, off = ids.reshape(B, T), logp.reshape(B, T), ent.reshape(B, T), off.reshape(B, T)
    mask = jnp.ones((B, T), jnp.bool_) if wl.live else ragged_mask(k_mask, B, T, wl.min_len_frac)
    adv = group_advantages(k_adv, B, wl.group_size, 0.0 if wl.live else wl.zero_adv_frac)
    old = _old_logps(k_old, logp, wl.ratio_noise, True)
    tail = None if share is None else tail.reshape(B, T)
    return LMHeadBatch(hidden, weight, ids, mask, adv, old, logp, ent, tail, off)


def make_logits_batch(
    B: int, T: int, V: int, data: str | Workload = "peaked", seed: int = 0, H: int = 256, **overrides: Any
) -> LogitsBatch:
    """Logits ``[B, T + 1, V]`` bf16 (the loss-from-logits path). Peaked: the logits of a peaked LM head of
    hidden size ``H`` (one bf16 matmul, bf16 result); flat: N(0, 1) logits, as the logits tables used."""
    wl = data if isinstance(data, Workload) else Workload(data=data, seed=seed, **overrides)
    R = B * (T + 1)
    k_ids, k_mask, k_adv, k_old = jax.random.split(jax.random.key(wl.seed + 1000), 4)
    if wl.data == "flat":
        logits = jax.jit(lambda: hashed_normal(wl.seed, 11, (B, T + 1, V), jnp.bfloat16))()
        ids = jax.jit(lambda: hashed_randint(wl.seed, 3, (B, T), V))()
        ids_full = jnp.concatenate([ids, jnp.zeros((B, 1), jnp.int32)], axis=1)
        _, logp, ent, _, off = _logits_row_stats(
            logits.reshape(R, V), ids_full.reshape(R), k_ids, rows=chunk_rows(R, V), sample=False
        )
        logp, ent, off = (x.reshape(B, T + 1)[:, :T] for x in (logp, ent, off))
        adv = jax.jit(lambda: hashed_normal(wl.seed, 4, (B,), jnp.float32))()
        old = jax.jit(lambda lp: lp + wl.ratio_noise * hashed_normal(wl.seed, 5, (B, T), jnp.float32))(logp)
        return LogitsBatch(logits, ids, jnp.ones((B, T), jnp.bool_), adv, old, logp, ent, None, off)
    head = make_lm_head_batch(B, T + 1, H, V, dataclasses.replace(wl, live=True))
    logits = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.bfloat16))(head.hidden, head.weight)
    ids = head.ids[:, :T]
    # log-probs and entropies of the bf16 logits themselves (what the loss sees)
    _, logp, ent, _, off = _logits_row_stats(
        logits.reshape(R, V), head.ids.reshape(R), k_ids, rows=chunk_rows(R, V), sample=False
    )
    logp, ent, off = (x.reshape(B, T + 1)[:, :T] for x in (logp, ent, off))
    tail = None if head.tail_mass is None else head.tail_mass[:, :T]
    del head
    mask = jnp.ones((B, T), jnp.bool_) if wl.live else ragged_mask(k_mask, B, T, wl.min_len_frac)
    adv = group_advantages(k_adv, B, wl.group_size, 0.0 if wl.live else wl.zero_adv_frac)
    old = _old_logps(k_old, logp, wl.ratio_noise, True)
    return LogitsBatch(logits, ids, mask, adv, old, logp, ent, tail, off)


def batch_stats(batch: LMHeadBatch | LogitsBatch) -> dict[str, float]:
    """What the batch looks like: mean entropy and target log-prob of live tokens, masked fraction,
    zero-advantage sequence fraction, clipped fractions among live tokens of sequences with a nonzero
    advantage (GMPO: log ratio beyond +-0.4 on the side the advantage's sign clips; GRPO: ratio outside
    [0.8, 1.2] on that side); the tail: ``tail_mass`` (mean softmax mass of live tokens in the harmonic tail,
    0 without one) and ``off_top16`` (mean mass outside each live row's 16 most probable tokens, model-free);
    and for an LM head the shared weight direction: ``shared_norm`` ``|mean_v W_v|``, its ratio to ``log V``
    and ``shared_frac`` ``|mean_v W_v|^2 / mean_v |W_v|^2`` (the share of the columns' squared norm)."""
    mask = np.asarray(batch.mask, bool)
    adv = np.asarray(batch.advantages, np.float64)
    ent = np.asarray(batch.entropy, np.float64)
    lp = np.asarray(batch.logps, np.float64)
    r = lp - np.asarray(batch.old_logps, np.float64)
    pos = (adv > 0)[:, None]
    active = mask & (adv != 0)[:, None]
    gmpo = np.where(pos, r > 0.4, r < -0.4) & active
    grpo = np.where(pos, np.exp(r) > 1.2, np.exp(r) < 0.8) & active
    n_active = max(int(active.sum()), 1)

    def live_mean(x):
        return round(float(np.asarray(x, np.float64)[mask].mean()) if mask.any() else float("nan"), 4)

    out = {
        "mean_entropy": live_mean(ent),
        "mean_target_logp": live_mean(lp),
        "masked_frac": round(float(1.0 - mask.mean()), 4),
        "zero_adv_frac": round(float((adv == 0).mean()), 4),
        "clip_frac_gmpo_0.4": round(float(gmpo.sum() / n_active), 5),
        "clip_frac_grpo_0.2": round(float(grpo.sum() / n_active), 5),
        "tail_mass": 0.0 if batch.tail_mass is None else live_mean(batch.tail_mass),
    }
    if batch.off_top is not None:
        out["off_top16"] = live_mean(batch.off_top)
    if isinstance(batch, LMHeadBatch):
        norm, frac = (float(x) for x in _shared_direction(batch.weight))
        V = batch.weight.shape[1]
        out.update(
            shared_norm=round(norm, 4), shared_over_logV=round(norm / math.log(V), 4), shared_frac=round(frac, 4)
        )
    return out


@jax.jit
def _shared_direction(weight):
    """``(|mean_v W_v|, |mean_v W_v|^2 / mean_v |W_v|^2)`` of a weight ``[H, V]`` (float32 sums)."""
    mean = jnp.mean(weight, axis=1, dtype=jnp.float32)
    sq = jnp.mean(jnp.sum(jnp.square(weight.astype(jnp.float32)), axis=0))
    n2 = jnp.sum(mean * mean)
    return jnp.sqrt(n2), n2 / sq


# ----------------------------------------------------------------------------------------------------
# Files for the PyTorch worker (it must not share a process with JAX's CUDA runtime)


def _bf16_to_np(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


LOSS_FIELDS = ("hidden", "weight", "ids", "mask", "advantages", "old_logps")  # the loss's arguments, in order


def save_arrays(path: str, arrays: dict[str, Any]) -> None:
    """Writes ``{name: array}`` to ``path`` (.npz, atomically); bf16 arrays as uint16 bit patterns."""
    out = {k: (_bf16_to_np(v) if v.dtype == jnp.bfloat16 else np.asarray(v)) for k, v in arrays.items()}
    tmp = path + ".tmp.npz"
    np.savez(tmp, **out)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workloads", description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, required=True)
    p.add_argument("--T", type=int, required=True)
    p.add_argument("--H", type=int, required=True)
    p.add_argument("--V", type=int, required=True)
    p.add_argument("--data", choices=DATA, default="peaked", help="; ".join(f"{m}: {describe(m)}" for m in MEMBERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the batch to this .npz (the PyTorch worker's input)")
    args = p.parse_args(argv)
    batch = make_lm_head_batch(args.B, args.T, args.H, args.V, args.data, args.seed)
    print(batch_stats(batch), flush=True)
    if args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)) or ".", exist_ok=True)
        save_arrays(args.save, {k: getattr(batch, k) for k in LOSS_FIELDS})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
