"""The README and the docstrings stay an entry, not a lab notebook, and the docs' links and example hold.

- README.md (prose, fenced code left out) and every module / class / function docstring under gmpo_jax/ carry
  no commit-like token (7-40 lowercase hex digits with at least one digit and one letter), no ISO date and no
  month-name date: measured numbers and their provenance belong in docs/performance.md and the records.
- README.md is at most 12.5 KB.
- Every relative link of README.md and docs/*.md points at an existing file, and its ``#fragment`` (or a
  same-page ``#fragment``) at a heading of the target.
- The README's "A Flax NNX train step" block is examples/nnx_train_step.py verbatim, and that script runs: its
  first step is on-policy (GMPO's loss is then ``-mean(advantages)`` exactly) and its updates raise the
  log-probs of the positive-advantage completions and lower those of the negative ones.
"""

import ast
import contextlib
import io
import pathlib
import re
import runpy

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_BYTES = 12_800  # 12.5 KB

COMMIT = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
ISO_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
    r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
MONTH_DATE = re.compile(rf"\b{_MONTH}\.? (?:\d{{1,2}}(?:st|nd|rd|th)?,? )?20\d\d\b|\b\d{{1,2}} {_MONTH}\.?,? 20\d\d\b")
PATTERNS = {"commit-like token": COMMIT, "ISO date": ISO_DATE, "month-name date": MONTH_DATE}


def offences(text: str, first_line: int, where: str) -> list[str]:
    """``where:line: kind 'match' in: line`` for every pattern match of ``text`` (line 1 = ``first_line``)."""
    out = []
    for i, line in enumerate(text.splitlines()):
        for kind, pattern in PATTERNS.items():
            out += [
                f"{where}:{first_line + i}: {kind} {m.group()!r} in: {line.strip()}" for m in pattern.finditer(line)
            ]
    return out


def readme_prose() -> list[tuple[int, str]]:
    """(line number, line) of README.md outside fenced code blocks."""
    lines, fenced = [], False
    for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((n, line))
    return lines


def docstrings(path: pathlib.Path):
    """(first line, text) of the module's, and every class' and function's, docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    yield first.lineno, first.value.value


def test_patterns_catch_what_they_are_for():
    """The patterns flag hashes and dates, and not hex-free words, numbers or version strings."""
    hits = lambda s: [k for k, p in PATTERNS.items() if p.search(s)]  # noqa: E731
    assert hits("measured at 4839fc4") == ["commit-like token"]
    assert hits("commit 1b11582 and c12a289") == ["commit-like token"]
    assert hits("on 2026-12-03") == ["ISO date"]
    assert hits("on December 3, 2026") == ["month-name date"] and hits("3 Dec 2026") == ["month-name date"]
    for fine in ("deadline", "151936 columns", "jax 0.11.2", "dtype=bfloat16", "feedface", "0x1f", "arXiv 2507.20673"):
        assert hits(fine) == [], fine


def test_readme_has_no_commit_or_date():
    bad = [o for n, line in readme_prose() for o in offences(line, n, "README.md")]
    assert not bad, "\n".join(bad)


def test_docstrings_have_no_commit_or_date():
    """Fails on main until the docstrings of every package under gmpo_jax/ are scrubbed (the list it prints)."""
    bad = []
    for path in sorted((ROOT / "gmpo_jax").rglob("*.py")):
        for line, text in docstrings(path):
            bad += offences(text, line, str(path.relative_to(ROOT)))
    assert not bad, f"{len(bad)} docstring line(s):\n" + "\n".join(bad)


def test_readme_size():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_slugs(md: pathlib.Path) -> set[str]:
    """GitHub's anchors of the headings of ``md`` (lower case; punctuation but ``-`` / ``_`` dropped)."""
    slugs = set()
    for line in md.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slugs.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return slugs


@pytest.mark.parametrize("md", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    bad = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif fragment and dest.suffix == ".md" and fragment not in heading_slugs(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not bad, f"{md.name}:\n" + "\n".join(bad)


EXAMPLE = ROOT / "examples" / "nnx_train_step.py"


def test_readme_nnx_step_is_the_example():
    text = README.read_text(encoding="utf-8")
    section = text.split("## A Flax NNX train step", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert code == EXAMPLE.read_text(encoding="utf-8"), "README's NNX block differs from examples/nnx_train_step.py"


def test_nnx_example_runs_and_learns():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns = runpy.run_path(str(EXAMPLE), run_name="__main__")
    losses = [float(m) for m in re.findall(r"step \d+: loss ([-+0-9.]+)", out.getvalue())]
    assert len(losses) == 3, out.getvalue()
    adv, mask = np.asarray(ns["advantages"]), np.asarray(ns["completion_mask"])
    # on-policy GMPO: every sequence ratio is 1, the loss -mean(A) (printed to 4 decimals)
    assert losses[0] == pytest.approx(-adv.mean(), abs=1e-4)
    assert losses[2] < losses[1] < losses[0]
    new = np.asarray(ns["logprobs"](ns["model"], ns["inputs"], ns["completion_ids"], ns["completion_mask"]))
    shift = ((new - np.asarray(ns["old_logps"])) * mask).sum(1) / mask.sum(1)
    assert np.all(np.sign(shift) == np.sign(adv)), (shift, adv)


def test_readme_headline_is_generated_from_the_records():
    """The README's performance table is what ``python -m benchmarks.report`` makes of the H200 records now."""
    from benchmarks import report

    recs = report.load(sorted(str(p) for p in (ROOT / "benchmarks" / "results").glob("*.jsonl")))["nvidia-h200"]
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- bench:headline:start -->\n", 1)[1].split("\n<!-- bench:headline:end -->", 1)[0]
    assert block == report.block_headline(recs)
