"""The python blocks of README.md and docs/*.md, each named by its document and the heading above it.

A block's ``key`` is ``"<doc> > <heading>"``, with ``" #<n>"`` for the n-th (from 0) block under the
same heading when there are several, so it stays put when other sections change. Any fence whose
language is a Python one (``python``, ``py``, ``python3``, ``pycon``) counts: a block cannot leave the
test suite by a spelling.

Example::

    block = find("docs/data.md > Caching a dataset")
    exec(block.compile(), namespace)           # tracebacks name the document's own line numbers
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON_FENCES = {"python", "py", "python3", "pycon"}
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    doc: str  # relative to the repository: "README.md", "docs/data.md"
    heading: str  # the nearest heading above the block, as written
    index: int  # its place among the python blocks under that heading
    line: int  # the line of its first line of code, from 1
    code: str

    @property
    def key(self) -> str:
        return f"{self.doc} > {self.heading}" + (f" #{self.index}" if self.index else "")

    def compile(self):
        """The block as code whose line numbers are the document's."""
        return compile("\n" * (self.line - 1) + self.code, str(ROOT / self.doc), "exec")


def documents() -> list[str]:
    """README.md and every docs/*.md (not docs/api/: the reference pages hold no recipes)."""
    return ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def python_blocks(doc: str) -> list[Block]:
    """Every python block of ``doc``, in order."""
    blocks: list[Block] = []
    heading, fence, language, start, lines = "", None, "", 0, []
    per_heading: dict[str, int] = {}
    for number, text in enumerate((ROOT / doc).read_text().splitlines(), start=1):
        if fence is None:
            opening = _FENCE.match(text)
            if opening:
                fence, language, start, lines = opening.group(1), opening.group(2).lower(), number + 1, []
            elif _HEADING.match(text):
                heading = _HEADING.match(text).group(1)
            continue
        if text.strip().startswith(fence[0] * len(fence)) and not text.strip().strip(fence[0]):
            if language in PYTHON_FENCES:
                index = per_heading.get(heading, 0)
                per_heading[heading] = index + 1
                blocks.append(Block(doc, heading, index, start, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(text)
    if fence is not None:
        raise ValueError(f"{doc}: the code block opened at line {start - 1} is never closed")
    return blocks


def all_blocks() -> dict[str, Block]:
    """Every python block of the README and the guides, by key."""
    return {b.key: b for doc in documents() for b in python_blocks(doc)}


def find(key: str) -> Block:
    """The block named ``key`` (a clear error naming the blocks there are, if it moved)."""
    blocks = all_blocks()
    if key not in blocks:
        doc = key.split(" > ", 1)[0]
        there = [k for k in blocks if k.startswith(doc + " > ")]
        raise KeyError(f"no python block {key!r}; {doc} has {there}")
    return blocks[key]
