"""Ported from the original's tests/torch_api/test_bagua_module.py (``model.with_bagua``).

Runs on 2 CPU ranks (Gloo) instead of every GPU of the machine, 100 training steps per
algorithm instead of 1000 (the tests assert that every rank trains and exits cleanly).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from tests.compat.internal.common_utils import find_free_port  # compat edit: the ported helpers
from tests.compat.internal.multi_process import run_processes, setup_bagua_env  # compat edit: forkserver ranks with a deadline
import unittest
import bagua.torch_api as bagua  # noqa: F401  (the original's import: it adds with_bagua to nn.Module)

# compat edit: `import multiprocessing` and `from tests import skip_if_cuda_not_available` dropped:
# the ranks come from run_processes, and the tests run on the CPU


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


def train(model, optimizer, loss_fn, is_async):
    if is_async:
        model.bagua_algorithm.resume(model)

    for _ in range(100):  # compat edit: budget: 100 steps (was 1000)
        data = torch.randn(4, 2)  # compat edit: .cuda() removed (CPU)
        target = torch.randn(4, 4)  # compat edit: .cuda() removed (CPU)

        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)

        loss.backward()
        optimizer.step()

    if is_async:
        model.bagua_algorithm.abort(model)


def bagua_init(model, optimizer, algorithm, process_group=None):
    # wrap model
    if algorithm == "gradient_allreduce":
        from bagua.torch_api.algorithms import gradient_allreduce

        bagua_algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
    elif algorithm == "bytegrad":
        from bagua.torch_api.algorithms import bytegrad

        bagua_algorithm = bytegrad.ByteGradAlgorithm(hierarchical=False)
    elif algorithm == "decentralized":
        from bagua.torch_api.algorithms import decentralized

        bagua_algorithm = decentralized.DecentralizedAlgorithm(hierarchical=False)
    elif algorithm == "async":
        from bagua.torch_api.algorithms import async_model_average

        bagua_algorithm = async_model_average.AsyncModelAverageAlgorithm(
            sync_interval_ms=20,
        )
    elif algorithm == "low_prec_decentralized":
        from bagua.torch_api.algorithms import decentralized

        bagua_algorithm = decentralized.LowPrecisionDecentralizedAlgorithm(
            hierarchical=False
        )
    elif algorithm == "qadam":
        from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

        optimizer = QAdamOptimizer(model.parameters(), warmup_steps=10)
        bagua_algorithm = QAdamAlgorithm(optimizer, hierarchical=False)
    else:
        raise ValueError("unsupported algorithm")

    model = model.with_bagua([optimizer], bagua_algorithm, process_group=process_group)

    return model, optimizer


def run_model_wrapper(rank, nranks, env, algorithm):
    # initialize subprocess env
    setup_bagua_env(rank, env)

    # construct model and optimizer, etc.
    model = Net()  # compat edit: .cuda() removed (CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    model, optimizer = bagua_init(
        model, optimizer, algorithm
    )

    train(model, optimizer, loss_fn, is_async=(algorithm == "async"))


def run_model_switch_wrapper(rank, nranks, env, algorithms):
    # initialize subprocess env
    setup_bagua_env(rank, env)

    # construct model and optimizer, etc.
    model = Net()  # compat edit: .cuda() removed (CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    for i in range(len(algorithms)):
        model, optimizer = bagua_init(model, optimizer, algorithms[i])
        train(model, optimizer, loss_fn, is_async=(algorithms[i] == "async"))


class TestBaguaModule(unittest.TestCase):
    def run_algorithm(self, nprocs, nranks, fn, algorithm):
        env = {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port(8000, 8100)),
            "BAGUA_SERVICE_PORT": str(find_free_port(9000, 9100)),
        }

        # compat edit: forkserver processes instead of spawned ones; a rank still running at the
        # 60 s deadline is killed (the original joined each with timeout=60 and left it running)
        exit_codes = run_processes(fn, [(i, nranks, env, algorithm) for i in range(nprocs)])

        for exitcode in exit_codes:
            self.assertEqual(exitcode, 0)

    # compat edit: @skip_if_cuda_not_available() removed from every test below (they run on the
    # CPU), and nprocs = 2 CPU ranks in each (was torch.cuda.device_count())
    def test_gradient_allreduce(self):
        nprocs = 2
        self.run_algorithm(
            nprocs, nprocs - 1, run_model_wrapper, algorithm="gradient_allreduce"
        )

    def test_decentralized(self):
        nprocs = 2
        self.run_algorithm(
            nprocs, nprocs - 1, run_model_wrapper, algorithm="decentralized"
        )

    def test_low_prec_decentralized(self):
        nprocs = 2
        self.run_algorithm(
            nprocs, nprocs - 1, run_model_wrapper, algorithm="low_prec_decentralized"
        )

    def test_async(self):
        nprocs = 2
        self.run_algorithm(nprocs, nprocs - 1, run_model_wrapper, algorithm="async")

    def test_bytegrad(self):
        nprocs = 2
        self.run_algorithm(nprocs, nprocs - 1, run_model_wrapper, algorithm="bytegrad")

    def test_qadam(self):
        nprocs = 2
        self.run_algorithm(nprocs, nprocs - 1, run_model_wrapper, algorithm="qadam")

    def test_model_switch(self):
        nprocs = 2
        algorithms = [
            "bytegrad",
            "decentralized",
            "gradient_allreduce",
            "qadam",
            "async",
            "low_prec_decentralized",
        ]
        self.run_algorithm(nprocs, nprocs - 1, run_model_switch_wrapper, algorithms)


if __name__ == "__main__":
    unittest.main()
