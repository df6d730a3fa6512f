"""Smoke tests of benchmarks/: the workload generator (statistics, raggedness, determinism), the driver on
tiny CPU shapes (one process per job, both workloads, gradient accuracy), the JSON record keys, and the
report generator (RESULTS.md and the README's bench blocks). Writes only to a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # benchmarks/ is not an installed package: import it from the checkout
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks import report, run, workloads  # noqa: E402
from benchmarks.shapes import SHAPES, select  # noqa: E402
from gmpo_jax import tuning  # noqa: E402

REQUIRED = {
    "implementation",
    "shape",
    "B",
    "T",
    "H",
    "V",
    "mode",
    "median_ms",
    "min_ms",
    "peak_gib",
    "floor_ms",
    "device",
    "jax",
    "date",
    "commit",
}


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
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--shape",
        "cpu-tiny",
        "--impl",
        "xla_chunked,dense_jax",
        "--mode",
        "fwd",
        "--mode",
        "fwd+bwd",
        "--data",
        "peaked",
        "--grad-acc",
        "true",
        "--results",
        str(results),
        "--log",
        str(tmp / "log.txt"),
        "--iters",
        "2",
        "--warmup",
        "0",
        "--min-time-s",
        "0",
        "--timeout-s",
        "120",
        "--commit",
        "test123",
    ]
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
        # the workload and its statistics are recorded: peaked rows, ragged masks
        assert r["data"] == "peaked" and 0.5 <= r["mean_entropy"] <= 3.0 and 0.0 < r["masked_frac"] < 0.8
        assert {"zero_adv_frac", "clip_frac_gmpo_0.4", "clip_frac_grpo_0.2"} <= set(r)
        if r["mode"] == "fwd+bwd":  # bf16 gradients against the float32 dense oracle: bf16 rounding only
            assert r["grad_acc_N"] == 128 and 0 < r["grad_rel_err_hidden"] < 0.02
            assert 0 < r["grad_rel_err_weight"] < 0.02
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
    assert "xla_chunked" in text and "dense_jax" in text and "data=peaked" in text


def test_report_readme_blocks(tmp_path):
    """The README's bench blocks are regenerated between their markers (text around them kept); a block
    without records names the command that would fill it."""
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:lm_head:start -->\nstale\n<!-- bench:lm_head:end -->\noutro\n")
    rec = dict(
        implementation="mosaic_gpu",
        shape="qwen2.5-0.5b",
        B=8,
        T=2048,
        H=896,
        V=151936,
        N=16384,
        mode="fwd+bwd",
        kind="lm_head",
        data="peaked",
        status="ok",
        median_ms=30.0,
        floor_ms=20.0,
        peak_gib=1.3,
        date="2026-12-01T00:00:00Z",
        commit="abc1234",
        device="nvidia-h200",
        device_name="NVIDIA H200",
        jax="0.11.2",
        mean_entropy=2.0,
        masked_frac=0.4,
        zero_adv_frac=0.25,
        grad_rel_err_hidden=0.003,
        grad_rel_err_weight=0.002,
        variant=None,
    )
    filtered = dict(rec, variant=run.FILTER_LABEL, median_ms=24.0, grad_rel_err_hidden=0.0035)
    found = report.update_readme(str(readme), {"nvidia-h200": [rec, filtered]})
    text = readme.read_text()
    assert found == ["lm_head"] and text.startswith("intro\n") and text.endswith("outro\n")
    assert "stale" not in text and "30 ms (1.50x), 1.30 GiB | 24 ms (1.20x), 1.30 GiB |" in text
    assert "0.3 / 0.2 %; 0.35 / 0.2 %; -; -" in text
    assert "bash benchmarks/gpu_suite.sh" in text and "abc1234" in text
    empty = report.block_sparsity([])
    assert "Not measured yet" in empty and "bash benchmarks/gpu_suite.sh" in empty


def test_filter_suite_times_the_filter_at_auto():
    """The main table's filtered column is ``grad_filter="auto"``'s threshold, and the GPU suite's filter group runs it."""
    assert float(run.FILTER_ROW) == tuning.GRAD_FILTER_AUTO
    assert not [j for j in run.suite_jobs("gpu", ["realistic"]) if "grad_filter" in j.get("opts", {})]
    jobs = run.suite_jobs("gpu", ["filter"])
    filtered = [j for j in jobs if j.get("variant") == run.FILTER_LABEL]
    assert len(filtered) == len(run.REALISTIC_CONFIGS)
    assert all(j["opts"]["grad_filter"] == run.FILTER_ROW and j["impl"] == "mosaic_gpu" for j in filtered)


# ----------------------------------------------------------------------------------------------------
# The workload generator


@pytest.fixture(scope="module")
def peaked_batch():
    return workloads.make_lm_head_batch(B=8, T=64, H=64, V=1000, data="peaked", seed=0)


