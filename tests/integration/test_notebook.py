"""The GMPO-vs-GRPO notebook: stored without outputs, in sync with its jupytext twin, and it executes.

As stored, execution takes about two minutes on 2 CPU cores (four training runs of 60 steps; the same check
is available as ``pytest --nbmake notebooks/``). Here every cell runs with a smaller configuration: a cell
inserted after the one that defines ``BASE`` validates the stored configuration (``TrainConfig.validate``
for both objectives) and then shrinks it to 22 steps of 32 completions (past step 20, so that every
summary window of the notebook is non-empty).
"""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent.parent / "notebooks"
IPYNB = NOTEBOOKS / "gmpo_vs_grpo.ipynb"
TWIN = NOTEBOOKS / "gmpo_vs_grpo.py"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(IPYNB, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_matches_its_jupytext_twin():
    a = nbformat.read(IPYNB, as_version=4)
    b = jupytext.read(TWIN)
    assert [(c.cell_type, c.source.strip()) for c in a.cells] == [(c.cell_type, c.source.strip()) for c in b.cells]


SHRINK = """\
for _lt in OBJECTIVES:  # the stored configuration is valid as it stands
    TrainConfig(loss_type=_lt, output_dir=out_root, **BASE).validate()
assert BASE["steps"] > 22 and BASE["batch_size"] > 32
BASE.update(steps=22, batch_size=32)
"""


def test_notebook_executes(tmp_path):
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(IPYNB, as_version=4)
    at = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "BASE = dict(" in c.source]
    assert len(at) == 1, "the cell that defines BASE"
    nb.cells.insert(at[0] + 1, nbformat.v4.new_code_cell(SHRINK))
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Both objectives learn" in text
