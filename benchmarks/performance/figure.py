"""One figure of the performance page, and the helpers its entries are written with.

A figure is a value computed from one results file (``value``: the file parsed, a dict for
``.json``, the text for ``.md``), how it is written (``fmt``), and the claim it supports; an
area's module collects its figures with ``Figures``. Example::

    FIGURES = Figures("data")
    FIGURES.add("cache_lmdb_epoch2", "cache.md", lambda t: grab(t, r"lmdb epoch-2 speedup ([\d.]+)x"), "{:.1f}x",
                met=at_least(20), claim="a second epoch from the LMDB cache at least 20x faster than no cache")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union


@dataclass(frozen=True)
class Figure:
    """One figure: ``value(parsed results file)`` written with ``fmt`` (a format string, applied to a
    tuple's items in order, or a function); ``grid``: (grid, row, column) to be shown in that grid
    of its area instead of as a row; ``met``: whether the value meets the claim's target."""

    name: str
    area: str
    source: str
    value: Callable[[Any], Any]
    fmt: Union[str, Callable[[Any], str]] = "{}"
    claim: str = ""
    setting: str = ""
    met: Optional[Callable[[Any], bool]] = None
    grid: Optional[tuple[str, str, str]] = None

    def text(self, value: Any) -> str:
        if value is None:
            return "not measured"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(*value) if isinstance(value, tuple) else self.fmt.format(value)



class Figures(list):
    """The figures of one area of the page, in the order the page shows them."""

    def __init__(self, area: str):
        super().__init__()
        self.area = area

    def add(self, name: str, source: str, value: Callable[[Any], Any], fmt: Union[str, Callable] = "{}",
            **kw: Any) -> None:
        """Register one figure of this area (see ``Figure``)."""
        self.append(Figure(name, self.area, source, value, fmt, **kw))


# --- parsing helpers for the results files written as markdown, and the usual formats --------

def grab(text: str, pattern: str) -> float:
    """The number of ``pattern``'s first group in ``text``; a clear error when absent."""
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"no match for {pattern!r}")
    return float(m.group(1))


def md_cell(text: str, column: str, **match: str) -> str:
    """The ``column`` cell of the first row of a markdown table whose cells in ``match``'s columns
    (underscores for spaces) equal the given text; bold marks dropped."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip())):
            continue
        header = [c.strip() for c in line.strip().strip("|").split("|")]
        wanted = {k.replace("_", " "): v for k, v in match.items()}
        if column not in header or any(k not in header for k in wanted):
            continue
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip().replace("**", "") for c in row.strip().strip("|").split("|")]
            if all(cells[header.index(k)] == v for k, v in wanted.items()):
                return cells[header.index(column)]
    raise ValueError(f"no table row with {match} and a column {column!r}")



def ratio(x: float) -> str:
    return f"{x:.2f}x"


def pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def at_least(bound: float) -> Callable[[float], bool]:
    return lambda v: v >= bound


def at_most(bound: float) -> Callable[[float], bool]:
    return lambda v: v <= bound

