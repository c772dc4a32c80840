"""The markdown the generator writes: docs/performance.md, the README's headline block, and the
markers it fills in README.md and docs/ (generated blocks and inline figures).

Example::

    marked("striped_per_flow", "6.56x")    # '<!--fig:striped_per_flow-->6.56x<!--/fig-->'
    fill(text, texts, "README.md", problems)   # text with its blocks and inline figures rewritten
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from .registry import AREAS, FIGURES, HEADLINE, HEADLINE_PLOT, PROSE_ONLY, Area
from .results import Results

BEGIN = "<!-- BEGIN GENERATED: {name} (python -m benchmarks.performance; do not edit) -->"
END = "<!-- END GENERATED: {name} -->"
#: a generated block; the command in its begin marker may be an older one (rewritten with the block)
BLOCK_RE = re.compile(r"<!-- BEGIN GENERATED: ([\w.-]+) \(python [^;()]+; do not edit\) -->"
                      r"(.*?)<!-- END GENERATED: \1 -->", re.S)
FIG_RE = re.compile(r"<!--fig:([\w.-]+)-->(.*?)<!--/fig-->", re.S)
PLOT_LINK_RE = re.compile(r"\]\(figures/([\w.-]+\.png)\)")


def marked(name: str, text: str) -> str:
    return f"<!--fig:{name}-->{text}<!--/fig-->"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


GRID_TITLES = {
    "speed": "Speed against torch DDP fp32: its epoch time over the variant's (above 1x is faster). 4 ranks, each its "
             "own machine; the tradeoff sweep's GPT-2 LM; each column one job with the variants interleaved.",
    "tta": "Against torch DDP on the LM of convergence.md (AdamW): steps and time to DDP's validation loss after its "
           "own run, and the loss at DDP's last step. Times are the deterministic curves' steps timed on each link.",
}


def page(results: Results, texts: dict[str, str]) -> str:
    """docs/performance.md."""
    out = ["# Performance figures", "",
           "_Generated from `benchmarks/results/` by `python -m benchmarks.performance`; do not edit. "
           "`benchmarks/RESULTS.md` keeps the dated history of every figure and the reasoning behind it._", "",
           "One figure per claim: the latest run kept in a results file. Each group of figures names the run it comes "
           "from: its date, the machine, the command that wrote it (its `--out` pointed at the results file named) "
           "and its plot. Every bandwidth-limited setting is emulated on one machine (`benchmarks/network/`: each "
           "emulated machine in its own network namespace behind a shaped link), so CPU is shared by all ranks: the "
           "ratios hold for the setting named, not for every cluster.", "",
           "How fast is an algorithm at a link speed? One grid answers it: [Algorithms at network speeds]"
           "(#algorithms-at-network-speeds).", ""]
    out += ["Contents: " + " · ".join(f"[{a.title}](#{_slug(a.title)})" for a in AREAS), ""]
    for area in AREAS:
        out += [f"## {area.title}", "", area.intro, ""]
        figures = [f for f in FIGURES if f.area == area.key]
        for source in dict.fromkeys(f.source for f in figures):
            facts = results.facts(source)
            here = [f for f in figures if f.source == source]
            out += [f"### From `{source}`", "",
                    f"- **Date:** {facts['date'] or 'not recorded'}",
                    f"- **Machine:** {facts['machine']}",
                    f"- **Command:** `{facts['command']}`" if facts["command"] else "- **Command:** not recorded",
                    f"- **Results:** `benchmarks/results/{source}`; history: RESULTS.md, \"{facts['section']}\"",
                    f"- **Plot:** [{facts['plot']}](figures/{facts['plot']})" if facts["plot"] else "- **Plot:** none",
                    ""]
            for grid in dict.fromkeys(f.grid[0] for f in here if f.grid):
                cells = [f for f in here if f.grid and f.grid[0] == grid]
                at = {(f.grid[1], f.grid[2]): f for f in cells}
                columns = list(dict.fromkeys(f.grid[2] for f in cells))
                rows = [row for row in dict.fromkeys(f.grid[1] for f in cells)  # a variant this run did not measure: no row
                        if any(texts.get(at[row, c].name) != "not measured" for c in columns if (row, c) in at)]
                out += [GRID_TITLES[grid], "",
                        _table(["variant", *columns], [[row] + [marked(at[row, c].name, texts.get(at[row, c].name, "?"))
                                                               if (row, c) in at else "" for c in columns]
                                                      for row in rows]), ""]
            plain = [f for f in here if not f.grid]
            if plain:
                out += [_table(["claim", "figure", "setting", "status"],
                               [[f.claim, marked(f.name, texts.get(f.name, "?")), f.setting, results.status(f)]
                                for f in plain]), ""]
            if facts["plot"]:
                out += [f"![{source}](figures/{facts['plot']})", ""]
        prose = [(claim, section) for a, claim, section in PROSE_ONLY if a == area.key]
        if prose:
            out += ["Recorded in `benchmarks/RESULTS.md` only (no results file holds these figures):", ""]
            out += [f"- {claim}: \"{section}\"." for claim, section in prose] + [""]
    return "\n".join(out).rstrip() + "\n"


def _slug(title: str) -> str:
    """The anchor both GitHub and MkDocs give a heading of plain words."""
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def headline(texts: dict[str, str]) -> str:
    """The README's block: the headline figures and one plot."""
    by = {f.name: f for f in FIGURES}
    rows = [[re.sub(r"\{([\w.-]+)\}", lambda m: marked(m.group(1), texts.get(m.group(1), "?")), label),
             marked(name, texts.get(name, "?")), by[name].setting or by[name].claim,
             f"[{_area(by[name].area).title}](docs/performance.md#{_slug(_area(by[name].area).title)})"]
            for name, label in HEADLINE]
    return "\n".join([_table(["", "figure", "setting", "more"], rows), "",
                      f"![epoch time of every algorithm against bandwidth and latency](benchmarks/figures/{HEADLINE_PLOT})",
                      "", "Every figure with its date, machine and command: [docs/performance.md](docs/performance.md)."])


def _area(key: str) -> Area:
    return next(a for a in AREAS if a.key == key)


BLOCKS: dict[str, Callable[[dict[str, str]], str]] = {"headline": headline}


def fill(text: str, texts: dict[str, str], where: str, problems: list[str]) -> str:
    """``text`` with its generated blocks and inline figures rewritten; unknown names go to ``problems``."""
    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in BLOCKS:
            problems.append(f"{where}: unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
            return m.group(0)
        return f"{BEGIN.format(name=name)}\n{BLOCKS[name](texts)}\n{END.format(name=name)}"

    def figure(m: re.Match) -> str:
        if m.group(1) not in texts:
            problems.append(f"{where}: unknown figure {m.group(1)!r} (not in the registry, benchmarks/performance/areas/)")
            return m.group(0)
        return marked(m.group(1), texts[m.group(1)])

    return FIG_RE.sub(figure, BLOCK_RE.sub(block, text))
