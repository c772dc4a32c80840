"""torchrun restarts a killed worker: the new attempt forms its groups and finishes.

Without a per-attempt store prefix in bagua.init_process_group, about half of these restarts
failed with Gloo's "connectFullMesh ... Connection refused" or hung: the restarted workers read
the dead attempt's addresses from torchrun's agent store (see bagua/comm/attempt.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tests.harness import run_command

JOB = Path(__file__).with_name("_restart_job.py")


@pytest.mark.parametrize("trial", range(1))  # 20 trials: python -m benchmarks.scale.elastic
def test_a_killed_worker_is_restarted_and_the_job_exits_0(trial):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", str(JOB)]
    run = run_command(cmd, timeout=90)
    output = run.stdout + run.stderr
    assert "connectFullMesh" not in output
    assert "rank 0 attempt 1 done" in output and "rank 1 attempt 1 done" in output, output[-4000:]
