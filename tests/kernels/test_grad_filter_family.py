"""The gradient filter on the workload family (``benchmarks.workloads``): its error stays at the exact path's.

The ``-live`` batches of the members (every row with a cotangent ``c ~ N(0, 1)``, temperature 0.9) at a small
shape (42 rows, H 64, V 1024, ``tau = 3e-3``), the filter's kernels in the Pallas interpreter
(``MosaicGpuBackend(interpret=True)``, windows of one 128-column tile), one run per member (the correction couples
a call's rows through their mean hidden state, so members cannot share a run). Two members: ``heavy-shared`` (a
weight direction shared by every column: the filter without any correction was 13-17x the exact path's hidden
error at this shape) and ``heavy-rough`` (its tail uneven inside every window, the same way for every row: at this
shape, float64 model, thresholding the mass instead of the score gave 2.1x, the even window mean instead of the
tilted one 1.1x; the other members: ``benchmarks/filter_error.py`` at larger shapes). Against the float64 gradient of
the same bf16 inputs:

* the rule (issue 32): the filtered hidden- and weight-gradient relative L2 errors within 1.5x of the exact
  path's own (plus 2e-5 for float32 rounding) on every member, with the filter dropping blocks (so a filter that
  drops nothing cannot pass);
* the bound of ``HeadOptions``' ``grad_filter`` docstring, per row: ``|dh_r(filter) - dh_r(exact)| <= |c_r| sum_k
  (min(D_rk, s_rk) max_(v in k) |W_v - mean_k(W)| + D_rk |m_k - mean_k(W)|) / temperature`` over the dropped windows,
  plus the bf16 rounding of ``dz`` (``D_rk`` the row's dropped mass in window ``k``, ``s_rk`` its score, which the
  filter keeps ``<= tau``, ``m_k`` the tilted mean column of the correction; float64 here,
  ``conftest.filter_window_stats`` / ``filter_window_means``).

The exact path's gradients come from ``xla_chunked`` (compiled, no interpreter run): it has the exact Mosaic path's
rounding points (``dz`` rounded to bfloat16 with its rounding cancelled, ``backend.cancel_rounding``; the weight
gradient returned in the weight's bfloat16), and its errors against float64 matched the interpreted Mosaic path's
to 4e-7 of themselves on both members (dh 1.8613e-3 and 2.2205e-3, dW 2.3409e-3 and 2.2730e-3), far
inside the rule's 2e-5: the rule is as strict as against the Mosaic path.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import filter_window_means, filter_window_stats, rel_err

from gmpo_jax.lm_head.backend import with_settings
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # benchmarks/
from benchmarks import workloads  # noqa: E402

B, T, H, V, WINDOW = 1, 42, 64, 1024, 128  # 42 rows (one row block), 8 one-tile windows
TAU, TEMP = 3e-3, 0.9
f64 = np.float64


MEMBERS = ("heavy-shared", "heavy-rough")


@functools.cache
def _batch(name):
    """The member's ``(h [R, H], w [H, V], ids [R], c [R])``, numpy."""
    b = workloads.make_lm_head_batch(B, T, H, V, f"{name}-live", seed=0)
    h = np.asarray(b.hidden).reshape(B * T, H)
    c = np.random.default_rng(1).normal(size=B * T).astype(np.float32)
    return h, np.asarray(b.weight), np.asarray(b.ids).reshape(B * T), c


@pytest.fixture(scope="module", params=MEMBERS)
def member(request):
    """(name, h, w, ids, c) and the float64 pieces: p, the window masses off the target, the gradients."""
    h, w, ids, c = _batch(request.param)
    z = h.astype(f64) @ w.astype(f64) / TEMP
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.zeros_like(p)
    onehot[np.arange(B * T), ids] = 1.0
    dz = (c.astype(f64) / TEMP)[:, None] * (onehot - p)
    off = filter_window_stats(p, ids, WINDOW)  # (D, s)
    ref = dz @ w.astype(f64).T, h.astype(f64).T @ dz
    exact, filtered = _f64(_exact_grads, h, w, ids, c), _f64(_filtered_grads, h, w, ids, c)
    return request.param, h, w, ids, c, off, ref, exact, filtered


