"""The job's timeout holds on every group bagua makes after init, not torch's 30-minute default.

One 2-rank job with ``init_process_group(timeout=5 s)``, each rank on its own "machine" (so groups
get stripes): both ranks build every kind of group, then rank 1 stays alive but stops (as a rank
stuck in its data loader would) while rank 0 runs one operation on each group. Each must
fail with a ``CollectiveError`` naming the operation after the timeout, not after the peer comes
back. Rank 1 leaves as soon as rank 0 has its errors.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import time
from pathlib import Path

import pytest
import torch

import bagua
from tests.harness import run_ranks
from tests.parallel.models import make_model, rank_batches

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("timeout")

TIMEOUT_S = 5.0
STUCK_S = 45.0  # how long rank 1 stays away at most: far beyond the timeout
EXPLICIT_S = 3.0  # new_group(timeout=...) overrides the job's
CASES = {"gradient_allreduce": TIMEOUT_S, "bytegrad": TIMEOUT_S, "decentralized": TIMEOUT_S, "new_group": TIMEOUT_S,
         "striped_new_group": TIMEOUT_S, "new_group_explicit_timeout": EXPLICIT_S}


def _step(ddp, opt) -> None:
    x, y = rank_batches(0, 1)[0]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _everything_times_out(rank: int, directory: str) -> dict:
    os.environ["BAGUA_NET_MIN_CHUNKSIZE"] = "1024"  # a 4 KB message goes in two pieces
    # No agreement check: it runs on stripe 0 alone, and the striped case is to wait on every stripe.
    bagua.init_process_group(timeout=datetime.timedelta(seconds=TIMEOUT_S), streams=2, check_collectives=False)
    operations = {}
    for algorithm in ("gradient_allreduce", "bytegrad", "decentralized"):  # each wrapper: its own communicator
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = bagua.DistributedDataParallel(model, [opt], algorithm=algorithm)
        operations[algorithm] = lambda ddp=ddp, opt=opt: _step(ddp, opt)
    plain = bagua.comm.new_group([0, 1])
    operations["new_group"] = lambda: bagua.comm.allreduce(torch.ones(4), group=plain)
    striped = bagua.comm.new_group([0, 1])
    assert striped.streams == 2
    operations["striped_new_group"] = lambda: bagua.comm.allreduce(torch.ones(1024), group=striped)
    explicit = bagua.comm.new_group([0, 1], timeout=datetime.timedelta(seconds=EXPLICIT_S))
    operations["new_group_explicit_timeout"] = lambda: bagua.comm.allreduce(torch.ones(4), group=explicit)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or None, got 3"):
        bagua.comm.new_group([0, 1], timeout=3)

    done = Path(directory, "rank0-done")
    if rank == 1:  # alive, not stepping; back once rank 0 is done (or after STUCK_S)
        deadline = time.monotonic() + STUCK_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    # The wrappers share the process's one communication thread: their steps go one after another,
    # the plain groups' operations alongside them (each waits for its own peer only).
    lanes = [["gradient_allreduce", "bytegrad", "decentralized"], ["new_group"], ["striped_new_group"],
             ["new_group_explicit_timeout"]]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
            timed = pool.map(lambda lane: {case: _timed(operations[case]) for case in lane}, lanes)
            return {case: result for lane in timed for case, result in lane.items()}
    finally:
        done.touch()


def _timed(operation) -> tuple[float, str]:
    """Seconds until ``operation`` failed with a CollectiveError, and the error's message."""
    start = time.monotonic()
    try:
        operation()
    except bagua.comm.CollectiveError as error:
        return time.monotonic() - start, str(error)
    return time.monotonic() - start, "no error"


@pytest.fixture(scope="module")
def stuck_peer(tmp_path_factory):
    return run_ranks(_everything_times_out, 2, str(tmp_path_factory.mktemp("stuck")), init=False,
                     local_world_size=1, timeout=STUCK_S + 30)[0]


@pytest.mark.parametrize("case", CASES)
def test_a_stuck_peer_fails_the_operation_after_the_groups_timeout(stuck_peer, case):
    elapsed, message = stuck_peer[case]
    timeout = CASES[case]
    assert timeout - 0.5 <= elapsed <= timeout + 2.0, (elapsed, message)
    assert "bagua.comm." in message and "failed on rank 0" in message, message
    if case == "striped_new_group":
        assert "stripe" in message, message

