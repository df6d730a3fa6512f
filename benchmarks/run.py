"""Benchmark driver: one configuration, or a whole suite, each job in its own process.

Examples::

    # one configuration (both modes), floor measured in the same run, appended to results/<device>.jsonl
    python -m benchmarks.run --shape qwen2.5-0.5b --N 16384 --impl xla_chunked
    python -m benchmarks.run --shape llama3-8b --impl mosaic_gpu,dense_jax --mode fwd+bwd
    python -m benchmarks.run --shape logits-llama3 --B 16 --T 1024 --impl mosaic_gpu,liger_triton
    # suites (see SUITE_GROUPS); --only picks groups; --budget-s bounds the whole run
    python -m benchmarks.run --suite gpu --only kernels,peers --budget-s 500
    python -m benchmarks.run --suite cpu --results /tmp/cpu.jsonl
    python -m benchmarks.run --suite gpu --dry-run          # list the jobs and their timeouts

A job is one implementation on one configuration, in all its modes (``fwd+bwd`` first: JAX cannot reset
its peak-memory counter, so only the first mode's peak is exact). Every job runs in a fresh process with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and a timeout (its process group is killed at the timeout); an
allocation failure is a result (``status: "oom"``), a crash or timeout is recorded too. The floors
(bf16 XLA matmul rate of each [N, H] x [H, V], device copy rate) are measured by a first job of the same
run and written into every record (``floor_ms``, ``x_floor``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks import _common
from benchmarks.shapes import SHAPES, Config, select

JAX_IMPLS = {"lm_head": ("xla_chunked", "mosaic_gpu", "dense_jax"), "logits": ("mosaic_gpu", "xla", "dense_jax")}
TORCH_IMPLS = {"lm_head": ("cce_gmpo", "liger_grpo"), "logits": ("liger_triton",)}
MODES = ("fwd+bwd", "fwd")

DEFAULT_OPTS: dict[str, Any] = dict(
    data="peaked",
    grad_acc=False,
    seed=0,
    logit_scale=1.0,
    logits_std=1.0,
    ratio_noise=0.2,
    mask="full",
    weight_layout="hv",
    chunk_size=None,
    iters=10,
    warmup=2,
    min_time_s=0.3,
    liger_chunk_size=1,
    cce_no_filter=True,
    liger_inplace=True,
    objective="gmpo",
    input_dtype="bfloat16",
    logits_precision="none",
    entropy_coef=0.0,
    softcap=0.0,
    grad_filter="none",
    oracle="float32",
    skip_masked_rows=True,
)

# options that change what is computed: a non-default value is recorded in the variant
LABELLED_OPTS = (
    "logit_scale",
    "logits_std",
    "ratio_noise",
    "mask",
    "weight_layout",
    "liger_chunk_size",
    "objective",
    "input_dtype",
    "logits_precision",
    "entropy_coef",
    "softcap",
    "grad_filter",
    "oracle",
    "skip_masked_rows",
)
LM_HEAD_FEATURES = ("input_dtype", "logits_precision", "entropy_coef", "softcap", "grad_filter", "oracle")  # jax_impls
CHOICES = {
    "mask": ("full", "ragged"),
    "weight_layout": ("hv", "vh"),
    "objective": ("gmpo", "grpo"),
    # benchmarks.workloads.DATA (this driver does not import JAX; tests/kernels/test_grad_filter_family.py keeps them equal)
    "data": tuple(
        ["light", "peaked", "heavy", "heavy-shared", "heavy-rough", "unsure", "flat"]
        + [f"{m}-live" for m in ("light", "peaked", "heavy", "heavy-shared", "heavy-rough", "unsure")]
    ),
    "input_dtype": ("bfloat16", "float32"),
    "logits_precision": ("none", "float32", "bf16x3"),
    "oracle": ("float32", "float64"),
}


def labelled(opts: dict[str, Any]) -> str:
    """The variant label of the options in ``opts`` that are away from their defaults, e.g.
    ``"input_dtype=float32,logits_precision=bf16x3"``; a ``grad_filter`` is followed by the filter's rule
    (``FILTER_RULE``), so that records of another rule do not fill the same cells."""
    parts = [f"{k}={opts[k]}" for k in LABELLED_OPTS if k in opts and opts[k] != DEFAULT_OPTS[k]]
    return ",".join(p + (f",filter_rule={FILTER_RULE}" if p.startswith("grad_filter=") else "") for p in parts)


# ----------------------------------------------------------------------------------------------------
# Suites

Q, L, G = "qwen2.5-0.5b", "llama3-8b", "logits-llama3"
# the main table (docs/performance.md): peaked then flat, ours against CCE (default and exact), with gradient accuracy
REALISTIC_CONFIGS = [(Q, 8, 2048), (L, 4, 2048), (Q, 2, 32768)]
FILTER_ROW = "0.01"  # the main table's grad_filter column: tuning.GRAD_FILTER_AUTO (a test keeps them equal)
# The gradient filter's keep rule (docs/SPEC.md): "score" thresholds each window's score D sqrt(2 ln(n / n_eff));
# the records labelled "grad_filter=..." alone were of the rule before it, which thresholded the window's mass D.
FILTER_RULE = "score"
FILTER_LABEL = f"grad_filter={FILTER_ROW},filter_rule={FILTER_RULE}"  # the filtered cells' variant
# masked tokens and zero-advantage sequences against the same batch fully live; B = 20 in groups of 2
# gives 30 % zero-advantage sequences, lengths uniform over 20-100 % of T about 40 % masked tokens
SPARSITY_CONFIGS = [(Q, 20, 768), (G, 20, 768)]  # 20 x 768: one chunk (16384 // 768 = 21 >= 20)
FAMILY_DATA = ["light", "peaked", "heavy", "heavy-shared", "heavy-rough", "unsure", "heavy-shared-live"]
FAMILY_CONFIGS = [(Q, 8, 2048), (L, 4, 2048)]
# the family group: shapes, members, implementations (exact = mosaic_gpu, cce = cce_gmpo, filter = mosaic_gpu with
# grad_filter=FILTER_ROW), gradient accuracy against the dense float32 oracle; --family-* override them
FAMILY_DEFAULTS: dict[str, Any] = dict(
    configs=FAMILY_CONFIGS, datas=FAMILY_DATA, impls=("exact", "cce", "filter"), grad_acc=True
)
GPU_LM_CONFIGS = [(Q, 8, 2048), (Q, 16, 4096), (L, 4, 2048), (Q, 2, 32768), (Q, 1, 512)]
GPU_LOGITS_CONFIGS = [(G, 2, 1024), (G, 16, 1024)]
SUITE_GROUPS = {
    "realistic": "the main table (docs/performance.md): mosaic_gpu and CCE (default, filter_eps=None) on peaked then flat data, "
    "gradient accuracy; then masked / zero-advantage vs fully live (LM head and logits paths)",
    "filter": "the main table's grad_filter column: mosaic_gpu with grad_filter=FILTER_ROW on its shapes, "
    "peaked then flat, gradient accuracy",
    "family": "the workload family (FAMILY_DATA): mosaic_gpu exact and grad_filter=FILTER_ROW, gradient accuracy, "
    "Qwen 8 x 2048 and Llama-3 4 x 2048, GRPO-like (ragged, zero-advantage) and heavy-shared fully live",
    "kernels": "mosaic_gpu on the LM-head shapes (flat data)",
    "core": "xla_chunked and dense_jax on the LM-head shapes (flat data)",
    "peers": "cce_gmpo and liger_grpo on the LM-head shapes (flat data; PyTorch, skipped when not importable)",
    "logits": "policy loss from logits: mosaic_gpu, xla, dense_jax, liger_triton (flat data; GMPO, and GRPO "
    "for mosaic_gpu and Liger)",
    "features": "loss features against the plain bf16 path (mosaic_gpu, peaked data, gradient accuracy): "
    "entropy_coef, softcap, logits_precision with bf16 / float32 inputs, xla_chunked float32 (HIGHEST)",
}
# The loss-feature rows (options of one job each): the plain bf16 path, then each feature alone. The
# precision rows are judged against the float64 oracle (their error is below the float32 oracle's own).
F64 = dict(oracle="float64")
FEATURE_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("mosaic_gpu", {}),
    ("mosaic_gpu", dict(entropy_coef=0.01)),
    ("mosaic_gpu", dict(softcap=30.0)),
    ("mosaic_gpu", dict(logits_precision="float32", **F64)),
    ("mosaic_gpu", dict(input_dtype="float32", logits_precision="float32", **F64)),
    ("mosaic_gpu", dict(input_dtype="float32", logits_precision="bf16x3", **F64)),
    ("xla_chunked", dict(input_dtype="float32", **F64)),  # the portable path's Precision.HIGHEST (the old fallback)
]
FEATURE_CONFIGS = [(Q, 8, 2048), (L, 4, 2048)]
# One row bucket (no exact work skipping) on every feature row, the plain one included: eight row buckets
# compile in 30-40 s per Mosaic job (records of 79fc5bb), which 14 jobs cannot afford in one 9-minute call;
# one bucket compiles in ~6 s (f4d6cda). The plain path with skipping is the main table's.
FEATURE_TUNING: dict[str, Any] = {"ROW_BUCKETS": 1}
# Seconds per job: measured on the H200 on 2026-12-01 (24a9a31, suite.log of two calls) at 41-52 s for the bf16
# rows (the float32 dense oracle's compile; 30 s timed every one of them out), 20-26 s with the float64 oracle,
# 23-28 s for float32 inputs, 32-35 s for xla_chunked at HIGHEST; the limits leave ~50 % over that. All 14
# jobs take ~500 s: the last one may be cut by the suite's 480 s budget (rerun it with --timeout-s / --shape).
FEATURE_TIMEOUTS = {"bf16": 75.0, "bf16+f64": 45.0, "f32": 45.0, "xla_f32": {Q: 50.0, L: 55.0}}


def _feature_timeout(shape: str, impl: str, row: dict[str, Any]) -> float:
    if impl == "xla_chunked":
        return FEATURE_TIMEOUTS["xla_f32"][shape]
    if row.get("input_dtype") == "float32":
        return FEATURE_TIMEOUTS["f32"]
    return FEATURE_TIMEOUTS["bf16+f64" if row.get("oracle") == "float64" else "bf16"]


def feature_jobs(configs, impl_for: dict[str, str], tuning: dict[str, Any], timeout) -> list[dict[str, Any]]:
    """The loss-feature jobs: every FEATURE_ROWS row at each configuration (row-major, so a budget cut drops
    whole rows), peaked data, fwd+bwd, gradient accuracy. ``impl_for`` renames implementations (the CPU
    stand-in runs xla_chunked for mosaic_gpu); ``timeout(shape, impl, row)`` sizes each job."""
    jobs = []
    for impl, row in FEATURE_ROWS:
        for shape, B, T in configs:
            job = _job(
                "jax",
                select(shape, B=B, T=T),
                impl_for.get(impl, impl),
                ["fwd+bwd"],
                timeout(shape, impl, row),
                dict(tuning) or None,
                datas=["peaked"],
                grad_acc=True,
                **row,
            )
            job["variant"] = ",".join(x for x in (job.get("variant"), labelled(row)) if x) or None
            jobs.append(job)
    return jobs


def _job(
    kind: str,
    cfg: Config,
    impl: str,
    modes: list[str],
    timeout_s: float,
    settings: dict[str, Any] | None = None,
    **opts: Any,
) -> dict[str, Any]:
    """One process's work. ``settings``: chunk_size and tuning constants, recorded as the variant 'k=v,..';
    ``opts``: options of this job only (``datas=[...]``: workloads timed one after another in the process,
    ``grad_acc``, ``save_batch``)."""
    job = dict(kind=kind, shape=cfg.shape, B=cfg.B, T=cfg.T, impl=impl, modes=list(modes), timeout_s=timeout_s)
    job_opts: dict[str, Any] = dict(opts)
    if settings:
        tuning = {k: v for k, v in settings.items() if k != "chunk_size"}
        job_opts.update(chunk_size=settings.get("chunk_size"), tuning=tuning)
        job["variant"] = ",".join(f"{k}={v}" for k, v in settings.items())
    if job_opts:
        job["opts"] = job_opts
    return job


def _gpu_timeout(cfg: Config, impl: str) -> float:
    big = cfg.N >= 65536 or cfg.H >= 4096
    if impl == "liger_grpo":
        return 150.0 if big else 90.0
    return 120.0 if big else 75.0


def suite_jobs(suite: str, only: list[str], family: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Jobs in priority order (the most informative first: a budget cut drops the tail).
    ``family``: overrides of the family group's ``FAMILY_DEFAULTS`` (``configs``, ``datas``, ``impls``,
    ``grad_acc``)."""
    jobs: list[dict[str, Any]] = []
    both = dict(datas=["peaked", "flat"], grad_acc=True)
    if suite == "gpu" and "realistic" in only:
        for shape, B, T in REALISTIC_CONFIGS:
            cfg = select(shape, B=B, T=T)
            jobs.append(_job("jax", cfg, "mosaic_gpu", ["fwd+bwd"], 150.0, save_batch=True, **both))
            jobs.append(_job("torch", cfg, "cce_gmpo", ["fwd+bwd"], 150.0, **both))
    if suite == "gpu" and "filter" in only:  # the main table's grad_filter column ("auto"'s threshold)
        filtered = dict(grad_filter=FILTER_ROW)
        for shape, B, T in REALISTIC_CONFIGS:
            job = _job("jax", select(shape, B=B, T=T), "mosaic_gpu", ["fwd+bwd"], 150.0, **both, **filtered)
            jobs.append(dict(job, variant=labelled(filtered)))
    if suite == "gpu" and "family" in only:  # every member in one process; per shape exact, CCE, filtered
        family = dict(FAMILY_DEFAULTS, **{k: v for k, v in (family or {}).items() if v or v is False})
        fam = dict(datas=list(family["datas"]), grad_acc=family["grad_acc"])
        filtered = dict(grad_filter=FILTER_ROW)
        for shape, B, T in family["configs"]:  # a budget cut keeps whole shapes (one shape's three side by side)
            cfg = select(shape, B=B, T=T)
            if "exact" in family["impls"]:
                jobs.append(_job("jax", cfg, "mosaic_gpu", ["fwd+bwd"], 240.0, save_batch=True, **fam))
            if "cce" in family["impls"]:
                jobs.append(_job("torch", cfg, "cce_gmpo", ["fwd+bwd"], 240.0, **fam))
            if "filter" in family["impls"]:
                job = _job("jax", cfg, "mosaic_gpu", ["fwd+bwd"], 240.0, **fam, **filtered)
                jobs.append(dict(job, variant=labelled(filtered)))
    if suite == "gpu" and "realistic" in only:
        for shape, B, T in SPARSITY_CONFIGS:
            cfg, pair = select(shape, B=B, T=T), dict(datas=["peaked", "peaked-live"])
            jobs.append(_job("jax", cfg, "mosaic_gpu", ["fwd+bwd"], 120.0, **pair))
            if cfg.kind == "logits":  # the same batches without skipping (skip_masked_rows=False), for the A/B
                skip = dict(skip_masked_rows=False)
                jobs.append(
                    dict(_job("jax", cfg, "mosaic_gpu", ["fwd+bwd"], 120.0, **pair, **skip), variant=labelled(skip))
                )
    if suite == "gpu":
        for shape, B, T in GPU_LM_CONFIGS:
            cfg = select(shape, B=B, T=T)
            plan = [
                ("kernels", "jax", "mosaic_gpu", MODES),
                ("core", "jax", "xla_chunked", MODES),
                ("core", "jax", "dense_jax", MODES),
                ("peers", "torch", "cce_gmpo", MODES),
                ("peers", "torch", "liger_grpo", ("fwd+bwd",)),
            ]
            for group, kind, impl, modes in plan:
                if impl == "dense_jax" and (B, T) == (2, 32768):
                    continue  # the dense reference is out of memory at N = 65536: shown once, at 16 x 4096
                if group in only:  # these groups are the flat-data tables
                    jobs.append(_job(kind, cfg, impl, modes, _gpu_timeout(cfg, impl), datas=["flat"]))
        if "logits" in only:
            for shape, B, T in GPU_LOGITS_CONFIGS:
                cfg = select(shape, B=B, T=T)
                for kind, impl in (
                    ("jax", "mosaic_gpu"),
                    ("jax", "xla"),
                    ("jax", "dense_jax"),
                    ("torch", "liger_triton"),
                ):
                    jobs.append(_job(kind, cfg, impl, MODES, 75.0, datas=["flat"]))
                for kind, impl in (("jax", "mosaic_gpu"), ("torch", "liger_triton")):  # Liger's objective
                    job = _job(kind, cfg, impl, ["fwd+bwd"], 75.0, datas=["flat"], objective="grpo")
                    jobs.append(dict(job, variant="objective=grpo"))
        if "features" in only:
            jobs += feature_jobs(FEATURE_CONFIGS, {}, FEATURE_TUNING, _feature_timeout)
    elif suite == "cpu":  # a smoke run of the portable paths (mosaic_gpu needs a Hopper GPU): ~30 s on 2 cores
        datas = ["peaked", "flat"]
        cfg = select("cpu-tiny")
        if "realistic" in only or "core" in only:
            jobs.append(_job("jax", cfg, "xla_chunked", ["fwd+bwd"], 120.0, datas=datas, grad_acc=True))
        if "logits" in only:
            jobs.append(_job("jax", select("logits-cpu"), "xla", ["fwd+bwd"], 120.0, datas=datas))
        if "features" in only:  # the GPU group's rows on the portable path (mosaic_gpu needs a Hopper GPU)
            jobs += feature_jobs([("cpu-tiny", 2, 64)], {"mosaic_gpu": "xla_chunked"}, {}, lambda *_: 120.0)
    else:
        raise ValueError(f"unknown suite {suite!r} (gpu | cpu)")
    return jobs


