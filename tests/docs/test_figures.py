"""Every performance figure in README.md and docs/ matches its results file
(python -m benchmarks.performance), the check can fail, and the README quotes no figure by hand."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import performance

ROOT = Path(__file__).resolve().parents[2]

# a performance figure's shape: a ratio (3.5x), a percentage, a duration, a size in MB or GB, a rate
# of work. Link speeds (100 Mbit/s) are settings, not figures; sizes in MiB are configuration.
FIGURE_LIKE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s?(?:x\b|%|ms\b|us\b|s\b|min\b|MB\b|GB\b)|"
                         r"\s?(?:MB|GB|TB|tokens|samples)/s)")


def test_every_figure_matches_its_results_file():
    assert performance.stale() == []


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The files the generator reads and writes, copied: README.md, docs/, the results and plots."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for part in ("results", "figures"):
        shutil.copytree(ROOT / "benchmarks" / part, tmp_path / "benchmarks" / part)
    return tmp_path


def test_a_changed_results_file_names_every_stale_figure_and_the_generator_rewrites_them(copy: Path):
    assert performance.stale(copy) == []
    results = copy / "benchmarks" / "results" / "ddp_striped_backend.json"
    data = json.loads(results.read_text())
    data["key"]["ddp_striped_speedup_100mbit-per-flow-streams1_x2"] = 9.876
    results.write_text(json.dumps(data))
    problems = performance.stale(copy)
    said = "says '6.56x', its results file gives '9.88x' (benchmarks/results/ddp_striped_backend.json)"
    for where in ("docs/performance.md", "docs/striped_connections.md", "README.md"):
        assert f"{where}: figure striped_per_flow {said}" in problems, problems
    assert "README.md: generated block headline is stale" in problems
    assert performance.write(copy) == []
    assert "<!--fig:striped_per_flow-->9.88x<!--/fig-->" in (copy / "docs" / "striped_connections.md").read_text()
    assert performance.stale(copy) == []


def test_a_figure_edited_by_hand_is_named(copy: Path):
    guide = copy / "docs" / "striped_connections.md"
    guide.write_text(guide.read_text().replace("<!--fig:hf_trainer_8bit-->4.20x", "<!--fig:hf_trainer_8bit-->4.5x"))
    assert performance.stale(copy) == [
        "docs/striped_connections.md: figure hf_trainer_8bit says '4.5x', its results file gives '4.20x' "
        "(benchmarks/results/hf_trainer.json)"]


def test_an_unknown_figure_a_stale_plot_copy_and_a_plot_no_page_links_are_named(copy: Path):
    guide = copy / "docs" / "convergence.md"
    guide.write_text(guide.read_text() + "\nIt is <!--fig:no_such_figure-->2x<!--/fig--> faster.\n")
    plot = copy / "docs" / "figures" / "tradeoff.png"
    plot.write_bytes(plot.read_bytes()[:-1])
    shutil.copy(copy / "benchmarks" / "figures" / "comm_busbw.png", copy / "docs" / "figures" / "comm_busbw.png")
    problems = performance.stale(copy)
    assert any(p.startswith("docs/convergence.md: unknown figure 'no_such_figure'") for p in problems), problems
    assert "docs/figures/tradeoff.png: missing or not the same as benchmarks/figures/tradeoff.png" in problems
    assert "docs/figures/comm_busbw.png: no page of docs/ links it" in problems


def test_a_readme_without_the_headline_block_is_named(copy: Path):
    readme = copy / "README.md"
    readme.write_text(performance.BLOCK_RE.sub("", readme.read_text()))
    assert any(p.startswith("README.md: no generated block headline") for p in performance.stale(copy))


def test_every_results_file_is_shown_or_said_why_not():
    files = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    results = performance.Results()
    results.values()
    assert files - results.read - set(performance.NOT_SHOWN) == set(), \
        "no figure reads these results files: add their figures to benchmarks/performance/areas/ (or say in NOT_SHOWN why not)"
    assert results.read | set(performance.NOT_SHOWN) | set(performance.RECORDED) <= files
    assert len({f.name for f in performance.FIGURES}) == len(performance.FIGURES)


def test_the_page_says_where_each_figure_comes_from():
    page = (ROOT / "docs" / "performance.md").read_text()
    for source in {f.source for f in performance.FIGURES}:
        section = page.split(f"### From `{source}`", 1)[1].strip().split("\n\n", 1)[0]
        for fact in ("**Date:**", "**Machine:**", "**Command:**", "**Results:**", "**Plot:**"):
            assert fact in section, (source, section)
    assert "](figures/tradeoff.png)" in page


def readme_figures_by_hand(text: str) -> list[str]:
    """Figure-like numbers in ``text`` outside code, generated blocks and figure markers."""
    for pattern in (r"```.*?```", performance.BLOCK_RE.pattern, performance.FIG_RE.pattern, r"`[^`\n]*`"):
        text = re.sub(pattern, "", text, flags=re.S)
    return [m.group(0) for m in FIGURE_LIKE.finditer(text)]


def test_the_readme_quotes_no_figure_by_hand():
    assert readme_figures_by_hand((ROOT / "README.md").read_text()) == [], \
        "write a measured figure as <!--fig:NAME-->...<!--/fig--> (benchmarks/performance/areas/)"


def test_the_readme_lint_sees_a_figure_by_hand():
    assert readme_figures_by_hand("bytegrad is 3.9x faster at 100 Mbit/s, 20% fewer steps, a 0.5 s step, "
                                  "9778 tokens/s; `make test` (`8 min`)\n```\n2.5x\n```\n"
                                  "<!--fig:speed_bytegrad_bw-10mbit-->3.56x<!--/fig-->") == \
        ["3.9x", "20%", "0.5 s", "9778 tokens/s"]
