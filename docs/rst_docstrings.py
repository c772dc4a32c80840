"""A Griffe extension for the API reference: bagua's docstrings are Google style with a few reST
habits, rewritten here into the Markdown that mkdocstrings renders (mkdocs.yml loads it; the
docstrings themselves stay as they are, readable in ``help()``).

- a literal block (``Example::`` or ``text::`` and an indented block) becomes a fenced code
  block; a top-level ``Example::`` becomes the ``Examples:`` section;
- a simple table (``====  ====`` borders) becomes a Markdown table, or a list when it has no
  header row and two columns;
- a role (``:class:`X```) becomes inline code.

Example::

    >>> print(markdown("Example::\\n\\n    x = 1"))
    Examples:
        ```python
        x = 1
        ```
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`~?([^`]+)`")
_BORDER = re.compile(r"^(\s*)=+(?:\s+=+)+\s*$")
_SECTION_EXAMPLE = re.compile(r"^Examples?::$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(block: list[str]) -> str:
    first = next(line.strip() for line in block if line.strip())
    if first.startswith(">>>"):
        return "pycon"
    if first.startswith(("python -m", "torchrun", "pip ", "$ ", "make ")):
        return "bash"
    return "python"


def _literal_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        marker = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > marker):
            end += 1
        while end > j and not lines[end - 1].strip():
            end -= 1
        block = lines[j:end]
        if not block:  # "::" with nothing indented after it: not a literal block
            out.append(line)
            i += 1
            continue
        depth = min(_indent(b) for b in block if b.strip())
        code = [b[depth:] for b in block]
        fence = " " * marker
        if marker == 0 and _SECTION_EXAMPLE.match(line.strip()):
            out.append("Examples:")
            fence = "    "
        else:
            text = line.rstrip()[:-2]
            if text.strip():
                out.append(text.rstrip() + ("" if text.endswith(" ") else ":"))
            out.append("")
        out.append(f"{fence}```{_language(block)}")
        out.extend(fence + c if c else "" for c in code)
        out.append(f"{fence}```")
        i = end
    return out


def _cells(line: str, starts: list[int]) -> list[str]:
    bounds = starts[1:] + [None]
    return [line[a:b].strip() for a, b in zip(starts, bounds)]


def _tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        border = lines[i]
        starts = [m.start() for m in re.finditer(r"=+", border)]
        borders = [i]
        j = i + 1
        while j < len(lines) and len(borders) < 3:
            if lines[j].strip() == border.strip():
                borders.append(j)
                if j + 1 >= len(lines) or not lines[j + 1].strip():
                    break
            elif not lines[j].strip():
                break
            j += 1
        if len(borders) < 2:
            out.append(lines[i])
            i += 1
            continue
        header = [] if len(borders) == 2 else [_cells(row, starts) for row in lines[borders[0] + 1:borders[1]]]
        rows: list[list[str]] = []
        for row in lines[borders[-2] + 1:borders[-1]]:
            cells = _cells(row, starts)
            if rows and not cells[0]:  # a continuation line: its cells extend the row above
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
            else:
                rows.append(cells)
        pad = border[:_indent(border)]
        if not header and len(starts) == 2:
            out.extend(f"{pad}- {a}: {b}" for a, b in rows)
        else:
            head = [" / ".join(filter(None, col)) for col in zip(*header)] if header else [""] * len(starts)
            out.append(pad + "| " + " | ".join(head) + " |")
            out.append(pad + "|" + " --- |" * len(starts))
            out.extend(pad + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows)
        i = borders[-1] + 1
    return out


def markdown(text: str) -> str:
    """``text`` (a docstring) with its literal blocks, simple tables and roles in Markdown.

    Example::

        >>> markdown("See :class:`Store`.")
        'See `Store`.'
    """
    text = _ROLE.sub(r"`\1`", text)
    return "\n".join(_tables(_literal_blocks(text.split("\n"))))


class RstDocstrings(griffe.Extension):
    """Rewrites every object's docstring with :func:`markdown` as Griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
