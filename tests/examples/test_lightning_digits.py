"""examples/lightning_digits.py end to end: Lightning launches 2 ranks with BaguaStrategy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_digits.py"
FINAL = re.compile(r"final validation accuracy: (\d+\.\d+) \(world size (\d+), algorithm (\S+)\)")


def test_lightning_digits_trains_on_two_ranks_with_bytegrad():
    cmd = [sys.executable, str(EXAMPLE), "--devices", "2", "--epochs", "3", "--algorithm", "bytegrad"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in 180 s (a hang?)\n{e.stdout}\n{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    found = FINAL.findall(proc.stdout)
    assert len(found) == 1, f"expected one final line (rank 0 only), got {found}:\n{output}"
    accuracy, world, algorithm = found[0]
    assert (world, algorithm) == ("2", "bytegrad")
    assert float(accuracy) > 0.9, output