def floor_job(jobs: list[dict[str, Any]], timeout_s: float = 150.0) -> dict[str, Any] | None:
    matmuls, copy = [], False
    for j in jobs:
        cfg = select(j["shape"], B=j["B"], T=j["T"])
        if cfg.kind == "lm_head":
            key = (cfg.N, cfg.H, cfg.V)
            if key not in matmuls:
                matmuls.append(key)
        else:
            copy = True
    if not matmuls and not copy:
        return None
    return dict(kind="floor", matmuls=matmuls, copy=copy, timeout_s=timeout_s)


# ----------------------------------------------------------------------------------------------------
# Execution


def execute(job: dict[str, Any], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs one job in this process (a worker); records are also emitted on stdout."""
    opts = dict(opts, **job.get("opts", {}), variant=job.get("variant"))
    if job["kind"] == "floor":
        from benchmarks import jax_impls

        floors = jax_impls.run_floors([tuple(m) for m in job["matmuls"]], job["copy"], opts)
        _common.emit({"kind": "floors", **floors})
        return [{"kind": "floors", **floors}]
    cfg = select(job["shape"], B=job["B"], T=job["T"])
    if job["kind"] == "jax":
        from benchmarks import jax_impls

        return jax_impls.run_impl(cfg, job["impl"], job["modes"], opts)
    if job["kind"] == "torch":
        from benchmarks import torch_peers

        return torch_peers.run_impl(cfg, job["impl"], job["modes"], opts)
    raise ValueError(f"unknown job kind {job['kind']!r}")


def run_child(job: dict[str, Any], opts: dict[str, Any], timeout_s: float, log) -> tuple[list, str, float]:
    """Runs a job in a fresh process group; returns (records, 'ok'|'timeout'|'crash (rc=..)', seconds)."""
    return _common.run_child("benchmarks.run", job, opts, _job_label(job), timeout_s, log)


def _job_label(job: dict[str, Any]) -> str:
    if job["kind"] == "floor":
        return f"floor matmuls={job['matmuls']} copy={job['copy']}"
    var = f" [{job['variant']}]" if job.get("variant") else ""
    datas = ",".join(job.get("opts", {}).get("datas") or [job.get("data") or ""])
    return f"{job['impl']}{var} {job['shape']} {job['B']}x{job['T']} {','.join(job['modes'])} {datas}".rstrip()


def _missing(job: dict[str, Any], got: list[dict[str, Any]], status: str, device: str | None) -> list[dict]:
    """Placeholder records for the modes a dead/timed-out/skipped job never reported."""
    done = {(r.get("data"), r.get("mode")) for r in got if r.get("variant") == job.get("variant")}
    cfg = select(job["shape"], B=job["B"], T=job["T"])
    out = []
    for data in job.get("opts", {}).get("datas") or [job.get("data")]:
        for mode in job["modes"]:
            if (data, mode) not in done:
                rec = _common.base_record(
                    cfg,
                    job["impl"],
                    mode,
                    status=status.split(" ")[0],
                    device=device,
                    variant=job.get("variant"),
                    data=data,
                )
                rec["error"] = status
                out.append(rec)
    return out


class Driver:
    def __init__(
        self,
        opts,
        results: str | None,
        log_path: str | None,
        budget_s: float | None,
        timeout_s: float | None,
        isolate: bool = True,
    ):
        self.opts, self.results, self.budget_s, self.timeout_s = opts, results, budget_s, timeout_s
        self.isolate = isolate
        self.log = open(log_path, "a", encoding="utf-8") if log_path else None
        self.t0 = time.perf_counter()
        self.floors: dict[str, Any] = {}
        self.floor_records: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.device: str | None = None

    def _path_for(self, rec: dict[str, Any]) -> str | None:
        if self.results:
            return self.results
        dev = rec.get("device") or self.device
        if not dev:
            return None
        return os.path.join(_common.REPO_ROOT, "benchmarks", "results", f"{dev}.jsonl")

    def _write(self, recs: list[dict[str, Any]]) -> None:
        for r in recs:
            if r.get("status") in ("unavailable", "unsupported", "skipped"):
                continue  # shown in the table only
            path = self._path_for(r)
            if path:
                _common.append_jsonl(path, [r])

    def run(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        fj = floor_job(jobs)
        for job in ([fj] if fj else []) + jobs:
            elapsed = time.perf_counter() - self.t0
            timeout = self.timeout_s or job.get("timeout_s", 120.0)
            if self.budget_s is not None:
                left = self.budget_s - elapsed
                if left < 15:
                    if job["kind"] != "floor":
                        self.records += _missing(job, [], "skipped (budget)", self.device)
                    print(f"[bench] skip {_job_label(job)}: budget spent", flush=True)
                    continue
                timeout = min(timeout, left)
            clipped = timeout < (self.timeout_s or job.get("timeout_s", 120.0))
            print(f"[bench] {elapsed:6.1f}s  {_job_label(job)}  (timeout {timeout:.0f}s)", flush=True)
            if self.isolate:
                recs, status, secs = run_child(job, self.opts, timeout, self.log)
                if status == "timeout" and clipped:
                    status = "skipped (budget ran out during the job)"  # not a property of the job
            else:
                t = time.perf_counter()
                recs, status = execute(job, self.opts), "ok"
                secs = time.perf_counter() - t
            if job["kind"] == "floor":
                for r in recs:
                    if r.get("kind") == "floors":
                        self.floors = r
                    else:
                        self.device = self.device or r.get("device")
                        self.floor_records.append(r)
                self._write([r for r in recs if r.get("kind") != "floors"])
                print(f"[bench]   floors: {self._floor_summary()} ({secs:.1f}s)", flush=True)
                continue
            for r in recs:
                self.device = self.device or r.get("device")
                _common.fill_floor(r, self.floors)
            if status != "ok":
                recs = recs + _missing(job, recs, status, self.device)
            for r in recs:
                if r.get("status") in ("timeout", "crash"):
                    _common.fill_floor(r, self.floors)
            self._write(recs)
            self.records += recs
            for r in recs:
                print("[bench]   " + _row(r), flush=True)
        if self.log:
            self.log.close()
        return self.records

    def _floor_summary(self) -> str:
        parts = [f"{k}: {v} TFLOP/s" for k, v in self.floors.get("matmul_tflops", {}).items()]
        if self.floors.get("copy_gbps"):
            parts.append(f"copy {self.floors['copy_gbps']} GB/s")
        return "; ".join(parts) or "none"


# ----------------------------------------------------------------------------------------------------
# Table


def _fmt(v, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def _name(r: dict[str, Any]) -> str:
    return r["implementation"] + (f" [{r['variant']}]" if r.get("variant") else "")


def _row(r: dict[str, Any], name_width: int = 30) -> str:
    rate = f"{r['tflops']}TF/s" if r.get("tflops") else (f"{r['gbps']}GB/s" if r.get("gbps") else "-")
    peak = _fmt(r.get("peak_gib") if r.get("peak_gib") is not None else r.get("peak_gib_cumulative"), ".3f")
    if r.get("peak_gib") is None and r.get("peak_gib_cumulative") is not None:
        peak = f"<={peak}"
    cfg = f"{r['shape']} {r['B']}x{r['T']}"
    gerr = "-"
    if r.get("grad_rel_err_hidden") is not None:
        gerr = f"{100 * r['grad_rel_err_hidden']:.2g}/{100 * r['grad_rel_err_weight']:.2g}%"
    return (
        f"{_name(r)[:name_width]:{name_width}s} {cfg[:24]:24s} {str(r.get('data') or '-'):>11s} "
        f"{r['mode']:>7s} {str(r['status'])[:11]:>11s} "
        f"{_fmt(r.get('median_ms'), '.4g'):>9s} {_fmt(r.get('min_ms'), '.4g'):>9s} "
        f"{_fmt(r.get('pipelined_ms'), '.4g'):>8s} "
        f"{_fmt(r.get('x_floor'), '.2f'):>6s} {peak:>8s} {rate:>11s} {gerr:>13s}"
    )


def table(records: list[dict[str, Any]], floors: dict[str, Any] | None = None) -> str:
    w = min(60, max([30] + [len(_name(r)) for r in records]))
    head = (
        f"{'implementation':{w}s} {'shape BxT':24s} {'data':>11s} {'mode':>7s} {'status':>11s} "
        f"{'median ms':>9s} {'min ms':>9s} {'pipe ms':>8s} {'xfloor':>6s} {'peak GiB':>8s} {'rate':>11s} "
        f"{'grad err h/w':>13s}"
    )
    lines = [head, "-" * len(head)] + [_row(r, w) for r in records]
    if floors:
        mm = ", ".join(f"[{k}] {v} TF/s" for k, v in floors.get("matmul_tflops", {}).items())
        lines.append(f"floors: bf16 XLA matmul N,H,V: {mm or '-'}; copy: {floors.get('copy_gbps') or '-'} GB/s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# CLI


def _split(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", choices=sorted(SHAPES), help="named shape (benchmarks/shapes.py)")
    p.add_argument("--N", type=int, help="tokens (picks the listed B x T with that N)")
    p.add_argument("--B", type=int)
    p.add_argument("--T", type=int)
    p.add_argument("--impl", action="append", help="implementation(s), comma-separated or repeated")
    p.add_argument("--mode", action="append", help="fwd and/or fwd+bwd (default both, fwd+bwd first)")
    p.add_argument("--suite", choices=("gpu", "cpu"), help="run a suite instead of one configuration")
    p.add_argument(
        "--only",
        action="append",
        help=f"suite groups: {', '.join(SUITE_GROUPS)}, or all (default: realistic on the GPU, all but "
        "features on the CPU)",
    )
    p.add_argument(
        "--family-configs",
        help="the family group's shapes, e.g. llama3-8b:4x2048,qwen2.5-0.5b:2x32768 (default: FAMILY_CONFIGS)",
    )
    p.add_argument("--family-data", help="the family group's members, comma-separated (default: FAMILY_DATA)")
    p.add_argument("--family-impls", help="the family group's implementations: exact,cce,filter (default: all)")
    p.add_argument(
        "--family-no-grad-acc", action="store_true", help="the family group without the gradient-accuracy oracle"
    )
    p.add_argument("--results", help="JSONL to append to (default benchmarks/results/<device>.jsonl)")
    p.add_argument("--log", help="append every job's stderr here")
    p.add_argument("--table", help="also write the final table to this file")
    p.add_argument("--budget-s", type=float, help="stop starting jobs after this many seconds")
    p.add_argument("--timeout-s", type=float, help="per-job timeout (default: per job, 75-150 s)")
    p.add_argument("--in-process", action="store_true", help="no subprocesses (debugging; peaks then mix)")
    p.add_argument("--dry-run", action="store_true", help="list the jobs and exit")
    for k, v in DEFAULT_OPTS.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            what = (
                "logits path, mosaic_gpu: MosaicGpuLogitsBackend(skip_masked_rows=...); "
                if k.startswith("skip")
                else ""
            )
            p.add_argument(
                flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=v, help=f"{what}(default {v})"
            )
        elif k in CHOICES:
            helps = {
                "objective": "logits path: GMPO() or GRPO(loss_type='grpo') (Liger's)",
                "data": "workload family member (benchmarks/workloads.py MEMBERS): light, peaked (trained-LM-like, "
                "ragged masks, zero-advantage groups), heavy (harmonic tail), heavy-shared (+ shared weight "
                "direction), heavy-rough (+ a tail uneven per token), unsure; flat = N(0,1) data, full mask; NAME-live = NAME, all live",
                "mask": "flat data only: legacy ragged mask (lengths in [3T/4, T])",
                "input_dtype": "LM head: dtype of hidden and weight (float32: the bf16 batch with the mantissa "
                "bits below bf16 filled, so that it rounds back to the bf16 batch)",
                "logits_precision": "LM head: HeadOptions(logits_precision=...); none = None",
                "oracle": "--grad-acc: float32 = dense float32 HIGHEST (gmpo_jax.reference.policy_loss); "
                "float64 = dense float64 under jax.enable_x64 (GMPO only), for errors below float32's",
            }
            p.add_argument(flag, default=v, choices=CHOICES[k], help=helps.get(k))
        elif k == "grad_filter":
            p.add_argument(flag, default=v, help="LM head: HeadOptions(grad_filter=...): none, auto or a float")
        elif k in ("entropy_coef", "softcap"):
            what = "GMPO(entropy_coef=) (loss -= c agg(H))" if k == "entropy_coef" else "HeadOptions(softcap=)"
            p.add_argument(flag, type=float, default=v, help=f"LM head: {what}; 0 = off (default)")
        else:
            p.add_argument(flag, type=float if isinstance(v, float) else int, default=v, help=f"(default {v})")
    p.add_argument(
        "--tuning",
        action="append",
        metavar="NAME=VALUE",
        help="set a tuning constant for this run: an attribute of gmpo_jax.tuning, or "
        "module.path.ATTR (JAX implementations; recorded as the variant)",
    )
    p.add_argument(
        "--sweep",
        action="append",
        metavar="NAME=V1,V2,..",
        help="one job per value (product over several --sweep); NAME is chunk_size or as --tuning",
    )
    _common.add_worker_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _common.worker_main(args, execute):
        return 0

    opts = {k: getattr(args, k) for k in DEFAULT_OPTS}
    if args.suite:
        cpu_default = [g for g in SUITE_GROUPS if g != "features"]
        only = _split(args.only) or (["realistic"] if args.suite == "gpu" else cpu_default)
        if "all" in only:
            only = list(SUITE_GROUPS)
        bad = [g for g in only if g not in SUITE_GROUPS]
        if bad:
            raise SystemExit(f"unknown --only group(s) {bad}; known: {list(SUITE_GROUPS)}")
        features = [k for k in LM_HEAD_FEATURES if opts[k] != DEFAULT_OPTS[k]]
        if features:  # the suites' jobs set them (the features group); a global value would mislabel peers
            raise SystemExit(f"{features}: give them with --shape / --impl, not with --suite")
        family: dict[str, Any] = {}
        if args.family_configs:
            family["configs"] = []
            for item in _split([args.family_configs]):
                shape, _, bt = item.partition(":")
                B, _, T = bt.partition("x")
                if shape not in SHAPES or not (B.isdigit() and T.isdigit()):
                    raise SystemExit(f"--family-configs: expected SHAPE:BxT, got {item!r}")
                family["configs"].append((shape, int(B), int(T)))
        family["datas"] = _split([args.family_data] if args.family_data else None)
        family["impls"] = _split([args.family_impls] if args.family_impls else None)
        if set(family["impls"]) - {"exact", "cce", "filter"}:
            raise SystemExit(f"--family-impls: exact, cce, filter; got {args.family_impls!r}")
        if args.family_no_grad_acc:
            family["grad_acc"] = False
        jobs = suite_jobs(args.suite, only, family)
        jobs = [j for j in jobs if j["kind"] != "torch" or _torch_peers_importable(j["impl"])] + [
            dict(j, skip=True) for j in jobs if j["kind"] == "torch" and not _torch_peers_importable(j["impl"])
        ]
    else:
        if not args.shape or not args.impl:
            raise SystemExit("give --shape and --impl (or --suite)")
        cfg = select(args.shape, N=args.N, B=args.B, T=args.T)
        modes = _split(args.mode) or list(MODES)
        for m in modes:
            if m not in MODES:
                raise SystemExit(f"unknown mode {m!r}; known: {MODES}")
        modes = [m for m in MODES if m in modes]  # fwd+bwd first (exact peak)
        fixed = dict(_parse_setting(t) for t in (args.tuning or []))
        if args.chunk_size:
            fixed = {"chunk_size": args.chunk_size, **fixed}
        sweeps = [_parse_sweep(x) for x in (args.sweep or [])]
        variants = [fixed]
        for name, values in sweeps:
            variants = [dict(v, **{name: val}) for v in variants for val in values]
        jobs = []
        for impl, over in [(i, v) for i in _split(args.impl) for v in variants]:
            if impl in JAX_IMPLS[cfg.kind]:
                kind = "jax"
            elif impl in TORCH_IMPLS[cfg.kind]:
                kind = "torch"
            else:
                raise SystemExit(
                    f"unknown {cfg.kind} implementation {impl!r}; known: {JAX_IMPLS[cfg.kind] + TORCH_IMPLS[cfg.kind]}"
                )
            features = [k for k in LM_HEAD_FEATURES if opts[k] != DEFAULT_OPTS[k]]
            if features and (kind != "jax" or cfg.kind != "lm_head"):  # ignored there: the label would lie
                raise SystemExit(f"{features} apply to the JAX LM-head implementations only, not {impl!r}")
            jobs.append(_job(kind, cfg, impl, modes, args.timeout_s or 600.0, over or None))

    label = labelled(opts)
    if label:  # data or peer settings away from the defaults: a variant, never mixed with default records
        for j in jobs:
            j["variant"] = ",".join(x for x in (j.get("variant"), label) if x)
    for j in jobs:  # every job names the workload(s) it times
        j.setdefault("opts", {}).setdefault("datas", [opts["data"]])
    skipped = [j for j in jobs if j.get("skip")]
    jobs = [j for j in jobs if not j.get("skip")]
    if args.dry_run:
        fj = floor_job(jobs)
        for j in ([fj] if fj else []) + jobs:
            print(f"{_job_label(j):70s} timeout {j.get('timeout_s')}")
        for j in skipped:
            print(f"{_job_label(j):70s} SKIPPED (peer not importable)")
        print(f"{len(jobs)} jobs; their timeouts sum to {sum(j['timeout_s'] for j in jobs):.0f} s (floor job aside)")
        return 0

    driver = Driver(opts, args.results, args.log, args.budget_s, args.timeout_s, isolate=not args.in_process)
    records = driver.run(jobs)
    for j in skipped:
        records += _missing(j, [], "unavailable (not importable)", driver.device)
    text = table(records, driver.floors)
    print("\n" + text, flush=True)
    if args.table:
        with open(args.table, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


def _value(text: str) -> Any:
    """A CLI value: a Python literal, or an integer power such as 2**24."""
    import ast
    import re

    text = text.strip()
    m = re.fullmatch(r"(\d+)\*\*(\d+)", text)
    if m:
        return int(m.group(1)) ** int(m.group(2))
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _parse_setting(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise SystemExit(f"expected NAME=VALUE, got {text!r}")
    name, value = text.split("=", 1)
    return name.strip(), _value(value)


def _parse_sweep(text: str) -> tuple[str, list[Any]]:
    name, values = text.split("=", 1) if "=" in text else (text, "")
    vals = [_value(v) for v in values.split(",") if v.strip()]
    if not vals:
        raise SystemExit(f"expected NAME=V1,V2,..., got {text!r}")
    return name.strip(), vals


def _torch_peers_importable(impl: str) -> bool:
    import importlib.util

    from benchmarks.torch_peers import PEERS

    return all(importlib.util.find_spec(m) is not None for m in ("torch", PEERS[impl]))


if __name__ == "__main__":
    sys.exit(main())
