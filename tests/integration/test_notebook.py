"""The GMPO-vs-GRPO notebook: stored without outputs, in sync with its jupytext twin, and it executes.

Execution takes about two minutes on 2 CPU cores (four short training runs); the same check is available
as ``pytest --nbmake notebooks/``.
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


def test_notebook_executes(tmp_path):
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(IPYNB, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Both objectives learn" in text
