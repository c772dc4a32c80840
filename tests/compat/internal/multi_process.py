"""The original's ``tests.internal.multi_process``: run a function on N local ranks.

``MultiProcessTestCase.run_test_locally(fn, nprocs, args, results)`` starts ``nprocs``
processes running ``fn(rank, nprocs, args, results, env)`` and asserts that each exits with
0 within the deadline, as the original did (it joined each with ``timeout=60``). Two changes,
both for the CPU suite: processes come from the suite's forkserver, torch and bagua preloaded (the
original spawned fresh interpreters, seconds each on 2 cores), and a rank still running at the
deadline is killed, so a hang fails the test instead of blocking pytest's exit. ``results``
(objects holding tensors) reach the ranks through shared memory, as with the original's spawn.

Example::

    class TestX(MultiProcessTestCase):
        def test_x(self):
            self.run_test_locally(run_x, 2, args={}, results=[Result() for _ in range(2)])
"""

import os
import threading
import time
import unittest
from typing import Any, Callable, Sequence

import torch

import bagua.torch_api as bagua
from tests.compat.internal.common_utils import find_free_port
from tests.harness import process_context

DEADLINE_S = 60.0

_ctx = process_context


def run_processes(target: Callable[..., Any], args_per_rank: Sequence[tuple], timeout: float = DEADLINE_S) -> list:
    """Run ``target(*args)`` in one process per entry of ``args_per_rank``; return their exit
    codes (None for one killed at the deadline). The processes leave together, as the ranks of
    a job do: rank 0 hosts the store that the others may still be using."""
    leave = _ctx.Barrier(len(args_per_rank))
    processes = [_ctx.Process(target=_run_then_leave, args=(target, args, leave, timeout)) for args in args_per_rank]
    for p in processes:
        p.start()
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in processes]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def _run_then_leave(target: Callable[..., Any], args: tuple, leave: Any, timeout: float) -> None:
    try:
        target(*args)
    except BaseException:
        leave.abort()  # the others need not wait for this rank: its exit code reports the failure
        raise
    try:
        leave.wait(timeout=timeout)
    except threading.BrokenBarrierError:
        pass  # another rank failed; its exit code says so


class MultiProcessTestCase(unittest.TestCase):
    def run_test_locally(self, fn, nprocs, args, results):
        env = {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port(8000, 8100)),
            "BAGUA_SERVICE_PORT": str(find_free_port(9000, 9100)),
        }
        codes = run_processes(fn, [(i, nprocs, args, results, env) for i in range(nprocs)])
        for code in codes:
            self.assertTrue(code == 0)


def setup_bagua_env(rank, env):
    """torchrun's variables for ``rank`` from ``env``, then ``bagua.init_process_group()``."""
    os.environ.update({name: env[name] for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                    "BAGUA_SERVICE_PORT")})
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)  # compat edit: was torch.cuda.set_device(rank); one thread per rank on the CPU
    bagua.init_process_group()
