"""A tiny training job for tests/comm/test_exit.py, launched by torchrun with 3 ranks.

``python -m torch.distributed.run --standalone --nproc-per-node 3 _exit_job.py MODE``, MODE:

- ``plain``: train one step and end without ``bagua.destroy_process_group()``;
- ``destroy``: the same, then destroy the groups (twice: the second call is a no-op);
- ``raise``: rank 1 raises after the step; every rank ends without destroying.

The job ends with a collective still in flight (an ``async_op=True`` handle nobody waits for,
as a fire-and-forget metric would): Gloo threads holding it at interpreter exit are what
aborts a job that does not tear its groups down.
"""

import sys

import torch

import bagua


def main(mode: str) -> None:
    torch.set_num_threads(1)
    bagua.init_process_group()
    rank = bagua.get_rank()
    t = torch.full((4,), float(rank))
    bagua.comm.allreduce(t)
    bagua.comm.broadcast(t, src=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo
    ddp = bagua.DistributedDataParallel(model, optimizers=[opt])
    opt.zero_grad()
    ddp(torch.randn(3, 4) + rank).sum().backward()
    opt.step()
    bagua.comm.allreduce(torch.full((4,), float(rank)), async_op=True)  # never waited
    if mode == "raise" and rank == 1:
        raise RuntimeError("bagua-exit-test: rank 1 fails on purpose")
    if mode == "destroy":
        bagua.destroy_process_group()
        bagua.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
