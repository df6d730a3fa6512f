"""Smoke test of benchmarks/: the driver on a tiny CPU shape (one process per job), the JSON record keys,
and the report generator. Writes only to a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # benchmarks/ is not an installed package: import it from the checkout
    sys.path.insert(0, ROOT)

from benchmarks import report  # noqa: E402
from benchmarks.shapes import SHAPES, select  # noqa: E402
REQUIRED = {"implementation", "shape", "B", "T", "H", "V", "mode", "median_ms", "min_ms", "peak_gib",
            "floor_ms", "device", "jax", "date", "commit"}


def test_named_shapes():
    assert (SHAPES["qwen2.5-0.5b"].H, SHAPES["qwen2.5-0.5b"].V) == (896, 151936)
    assert (SHAPES["llama3-8b"].H, SHAPES["llama3-8b"].V) == (4096, 128256)
    assert (select("qwen2.5-0.5b", N=16384).B, select("qwen2.5-0.5b", N=16384).T) == (8, 2048)
    assert (select("qwen2.5-0.5b", N=65536).B, select("qwen2.5-0.5b", N=65536).T) == (16, 4096)
    assert select("qwen2.5-0.5b", B=2, T=32768).N == 65536
    assert select("logits-llama3", B=16, T=1024).logits_bytes() == 16 * 1025 * 128256 * 2
    assert select("qwen2.5-0.5b", N=16384).model_flops("fwd+bwd") == 6 * 16384 * 896 * 151936
    with pytest.raises(ValueError):
        select("no-such-shape")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    results = tmp / "cpu.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.run", "--shape", "cpu-tiny", "--impl", "xla_chunked,dense_jax",
           "--mode", "fwd", "--mode", "fwd+bwd", "--results", str(results), "--log", str(tmp / "log.txt"),
           "--iters", "2", "--warmup", "0", "--min-time-s", "0", "--timeout-s", "120", "--commit", "test123"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return tmp, results, records, proc.stdout


def test_cpu_run_records(cpu_run):
    _, _, records, stdout = cpu_run
    runs = [r for r in records if r.get("kind") == "lm_head"]
    floors = [r for r in records if r.get("kind") == "floor"]
    assert floors and floors[0]["implementation"] == "xla_matmul_bf16" and floors[0]["tflops"] > 0
    got = {(r["implementation"], r["mode"]) for r in runs}
    assert got == {(i, m) for i in ("xla_chunked", "dense_jax") for m in ("fwd", "fwd+bwd")}
    for r in runs:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["status"] == "ok", r.get("error")
        assert (r["shape"], r["B"], r["T"], r["H"], r["V"]) == ("cpu-tiny", 2, 64, 64, 1000)
        assert r["device"] == "cpu" and r["peak_gib"] is None and r["commit"] == "test123"
        assert 0 < r["min_ms"] <= r["median_ms"] and r["n_runs"] >= 2
        assert r["floor_ms"] > 0 and r["x_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"], rel=1e-2)
        assert r["finite"] and r["inputs_gib"] > 0
    # fwd+bwd is run first in each process, and the floor of fwd+bwd is 3x that of fwd (6NHV vs 2NHV)
    by = {(r["implementation"], r["mode"]): r for r in runs}
    assert by["xla_chunked", "fwd+bwd"]["floor_ms"] == pytest.approx(3 * by["xla_chunked", "fwd"]["floor_ms"], rel=1e-3)
    # same data in both processes: the fused path and the dense reference agree on loss and gradients
    a, b = by["xla_chunked", "fwd+bwd"], by["dense_jax", "fwd+bwd"]
    assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=1e-4)
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=2e-2)
    assert "xla_chunked" in stdout and "floors:" in stdout  # the table


def test_report(cpu_run):
    tmp, results, _, _ = cpu_run
    out = tmp / "RESULTS.md"
    out.write_text("# keep me\n\n" + report.BEGIN + "\nold\n" + report.END + "\n\nnotes stay\n")
    assert report.main(["--results", str(results), "--out", str(out), "--plot-dir", str(tmp)]) == 0
    text = out.read_text()
    assert text.startswith("# keep me") and text.rstrip().endswith("notes stay") and "\nold\n" not in text
    assert "### cpu-tiny" in text and "xla_chunked" in text and "dense_jax" in text


def test_sharded_bench_two_cpu_devices(tmp_path):
    """benchmarks.sharded_bench on 2 simulated CPU devices: single / data / vocab layouts all run and
    return the same loss (the sharded call equals the unsharded one)."""
    results = tmp_path / "sharded.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.sharded_bench", "--shape", "cpu-tiny", "--B", "4", "--T", "64",
           "--impl", "xla_chunked", "--iters", "2", "--results", str(results)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)
    recs = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["layout"], r["n_devices"], r["status"]) for r in recs] == [
        ("single", 1, "ok"), ("data", 2, "ok"), ("vocab", 2, "ok")]
    assert REQUIRED <= set(recs[0])
    np_losses = [r["loss"] for r in recs]
    assert max(np_losses) - min(np_losses) <= 1e-6 * max(1.0, abs(np_losses[0]))


def test_logits_inplace_script_on_cpu(tmp_path):
    """benchmarks.logits_inplace on a tiny shape with the kernels in the interpreter: three records; only
    the donated in-place program aliases the logits (XLA's memory analysis), and it needs one logits
    buffer less than the out-of-place program."""
    out = tmp_path / "inplace.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.logits_inplace", "--interpret", "--B", "1", "--T", "63", "--V", "256",
           "--iters", "1", "--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    recs = {r["config"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"out-of-place", "inplace, donated", "inplace, kept"}
    assert all(r["repeatable"] for r in recs.values())
    assert recs["inplace, donated"]["alias_gib"] == recs["inplace, donated"]["logits_gib"]
    assert recs["out-of-place"]["alias_gib"] == 0 and recs["inplace, kept"]["alias_gib"] == 0
    saved = recs["out-of-place"]["xla_peak_gib"] - recs["inplace, donated"]["xla_peak_gib"]
    assert saved == pytest.approx(recs["out-of-place"]["logits_gib"], rel=0.05)


def test_kernels_bench_table_entries():
    """The block sweep's selection (benchmarks.kernels_bench.table_entries): the fastest block per kernel and
    head, failed variants (no time) ignored, in the shape of gmpo_jax.tuning.MOSAIC_BLOCKS."""
    from benchmarks.kernels_bench import table_entries
    recs = [dict(kernel="logprob", block=[128, 128, 64, 4], H=896, V=151936, ms=3.70),
            dict(kernel="logprob", block=[64, 256, 64, 4], H=896, V=151936, ms=3.56),
            dict(kernel="grad", block=[64, 128, 64, 6], H=896, V=151936, ms=4.03),
            dict(kernel="grad", block=[128, 128, 64, 3], H=896, V=151936, ms=3.84),
            dict(kernel="grad", block=[64, 256, 64, 3], H=896, V=151936, error="smem"),
            dict(kernel="logprob", block=[128, 128, 64, 4], H=4096, V=128256, ms=14.44),
            dict(what="xla_matmul", H=896, V=151936, ms=3.29)]
    assert table_entries(recs, "NVIDIA H200") == {
        ("NVIDIA H200", 896, 151936): {"logprob": (64, 256, 64, 4), "grad": (128, 128, 64, 3)},
        ("NVIDIA H200", 4096, 128256): {"logprob": (128, 128, 64, 4)}}


def test_logits_profile_times_on_cpu(capsys):
    """benchmarks.logits_profile --time on a tiny batch with the xla backend: one JSON line with one positive
    per-call time per repeat, from this checkout's gmpo_jax."""
    from benchmarks import logits_profile

    logits_profile.main(["--B", "1", "--T", "8", "--impl", "xla", "--time", "--calls", "2", "--repeats", "2"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["B"] == 1 and rec["impl"] == "xla" and rec["objective"] == "grpo"
    assert len(rec["queued_ms"]) == 2 and all(t > 0 for t in rec["queued_ms"])
    assert rec["gmpo_jax"].startswith(ROOT)