@jax.jit
def _exact_grads(h, w, ids, c):
    be = XlaChunkedBackend()
    lse = be.logprobs(h, w, None, ids, TEMP, weight_layout="hv")[1]
    dh, dw, _ = be.grads(h, w, None, ids, c, lse, TEMP, weight_layout="hv", dw_acc=None, db_acc=None)
    return dh, dw.astype(w.dtype)  # the weight gradient in the weight's dtype, as the Mosaic path returns it


@jax.jit
def _filtered_grads(h, w, ids, c):
    be = with_settings(MosaicGpuBackend(interpret=True, filter_window=WINDOW), grad_filter=TAU)
    _, lse, mass = be.logprobs(h, w, None, ids, TEMP, weight_layout="hv", with_window_mass=True)
    return be.grads(h, w, None, ids, c, lse, TEMP, weight_layout="hv", dw_acc=None, db_acc=None, window_mass=mass)[:2]


def _f64(grads, h, w, ids, c):
    """``(dh, dW)`` of ``grads`` (``_exact_grads``: ``xla_chunked``, the module docstring; ``_filtered_grads``: the
    Mosaic kernels in the interpreter) as float64 arrays of the bf16 results."""
    return tuple(np.asarray(x, f64) for x in grads(*(jnp.asarray(x) for x in (h, w, ids, c))))


def test_filter_error_within_1_5x_of_the_exact_path(member):
    name, h, w, ids, c, off, (dh_ref, dw_ref), (dh0, dw0), (dh1, dw1) = member
    own = np.arange(V // WINDOW)[None] == (ids // WINDOW)[:, None]
    kept = ((off[1] > TAU) | own).mean()
    assert kept < 0.95, f"{name}: the filter keeps {kept:.0%} of the blocks: nothing to test"
    for what, got, exact, want in (("dh", dh1, dh0, dh_ref), ("dW", dw1, dw0, dw_ref)):
        e_exact, e_filter = rel_err(exact, want), rel_err(got, want)
        assert e_filter <= 1.5 * e_exact + 2e-5, f"{name} {what}: filter {e_filter:.3e}, exact {e_exact:.3e}"


def test_filter_bound_on_heavy_tails(member):
    name, h, w, ids, c, off, (dh_ref, _), (dh0, _), (dh1, _) = member
    if name not in workloads.HEAVY:
        pytest.skip("the bound is checked on the heavy-tailed members")
    own = np.arange(V // WINDOW)[None] == (ids // WINDOW)[:, None]
    dropped = ~((off[1] > TAU) | own)  # [R, n_w]
    wf = w.astype(f64).reshape(H, V // WINDOW, WINDOW)
    spread = np.linalg.norm(wf - wf.mean(2, keepdims=True), axis=0).max(1)  # max_(v in k) |W_v - mean_k(W)|
    tilted = filter_window_means(w, WINDOW, h.astype(f64).mean(0), None, TEMP)  # every row has a cotangent
    shift = np.linalg.norm(tilted - filter_window_means(w, WINDOW), axis=1)  # |m_k - mean_k(W)|
    per_block = np.minimum(*off) * spread[None] + off[0] * shift[None]
    bound = np.abs(c.astype(f64)) / TEMP * np.sum(np.where(dropped, per_block, 0.0), axis=1)
    moved = np.linalg.norm(dh1 - dh0, axis=1)
    slack = 4e-3 * np.linalg.norm(dh_ref, axis=1) + 1e-6  # bf16 rounding of the two dz
    assert np.all(moved <= bound + slack), f"{name}: {np.max(moved - bound - slack)}"
    assert dropped.any() and np.max(moved) > 0


def test_benchmark_driver_knows_every_member():
    """``benchmarks/run.py --data`` (which does not import JAX) lists the family's members, and each has a line."""
    from benchmarks import run

    assert run.CHOICES["data"] == workloads.DATA
    assert all(workloads.describe(m) for m in workloads.DATA)
    assert set(run.FAMILY_DATA) <= set(workloads.DATA) and set(workloads.HEAVY) <= set(run.FAMILY_DATA)
