"""The package's import layering: leaves (objectives, _validation, _lse, tuning, _dispatch, _device, batch, options)
<- kernels <-
each op (lm_head/, logits/), and never one op importing the other. Every ``import`` / ``from ... import`` of
``gmpo_jax`` modules is read from the source (lazy imports inside functions included)."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(os.environ.get("GMPO_LAYERING_ROOT", pathlib.Path(__file__).resolve().parents[2])) / "gmpo_jax"
LEAVES = ("objectives", "_validation", "_lse", "tuning", "_dispatch", "_device", "batch", "options")
# group -> the groups it must not import
FORBIDDEN = {
    **{leaf: ("kernels", "lm_head", "logits") for leaf in LEAVES},
    "kernels": ("lm_head", "logits"),
    "lm_head": ("logits",),
    "logits": ("lm_head",),
}


def _group(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "gmpo_jax" or len(parts) < 2:
        return None
    return parts[1]


def import_graph() -> dict[str, set[str]]:
    """``{group: {imported groups}}`` over ``gmpo_jax/`` (a group: the first component below ``gmpo_jax``)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        group = _group(".".join(rel.parts))
        if group is None:
            continue
        graph.setdefault(group, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "gmpo_jax"]
            for name in names:
                other = _group(name)
                if other is not None and other != group:
                    graph[group].add(other)
    return graph


@pytest.mark.parametrize("group", sorted(FORBIDDEN))
def test_no_layering_inversion(group):
    imported = import_graph().get(group, set())
    bad = sorted(imported & set(FORBIDDEN[group]))
    assert not bad, f"gmpo_jax.{group} imports {bad}"


if __name__ == "__main__":  # print the graph
    for g, deps in sorted(import_graph().items()):
        print(f"{g:14s} -> {', '.join(sorted(deps)) or '-'}")