def test_peaked_entropy_hits_the_target(peaked_batch):
    stats = workloads.batch_stats(peaked_batch)
    assert 1.5 <= stats["mean_entropy"] <= 2.5, stats  # target 2.0 nats, set by bisection on 256 rows
    low = workloads.batch_stats(workloads.make_lm_head_batch(4, 64, 64, 1000, "peaked", entropy=0.7))
    assert low["mean_entropy"] < stats["mean_entropy"] and 0.3 <= low["mean_entropy"] <= 1.1, low
    flat = workloads.batch_stats(workloads.make_lm_head_batch(4, 64, 64, 1000, "flat"))
    assert flat["mean_entropy"] > 5.0 and flat["masked_frac"] == 0.0  # near log(1000) = 6.9


def test_peaked_shapes_dtypes_and_zipf(peaked_batch):
    b = peaked_batch
    assert b.hidden.shape == (8, 64, 64) and b.hidden.dtype == "bfloat16"
    assert b.weight.shape == (64, 1000) and b.weight.dtype == "bfloat16"
    assert b.ids.shape == b.mask.shape == b.old_logps.shape == (8, 64) and b.advantages.shape == (8,)
    ids = np.asarray(b.ids)
    assert 0 <= ids.min() and ids.max() < 1000
    assert np.median(ids) < 100  # frequent tokens at low ids (Zipf prior)
    # targets were sampled from the model itself: their log-probs are the exact ones, mostly likely tokens
    assert float(np.asarray(b.logps).mean()) > -4.0


def test_masks_are_ragged_and_advantages_grouped(peaked_batch):
    mask = np.asarray(peaked_batch.mask)
    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) > 1 and lengths.min() >= int(0.2 * 64) and lengths.max() <= 64
    assert all(mask[i, :n].all() and not mask[i, n:].any() for i, n in enumerate(lengths))  # prefixes
    adv = np.asarray(workloads.group_advantages(np.asarray([0, 1], np.uint32), 20, 2, 0.3))
    groups = adv.reshape(10, 2)
    zero = (groups == 0).all(1)
    assert zero.sum() == 3  # 30 % of the groups all-equal: advantage exactly 0
    assert np.allclose(groups[~zero].sum(1), 0.0, atol=1e-5) and (np.abs(groups[~zero]) > 0.5).all()
    stats = workloads.batch_stats(peaked_batch)
    assert stats["zero_adv_frac"] == 0.25  # B = 8 in groups of 2: one of four groups
    live = workloads.make_lm_head_batch(8, 64, 64, 1000, "peaked-live")
    assert bool(np.asarray(live.mask).all()) and (np.asarray(live.advantages) != 0).all()
    assert np.array_equal(np.asarray(live.ids), np.asarray(peaked_batch.ids))  # the same batch, all live


def test_old_logps_are_close_and_some_clip(peaked_batch):
    stats = workloads.batch_stats(peaked_batch)
    r = np.asarray(peaked_batch.logps) - np.asarray(peaked_batch.old_logps)
    assert np.abs(r).mean() < 0.2
    assert stats["clip_frac_grpo_0.2"] > 0.0 and stats["clip_frac_gmpo_0.4"] <= stats["clip_frac_grpo_0.2"]


def test_workload_is_deterministic_by_seed(peaked_batch):
    again = workloads.make_lm_head_batch(B=8, T=64, H=64, V=1000, data="peaked", seed=0)
    other = workloads.make_lm_head_batch(B=8, T=64, H=64, V=1000, data="peaked", seed=1)
    for a, b in zip(peaked_batch, again):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(peaked_batch.ids), np.asarray(other.ids))


def test_logits_batch():
    b = workloads.make_logits_batch(B=2, T=31, V=500, data="peaked", seed=0, H=32)
    assert b.logits.shape == (2, 32, 500) and b.logits.dtype == "bfloat16" and b.ids.shape == (2, 31)
    stats = workloads.batch_stats(b)
    assert 1.0 <= stats["mean_entropy"] <= 3.0 and stats["masked_frac"] > 0.0


def test_sharded_bench_two_cpu_devices(tmp_path):
    """benchmarks.sharded_bench on 2 simulated CPU devices: single / data / vocab layouts all run and
    return the same loss (the sharded call equals the unsharded one)."""
    results = tmp_path / "sharded.jsonl"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.sharded_bench",
        "--shape",
        "cpu-tiny",
        "--B",
        "4",
        "--T",
        "64",
        "--impl",
        "xla_chunked",
        "--iters",
        "2",
        "--results",
        str(results),
    ]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)
    recs = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["layout"], r["n_devices"], r["status"]) for r in recs] == [
        ("single", 1, "ok"),
        ("data", 2, "ok"),
        ("vocab", 2, "ok"),
    ]
    assert REQUIRED <= set(recs[0])
    np_losses = [r["loss"] for r in recs]
    assert max(np_losses) - min(np_losses) <= 1e-6 * max(1.0, abs(np_losses[0]))


