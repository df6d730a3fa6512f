"""The gradient filter's error on the workload family, in float64 NumPy (CPU, ~1-3 min).

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.filter_error            # N 1024, H 128, V 65536
    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.filter_error --V 151936 --window 8192 --tail 65536

For each member (``benchmarks.workloads``, its ``-live`` batch: every row has a cotangent ``c_r ~ N(0, 1)``,
temperature 1) and threshold ``tau``: the kept fraction of the (row, window) blocks, and the relative L2 error of
the hidden-state and weight gradients against the float64 gradient of the same bf16 inputs, of

* ``exact``: every window, ``dz = c (onehot - p)`` rounded to bfloat16 as the kernels store it, with the
  rounding cancellation of the exact path (``backend.cancel_rounding``: ``dh -= (sum_v dz_v) W_id``);
* ``filter``: the gradient filter as it was: the windows whose mass off the target is ``<= tau`` dropped (the
  target's window kept; the windows from ``--tail`` on kept together), ``cancel_rounding`` of the kept entries'
  rounding only (``mosaic_gpu._dropped_mass``);
* ``+mean``: ``filter`` plus the dropped windows' hidden-gradient correction ``-c_r sum_k D_rk mean_k(W)``
  (``D_rk``: row ``r``'s dropped mass in window ``k``; ``mean_k(W)``: the window's mean weight column);
* ``+mean+dW``: also the weight gradient's: each dropped block ``(r, k)`` adds ``-c_r D_rk h_r / width_k`` to
  every column of window ``k``;
* ``+oracle``: the hidden correction with each window's columns weighted by the batch's mean softmax mass
  (not available to the kernels: how much a better window mean could gain).
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

MEMBERS = ("light", "peaked", "heavy", "heavy-shared", "unsure")
TAUS = (1e-4, 1e-3, 1e-2)
VARIANTS = ("exact", "filter", "+mean", "+mean+dW", "+oracle")


def _bf16(x):
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _windows(V: int, window: int, tail: int):
    """Column ranges of the windows, and the index of the first tail window (``n_head``)."""
    n_w = -(-V // window)
    return [(k * window, min((k + 1) * window, V)) for k in range(n_w)], min(tail // window, V // window)


def measure(h, w, ids, c, *, window: int, tail: int, taus=TAUS, chunk: int = 128):
    """``{(tau, variant): (hidden error, weight error)}`` and ``{tau: kept fraction}``; float64 throughout, ``h
    [N, H]`` and ``w [H, V]`` the bf16 values as float64."""
    N, H = h.shape
    V = w.shape[1]
    wins, n_head = _windows(V, window, tail)
    n_w = len(wins)
    widths = np.array([b - a for a, b in wins], np.float64)
    col_w = np.repeat(np.arange(n_w), widths.astype(int))  # window of each column
    means = np.stack([w[:, a:b].mean(1) for a, b in wins])  # [n_w, H]
    # the batch's mean softmax mass per column (the '+oracle' weighting): a first pass
    marg = np.zeros(V)
    for r0 in range(0, N, chunk):
        z = h[r0 : r0 + chunk] @ w
        p = np.exp(z - z.max(1, keepdims=True))
        marg += (p / p.sum(1, keepdims=True)).sum(0)
    wmeans = np.stack([(w[:, a:b] * marg[a:b]).sum(1) / marg[a:b].sum() for a, b in wins])
    keys = [(t, v) for t in taus for v in VARIANTS]
    dh = {k: np.zeros((N, H)) for k in keys}
    dw = {k: np.zeros((H, V)) for k in keys}
    dh_ref, dw_ref = np.zeros((N, H)), np.zeros((H, V))
    kept = dict.fromkeys(taus, 0.0)
    for r0 in range(0, N, chunk):
        hc, ic, cc = h[r0 : r0 + chunk], ids[r0 : r0 + chunk], c[r0 : r0 + chunk]
        R = hc.shape[0]
        z = hc @ w
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        onehot = np.zeros_like(p)
        onehot[np.arange(R), ic] = 1.0
        dz = cc[:, None] * (onehot - p)
        dh_ref[r0 : r0 + R] = dz @ w.T
        dw_ref += hc.T @ dz
        dzb = _bf16(dz)
        w_id = w[:, ic].T  # [R, H]
        exact = dzb @ w.T - dzb.sum(1)[:, None] * w_id, hc.T @ dzb
        off = np.add.reduceat(p * (1 - onehot), np.array([a for a, _ in wins]), axis=1)
        own = np.arange(n_w)[None] == (ic // window)[:, None]
        for tau in taus:
            live = (off > tau) | own
            if n_head < n_w:
                live[:, n_head:] = live[:, n_head:].any(1, keepdims=True)
            kept[tau] += live.sum()
            D = np.where(live, 0.0, off)  # dropped mass per (row, window)
            dzk = np.where(live[:, col_w], dzb, 0.0)
            base = dzk @ w.T - (dzk.sum(1) - cc * D.sum(1))[:, None] * w_id
            base_w = hc.T @ dzk
            corr = -cc[:, None] * (D @ means)
            corr_w = (hc.T @ (-cc[:, None] * D / widths[None]))[:, col_w]
            for v, (a, b) in {
                "exact": exact,
                "filter": (base, base_w),
                "+mean": (base + corr, base_w),
                "+mean+dW": (base + corr, base_w + corr_w),
                "+oracle": (base - cc[:, None] * (D @ wmeans), base_w),
            }.items():
                dh[(tau, v)][r0 : r0 + R] = a
                dw[(tau, v)] += b
    rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(y))  # noqa: E731
    errs = {k: (rel(dh[k], dh_ref), rel(dw[k], dw_ref)) for k in keys}
    return errs, {t: kept[t] / (N * n_w) for t in taus}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.filter_error", description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--H", type=int, default=128)
    p.add_argument("--V", type=int, default=65536)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--tail", type=int, default=1 << 30, help="first column of the tail (default: no tail)")
    p.add_argument("--members", default=",".join(MEMBERS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from benchmarks import workloads

    N = args.B * args.T
    print(f"N {N}, H {args.H}, V {args.V}, windows of {args.window} (tail from {min(args.tail, args.V)})")
    print(f"{'member':14s} {'tau':>7s} {'kept':>6s} " + " ".join(f"{v:>17s}" for v in VARIANTS))
    print(f"{'':14s} {'':7s} {'':6s} " + " ".join(f"{'dh %   dW %':>17s}" for _ in VARIANTS))
    for m in args.members.split(","):
        t0 = time.time()
        b = workloads.make_lm_head_batch(args.B, args.T, args.H, args.V, f"{m}-live", seed=args.seed)
        s = workloads.batch_stats(b)
        h = np.asarray(b.hidden, np.float64).reshape(N, args.H)
        w = np.asarray(b.weight, np.float64)
        ids = np.asarray(b.ids).reshape(N)
        c = np.random.default_rng(args.seed).normal(size=N)
        errs, kept = measure(h, w, ids, c, window=args.window, tail=args.tail)
        print(
            f"{m} (entropy {s['mean_entropy']}, tail {s['tail_mass']}, off_top16 {s['off_top16']}, "
            f"shared/logV {s['shared_over_logV']}; {time.time() - t0:.0f} s)"
        )
        for tau in TAUS:
            cells = " ".join(f"{100 * errs[(tau, v)][0]:8.4f} {100 * errs[(tau, v)][1]:8.4f}" for v in VARIANTS)
            print(f"{'':14s} {tau:7.0e} {100 * kept[tau]:5.1f}% {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
