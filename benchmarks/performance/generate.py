"""What the generator writes and what ``--check`` compares: docs/performance.md, the blocks and
figures of README.md and docs/, the plots docs/ links (copied into docs/figures/), and the other
generators' parts of docs/ (checked only).

Example::

    stale()      # [] when every figure, block and plot copy matches its results file
    write()      # writes them; returns what still does not match
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Union

from benchmarks.jobs import ROOT
from benchmarks.records import RESULTS

from .markdown import BEGIN, BLOCK_RE, END, FIG_RE, PLOT_LINK_RE, fill, page
from .registry import FIGURES
from .results import Results

PAGE = "docs/performance.md"


def _foreign_blocks() -> list[tuple[str, str, str, Callable[[], str], str]]:
    """The other generators' blocks in docs/: (file, begin, end, their text now, the command that writes it)."""
    from benchmarks.accuracy import time_to_accuracy
    from benchmarks.tradeoff import report  # imports torch and bagua: only when checking

    def tradeoff_text() -> str:
        results = json.loads((RESULTS / "tradeoff.json").read_text())
        fit = json.loads((RESULTS / "tradeoff_model.json").read_text())
        return report.guide_section(results, fit, "tradeoff.png")

    return [("docs/choosing_an_algorithm.md", report.BEGIN, report.END, tradeoff_text,
             "python -m benchmarks.tradeoff.sweep --report"),
            ("docs/convergence.md", time_to_accuracy.BEGIN, time_to_accuracy.END, lambda: time_to_accuracy.generated()[0],
             "python -m benchmarks.accuracy.time_to_accuracy --report")]


def targets(root: Path) -> list[Path]:
    """The files whose figures the generator fills: README.md and every docs page but its own."""
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
            if p.exists() and p != root / PAGE]


def expected(root: Path = ROOT) -> tuple[dict[Path, Union[str, bytes]], list[str]]:
    """Every file the generator writes, with the content it should have, and the problems found."""
    results = Results(root)
    texts, problems = results.values()
    files: dict[Path, Union[str, bytes]] = {}
    if not problems:
        files[root / PAGE] = page(results, texts)
    for path in targets(root):
        files[path] = fill(path.read_text(), texts, str(path.relative_to(root)), problems)
    if (root / "README.md").exists() and "headline" not in dict(BLOCK_RE.findall((root / "README.md").read_text())):
        problems.append(f"README.md: no generated block headline ({BEGIN.format(name='headline')} ... "
                        f"{END.format(name='headline')})")
    plots = sorted({m for path, text in files.items() if path.parent == root / "docs" and isinstance(text, str)
                    for m in PLOT_LINK_RE.findall(text)})
    for plot in plots:
        source = root / "benchmarks" / "figures" / plot
        if source.exists():
            files[root / "docs" / "figures" / plot] = source.read_bytes()
        else:
            problems.append(f"docs/ links figures/{plot}, which benchmarks/figures/ does not have")
    return files, problems


def stale(root: Path = ROOT) -> list[str]:
    """What is out of date, each named; empty when everything matches its results file."""
    files, problems = expected(root)
    for path, want in files.items():
        where = str(path.relative_to(root))
        have = (path.read_bytes() if isinstance(want, bytes) else path.read_text()) if path.exists() else None
        if have == want:
            continue
        if isinstance(want, bytes):
            problems.append(f"{where}: missing or not the same as benchmarks/figures/{path.name}")
            continue
        if have is None:
            problems.append(f"{where}: missing")
            continue
        old, new = dict(FIG_RE.findall(have)), dict(FIG_RE.findall(want))
        named = [f"{where}: figure {n} says {old[n]!r}, its results file gives {v!r} "
                 f"(benchmarks/results/{_source(n)})" for n, v in new.items() if n in old and old[n] != v]
        blocks_old, blocks_new = dict(BLOCK_RE.findall(have)), dict(BLOCK_RE.findall(want))
        named += [f"{where}: generated block {n} is stale" for n in blocks_new if blocks_old.get(n) != blocks_new[n]]
        problems += named or [f"{where}: stale (not what python -m benchmarks.performance writes)"]
    figures_dir = root / "docs" / "figures"
    if figures_dir.exists():
        problems += [f"docs/figures/{p.name}: no page of docs/ links it" for p in sorted(figures_dir.iterdir())
                     if p not in files]
    if root == ROOT:  # the other generators read this checkout's results files only
        for name, begin, end, text, command in _foreign_blocks():
            doc = (root / name).read_text()
            if begin not in doc or end not in doc:
                problems.append(f"{name}: its generated part ({begin}) is missing: run {command}")
            elif doc.split(begin, 1)[1].split(end, 1)[0].strip() != text().strip():
                problems.append(f"{name}: the part between {begin} and {end} is stale: run {command}")
    return problems


def _source(name: str) -> str:
    return next(f.source for f in FIGURES if f.name == name)


def write(root: Path = ROOT) -> list[str]:
    """Write every generated file; returns what still does not match (the other generators' parts)."""
    files, problems = expected(root)
    if problems:
        return problems
    for path, content in files.items():
        have = path.read_bytes() if path.exists() else None
        data = content if isinstance(content, bytes) else content.encode()
        if have != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path.relative_to(root)}")
    figures_dir = root / "docs" / "figures"
    for extra in (p for p in figures_dir.iterdir() if p not in files) if figures_dir.exists() else ():
        extra.unlink()
        print(f"removed {extra.relative_to(root)} (no page links it)")
    return stale(root)

