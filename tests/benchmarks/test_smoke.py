"""``make bench-smoke`` (benchmarks/smoke.py) runs every benchmark script: a script added without
a smoke entry, or one whose entry names a file that is gone, fails here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import smoke  # noqa: E402

BENCHMARKS = Path(smoke.__file__).resolve().parent
#: runnable scripts smoke.py does not start itself, and why
NOT_SMOKED = {
    "smoke.py": "the runner itself",
    "gpu_check.py": "make gpu-check's (a GPU)",
    "codec_gpu.py": "make gpu-check's (a GPU)",
    "netns.py": "the emulated network every netns entry runs through",
    "tradeoff_report.py": "tradeoff.py's report, which the tradeoff entry runs",
}


def test_every_runnable_benchmark_has_its_smallest_run_in_smoke():
    runnable = {p.name for p in BENCHMARKS.glob("*.py") if "__main__" in p.read_text()}
    smoked = {entry.script for entry in smoke.SMOKES}
    smoked |= {arg.removeprefix("benchmarks/") for entry in smoke.SMOKES for arg in entry.args if arg.endswith(".py")}
    assert runnable - smoked - set(NOT_SMOKED) == set()
    assert smoked <= runnable  # no entry names a script that is gone
    assert set(NOT_SMOKED) <= runnable
