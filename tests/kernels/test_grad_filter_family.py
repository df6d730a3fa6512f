"""The gradient filter on the workload family (``benchmarks.workloads``): its error stays at the exact path's.

The ``-live`` batches of the members (every row with a cotangent ``c ~ N(0, 1)``, temperature 0.9) at a small
shape (42 rows, H 64, V 1024, ``tau = 3e-3``), the filter's kernels in the Pallas interpreter
(``MosaicGpuBackend(interpret=True)``, windows of one 128-column tile). Three members run, all in one interpreter
run (``filtered``): the heavy-tailed ones with a shared weight direction, where the filter's error was largest
(``benchmarks/filter_error.py`` measures every member at larger shapes in float64), ``heavy-rough`` (its tail
uneven inside every window) the hardest: there thresholding the mass instead of the score at the same ``tau`` gave
2.1x the exact path's hidden-gradient error at this shape (float64 model; the score 1.1x). Against the float64
gradient of the same bf16 inputs:

* the rule (issue 32): the filtered hidden- and weight-gradient relative L2 errors within 1.5x of the exact
  path's own (plus 2e-5 for float32 rounding) on every member, with the filter dropping blocks (so a filter that
  drops nothing cannot pass); on the heavy-tailed members with a shared weight direction the filter without the
  dropped windows' correction was 13-17x the exact path's hidden error at this shape;
* the bound of ``HeadOptions``' ``grad_filter`` docstring, per row, on the heavy-tailed members:
  ``|dh_r(filter) - dh_r(exact)| <= |c_r| sum_k min(D_rk, s_rk) max_(v in k) |W_v - mean_k(W)| / temperature`` plus
  the bf16 rounding of ``dz`` (``D_rk`` the row's dropped mass in window ``k``, ``s_rk`` its score, which the filter
  keeps ``<= tau``; float64 here, ``conftest.filter_window_stats``).

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
from conftest import filter_window_stats, rel_err

from gmpo_jax.lm_head.backend import with_settings
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # benchmarks/
from benchmarks import workloads  # noqa: E402

B, T, H, V, WINDOW = 1, 42, 64, 1024, 128  # 42 rows: three members in one 128-row block; 8 one-tile windows
TAU, TEMP = 3e-3, 0.9
f64 = np.float64


MEMBERS = ("heavy-shared", "heavy-rough", "unsure")


@functools.cache
def _batch(name):
    """The member's ``(h [R, H], w [H, V], ids [R], c [R])``, numpy."""
    b = workloads.make_lm_head_batch(B, T, H, V, f"{name}-live", seed=0)
    h = np.asarray(b.hidden).reshape(B * T, H)
    c = np.random.default_rng(1).normal(size=B * T).astype(np.float32)
    return h, np.asarray(b.weight), np.asarray(b.ids).reshape(B * T), c


@pytest.fixture(scope="module")
def filtered():
    """Every member's filtered ``(dh, dW)`` from one interpreter run: member ``k``'s rows hold its hidden states in
    columns ``[k H, (k + 1) H)`` of a wider hidden state (zeros elsewhere) and the weights are stacked along ``H``,
    so that each row's logits, window masses, kept windows and ``dz`` are its member's own (the other members'
    columns add exact zeros), as are its ``dh`` (its own columns) and each member's ``dW`` rows; the three members' 126
    rows fill one 128-row block: the interpreter's time of one member. (Against separate runs: ``dh`` bitwise, ``dW`` to one bfloat16 rounding of an entry.)"""
    R, n = B * T, len(MEMBERS)
    hs, ws, ids, cs = zip(*(_batch(m) for m in MEMBERS))
    h = np.zeros((n * R, n * H), hs[0].dtype)
    for k, x in enumerate(hs):
        h[k * R : (k + 1) * R, k * H : (k + 1) * H] = x
    dh, dw = _f64(_filtered_grads, h, np.concatenate(ws, axis=0), np.concatenate(ids), np.concatenate(cs))
    return {m: (dh[k * R : (k + 1) * R, k * H : (k + 1) * H], dw[k * H : (k + 1) * H]) for k, m in enumerate(MEMBERS)}


@pytest.fixture(scope="module", params=MEMBERS)
def member(request, filtered):
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
    return request.param, h, w, ids, c, off, ref, _f64(_exact_grads, h, w, ids, c), filtered[request.param]


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
    D = np.where((off[1] > TAU) | own, 0.0, np.minimum(*off))  # [R, n_w]: min(D, s) of the dropped blocks
    wf = w.astype(f64).reshape(H, V // WINDOW, WINDOW)
    spread = np.linalg.norm(wf - wf.mean(2, keepdims=True), axis=0).max(1)  # max_(v in k) |W_v - mean_k(W)|
    bound = np.abs(c.astype(f64)) / TEMP * (D @ spread)
    moved = np.linalg.norm(dh1 - dh0, axis=1)
    slack = 4e-3 * np.linalg.norm(dh_ref, axis=1) + 1e-6  # bf16 rounding of the two dz
    assert np.all(moved <= bound + slack), f"{name}: {np.max(moved - bound - slack)}"
    assert D.sum() > 0 and np.max(moved) > 0


def test_benchmark_driver_knows_every_member():
    """``benchmarks/run.py --data`` (which does not import JAX) lists the family's members, and each has a line."""
    from benchmarks import run

    assert run.CHOICES["data"] == workloads.DATA
    assert all(workloads.describe(m) for m in workloads.DATA)
    assert set(run.FAMILY_DATA) <= set(workloads.DATA) and set(workloads.HEAVY) <= set(run.FAMILY_DATA)
