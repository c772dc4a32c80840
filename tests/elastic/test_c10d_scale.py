"""Scale down and up under ``torchrun --nnodes 1:2 --rdzv-backend c10d``: two agents on this machine.

examples/elastic_digits.py trains at world size 2; one agent is killed with its worker (SIGKILL)
and training goes on at world size 1 from the last checkpoint; the agent is started again and
training goes on at world size 2. Every epoch, gathered over the attempts, trains on each sample
once (up to the sampler's padding at world size 2), and both agents exit 0.
"""

from __future__ import annotations

import pytest

from benchmarks.scale.elastic import run_c10d_scale

TRAIN_SAMPLES = 1437  # the digits' training split
# World size 1 trains from epoch 1 for ~4 epochs (~13 s here) until the restarted agent has joined
# (~10 s after its launch, under load); 16 epochs leave it ~45 s and end the job ~20 s after the
# join (40 took another minute at world size 2 and tested nothing more)
EPOCHS = 16


def test_a_lost_node_scales_the_job_down_and_a_returning_one_up(tmp_path):
    try:
        result = run_c10d_scale(tmp_path, epochs=EPOCHS, timeout=150)
    except RuntimeError as e:
        pytest.fail(str(e))
    assert result["exit_codes"] == [0, 0]
    assert result["worlds"][-3:] == [2, 1, 2], result["worlds"]
    assert sorted(result["epochs"]) == list(range(EPOCHS))
    for epoch, samples in result["epochs"].items():
        assert sorted(set(samples)) == list(range(TRAIN_SAMPLES)), epoch
        # padding: one sample repeated per part of the epoch trained at world size 2
        assert TRAIN_SAMPLES <= len(samples) <= TRAIN_SAMPLES + 2, (epoch, len(samples))
