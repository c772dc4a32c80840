"""Ported from the original's tests/torch_api/data_parallel/test_gradient_allreduce.py
(``bagua.torch_api.data_parallel.DistributedDataParallel``).

Runs on 2 CPU ranks (Gloo) instead of every GPU of the machine.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from tests.compat.internal.common_utils import find_free_port  # compat edit: the ported helpers
from tests.compat.internal.multi_process import run_processes, setup_bagua_env  # compat edit: forkserver ranks with a deadline
import unittest
from bagua.torch_api.utils import flatten
import bagua.torch_api as bagua
from bagua.torch_api.data_parallel import DistributedDataParallel as DDP

# compat edit: `import multiprocessing` and `from tests import skip_if_cuda_not_available` dropped:
# the ranks come from run_processes, and the test runs on the CPU


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=True)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.fc3(x)
        return F.softmax(x, dim=1)


def _init_bagua_env(rank, env):
    # set deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(rank)
    # initialize subprocess env
    setup_bagua_env(rank, env)


def run_model(
    rank,
    nprocs,
    hierarchical,
    results,
    env,
):
    _init_bagua_env(rank, env)

    # construct model and optimizer, etc.
    model = Net()  # compat edit: .cuda() removed (CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    def run_epochs(num_epochs):
        for epoch in range(num_epochs):
            data = torch.randn(4, 2)  # compat edit: .cuda() removed (CPU)
            target = torch.randn(4, 4)  # compat edit: .cuda() removed (CPU)

            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)

            loss.backward()
            optimizer.step()

    run_epochs(1)

    # wrap model
    model = DDP(
        model,
        optimizers=[optimizer],
        algorithm=bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm(
            hierarchical=hierarchical,
        ),
    )

    run_epochs(10)

    ret = results[rank]

    ret._weight.copy_(flatten([param.data for param in model.parameters()]))


class Result(object):
    def __init__(self):
        model = Net()
        self._weight = flatten(
            [torch.zeros_like(param.data) for param in model.parameters()]
        )


class TestGradientAllReduce(unittest.TestCase):
    def run_test_locally(
        self,
        nprocs,
        hierarchical,
    ):
        env = {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port(8000, 8100)),
            "BAGUA_SERVICE_PORT": str(find_free_port(9000, 9100)),
        }

        results = [Result() for _ in range(nprocs)]
        # compat edit: forkserver processes instead of spawned ones; a rank still running at the
        # 60 s deadline is killed (the original joined each with timeout=60 and left it running)
        exit_codes = run_processes(run_model, [(i, nprocs, hierarchical, results, env) for i in range(nprocs)])

        for exitcode in exit_codes:
            self.assertTrue(exitcode == 0)

        for rank in range(nprocs):
            peer_rank = (rank + 1) % nprocs
            # all workers have equal weights
            self.assertTrue(
                torch.equal(
                    results[rank]._weight,
                    results[peer_rank]._weight,
                )
            )

    # compat edit: @skip_if_cuda_not_available() removed (runs on the CPU)
    def test_algorithm(self):
        nprocs = 2  # compat edit: two CPU ranks (was torch.cuda.device_count())
        self.run_test_locally(
            nprocs=nprocs,
            hierarchical=False,
        )


if __name__ == "__main__":
    unittest.main()
