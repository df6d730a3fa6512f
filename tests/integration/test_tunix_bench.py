"""benchmarks/tunix_bench.py: its CPU preset end to end (one process per job, records, agreement of the two
losses, compiled memory), the report, and that the GPU-size configurations trace (no run, no allocation).

Skipped without Tunix (``pip install -e '.[tunix]'``). Tolerance (float32, HIGHEST precision): gradients
1e-4 relative (global and of each leaf's largest entry), as in ``tests/integration/test_tunix.py``; the loss 1e-6
absolute, because a GRPO loss with group-normalised advantages is a near-cancelling sum of O(1) terms (about
-6e-3 here), so its relative error is no measure. Tunix's dense log-sum-exp against the chunked online one
moves results by a few float32 ulps (measured: gradients ~3e-7, loss ~6e-8 absolute).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tunix")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # benchmarks/ is not an installed package: import it from the checkout
    sys.path.insert(0, ROOT)

from benchmarks import report, tunix_bench  # noqa: E402

LOSS_ATOL, GRAD_TOL = 1e-6, 1e-4
KEYS = {"device", "jax", "tunix", "commit", "config", "impl", "step_ms", "peak_bytes", "temp_bytes", "loss"}


@pytest.fixture(scope="module")
def cpu_records(tmp_path_factory):
    results = tmp_path_factory.mktemp("tunix_bench") / "tunix.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.tunix_bench", "--preset", "cpu", "--results", str(results)]
    cmd += ["--iters", "2", "--warmup", "1", "--commit", "test123", "--budget-s", "300"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()], proc.stdout


def test_cpu_preset_records(cpu_records):
    records, _ = cpu_records
    assert [(r["kind"], r["impl"]) for r in records] == [
        ("tunix_grad_check", "gmpo_jax_fused_vs_tunix_grpo"),
        ("tunix_step", "tunix_grpo"),
        ("tunix_step", "gmpo_jax_fused"),
    ]
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    check, tunix, fused = records
    for r in records:
        assert (r["device"], r["commit"], r["tunix"], r["config"], r["dtype"]) == (
            "cpu",
            "test123",
            "0.1.7",
            "tiny-qwen3",
            "float32",
        )
    # both losses and every parameter gradient agree at float32 (HIGHEST precision)
    assert check["loss_abs_err"] <= LOSS_ATOL and 0 < check["grad_rel_err"] <= GRAD_TOL
    assert check["grad_max_err"] <= GRAD_TOL
    assert check["grad_norm"] > 0 and check["fused_backend"] == "xla_chunked"
    for r in (tunix, fused):
        assert KEYS <= set(r), KEYS - set(r)
        assert r["step_ms"] > 0 and r["n_runs"] == 2 and r["finite"] and r["peak_bytes"] is None  # CPU
        assert r["grad_rel_err"] == check["grad_rel_err"] and r["grad_check"] == "float32"
        assert r["params"] == tunix["params"] > 0
    assert (tunix["fused_backend"], fused["fused_backend"]) == (None, "xla_chunked")
    # the first step runs on the same initial parameters and batch: the same loss
    assert fused["loss"] == pytest.approx(tunix["loss"], rel=0, abs=LOSS_ATOL)
    assert fused["kl"] == pytest.approx(tunix["kl"], rel=2e-5, abs=1e-7)
    assert fused["pg_clipfrac"] == pytest.approx(tunix["pg_clipfrac"], abs=1e-6) and tunix["pg_clipfrac"] > 0
    # no [B, P+T, V] float32 logits: the fused step's compiled workspace is not larger than Tunix's
    assert 0 < fused["temp_bytes"] <= tunix["temp_bytes"]


def test_report_table(cpu_records, tmp_path):
    records, stdout = cpu_records
    text = tunix_bench.report(records)
    rows = [line for line in text.splitlines() if line.startswith("| cpu |")]
    assert len(rows) == 2 and "tunix_grpo" in rows[0] and "gmpo_jax_fused" in rows[1]
    assert rows[1].count(" / ") == 2 and text in stdout  # the driver prints the same table
    path = tmp_path / "mixed.jsonl"  # benchmarks.report, which reads results/*.jsonl, leaves them out
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.load([str(path)]) == {}


def test_gpu_configs_trace():
    """The GPU presets' steps, gradient check and log-prob pass trace at their real shapes (abstract
    parameters, nothing allocated; Qwen2.5-0.5B with 1 of its 24 layers to keep this fast)."""
    cases = tunix_bench.PRESETS["gpu"]
    assert [(c.name, c.B, c.T, c.P, c.dtype) for c in cases] == [
        ("qwen2.5-0.5b", 8, 1024, 256, "bfloat16"),
        ("llama3-8b-head", 8, 1024, 256, "bfloat16"),
    ]
    for case in cases:
        _, cfg = tunix_bench.model_config(case, case.dtype)
        assert (cfg.embed_dim, cfg.vocab_size) == {"qwen2.5-0.5b": (896, 151936), "llama3-8b-head": (4096, 128256)}[
            case.name
        ]
        lines = tunix_bench.build_only(dataclasses.replace(case, layers=1))
        assert len(lines) == 4 and all(case.name in line for line in lines)


def test_fused_step_compiles_without_the_logits():
    """The Llama-3-8B-head step (1 layer), compiled for the CPU: the fused loss's temporaries are smaller than
    Tunix's by at least one float32 ``[B, P + T, V]`` logits buffer (4.9 GiB), which Tunix's loss holds and the
    fused one never makes."""
    import re

    case = dataclasses.replace(tunix_bench.PRESETS["gpu"][1], layers=1)
    lines = tunix_bench.build_only(case, compile_steps=True)
    temp = {
        impl: float(re.search(r"temp ([0-9.]+) GiB", line).group(1))
        for line in lines
        for impl in tunix_bench.IMPLS
        if f" {impl}: compiled" in line
    }
    logits_gib = case.B * (case.P + case.T) * 128256 * 4 / 2**30
    assert temp["tunix_grpo"] - temp["gmpo_jax_fused"] >= logits_gib, (temp, logits_gib)


def test_dry_run_lists_jobs(capsys):
    assert tunix_bench.main(["--preset", "gpu", "--dry-run", "--check-dtypes", "float32,bfloat16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and "tunix_grpo bfloat16" in out[0] and "gmpo_jax_fused bfloat16" in out[1]
    assert "check float32" in out[4] and "check bfloat16" in out[-1]  # the measurement first, checks after
