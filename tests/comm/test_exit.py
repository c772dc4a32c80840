"""A job that ends without destroy_process_group() exits 0 (bagua's exit handler tears the groups
down while the interpreter is alive, after stopping background threads); one that raises exits
with its own error. Real 3-rank jobs (tests/comm/_exit_job.py), each rank a real process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_exit_job.py")


def _runs(mode: str, runs: int) -> tuple[list[list[int]], str]:
    done = subprocess.run([sys.executable, str(JOB), mode, str(runs)], capture_output=True, text=True, timeout=40 * runs)
    statuses = [[int(s) for s in re.findall(r"-?\d+", line.split(":", 1)[1])]
                for line in done.stdout.splitlines() if line.startswith("run ")]
    assert done.returncode == 0 and len(statuses) == runs, done.stdout + done.stderr
    return statuses, done.stderr


@pytest.mark.parametrize("mode, runs", [("plain", 20), ("async", 8), ("destroy", 2)])
def test_jobs_that_end_without_destroying_the_groups_exit_zero(mode, runs):
    statuses, stderr = _runs(mode, runs)
    assert statuses == [[0, 0, 0]] * runs, stderr
    assert "terminate called" not in stderr


def test_a_rank_that_raises_exits_with_its_error_and_the_others_finish():
    statuses, stderr = _runs("raise", 2)
    assert statuses == [[0, 1, 0]] * 2, stderr
    assert "rank 1 failed on purpose" in stderr and "terminate called" not in stderr
