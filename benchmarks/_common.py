"""Framework-free helpers shared by the JAX and PyTorch benchmark workers and the driver.

Nothing here imports jax or torch: the driver process must not initialise a GPU runtime (it would hold
device memory beside the measured child processes).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

GIB = float(2**30)
RESULT_PREFIX = "@@RESULT "  # a worker's stdout line carrying one JSON record
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 4)


def device_slug(kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'; 'cpu' -> 'cpu'. Used as the results file name."""
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def git_commit() -> str:
    """Short commit of the checkout: --commit / $GMPO_BENCH_COMMIT, else git, else 'unknown'."""
    env = os.environ.get("GMPO_BENCH_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def cache_path(B: int, T: int, H: int, V: int, data: str, seed: int) -> str:
    """Where a workload's LM-head batch is kept for the PyTorch worker ($GMPO_BENCH_DATA, default /tmp)."""
    root = os.environ.get("GMPO_BENCH_DATA", "/tmp/gmpo_bench_data")
    return os.path.join(root, f"lm_head_{data}_s{seed}_{B}x{T}_{H}x{V}.npz")


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def timing_stats(times_s: list[float]) -> dict[str, Any]:
    ms = [t * 1e3 for t in times_s]
    return {
        "median_ms": round(statistics.median(ms), 4),
        "min_ms": round(min(ms), 4),
        "max_ms": round(max(ms), 4),
        "n_runs": len(ms),
    }


def n_iters(first_s: float, min_iters: int, min_time_s: float, max_iters: int = 200) -> int:
    """At least ``min_iters`` timed runs, more for fast calls so the timed total reaches ``min_time_s``."""
    if first_s <= 0:
        return max_iters
    return max(min_iters, min(max_iters, int(min_time_s / first_s) + 1))


def throughput(cfg, mode: str, median_ms: float) -> dict[str, float]:
    """The achieved rate of a timed call: TFLOP/s of the LM-head model flops, or GB/s of the floor bytes."""
    seconds = median_ms * 1e-3
    if cfg.kind == "lm_head":
        return {"tflops": round(cfg.model_flops(mode) / seconds / 1e12, 2)}
    return {"gbps": round(cfg.floor_bytes(mode) / seconds / 1e9, 1)}


def classify_error(exc: BaseException) -> str:
    """'oom' for allocation failures (XLA RESOURCE_EXHAUSTED, CUDA OOM), 'unsupported' for a backend's
    typed refusal (UnsupportedConfigError is a NotImplementedError), else 'error'."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if "resource_exhausted" in low or "out of memory" in low or "outofmemory" in low:
        return "oom"
    if isinstance(exc, NotImplementedError):
        return "unsupported"
    return "error"


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def emit(record: dict[str, Any]) -> None:
    """Worker side: one record on stdout, parsed by the driver."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(record, sort_keys=False) + "\n")
    sys.stdout.flush()


def parse_records(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                out.append(json.loads(line[len(RESULT_PREFIX) :]))
            except json.JSONDecodeError:
                pass
    return out


def append_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    if not records:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def base_record(cfg, implementation: str, mode: str, **extra: Any) -> dict[str, Any]:
    """The keys every result line carries (issue 2's list first), in a stable order."""
    rec: dict[str, Any] = {
        "implementation": implementation,
        "shape": cfg.shape,
        "B": cfg.B,
        "T": cfg.T,
        "H": cfg.H,
        "V": cfg.V,
        "mode": mode,
        "median_ms": None,
        "min_ms": None,
        "peak_gib": None,
        "floor_ms": None,
        "device": None,
        "jax": pkg_version("jax"),
        "date": now_utc(),
        "commit": git_commit(),
        "status": None,
        "N": cfg.N,
        "kind": cfg.kind,
        "variant": None,
    }
    rec.update(extra)
    return rec


def fill_floor(rec: dict[str, Any], floors: dict[str, Any]) -> None:
    """Adds floor_ms / x_floor / the rates used, from a floor worker's output (keyed by N,H,V and 'copy')."""
    mode = rec.get("mode")
    if rec.get("kind") == "logits":
        copy = floors.get("copy_gbps")
        if copy:
            nbytes = (2 if mode == "fwd+bwd" else 1) * rec["B"] * (rec["T"] + 1) * rec["V"] * 2
            rec["floor_ms"] = round(nbytes / (copy * 1e9) * 1e3, 4)
            rec["floor_copy_gbps"] = copy
    else:
        rate = floors.get("matmul_tflops", {}).get(f"{rec['N']},{rec['H']},{rec['V']}")
        if rate:
            flops = (6.0 if mode == "fwd+bwd" else 2.0) * rec["N"] * rec["H"] * rec["V"]
            rec["floor_ms"] = round(flops / (rate * 1e12) * 1e3, 4)
            rec["floor_matmul_tflops"] = rate
    if rec.get("floor_ms") and rec.get("median_ms"):
        rec["x_floor"] = round(rec["median_ms"] / rec["floor_ms"], 3)
        if rec.get("pipelined_ms"):
            rec["x_floor_pipelined"] = round(rec["pipelined_ms"] / rec["floor_ms"], 3)


def child_env() -> dict[str, str]:
    """The environment of a measured worker process: no preallocation (peaks are the job's own), the
    checkout importable, unbuffered output."""
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        paths.append(REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def add_worker_args(parser) -> None:
    """The flags of a benchmark driver's worker protocol: ``--commit`` (recorded), and the hidden ``--child`` /
    ``--opts`` (JSON) with which :func:`run_child` starts a worker."""
    parser.add_argument("--commit", help="commit to record (default: $GMPO_BENCH_COMMIT, git, or 'unknown')")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--opts", help=argparse.SUPPRESS)


def worker_main(args, execute) -> bool:
    """Applies ``--commit`` (to this process and its workers); in a worker (``--child``) runs
    ``execute(job, opts)`` and returns True (the driver then exits), else returns False."""
    if args.commit:
        os.environ["GMPO_BENCH_COMMIT"] = args.commit
    if not args.child:
        return False
    execute(json.loads(args.child), json.loads(args.opts))
    return True


def run_child(
    module: str, job: dict[str, Any], opts: dict[str, Any], label: str, timeout_s: float, log
) -> tuple[list[dict[str, Any]], str, float]:
    """Runs ``job`` in a worker (``python -m module --child job --opts opts``, :func:`worker_main`) in a fresh
    process group (killed whole at the timeout); returns its records (``emit`` lines), ``'ok' | 'timeout' |
    'crash (rc=..)'`` and the seconds it took. ``log``: an open file for the worker's output, or None."""
    cmd = [sys.executable, "-m", module, "--child", json.dumps(job), "--opts", json.dumps(opts)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    status = "ok"
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        status = "timeout"
    seconds = time.perf_counter() - t0
    if status == "ok" and proc.returncode != 0:
        status = f"crash (rc={proc.returncode})"
    if log is not None:
        log.write(f"\n=== {label} :: {status} in {seconds:.1f}s\n")
        noise = [ln for ln in out.splitlines() if not ln.startswith(RESULT_PREFIX)]
        if noise:
            log.write("--- stdout\n" + "\n".join(noise[-200:]) + "\n")
        if err.strip():
            log.write("--- stderr (last 150 lines)\n" + "\n".join(err.splitlines()[-150:]) + "\n")
        log.flush()
    return parse_records(out), status, seconds
