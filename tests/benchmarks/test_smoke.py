"""``make bench-smoke`` (benchmarks/smoke.py) runs every benchmark: a runnable module added without a
smoke entry, or an entry that names a module that is gone, fails here."""

from __future__ import annotations

from pathlib import Path

from benchmarks import smoke

BENCHMARKS = Path(smoke.__file__).resolve().parent
#: runnable modules smoke.py does not start itself, and why
NOT_SMOKED = {
    "benchmarks.smoke": "the runner itself",
    "benchmarks.gpu.check": "make gpu-check's (a GPU)",
    "benchmarks.gpu.codec": "make gpu-check's (a GPU)",
    "benchmarks.tradeoff.report": "the sweep's report, which the tradeoff entry runs",
    "benchmarks.performance": "the performance page's generator, whose check tests/docs/test_figures.py runs",
    "benchmarks.network.probes": "the emulated network's probes, which tests/comm runs as ranks",
    "benchmarks.network.delay_line": "the emulated network's delay line, which every --delay starts",
}


def module_name(path: Path) -> str:
    """``benchmarks/step/ddp.py`` -> ``benchmarks.step.ddp``; a package's ``__main__.py``: the package."""
    parts = path.relative_to(BENCHMARKS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__main__" else parts)


def runnable_modules() -> set[str]:
    return {module_name(p) for p in BENCHMARKS.rglob("*.py")
            if p.name == "__main__.py" or 'if __name__ == "__main__"' in p.read_text()}


def test_every_runnable_benchmark_has_its_smallest_run_in_smoke():
    runnable = runnable_modules()
    smoked = {entry.module for entry in smoke.SMOKES}
    smoked |= {entry.args[i + 1] for entry in smoke.SMOKES for i, arg in enumerate(entry.args[:-1]) if arg == "-m"}
    assert runnable - smoked - set(NOT_SMOKED) == set()
    assert smoked <= runnable  # no entry names a module that is gone
    assert set(NOT_SMOKED) <= runnable


def test_the_module_names_are_those_python_m_runs():
    assert module_name(BENCHMARKS / "step" / "ddp.py") == "benchmarks.step.ddp"
    assert module_name(BENCHMARKS / "performance" / "__main__.py") == "benchmarks.performance"
    assert {"benchmarks.step.ddp", "benchmarks.network.netns", "benchmarks.performance"} <= runnable_modules()
