"""The gradient filter's error on the workload family, in float64 NumPy (CPU, ~10 min).

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.filter_error            # N 1024, H 128, V 65536
    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.filter_error --H 896 --V 151936 --window 8192 --tail 65536

For each member (``benchmarks.workloads``, its ``-live`` batch: every row has a cotangent ``c_r ~ N(0, 1)``,
temperature 1) and rule: the kept fraction of the (row, window) blocks, and the relative L2 error of the
hidden-state and weight gradients against the float64 gradient of the same bf16 inputs, of

* ``exact``: every window, ``dz = c (onehot - p)`` rounded to bfloat16 as the kernels store it, with the
  rounding cancellation of the exact path (``backend.cancel_rounding``: ``dh -= (sum_v dz_v) W_id``);
* ``mass tau`` (``--mass-taus``): the windows whose mass off the target ``D`` is ``<= tau`` dropped (the rule
  before the score);
* ``score tau`` (``--score-taus``): the windows whose score ``s = D sqrt(2 ln(n / n_eff))`` is ``<= tau`` dropped
  (``n`` the window's columns, ``n_eff = D / p_max``);

each with the dropped windows' hidden-gradient correction ``-c_r sum_k D_rk m_k`` (``D_rk``: row ``r``'s dropped mass
in window ``k``) of each ``--corrections``: ``even`` (``m_k`` the window's mean weight column), ``tilted`` (its
columns weighted by ``softmax(h_mean W)`` over the window, ``h_mean`` the rows' mean hidden state: what
``mosaic_gpu`` does), ``none``.

Every rule keeps the target's window, keeps the windows from ``--tail`` on together (all where any one is) and
cancels the kept entries' rounding only (``mosaic_gpu.grad_filter._dropped_mass``).
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

MEMBERS = ("light", "peaked", "heavy", "heavy-shared", "unsure")


def _bf16(x):
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _windows(V: int, window: int, tail: int):
    """Column ranges of the windows, and the index of the first tail window (``n_head``)."""
    n_w = -(-V // window)
    return [(k * window, min((k + 1) * window, V)) for k in range(n_w)], min(tail // window, V // window)


def window_means(w, wins, h_mean=None):
    """``[n_windows, H]``: each window's mean weight column, evenly or (``h_mean``) weighted by
    ``softmax(h_mean W)`` over the window's columns."""
    if h_mean is None:
        return np.stack([w[:, a:b].mean(1) for a, b in wins])
    z = h_mean @ w
    out = []
    for a, b in wins:
        pi = np.exp(z[a:b] - z[a:b].max())
        out.append((w[:, a:b] * pi).sum(1) / pi.sum())
    return np.stack(out)


