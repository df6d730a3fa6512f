"""The scripts under examples/ run as a user runs them (a fresh interpreter, CPU) and their own asserts hold.

``gradient_accumulation.py`` asserts that k micro-batches through ``optax.MultiSteps`` give the whole batch's
SGD update within 1e-5 of each parameter's largest entry (GMPO re-weighted by sequence counts, dapo with the
window's ``num_items_in_batch``; measured ~1e-7), and that the unweighted variants miss by > 1e-2.
``tunix_grpo.py`` trains two steps of Tunix's GRPO learner with the registered fused GMPO loss (skipped
without Tunix).
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def run_example(name: str, timeout: float) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_gradient_accumulation_example():
    out = run_example("gradient_accumulation.py", timeout=120)
    assert "GMPO: update within" in out and "dapo: update within" in out, out


def test_tunix_grpo_example():
    pytest.importorskip("tunix")
    out = run_example("tunix_grpo.py", timeout=240)
    assert "2 steps with 'gmpo'" in out, out
