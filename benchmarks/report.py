"""Turns benchmarks/results/*.jsonl into the performance tables of the docs, benchmarks/RESULTS.md and plots.

    python -m benchmarks.report                      # all devices found in benchmarks/results/
    python -m benchmarks.report --results a.jsonl --out /tmp/R.md --plot-dir /tmp --doc /tmp/performance.md

Every ``<!-- bench:NAME:start -->`` ... ``<!-- bench:NAME:end -->`` block (NAME in ``BLOCKS``) of the files
given by ``--doc`` (default: ``DOCS``, README.md and docs/performance.md) is regenerated from the H200 records:
README.md holds ``headline`` (the workload family's worst member beside the peers, no dates or commits: the
README has none), docs/performance.md the others (lm_head, sparsity, lm_head_flat, logits), each with date,
device, versions, commits and the command that reproduces it.

For every (implementation, variant, shape, B, T, mode) the latest record wins. RESULTS.md keeps whatever is
written outside the ``<!-- BEGIN GENERATED -->`` / ``<!-- END GENERATED -->`` markers (notes, test runs),
and replaces what is between them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import OrderedDict
from typing import Any

from benchmarks import _common

BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"
HERE = os.path.dirname(os.path.abspath(__file__))

LM_COLUMNS = [
    ("mosaic_gpu", None),
    ("xla_chunked", None),
    ("dense_jax", None),
    ("cce_gmpo", None),
    ("cce_gmpo", "filter_eps=None"),
    ("liger_grpo", None),
]
GRPO = "objective=grpo"  # the logits path with GRPO(loss_type="grpo"), Liger's objective (fused for us)
LOGITS_COLUMNS = [
    ("mosaic_gpu", None),
    ("mosaic_gpu", GRPO),
    ("xla", None),
    ("xla", GRPO),
    ("dense_jax", None),
    ("dense_jax", GRPO),
    ("liger_triton", None),
    ("liger_triton", GRPO),
    ("liger_triton", "inplace"),
    ("liger_triton", "inplace," + GRPO),
]
OURS_LM = ("mosaic_gpu", "xla_chunked")
OURS_LOGITS = ("mosaic_gpu", "xla")
MIB = 2.0**20 / _common.GIB  # one MiB in GiB


def load(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Records per device slug (file order kept)."""
    by_dev: dict[str, list[dict[str, Any]]] = OrderedDict()
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "layout" in r:  # multi-device runs (benchmarks.sharded_bench): tabulated by hand
                    continue
                if str(r.get("kind", "")).startswith("tunix_"):  # benchmarks.tunix_bench: its own --report
                    continue
                if r.get("kind") == "compile_probe":  # benchmarks.compile_probe: tabulated by hand
                    continue
                dev = r.get("device") or os.path.splitext(os.path.basename(p))[0]
                by_dev.setdefault(dev, []).append(r)
    return by_dev


RESULT_STATUSES = ("ok", "oom", "nonfinite")


def vkey(r: dict[str, Any]) -> str | None:
    """The variant as the tables key it: the workload joins the variant unless it is flat (records before
    2026-12-01 have no ``data`` and are flat), so the flat tables below never mix workloads."""
    data, var = r.get("data") or "flat", r.get("variant")
    if data == "flat":
        return var
    return ",".join(x for x in (f"data={data}", var) if x)


