"""``gmpo-jax train --mesh data=D,model=M``: option validation, and sharded training on 8 simulated devices.

The mesh runs need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX initialises its
CPU backend, which this process has already done with one device, so ``tests/train_mesh_cases.py`` runs
them in a subprocess (as ``tests/integration/test_sharding.py`` does) and prints JSON; meanwhile this process trains
the same configuration on one device, and the test compares the two.

Tolerance. Sharded and single-device runs use the same seed, prompts and sampling keys; JAX's random
numbers do not depend on the sharding, so step 1 samples the very same completions. The float32 results
differ by rounding only: the batch sums are split into per-device partial sums (``psum``), the log-sum-
exp is combined across vocabulary shards and the gradients are all-reduced, so summation order changes
(observed: relative differences of ~1e-6). Losses and metrics are compared with ``rtol=1e-4`` plus
``atol=1e-5`` (the on-policy step-1 GMPO loss is ~1e-8, i.e. zero), tight enough that a wrong normaliser
(a factor of 2 or 4 in a 2 x 2 mesh) or a lost shard fails. Rewards, completion lengths and exact-match
fractions are compared exactly for both steps: step 2 samples from parameters that agree to ~1e-6, so a
token could in principle flip, but none does here (deterministic for a given platform).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import gmpo_jax
from gmpo_jax.train import ConfigError, TrainConfig, cli, loop, parallel

HERE = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(HERE))
import train_mesh_cases  # noqa: E402  (TINY only: importing it runs nothing)

_METRICS = ("loss", "kl", "clip_fraction", "grad_norm", "log_ratio_min", "log_ratio_max")
_SAMPLES = ("reward_mean", "reward_std", "completion_length", "exact_match", "eos_fraction")


# ---------------------------------------------------------------------------------------------
# validation: one line naming --mesh, before anything compiles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mesh, why",
    [
        ("data=2x", "must look like data=D,model=M"),
        ("2,2", "must look like data=D,model=M"),
        ("", "must look like data=D,model=M"),
        ("data=1,tensor=2", "axis names are data and model"),
        ("data=1,data=1", "names the data axis twice"),
        ("data=0,model=1", "axis sizes must be >= 1"),
        ("data=-1", "must look like data=D,model=M"),
        ("data={n},model=1", "needs {n} devices but JAX sees {have}"),  # n = one more device than JAX has
        ("data=1,model={n}", "needs {n} devices but JAX sees {have}"),
    ],
)
def test_bad_mesh_is_one_line_error_before_compiling(mesh, why, capsys, compile_counter):
    have = jax.device_count()
    mesh, why = mesh.format(n=have + 1), why.format(n=have + 1, have=have)
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--mesh", mesh])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("gmpo-jax train: error: --mesh ") and why in err, err
    assert compile_counter == []


def test_mesh_data_axis_must_divide_batch(monkeypatch):
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    with pytest.raises(ConfigError, match=r"^--mesh data=3 must divide --batch-size=16"):
        TrainConfig(mesh="data=3,model=2", batch_size=16, group_size=4).validate()
    assert TrainConfig(mesh=" model = 2 , data = 4 ", batch_size=16, group_size=4).validate().mesh_shape() == (4, 2)


def test_mesh_option_parsed_and_in_help(capsys):
    assert cli.config_from_args(["train", "--mesh", "data=1,model=1"]).mesh == "data=1,model=1"
    assert cli.config_from_args(["train"]).mesh is None
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--mesh" in out and "data=D,model=M" in out


def test_mesh_1x1_calls_the_single_device_program():
    """``data=1,model=1``: a one-device mesh, and the fused functions get no mesh arguments (and no pad)."""
    tm = parallel.make_train_mesh(1, 1)
    assert (tm.data_axis, tm.vocab_axis, tuple(tm.mesh.axis_names)) == (None, None, ("data", "model"))
    w = jax.numpy.ones((4, 15))
    single = (w, gmpo_jax.HeadOptions(weight_layout="hv"), None)
    assert parallel.fused_head(w, "hv", tm) == single and parallel.fused_head(w, "hv", None) == single
    assert parallel.parse_mesh("data=1,model=1") == (1, 1) and parallel.parse_mesh("model=1") == (1, 1)


# ---------------------------------------------------------------------------------------------
# sharded training on 8 simulated CPU devices
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compares with a CPU child process; run on CPU")
def test_mesh_training_matches_single_device(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "train_mesh_cases.py"), str(tmp_path / "mesh")],
        cwd=HERE.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:  # the single-device reference, on this process's device while the child compiles its meshes
        cfg = TrainConfig(**train_mesh_cases.TINY, output_dir=str(tmp_path / "single"))
        base = loop.train(cfg, log=lambda s: None).history
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"tests/train_mesh_cases.py failed (rc={proc.returncode}):\n{out[-8000:]}"
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])

    assert set(result["runs"]) == {"data=2,model=2", "data=4,model=1"}
    for mesh, run in result["runs"].items():
        hist = run["history"]
        assert [h["step"] for h in hist] == [1, 2]
        for h, b in zip(hist, base):
            for k in _METRICS:
                assert np.isfinite(h[k]), (mesh, h)
                np.testing.assert_allclose(h[k], b[k], rtol=1e-4, atol=1e-5, err_msg=f"{mesh} step {h['step']} {k}")
            for k in _SAMPLES:
                assert h[k] == b[k] or (np.isnan(h[k]) and np.isnan(b[k])), (mesh, h["step"], k, h[k], b[k])
    # V = 16 on model=2: the tied embedding and its AdamW moments stay split along V through the updates
    assert result["runs"]["data=2,model=2"]["head_spec"] in ("P('model',)", "P('model', None)")
    assert result["runs"]["data=2,model=2"]["moment_specs"] == [result["runs"]["data=2,model=2"]["head_spec"]]
    assert result["runs"]["data=4,model=1"]["head_spec"] == "P()"

    # V = 15 on model=2: padded to 16, vocab_size=15 masks the padding; same loss and gradients
    for layout, case in result["pad_case"].items():
        assert case["padded_shape"] == [16, 16] and case["vocab_size"] == 15, (layout, case)
        assert case["dw_shape"] == ([16, 15] if layout == "hv" else [15, 16]), (layout, case)
        np.testing.assert_allclose(case["loss"], case["ref_loss"], rtol=1e-5, err_msg=layout)
        assert case["dh_rel"] < 1e-5 and case["dw_rel"] < 1e-5, (layout, case)