def test_loss_features_cpu(tmp_path):
    """The "features" group (run.py): its CPU stand-in (xla_chunked for mosaic_gpu, cpu-tiny) runs every new
    option once in one process; records carry the settings and their variant; each oracle computes the
    timed loss (entropy term and soft cap included); float32 inputs with logits_precision="float32" are
    float32-accurate against the float64 oracle; RESULTS.md gets the Loss features table. The GPU group's
    jobs are listed, not run."""
    from benchmarks import run

    gpu = run.suite_jobs("gpu", ["features"])
    assert len(gpu) == 2 * len(run.FEATURE_ROWS) and all(j["opts"]["grad_acc"] for j in gpu)
    assert {(j["shape"], j["B"], j["T"]) for j in gpu} == {("qwen2.5-0.5b", 8, 2048), ("llama3-8b", 4, 2048)}
    assert sum(j["opts"].get("oracle") == "float64" for j in gpu) == 8 and all(j["variant"] for j in gpu)

    results = tmp_path / "features.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.run", "--suite", "cpu", "--only", "features", "--in-process"]
    cmd += ["--results", str(results), "--iters", "2", "--warmup", "0", "--min-time-s", "0", "--commit", "test123"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    by = {r["variant"]: r for r in recs if r.get("kind") == "lm_head"}
    assert set(by) == {run.labelled(row) or None for _, row in run.FEATURE_ROWS}
    for r in by.values():
        assert r["status"] == "ok" and r["implementation"] == "xla_chunked" and r["data"] == "peaked", r
        settings = (r["input_dtype"], r["logits_precision"], r["entropy_coef"], r["softcap"], r["oracle"])
        assert settings == (
            "float32" if "input_dtype=float32" in str(r["variant"]) else "bfloat16",
            next((p for p in ("float32", "bf16x3") if f"logits_precision={p}" in str(r["variant"])), None),
            0.01 if "entropy_coef" in str(r["variant"]) else 0.0,
            30.0 if "softcap" in str(r["variant"]) else 0.0,
            "float64" if "oracle=float64" in str(r["variant"]) else "float32",
        )
        assert r["oracle"] in r["grad_oracle"] or "upcast=True" in r["grad_oracle"]
        # the oracle's loss is the timed loss (an entropy term or cap left out would differ by >= 1e-2)
        assert r["loss_abs_err"] < 1e-5 and r["oracle_loss"] == pytest.approx(r["loss"], abs=1e-5)
    f32 = by["input_dtype=float32,logits_precision=float32,oracle=float64"]
    assert f32["grad_rel_err_hidden"] < 1e-5 and f32["grad_rel_err_weight"] < 1e-5
    assert by[None]["grad_rel_err_hidden"] > 100 * f32["grad_rel_err_hidden"]  # bf16 gradients: bf16 rounding
    out = tmp_path / "RESULTS.md"
    assert report.main(["--results", str(results), "--out", str(out), "--plot-dir", str(tmp_path)]) == 0
    text = out.read_text()
    assert "### Loss features" in text and "logits_precision=bf16x3" in text and "x plain]" in text
    assert "Not measured yet" not in text


def test_precision_probe_runs_and_restores_the_gemm():
    """``benchmarks.precision_probe`` at a small shape in the interpreter: every variant within the float32
    head's interpreter bounds (``test_logits_precision``), and the patched ``split_dot`` put back."""
    from benchmarks import precision_probe
    from gmpo_jax.lm_head import backend, mosaic_gpu

    recs = precision_probe.probe(R=64, H=64, V=128, interpret=True)  # one vocabulary tile
    assert mosaic_gpu.split_dot is backend.split_dot
    assert [(r["logits_precision"], r["gradient_gemms"]) for r in recs] == [
        ("float32", "split_dot"), ("float32", "highest"), ("bf16x3", "split_dot"), ("bf16x3", "highest"),
        (None, "portable"),
    ]  # fmt: skip
    for r in recs:
        bound = 1e-4 if r["logits_precision"] == "bf16x3" else 1e-5
        assert r["dh_rel"] < bound and r["dw_rel"] < bound, r


def test_family_group_overrides():
    """``--family-*`` overrides reach the family group's jobs, ``--family-no-grad-acc`` included (a False
    override was once dropped with the empty ones, so the oracle ran anyway)."""
    from benchmarks import run

    def jobs(**family):
        return run.suite_jobs("gpu", ["family"], family)

    default = jobs()
    assert default and all(j["opts"]["grad_acc"] for j in default)
    off = jobs(grad_acc=False)
    assert len(off) == len(default) and not any(j["opts"]["grad_acc"] for j in off)
    one = jobs(configs=[("llama3-8b", 4, 2048)], datas=["light"], impls=["filter"])
    assert [(j["shape"], j["opts"]["datas"], j["variant"]) for j in one] == [("llama3-8b", ["light"], run.FILTER_LABEL)]