def measure(h, w, ids, c, rules, *, window: int, tail: int, chunk: int = 128):
    """``{rule: (hidden error, weight error, kept fraction)}`` and the exact path's ``(hidden, weight)`` errors;
    ``rules``: ``(kind, tau, correction)`` triples, ``kind`` ``"mass"`` or ``"score"``, ``correction`` ``"even"``,
    ``"tilted"`` or ``"none"``. Float64 throughout, ``h [N, H]`` and ``w [H, V]`` the bf16 values as float64."""
    N, H = h.shape
    V = w.shape[1]
    wins, n_head = _windows(V, window, tail)
    n_w = len(wins)
    starts = np.array([a for a, _ in wins])
    widths = np.array([b - a for a, b in wins], np.float64)
    col_w = np.repeat(np.arange(n_w), widths.astype(int))  # window of each column
    means = {"even": window_means(w, wins), "tilted": window_means(w, wins, h.mean(0)), "none": 0.0 * w[:, :n_w].T}
    dh = {r: np.zeros((N, H)) for r in rules}
    dw = {r: np.zeros((H, V)) for r in rules}
    kept = dict.fromkeys(rules, 0.0)
    dh_ref, dw_ref, dh_ex, dw_ex = np.zeros((N, H)), np.zeros((H, V)), np.zeros((N, H)), np.zeros((H, V))
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
        dh_ex[r0 : r0 + R] = dzb @ w.T - dzb.sum(1)[:, None] * w_id
        dw_ex += hc.T @ dzb
        off = np.add.reduceat(p * (1 - onehot), starts, axis=1)  # D
        n_eff = np.add.reduceat(p, starts, axis=1) / np.maximum(np.maximum.reduceat(p, starts, axis=1), 1e-300)
        score = off * np.sqrt(2.0 * np.log(np.maximum(widths[None] / np.maximum(n_eff, 1.0), 1.0)))
        own = np.arange(n_w)[None] == (ic // window)[:, None]
        for rule in rules:
            kind, tau, correction = rule
            live = ((off if kind == "mass" else score) > tau) | own
            if n_head < n_w:
                live[:, n_head:] = live[:, n_head:].any(1, keepdims=True)
            kept[rule] += live.sum()
            D = np.where(live, 0.0, off)  # dropped mass per (row, window)
            dzk = np.where(live[:, col_w], dzb, 0.0)
            dh[rule][r0 : r0 + R] = dzk @ w.T - (dzk.sum(1) - cc * D.sum(1))[:, None] * w_id
            dh[rule][r0 : r0 + R] -= cc[:, None] * (D @ means[correction])
            dw[rule] += hc.T @ dzk
    rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(y))  # noqa: E731
    out = {r: (rel(dh[r], dh_ref), rel(dw[r], dw_ref), kept[r] / (N * n_w)) for r in rules}
    return out, (rel(dh_ex, dh_ref), rel(dw_ex, dw_ref))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.filter_error", description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--H", type=int, default=128)
    p.add_argument("--V", type=int, default=65536)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--tail", type=int, default=1 << 30, help="first column of the tail (default: no tail)")
    p.add_argument("--members", default=",".join(MEMBERS))
    p.add_argument("--mass-taus", default="1e-3,1e-2", help="thresholds of the mass rule (empty: none)")
    p.add_argument("--score-taus", default="3e-3,7e-3,1e-2,2e-2", help="thresholds of the score rule")
    p.add_argument("--corrections", default="tilted", help="even, tilted and / or none, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from benchmarks import workloads

    taus = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    corr = args.corrections.split(",")
    rules = [(k, t, c) for k in ("mass", "score") for t in taus(getattr(args, f"{k}_taus")) for c in corr]
    N = args.B * args.T
    print(
        f"N {N}, H {args.H}, V {args.V}, windows of {args.window} (tail from {min(args.tail, args.V)}), seed {args.seed}"
    )
    print("relative L2 error %, hidden / weight gradient (x the exact path's); kept: (row, window) blocks")
    for m in args.members.split(","):
        t0 = time.time()
        b = workloads.make_lm_head_batch(args.B, args.T, args.H, args.V, f"{m}-live", seed=args.seed)
        s = workloads.batch_stats(b)
        h = np.asarray(b.hidden, np.float64).reshape(N, args.H)
        w = np.asarray(b.weight, np.float64)
        ids = np.asarray(b.ids).reshape(N)
        c = np.random.default_rng(args.seed).normal(size=N)
        out, (eh, ew) = measure(h, w, ids, c, rules, window=args.window, tail=args.tail)
        print(
            f"{m} (entropy {s['mean_entropy']}, tail {s['tail_mass']}, off_top16 {s['off_top16']}, "
            f"shared/logV {s['shared_over_logV']}; {time.time() - t0:.0f} s): exact {100 * eh:.4f} / {100 * ew:.4f}"
        )
        for (kind, tau, correction), (a, b_, k) in out.items():
            name = f"{kind} {tau:.0e} {correction}"
            print(
                f"  {name:24s} kept {100 * k:5.1f} %  {100 * a:.4f} ({a / eh:.2f}x) / {100 * b_:.4f} ({b_ / ew:.2f}x)"
            )
        print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
