"""The results files the figures are computed from, each parsed once, and each file's facts
(date, machine, command, plot, its section of RESULTS.md).

Example::

    results = Results()
    texts, errors = results.values()       # every figure's text by name; errors name figure and file
    results.facts("tradeoff.json")["command"]
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.jobs import ROOT

from .figure import Figure
from .registry import CPU_BOX, FIGURES, RECORDED, Recorded


class Results:
    """The parsed results files under ``root``/benchmarks/results, each read once; ``read`` names
    those read. A JSON file's dict carries ``_results`` (this), for the figures that read a second
    file beside it."""

    def __init__(self, root: Path = ROOT):
        self.dir = root / "benchmarks" / "results"
        self._cache: dict[str, Any] = {}
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        if name not in self._cache:
            path = self.dir / name
            if not path.exists():
                raise FileNotFoundError(f"benchmarks/results/{name} does not exist")
            if name.endswith(".json"):
                self._cache[name] = {**json.loads(path.read_text()), "_results": self}
            else:
                self._cache[name] = path.read_text()
        return self._cache[name]

    def values(self) -> tuple[dict[str, str], list[str]]:
        """Every figure's text, by name, and the errors of those that could not be computed."""
        texts, errors = {}, []
        for f in FIGURES:
            try:
                texts[f.name] = f.text(f.value(self[f.source]))
            except Exception as e:  # noqa: BLE001 - named with its figure and file, not hidden
                errors.append(f"figure {f.name}: benchmarks/results/{f.source}: {type(e).__name__}: {e}")
        return texts, errors

    def status(self, f: Figure) -> str:
        if f.met is None:
            return ""
        try:
            return "met" if f.met(f.value(self[f.source])) else "not met"
        except Exception:  # noqa: BLE001 - values() reports it
            return ""

    def facts(self, name: str) -> dict[str, str]:
        """Date, machine, command, plot and RESULTS.md section of one results file."""
        doc, rec = self[name], RECORDED.get(name, Recorded(""))
        if isinstance(doc, str):
            date = re.search(r"Date:\s*(\d{4}-\d{2}-\d{2})", doc)
            machine = re.search(r"Machine:\s*(.+?)(?:\.\s|\n\n|\n- )", doc, re.S)
            command = re.search(r"Command:\s*`([^`]+)`", doc)
            plot = re.search(r"Plot:\s*`benchmarks/figures/([\w.-]+)`", doc)
            facts = {"date": date and date.group(1), "machine": machine and " ".join(machine.group(1).split()),
                     "command": command and command.group(1), "plot": plot and plot.group(1)}
        else:
            dates = sorted({doc["date"]} if "date" in doc else {
                w["date"] for v in doc.values() if isinstance(v, dict)
                for w in v.values() if isinstance(w, dict) and "date" in w})
            machine = doc.get("machine")
            if isinstance(machine, dict):
                machine = machine.get("description")
            if isinstance(machine, str) and "torch" in doc:
                machine += f", torch {doc['torch']}"
            command = doc.get("command")
            if command is None and rec.module and "argv" in doc:
                argv = list(doc["argv"])
                if "--out" in argv:  # where the run wrote it then; the file lives here now
                    argv[argv.index("--out") + 1] = f"benchmarks/results/{name}"
                command = " ".join(["python", "-m", rec.module, *argv])
            facts = {"date": " to ".join(dict.fromkeys([dates[0], dates[-1]])) if dates else None,
                     "machine": machine, "command": command, "plot": None}
        for key in ("date", "command", "plot"):
            facts[key] = facts[key] or getattr(rec, key)
        facts["machine"] = facts["machine"] or CPU_BOX
        facts["section"] = rec.section
        return facts

