"""A tiny real training job that ends without ``destroy_process_group()``, for test_exit.py.

``python _exit_job.py MODE`` under torchrun runs one job; ``python _exit_job.py MODE RUNS`` runs
RUNS jobs of 3 ranks each, every rank a process forked from this one after torch, bagua and
torch._dynamo are imported (so a run costs its training, not three interpreters' imports), and
prints one line per run with the ranks' exit statuses. Each rank leaves through the normal
interpreter exit, where the Gloo abort happened. MODE:

- ``plain``: ends without ``destroy_process_group()``;
- ``destroy``: calls it, then ends;
- ``raise``: rank 1 raises after training (its exit status must be 1, the others' 0);
- ``async``: trains with the async algorithm and ends with its averaging thread running.
"""

import os
import socket
import sys

import torch
import torch._dynamo  # noqa: F401  (imported once, before forking)

import bagua

WORLD = 3


def main(mode: str) -> None:
    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    t = torch.full((4,), float(rank))
    bagua.comm.allreduce(t)
    bagua.comm.broadcast(t, src=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=0) if mode == "async" else "gradient_allreduce"
    ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(3, 4) + rank).sum().backward()
        opt.step()
    if mode == "raise" and rank == 1:
        raise RuntimeError("bagua-exit-test: rank 1 failed on purpose")
    if mode == "destroy":
        bagua.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, runs: int) -> None:
    # The ranks' objects from before the fork (torch's, bagua's, dynamo's modules) go to the permanent
    # generation: a rank's interpreter exit then skips the final collection over them (~1.3 s of CPU
    # a rank, 4 s of a run's 4.3 s on 2 cores, plus the copy-on-write of every page it touched); what
    # a rank makes itself (groups, wrapper, Gloo threads) is torn down as before. Side effect: at exit
    # nanobind (triton) reports its frozen, never-freed objects as "leaked" on stderr.
    import gc

    gc.collect()
    gc.freeze()
    for run in range(runs):
        port, children = _free_port(), []
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:  # a rank: train, then leave through the interpreter's own exit
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                                  LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                main(mode)
                sys.exit(0)
            children.append(pid)
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        print(f"run {run}: {statuses}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        launch(sys.argv[1], int(sys.argv[2]))
    else:
        main(sys.argv[1])
