"""A torchrun job whose rank 1 kills itself (SIGKILL) mid-way through its first attempt.

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 _restart_job.py

The restarted attempt must form its process group again and finish; each rank prints
``rank R attempt A done``.
"""

import os
import signal

import torch

import bagua

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
bagua.init_process_group()
rank = bagua.get_rank()
t = torch.ones(1000)
for step in range(20):
    bagua.comm.allreduce(t)
    if attempt == 0 and rank == 1 and step == 10:
        os.kill(os.getpid(), signal.SIGKILL)
assert torch.all(t == 2.0 ** 20)  # twenty allreduces of ones over 2 ranks, in this attempt
print(f"rank {rank} attempt {attempt} done", flush=True)
bagua.destroy_process_group()
