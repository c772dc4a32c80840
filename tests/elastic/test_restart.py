"""torchrun restarts a killed worker: the new attempt forms its groups and finishes.

Without a per-attempt store prefix in bagua.init_process_group, about half of these restarts
failed with Gloo's "connectFullMesh ... Connection refused" or hung: the restarted workers read
the dead attempt's addresses from torchrun's agent store (see bagua/comm/attempt.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_restart_job.py")


@pytest.mark.parametrize("trial", range(1))  # 20 trials: benchmarks/elastic.py
def test_a_killed_worker_is_restarted_and_the_job_exits_0(trial):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", str(JOB)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the restarted job hung (90 s):\n{e.stdout}\n{e.stderr}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "connectFullMesh" not in output
    assert "rank 0 attempt 1 done" in output and "rank 1 attempt 1 done" in output, output[-4000:]