def latest(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per key, the latest record that is a result (ok / oom / nonfinite), else the latest failure."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == "floor":
            continue
        key = (r["implementation"], vkey(r), r["shape"], r["B"], r["T"], r["mode"])
        prev = out.get(key)
        rank = (r.get("status") in RESULT_STATUSES, str(r.get("date", "")))
        if prev is None or rank >= (prev.get("status") in RESULT_STATUSES, str(prev.get("date", ""))):
            out[key] = r
    return out


def newer_failures(records: list[dict[str, Any]], lat: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """Failures (error, timeout, crash) newer than the result shown for their key."""
    out = []
    for r in records:
        if r.get("kind") == "floor" or r.get("status") in RESULT_STATUSES:
            continue
        shown = lat.get((r["implementation"], vkey(r), r["shape"], r["B"], r["T"], r["mode"]))
        if shown is not r and shown is not None and str(r.get("date", "")) > str(shown.get("date", "")):
            out.append(r)
    return out


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def device_ms(r: dict[str, Any] | None) -> float | None:
    """Time per call as the device sees it: JAX's pipelined time (calls under 5 ms, back to back, one
    sync) when measured, else the median of blocking calls (JAX) or of CUDA-event-timed calls (torch)."""
    if not r or r.get("status") != "ok":
        return None
    return r.get("pipelined_ms") or r.get("median_ms")


def x_floor(r: dict[str, Any] | None) -> float | None:
    t = device_ms(r)
    return t / r["floor_ms"] if t and r.get("floor_ms") else None


def _cell(r: dict[str, Any] | None, with_peak: bool = True) -> str:
    if r is None:
        return ""
    st = r.get("status")
    if st == "oom":
        return "out of memory"
    if st != "ok":
        return str(st)
    s = f"{_ms(device_ms(r))} ms"
    if r.get("pipelined_ms"):
        s += f" [blocking {_ms(r.get('median_ms'))}]"
    if x_floor(r):
        s += f" ({x_floor(r):.2f}x)"
    peak = r.get("peak_gib")
    if with_peak and peak is not None:
        s += f", {peak:.2f} GiB"
    return s


def _configs(lat: dict[tuple, dict[str, Any]], kind: str) -> list[tuple[str, int, int]]:
    seen = sorted(
        {(r["shape"], r["B"], r["T"]) for r in lat.values() if r.get("kind") == kind},
        key=lambda x: (x[0], x[1] * x[2], -x[1]),
    )
    return seen


def lm_budget_gib(r: dict[str, Any], extra_gib: float) -> float | None:
    """inputs + returned gradients + one float32 copy of the weight + extra (issues 2 and 3)."""
    if r.get("inputs_gib") is None or r.get("weight_f32_gib") is None:
        return None
    return r["inputs_gib"] + (r.get("grads_gib") or 0.0) + r["weight_f32_gib"] + extra_gib


def logits_budget_gib(r: dict[str, Any]) -> float | None:
    """logits + dlogits + 64 MiB (issue 5)."""
    if r.get("logits_gib") is None:
        return None
    return 2 * r["logits_gib"] + 64 * MIB


def _ratio(a: dict | None, b: dict | None) -> float | None:
    ta, tb = device_ms(a), device_ms(b)
    return ta / tb if ta and tb else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def shape_tables(lat: dict[tuple, dict[str, Any]]) -> list[str]:
    out: list[str] = []
    lm = _configs(lat, "lm_head")
    for shape in sorted({c[0] for c in lm}):
        rows = [c for c in lm if c[0] == shape]
        any_r = next(r for r in lat.values() if r["shape"] == shape)
        out.append(f"### {shape} (H = {any_r['H']}, V = {any_r['V']}), forward + backward\n")
        cols = [c for c in LM_COLUMNS if any((c[0], c[1], *row, "fwd+bwd") in lat for row in rows)]
        if not cols:
            continue
        hdr = ["B x T (N)", "floor"] + [c[0] + (f" [{c[1]}]" if c[1] else "") for c in cols] + ["memory target"]
        out.append("| " + " | ".join(hdr) + " |")
        out.append("|" + "---|" * len(hdr))
        for _, B, T in rows:
            recs = [lat.get((c[0], c[1], shape, B, T, "fwd+bwd")) for c in cols]
            ref = next((r for r in recs if r and r.get("floor_ms")), None)
            floor = f"{_ms(ref['floor_ms'])} ms" if ref else "-"
            budget = next((lm_budget_gib(r, 0.5) for r in recs if r and lm_budget_gib(r, 0.5)), None)
            out.append(
                "| "
                + " | ".join(
                    [f"{B} x {T} ({B * T})", floor]
                    + [_cell(r) for r in recs]
                    + [f"{budget:.2f} GiB" if budget else "-"]
                )
                + " |"
            )
        out.append(
            "\nCells: time per call (x the floor), peak device memory of the process (inputs included). "
            "Time: median of CUDA-event-timed calls (PyTorch) or of blocking calls (JAX); for JAX calls "
            "under 5 ms, the pipelined time (calls back to back, one sync) with the blocking median beside. "
            "Floor = 6·N·H·V / the bf16 XLA matmul rate of [N, H] x [H, V] measured in the same run. "
            "Memory target = inputs + returned gradients + one f32 copy of the weight + 512 MiB.\n"
        )
        # forward only
        fcols = [c for c in LM_COLUMNS if any((c[0], c[1], *row, "fwd") in lat for row in rows)]
        if fcols:
            out.append(f"Forward only (loss, no gradient), {shape}:\n")
            ours = [o for o in OURS_LM if any((o, None, *row, "fwd") in lat for row in rows)]
            hdr = (
                ["B x T", "floor (2NHV)"]
                + [c[0] + (f" [{c[1]}]" if c[1] else "") for c in fcols]
                + [f"{o} fwd / fwd+bwd" for o in ours]
            )
            out.append("| " + " | ".join(hdr) + " |")
            out.append("|" + "---|" * len(hdr))
            for _, B, T in rows:
                recs = [lat.get((c[0], c[1], shape, B, T, "fwd")) for c in fcols]
                ref = next((r for r in recs if r and r.get("floor_ms")), None)
                fr = [
                    _x(_ratio(lat.get((o, None, shape, B, T, "fwd")), lat.get((o, None, shape, B, T, "fwd+bwd"))))
                    for o in ours
                ]
                out.append(
                    "| "
                    + " | ".join(
                        [f"{B} x {T}", f"{_ms(ref['floor_ms'])} ms" if ref else "-"]
                        + [_cell(r, with_peak=False) for r in recs]
                        + fr
                    )
                    + " |"
                )
            out.append("")
        # ratios
        peers = [c for c in cols if c[0] not in OURS_LM]
        ours = [c[0] for c in cols if c[0] in OURS_LM]
        if ours and peers:
            out.append(f"Ours against the others, forward + backward time ratios (lower is better), {shape}:\n")
            hdr = ["B x T", "impl", "x floor"] + [f"x {p[0]}" + (f" [{p[1]}]" if p[1] else "") for p in peers]
            out.append("| " + " | ".join(hdr) + " |")
            out.append("|" + "---|" * len(hdr))
            for _, B, T in rows:
                for o in ours:
                    mine = lat.get((o, None, shape, B, T, "fwd+bwd"))
                    if not mine:
                        continue
                    vals = [_x(x_floor(mine)) if mine.get("status") == "ok" else mine.get("status", "-")]
                    vals += [_x(_ratio(mine, lat.get((p[0], p[1], shape, B, T, "fwd+bwd")))) for p in peers]
                    out.append("| " + " | ".join([f"{B} x {T}", o] + vals) + " |")
            out.append("")

    lg = _configs(lat, "logits")
    for shape in sorted({c[0] for c in lg}):
        rows = [c for c in lg if c[0] == shape]
        any_r = next(r for r in lat.values() if r["shape"] == shape)
        for mode in ("fwd+bwd", "fwd"):
            cols = [c for c in LOGITS_COLUMNS if any((c[0], c[1], *row, mode) in lat for row in rows)]
            if not cols:
                continue
            title = "forward + backward" if mode == "fwd+bwd" else "forward only"
            out.append(f"### {shape} (logits [B, T+1, V], V = {any_r['V']}), {title}\n")
            hdr = (
                ["B x T", "logits", "floor"]
                + [c[0] + (f" [{c[1]}]" if c[1] else "") for c in cols]
                + (["memory target"] if mode == "fwd+bwd" else [])
            )
            out.append("| " + " | ".join(hdr) + " |")
            out.append("|" + "---|" * len(hdr))
            for _, B, T in rows:
                recs = [lat.get((c[0], c[1], shape, B, T, mode)) for c in cols]
                ref = next((r for r in recs if r and r.get("floor_ms")), None)
                lgib = next((r.get("logits_gib") for r in recs if r and r.get("logits_gib")), None)
                row = [f"{B} x {T}", f"{lgib:.2f} GiB" if lgib else "-", f"{_ms(ref['floor_ms'])} ms" if ref else "-"]
                row += [_cell(r, with_peak=(mode == "fwd+bwd")) for r in recs]
                if mode == "fwd+bwd":
                    budget = next((logits_budget_gib(r) for r in recs if r and logits_budget_gib(r)), None)
                    row.append(f"{budget:.2f} GiB" if budget else "-")
                out.append("| " + " | ".join(row) + " |")
            out.append("")
        out.append(
            "Floor = bytes of the logits (read once) + bytes of dlogits (written once, fwd+bwd only) over "
            "the device copy rate measured in the same run. Memory target = logits + dlogits + 64 MiB. "
            "Peaks are JAX's default (BFC) allocator's, which counts unsplit chunks whole: on the H200 "
            "(2026-11-30) an exact allocator measured logits + dlogits + 0.5 / 4.1 MiB at B = 2 / 16 "
            "(docs/performance.md).\n"
        )
    return out


# ----------------------------------------------------------------------------------------------------
# Loss features (run.py's "features" group): entropy_coef, softcap, logits_precision, float32 inputs

FEATURES_COMMAND = "bash benchmarks/gpu_suite.sh --only features"


def feature_settings(r: dict[str, Any]) -> tuple[str, str, str, float, float]:
    """``(implementation, input_dtype, logits_precision, entropy_coef, softcap)`` of an LM-head record
    (records before these options existed ran the defaults)."""
    return (
        r["implementation"],
        r.get("input_dtype") or "bfloat16",
        r.get("logits_precision") or "none",
        float(r.get("entropy_coef") or 0.0),
        float(r.get("softcap") or 0.0),
    )


def is_feature_key(key: tuple) -> bool:
    _, dtype, precision, coef, cap = key
    return dtype != "bfloat16" or precision != "none" or coef != 0 or cap != 0


def is_feature(r: dict[str, Any]) -> bool:
    """A record with a loss feature on (or float32 inputs): the Loss features table, not the others."""
    return r.get("kind") == "lm_head" and is_feature_key(feature_settings(r))


def _feature_rank(key: tuple) -> tuple:
    impl, dtype, precision, coef, cap = key  # plain, entropy, soft cap, precision rows, then the portable path
    return (impl != "mosaic_gpu", dtype != "bfloat16", precision != "none", precision == "bf16x3", cap != 0, coef != 0)


def _feature_label(key: tuple) -> str:
    _, dtype, precision, coef, cap = key
    parts = [f"entropy_coef={coef:g}" if coef else "", f"softcap={cap:g}" if cap else ""]
    parts.append(f"logits_precision={precision}" if precision != "none" else "")
    return ", ".join(p for p in parts if p) or (
        "plain" if dtype == "bfloat16" else "Precision.HIGHEST (no logits_precision)"
    )


def _err_pair(r: dict[str, Any] | None) -> str:
    if not r or r.get("grad_rel_err_hidden") is None:
        return "-"
    oracle = "f64" if "float64" in str(r.get("grad_oracle")) else "f32"
    return f"{r['grad_rel_err_hidden']:.2g} / {r['grad_rel_err_weight']:.2g} ({oracle})"


def _feature_command(tuning: str) -> str:
    """How a features table's records are made: the suite (its one-bucket tuning), or one job per row."""
    if json.loads(tuning) == {"ROW_BUCKETS": 1}:
        return f"`{FEATURES_COMMAND}`"
    return (
        "one job per cell, `python3 -m benchmarks.run --shape SHAPE --B B --T T --impl mosaic_gpu --mode fwd+bwd "
        "--data peaked --grad-acc true` plus the feature's flag (e.g. `--entropy-coef 0.01`); the plain row is "
        "the main table's record"
    )


def feature_tables(lat: dict[tuple, dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """One table per (workload, tuning) with loss-feature records: every feature row beside the plain bf16
    rows (the same implementations, workload and tuning), per configuration: time [x the plain row of
    ``mosaic_gpu``, else of the implementation there is], peak, and the gradient error against the oracle
    the record names. Returns the lines and the records shown."""
    recs = [r for r in lat.values() if r.get("kind") == "lm_head" and r["mode"] == "fwd+bwd"]
    tuning_of = lambda r: json.dumps(r.get("tuning"), sort_keys=True)  # noqa: E731
    groups: dict[tuple, list[dict[str, Any]]] = OrderedDict()
    for r in recs:
        if is_feature(r):
            groups.setdefault((r.get("data") or "flat", tuning_of(r)), []).append(r)
    out: list[str] = []
    shown: list[dict[str, Any]] = []
    for (data, tuning), feats in groups.items():
        impls = {r["implementation"] for r in feats}
        plain = [
            r
            for r in recs
            if r["implementation"] in impls
            and not is_feature(r)
            and (r.get("data") or "flat") == data
            and tuning_of(r) == tuning
        ]
        configs = sorted({(r["shape"], r["B"], r["T"]) for r in feats}, key=lambda c: (c[0] != Q, c[1] * c[2]))
        plain = [r for r in plain if (r["shape"], r["B"], r["T"]) in configs]  # the others stay in their tables
        shown += feats + plain
        cell = {(feature_settings(r), r["shape"], r["B"], r["T"]): r for r in feats + plain}
        keys = sorted({feature_settings(r) for r in feats + plain}, key=_feature_rank)
        tuned = ", ".join(f"{k}={v}" for k, v in (json.loads(tuning) or {}).items())
        out.append(f"### Loss features, forward + backward, {data} data{', ' + tuned if tuned else ''}\n")
        hdr = ["feature", "implementation", "inputs"]
        for shape, B, T in configs:
            hdr += [f"{HEADS.get(shape, shape)}, {B} x {T}", "grad error hidden / weight"]
        out.append("| " + " | ".join(hdr) + " |")
        out.append("|" + "---|" * len(hdr))
        for key in keys:
            line = [_feature_label(key), f"`{key[0]}`", key[1]]
            for shape, B, T in configs:
                r = cell.get((key, shape, B, T))
                base = next(
                    (cell[k, shape, B, T] for k in keys if not is_feature_key(k) and (k, shape, B, T) in cell), None
                )
                ratio = _ratio(r, base) if r is not base else None
                line += [_c(r) + (f" [{ratio:.2f}x plain]" if ratio else ""), _err_pair(r)]
            out.append("| " + " | ".join(line) + " |")
        out.append(
            "\nCells: time per call (x the floor) [x the plain row: bf16 inputs, no feature], peak device memory. "
            "Gradient error: relative L2 against the dense oracle the record names (f32: "
            "`gmpo_jax.reference.policy_loss`, float32 logits at HIGHEST; f64: float64 logits, for the float32 "
            "modes whose error is below the f32 oracle's own). float32 inputs: the bf16 batch with the mantissa "
            f"bits below bf16 filled (`benchmarks.jax_impls.as_float32`). Reproduce: {_feature_command(tuning)}.\n"
        )
    return out, shown


def other_variants(lat: dict[tuple, dict[str, Any]], shown: list[dict[str, Any]] = ()) -> list[str]:
    """Records outside the main tables (and not in ``shown``): sweeps (chunk_size, tuning constants) and
    other variants."""
    known = set(LM_COLUMNS) | set(LOGITS_COLUMNS)
    seen = {id(r) for r in shown}
    rest = [r for r in lat.values() if (r["implementation"], vkey(r)) not in known and id(r) not in seen]
    if not rest:
        return []
    out = [
        "### Sweeps and other variants\n",
        "| implementation | variant | shape | B x T | mode | median ms | x floor | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(
        rest, key=lambda r: (r["shape"], r["N"], r["B"], r["implementation"], r["mode"], str(r.get("variant")))
    ):
        ok = r.get("status") == "ok"
        out.append(
            f"| {r['implementation']} | {vkey(r) or ''} | {r['shape']} | {r['B']} x {r['T']} | "
            f"{r['mode']} | {_ms(device_ms(r)) if ok else r.get('status')} | "
            f"{_x(x_floor(r)) if ok else '-'} | "
            f"{'-' if r.get('peak_gib') is None else format(r['peak_gib'], '.2f')} |"
        )
    out.append("")
    return out


def _check(label: str, value: str, ok: bool | None) -> str:
    mark = "n/a" if ok is None else ("met" if ok else "MISSED")
    return f"| {label} | {value} | {mark} |"


def targets(lat: dict[tuple, dict[str, Any]]) -> list[str]:
    """The issues' numeric targets, checked against the latest records."""
    Q, L, G = "qwen2.5-0.5b", "llama3-8b", "logits-llama3"
    get = lambda impl, shape, B, T, mode="fwd+bwd", var=None: lat.get((impl, var, shape, B, T, mode))  # noqa: E731
    rows: list[str] = ["| target | measured | |", "|---|---|---|"]

    def ratio_check(label, mine, other, limit):
        r = _ratio(mine, other)
        if limit is None:  # information only
            rows.append(f"| {label} | {'-' if r is None else f'{r:.2f}x'} | info |")
            return
        rows.append(
            _check(label, "-" if r is None else f"{r:.2f}x (limit {limit:.3g}x)", None if r is None else r <= limit)
        )

    def floor_check(label, mine, limit):
        xf = x_floor(mine)
        rows.append(
            _check(
                label, "-" if xf is None else f"{xf:.2f}x floor (limit {limit}x)", None if xf is None else xf <= limit
            )
        )

    def peak_check(label, mine, budget):
        p = mine.get("peak_gib") if mine and mine.get("status") == "ok" else None
        rows.append(
            _check(
                label,
                "-" if p is None or budget is None else f"{p:.2f} GiB (limit {budget:.2f})",
                None if p is None or budget is None else p <= budget,
            )
        )

    # issue 2 (portable path)
    for B, T in ((16, 4096), (2, 32768)):
        r = get("xla_chunked", Q, B, T)
        rows.append(
            _check(
                f"#2 xla_chunked runs N=65536 ({B}x{T})",
                r.get("status", "-") if r else "-",
                None if r is None else r.get("status") == "ok",
            )
        )
        peak_check(
            f"#2 xla_chunked peak {B}x{T} <= in + grads + f32 W + 1 GiB", r, lm_budget_gib(r, 1.0) if r else None
        )
    ratio_check(
        "#2 xla_chunked 8x2048 <= 1.5x dense_jax", get("xla_chunked", Q, 8, 2048), get("dense_jax", Q, 8, 2048), 1.5
    )
    # issue 3 (kernels)
    m16 = get("mosaic_gpu", Q, 8, 2048)
    ratio_check("#3 mosaic_gpu 8x2048 <= 0.8x cce_gmpo", m16, get("cce_gmpo", Q, 8, 2048), 0.8)
    ratio_check("#3 mosaic_gpu 8x2048 <= 0.7x dense_jax", m16, get("dense_jax", Q, 8, 2048), 0.7)
    floor_check("#3 mosaic_gpu 8x2048 <= 1.3x floor", m16, 1.3)
    for B, T in ((16, 4096), (2, 32768)):
        ratio_check(
            f"#3 mosaic_gpu {B}x{T} <= 0.8x cce_gmpo", get("mosaic_gpu", Q, B, T), get("cce_gmpo", Q, B, T), 0.8
        )
    floor_check("#3 mosaic_gpu llama3-8b 4x2048 <= 1.3x floor", get("mosaic_gpu", L, 4, 2048), 1.3)
    for shape, B, T in ((Q, 1, 512), (Q, 8, 2048), (Q, 16, 4096), (Q, 2, 32768), (L, 4, 2048)):
        r = get("mosaic_gpu", shape, B, T)
        peak_check(
            f"#3 mosaic_gpu peak {shape} {B}x{T} <= in + grads + f32 W + 512 MiB",
            r,
            lm_budget_gib(r, 0.5) if r else None,
        )
    for shape, B, T in ((Q, 1, 512), (Q, 8, 2048), (Q, 16, 4096), (Q, 2, 32768), (L, 4, 2048)):
        ratio_check(
            f"#3 mosaic_gpu fwd <= 0.4x fwd+bwd, {shape} {B}x{T}",
            get("mosaic_gpu", shape, B, T, "fwd"),
            get("mosaic_gpu", shape, B, T),
            0.4,
        )
    # issue 5 (logits)
    for var, what in ((None, "GMPO"), (GRPO, "GRPO")):
        for B, T in ((2, 1024), (16, 1024)):
            r = get("mosaic_gpu", G, B, T, var=var)
            if var is not None and r is None:
                continue
            floor_check(f"#5 mosaic_gpu logits {what} {B}x{T} fwd+bwd <= 1.3x floor", r, 1.3)
            floor_check(
                f"#5 mosaic_gpu logits {what} {B}x{T} fwd <= 1.3x floor",
                get("mosaic_gpu", G, B, T, "fwd", var=var),
                1.3,
            )
            peak_check(
                f"#5 mosaic_gpu logits {what} {B}x{T} peak <= logits + dlogits + 64 MiB",
                r,
                logits_budget_gib(r) if r else None,
            )
            liger = get("liger_triton", G, B, T, var=var) or get("liger_triton", G, B, T)
            ratio_check(
                f"#5 mosaic_gpu logits {what} {B}x{T} time / liger_triton (GRPO)"
                + (" (>= 2.8x faster)" if B == 2 else ""),
                r,
                liger,
                1 / 2.8 if B == 2 else None,
            )
    return rows


def environment(records: list[dict[str, Any]]) -> list[str]:
    def values(key):
        return sorted({str(r[key]) for r in records if r.get(key) not in (None, "")})

    floors = [r for r in records if r.get("kind") == "floor" and r.get("status") == "ok"]
    last: dict[tuple, dict[str, Any]] = {}  # the latest measurement of each floor
    for r in floors:
        last[(r["implementation"], r["N"], r["H"], r["V"])] = r
    mm = [
        f"[{r.get('rows', r['N'])}, {r['H']}] x [{r['H']}, {r['V']}]: {r['tflops']} TFLOP/s"
        for k, r in sorted(last.items())
        if k[0] == "xla_matmul_bf16"
    ]
    mm = list(dict.fromkeys(mm))
    cp = [f"{r['gbps']} GB/s ({r.get('op')}, {r.get('copy_gib')} GiB)" for k, r in last.items() if k[0] == "xla_copy"]
    dates = values("date")
    lines = [
        f"- device: {', '.join(values('device_name')) or '-'}",
        f"- dates: {dates[0] if dates else '-'} .. {dates[-1] if dates else '-'}; commits: {', '.join(values('commit'))}",
        f"- jax {', '.join(values('jax'))} (jaxlib {', '.join(values('jaxlib'))}); torch {', '.join(values('torch')) or '-'}; "
        f"triton {', '.join(values('triton')) or '-'}; peers: "
        + ", ".join(
            f"{impl} {v}"
            for impl, v in sorted({(r["implementation"], r["peer_version"]) for r in records if r.get("peer_version")})
        ),
        f"- bf16 XLA matmul rate (f32 result) measured in the runs: {'; '.join(mm) or '-'}",
        f"- device copy rate (read + write): {'; '.join(cp) or '-'}",
    ]
    return lines


def plot(device: str, lat: dict[tuple, dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lm = [r for r in lat.values() if r.get("kind") == "lm_head" and r["mode"] == "fwd+bwd"]
    lg = [r for r in lat.values() if r.get("kind") == "logits" and r["mode"] == "fwd+bwd"]
    # the LM-head panel shows the most-populated lm_head shape (the Qwen head on the GPU)
    shapes = sorted({r["shape"] for r in lm}, key=lambda s: -len({(r["B"], r["T"]) for r in lm if r["shape"] == s}))
    panels = ([("lm_head", shapes[0], LM_COLUMNS)] if shapes else []) + (
        [("logits", lg[0]["shape"], LOGITS_COLUMNS)] if lg else []
    )
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.6 * len(panels)), squeeze=False)
    for row, (kind, shape, columns) in enumerate(panels):
        recs = [r for r in (lm if kind == "lm_head" else lg) if r["shape"] == shape]
        ax_t, ax_m = axes[row]
        for impl, var in columns:
            pts = sorted(
                (r["N"], r["B"], r)
                for r in recs
                if r["implementation"] == impl and vkey(r) == var and r.get("status") == "ok"
            )
            if not pts:
                continue
            label = impl + (f" [{var}]" if var else "")
            # one point per N: the configuration with the most sequences (e.g. 16x4096 over 2x32768)
            by_n: dict[int, dict] = {}
            for n, b, r in pts:
                if n not in by_n or b > by_n[n]["B"]:
                    by_n[n] = r
            xs = sorted(by_n)
            style = "-o" if impl in OURS_LM + OURS_LOGITS else "--s"
            ax_t.plot(xs, [device_ms(by_n[n]) for n in xs], style, label=label)
            pk = [(n, by_n[n].get("peak_gib")) for n in xs if by_n[n].get("peak_gib") is not None]
            if pk:
                ax_m.plot([p[0] for p in pk], [p[1] for p in pk], style, label=label)
            ooms = sorted(
                {r["N"] for r in recs if r["implementation"] == impl and vkey(r) == var and r.get("status") == "oom"}
            )
            for n in ooms:
                ax_t.annotate(
                    f"{label}: OOM", (n, ax_t.get_ylim()[1] if ax_t.lines else 1), fontsize=7, rotation=90, va="top"
                )
        floor_pts = sorted({(r["N"], r["floor_ms"]) for r in recs if r.get("floor_ms")})
        if floor_pts:
            ax_t.plot([p[0] for p in floor_pts], [p[1] for p in floor_pts], "k:", lw=2, label="floor")
        budget = sorted(
            {
                (r["N"], lm_budget_gib(r, 0.5) if kind == "lm_head" else logits_budget_gib(r))
                for r in recs
                if (lm_budget_gib(r, 0.5) if kind == "lm_head" else logits_budget_gib(r))
            }
        )
        if budget:
            ax_m.plot([b[0] for b in budget], [b[1] for b in budget], "k:", lw=2, label="memory target")
        what = "LM head + GMPO" if kind == "lm_head" else "loss from logits"
        for ax, ylabel in ((ax_t, "fwd+bwd time, ms (median)"), (ax_m, "peak device memory, GiB")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N = B x T tokens")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{device}: {shape}, {what}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(by_dev: dict[str, list[dict[str, Any]]], plot_dir: str, md_dir: str) -> str:
    out = [
        BEGIN,
        "",
        "_Generated by `python -m benchmarks.report` from `benchmarks/results/*.jsonl`; edit outside the markers._",
        "",
    ]
    measured_features = False
    for dev, records in by_dev.items():
        lat = latest(records)
        if not lat:
            continue
        out.append(f"## {dev}\n")
        out += environment(records)
        out.append("")
        png = os.path.join(plot_dir, f"{dev}.png")
        if plot(dev, lat, png):
            out.append(f"![{dev}]({os.path.relpath(png, md_dir)})\n")
        checks = targets(lat)
        if any(row.split(" | ")[1] != "-" for row in checks[2:]):
            out.append("### Targets (issues 2, 3, 5)\n")
            out += checks
            out.append("")
        out += shape_tables(lat)
        features, shown = feature_tables(lat)
        measured_features = measured_features or bool(features)
        out += features
        out += other_variants(lat, shown)
        bad = [r for r in lat.values() if r.get("status") not in ("ok", "oom")] + newer_failures(records, lat)
        if bad:
            out.append("Runs that did not produce a time:\n")
            for r in sorted(bad, key=lambda r: (r["shape"], r["N"], r["implementation"])):
                out.append(
                    f"- {r['implementation']}{' [' + r['variant'] + ']' if r.get('variant') else ''} "
                    f"{r['shape']} {r['B']}x{r['T']} {r['mode']}: {r.get('status')} "
                    f"{(r.get('error') or '')[:200]}"
                )
            out.append("")
    if not measured_features:
        out += [
            "## Loss features (entropy_coef, softcap, logits_precision, float32 inputs)\n",
            f"_Not measured yet. On an H200: `{FEATURES_COMMAND}`, append `$OUT/run.jsonl` to "
            "`benchmarks/results/nvidia-h200.jsonl`, then `python -m benchmarks.report` (benchmarks/README.md)._",
            "",
        ]
    out.append(END)
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------
# The docs' performance tables, between <!-- bench:NAME:start --> / <!-- bench:NAME:end --> markers

ROOT = os.path.dirname(HERE)
DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "performance.md")]
Q, L, G = "qwen2.5-0.5b", "llama3-8b", "logits-llama3"
HEADS = {Q: "Qwen2.5-0.5B head (896, 151936)", L: "Llama-3-8B head (4096, 128256)", G: "logits [B, T+1, 128256]"}
COMMANDS = {
    "lm_head": "bash benchmarks/gpu_suite.sh",
    "sparsity": "bash benchmarks/gpu_suite.sh",
    "lm_head_flat": "bash benchmarks/gpu_suite.sh --only kernels,core,peers",
    "logits": "bash benchmarks/gpu_suite.sh --only logits",
}


def _get(
    recs: list[dict[str, Any]], impl: str, shape: str, B: int, T: int, data: str = "flat", variant: str | None = None
) -> dict[str, Any] | None:
    """The latest fwd+bwd result (else failure) of one cell."""
    best = None
    for r in recs:
        if (
            r.get("kind") == "floor"
            or r["implementation"] != impl
            or r["shape"] != shape
            or r["B"] != B
            or r["T"] != T
            or r["mode"] != "fwd+bwd"
            or (r.get("data") or "flat") != data
            or r.get("variant") != variant
        ):
            continue
        rank = (r.get("status") in RESULT_STATUSES, str(r.get("date", "")))
        if best is None or rank >= (best.get("status") in RESULT_STATUSES, str(best.get("date", ""))):
            best = r
    return best


def _c(r: dict[str, Any] | None, with_peak: bool = True) -> str:
    return _cell(r, with_peak) if r else "-"


def _pct_pair(r: dict[str, Any] | None) -> str:
    if not r or r.get("grad_rel_err_hidden") is None:
        return "-"
    return f"{100 * r['grad_rel_err_hidden']:.2g} / {100 * r['grad_rel_err_weight']:.2g} %"


def _provenance(used: list[dict[str, Any]], command: str) -> str:
    used = [r for r in used if r]
    if not used:
        return (
            f"_Not measured yet. On an H200: `{command}`, append `$OUT/run.jsonl` to "
            "`benchmarks/results/nvidia-h200.jsonl`, then `python -m benchmarks.report` "
            "(benchmarks/README.md)._"
        )
    vals = lambda k: ", ".join(sorted({str(r[k]) for r in used if r.get(k)})) or "-"  # noqa: E731
    dates = sorted(str(r.get("date", ""))[:10] for r in used)
    peers = sorted({f"{r['implementation']} {r['peer_version']}" for r in used if r.get("peer_version")})
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} .. {dates[-1]}"
    return (
        f"_{vals('device_name')}, {span}, jax {vals('jax')}"
        + (f", torch {vals('torch')}" if peers else "")
        + (f", {', '.join(peers)}" if peers else "")
        + f"; commit(s) {vals('commit')}. "
        f"Reproduce: `{command}` (benchmarks/README.md)._"
    )


def _data_label(r: dict[str, Any] | None, data: str) -> str:
    if not r or r.get("mean_entropy") is None:
        return data
    return (
        f"{data} ({r['mean_entropy']:.1f} nats, {100 * r.get('masked_frac', 0):.0f} % masked, "
        f"{100 * r.get('zero_adv_frac', 0):.0f} % zero-adv.)"
    )


def block_lm_head(recs: list[dict[str, Any]]) -> str:
    from benchmarks.run import FILTER_LABEL, FILTER_ROW, REALISTIC_CONFIGS

    rows = [
        f"| workload | data | gmpo_jax `mosaic_gpu` | gmpo_jax `grad_filter={FILTER_ROW}` | CCE default "
        "| CCE `filter_eps=None` | floor 6NHV | grad error hidden / weight: ours; ours filtered; CCE; CCE exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    used = []
    for shape, B, T in REALISTIC_CONFIGS:
        for data in ("peaked", "flat"):
            ours = _get(recs, "mosaic_gpu", shape, B, T, data)
            filt = _get(recs, "mosaic_gpu", shape, B, T, data, FILTER_LABEL)
            cce = _get(recs, "cce_gmpo", shape, B, T, data)
            exact = _get(recs, "cce_gmpo", shape, B, T, data, "filter_eps=None")
            used += [ours, filt, cce, exact]
            floor = next((r["floor_ms"] for r in (ours, filt, cce, exact) if r and r.get("floor_ms")), None)
            rows.append(
                f"| {HEADS[shape]}, {B} x {T} | {_data_label(ours or cce, data)} | {_c(ours)} | {_c(filt)} | "
                f"{_c(cce)} | {_c(exact)} | {_ms(floor) + ' ms' if floor else '-'} | "
                f"{_pct_pair(ours)}; {_pct_pair(filt)}; {_pct_pair(cce)}; {_pct_pair(exact)} |"
            )
    rows += [
        "",
        "Cells: median ms (x the floor), peak device memory (inputs included). Floor: 6·N·H·V at the "
        "bf16 XLA matmul rate measured in the same run. Gradient error: relative L2 error against a "
        "float32 dense oracle on the same bf16 inputs (`grad_acc_N` in the records says on how many "
        f'tokens). The `grad_filter={FILTER_ROW}` column (`"auto"`) comes from `bash benchmarks/gpu_suite.sh '
        "--only filter`.",
        "",
        _provenance(used, COMMANDS["lm_head"]),
    ]
    return "\n".join(rows)


def block_sparsity(recs: list[dict[str, Any]]) -> str:
    from benchmarks.run import SPARSITY_CONFIGS

    rows = [
        "| path | batch | peaked: masked tokens, zero-advantage sequences | same batch, all live | ratio |",
        "|---|---|---|---|---|",
    ]
    used = []
    for shape, B, T in SPARSITY_CONFIGS:
        sparse = _get(recs, "mosaic_gpu", shape, B, T, "peaked")
        live = _get(recs, "mosaic_gpu", shape, B, T, "peaked-live")
        used += [sparse, live]
        ratio = _ratio(sparse, live)
        rows.append(
            f"| {'LM head + GMPO' if shape != G else 'loss from logits, GMPO'}, `mosaic_gpu` | "
            f"{HEADS[shape]}, {B} x {T} | {_data_label(sparse, 'peaked')}: {_c(sparse, False)} | "
            f"{_c(live, False)} | {_x(ratio)} |"
        )
    rows += ["", _provenance(used, COMMANDS["sparsity"])]
    return "\n".join(rows)


def block_lm_head_flat(recs: list[dict[str, Any]]) -> str:
    cols = [(Q, 8, 2048), (Q, 2, 32768), (L, 4, 2048)]
    impls = [
        ("mosaic_gpu", None, "gmpo_jax `mosaic_gpu`"),
        ("xla_chunked", None, "gmpo_jax `xla_chunked`"),
        ("dense_jax", None, "dense JAX (full logits, bf16)"),
        ("cce_gmpo", None, "Cut Cross-Entropy + GMPO"),
        ("liger_grpo", None, "Liger fused GRPO"),
    ]
    rows = [
        "| flat data, fwd + bwd | " + " | ".join(f"{HEADS[s]}, {B} x {T}" for s, B, T in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    used = []
    for impl, var, label in impls:
        cells = [_get(recs, impl, s, B, T, "flat", var) for s, B, T in cols]
        used += cells
        rows.append(f"| {label} | " + " | ".join(_c(c) for c in cells) + " |")
    floors = [
        next((r["floor_ms"] for r in used if r and (r["shape"], r["B"], r["T"]) == c and r.get("floor_ms")), None)
        for c in cols
    ]
    rows.append(
        "| floor: 6·N·H·V at the measured XLA matmul rate | "
        + " | ".join(f"{_ms(f)} ms" if f else "-" for f in floors)
        + " |"
    )
    rows += ["", _provenance(used, COMMANDS["lm_head_flat"])]
    return "\n".join(rows)


def block_logits(recs: list[dict[str, Any]]) -> str:
    cols = [(G, 2, 1024), (G, 16, 1024)]
    impls = [
        ("mosaic_gpu", GRPO, "gmpo_jax `mosaic_gpu`, GRPO"),
        ("mosaic_gpu", None, "gmpo_jax `mosaic_gpu`, GMPO"),
        ("xla", None, "gmpo_jax `xla`, GMPO"),
        ("liger_triton", GRPO, "Liger `triton_grpo_loss`, GRPO"),
        ("dense_jax", None, "naive JAX, GMPO"),
    ]
    rows = [
        "| flat data, fwd + bwd | " + " | ".join(f"{HEADS[s]}, {B} x {T}" for s, B, T in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    used = []
    for impl, var, label in impls:
        cells = [
            _get(recs, impl, s, B, T, "flat", var)
            or (_get(recs, impl, s, B, T, "flat") if impl == "liger_triton" else None)
            for s, B, T in cols
        ]
        used += cells
        rows.append(f"| {label} | " + " | ".join(_c(c) for c in cells) + " |")
    floors = [
        next((r["floor_ms"] for r in used if r and (r["B"], r["T"]) == c[1:] and r.get("floor_ms")), None) for c in cols
    ]
    rows.append(
        "| floor: read the logits + write their gradient at the measured copy rate | "
        + " | ".join(f"{_ms(f)} ms" if f else "-" for f in floors)
        + " |"
    )
    rows += [
        "",
        "JAX calls under 5 ms: pipelined time (calls back to back, one sync), the blocking median in "
        "brackets; Liger: CUDA events.",
        "",
        _provenance(used, COMMANDS["logits"]),
    ]
    return "\n".join(rows)


def _ms_err(r: dict[str, Any] | None) -> str:
    """``ms (hidden / weight gradient error)`` of one record, ``-`` when missing."""
    if not r:
        return "-"
    if device_ms(r) is None:
        return _cell(r)
    err = _pct_pair(r)
    return f"{_ms(device_ms(r))} ms" + (f" ({err})" if err != "-" else "")


def block_headline(recs: list[dict[str, Any]]) -> str:
    """The README's one table: per family shape the member where the default (``grad_filter="auto"``) is
    slowest against CCE's default (with the family's range of that ratio), the realistic long-sequence shape,
    and flat data with every peer; the exact path (``grad_filter=None``) beside it. No dates or commits
    (docs/performance.md has them)."""
    from benchmarks.run import FAMILY_CONFIGS, FAMILY_DATA, FILTER_LABEL, REALISTIC_CONFIGS

    rows = [
        '| workload: GMPO loss + hidden and weight gradients, bf16 | gmpo_jax default (`grad_filter="auto"`) '
        "| gmpo_jax exact (`grad_filter=None`) | Cut Cross-Entropy (default) | default / CCE | Liger fused GRPO |",
        "|---|---|---|---|---|---|",
    ]

    def cells(shape, B, T, data):
        ours = _get(recs, "mosaic_gpu", shape, B, T, data, FILTER_LABEL)
        return ours, _get(recs, "mosaic_gpu", shape, B, T, data), _get(recs, "cce_gmpo", shape, B, T, data)

    def row(label, shape, B, T, data, ratio_note="", liger=None):
        ours, exact, cce = cells(shape, B, T, data)
        rows.append(
            f"| {label} | {_ms_err(ours)} | {_ms_err(exact)} | {_ms_err(cce)} | {_x(_ratio(ours, cce))}{ratio_note} "
            f"| {_ms_err(liger)} |"
        )

    for shape, B, T in FAMILY_CONFIGS:
        ratios = {d: x for d in FAMILY_DATA if (x := _ratio(*cells(shape, B, T, d)[::2]))}
        if not ratios:
            rows.append(f"| {HEADS[shape]}, {B} x {T}, workload family | not measured | | | | |")
            continue
        worst = max(ratios, key=ratios.__getitem__)
        errs = [
            r["grad_rel_err_hidden"]
            for d in ratios
            if (r := _get(recs, "cce_gmpo", shape, B, T, d)) and r.get("grad_rel_err_hidden") is not None
        ]
        note = f" (family: {min(ratios.values()):.2f}-{max(ratios.values()):.2f}x"
        note += f"; CCE's hidden gradient up to {100 * max(errs):.2g} % off)" if errs else ")"
        label = f"{HEADS[shape]}, {B} x {T}: `{worst}`, worst of {len(ratios)} members"
        row(label, shape, B, T, worst, note)
    for shape, B, T in REALISTIC_CONFIGS:
        if (shape, B, T) not in FAMILY_CONFIGS:
            row(f"{HEADS[shape]}, {B} x {T}: `peaked` (GRPO-like)", shape, B, T, "peaked")
    shape, B, T = REALISTIC_CONFIGS[0]
    liger = _get(recs, "liger_grpo", shape, B, T, "flat")
    row(f"{HEADS[shape]}, {B} x {T}: `flat` N(0, 1) data, the only one Liger ran", shape, B, T, "flat", liger=liger)
    rows += [
        "",
        "Median ms on one H200 (in brackets the hidden / weight-gradient relative L2 error against a float32 "
        "dense oracle on the same inputs). Members: `benchmarks/workloads.py`; every other table, the dates, "
        "commits and commands: [docs/performance.md](docs/performance.md).",
    ]
    return "\n".join(rows)


BLOCKS = {
    "headline": block_headline,
    "lm_head": block_lm_head,
    "sparsity": block_sparsity,
    "lm_head_flat": block_lm_head_flat,
    "logits": block_logits,
}


def update_markers(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """Replaces what is between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``; returns the
    new text and the names found."""
    found = []
    for name, body in blocks.items():
        start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            text = head + start + "\n" + body + "\n" + end + rest.split(end, 1)[1]
            found.append(name)
    return text, found


def update_doc(path: str, by_dev: dict[str, list[dict[str, Any]]], device: str = "nvidia-h200") -> list[str]:
    """Regenerates the bench blocks found in the file ``path`` from ``device``'s records; returns their names."""
    recs = by_dev.get(device, [])
    blocks = {name: fn(recs) for name, fn in BLOCKS.items()}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text, found = update_markers(text, blocks)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return found


update_readme = (
    update_doc  # the name before the tables moved to docs/performance.md (tests/integration/test_benchmarks.py)
)


TEMPLATE_HEAD = """# Benchmarks

How these numbers are made: `benchmarks/run.py` (one process per implementation and configuration,
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, bf16 random inputs, warm-up, median and min of >= 10 timed calls,
peak device memory of the process with the inputs), the floors measured in the same run, the PyTorch
peers run beside ours from carried wheels. Raw records: `benchmarks/results/<device>.jsonl` (one JSON
object per line). Re-run on the GPU with `bash benchmarks/gpu_suite.sh`, then `python -m benchmarks.report`.

"""


def write_markdown(path: str, generated: str) -> None:
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    if old and BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + generated + tail
    else:
        text = (
            TEMPLATE_HEAD + generated + "\n\n## Notes\n\n(Hand-written analysis goes here: where a target is "
            "missed, by how much and why, from measurement; GPU test runs with command and pass count.)\n"
        )
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    p.add_argument("--results", action="append", help="JSONL file(s) (default benchmarks/results/*.jsonl)")
    p.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--plot-dir", default=os.path.join(HERE, "results"))
    p.add_argument(
        "--doc",
        "--readme",
        dest="docs",
        action="append",
        default=None,
        help="file whose <!-- bench:NAME:start/end --> blocks are regenerated, repeatable (default: README.md "
        "and docs/performance.md, unless --results is given; '' skips)",
    )
    p.add_argument("--device", default="nvidia-h200", help="device slug of the docs' tables")
    args = p.parse_args(argv)
    if args.docs is None:  # tables from other records never overwrite the docs by accident
        args.docs = [] if args.results else DOCS
    paths = args.results or sorted(glob.glob(os.path.join(HERE, "results", "*.jsonl")))
    by_dev = load(paths)
    os.makedirs(args.plot_dir, exist_ok=True)
    generated = render(by_dev, args.plot_dir, os.path.dirname(os.path.abspath(args.out)))
    write_markdown(args.out, generated)
    print(f"wrote {args.out} ({len(by_dev)} device(s): {', '.join(by_dev) or 'none'})")
    for doc in filter(None, args.docs):
        found = update_doc(doc, by_dev, args.device)
        print(f"updated {doc}: {', '.join(found) or 'no bench markers found'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
