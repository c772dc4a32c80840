"""Ported from the original's tests/torch_api/data_parallel/test_bagua_ddp.py.

The original derived its test class from ``test_c10d_common.AbstractDistributedDataParallelTest``
(torch's own DDP suite, copied; not ported): this test uses its ``world_size`` (2) only.

Deliberate difference: a parameter that gets no gradient, in a wrapper built without
``find_unused_parameters``, is an error at the end of backward (torch DDP raises too, at the next
forward); the original left that parameter's bucket silently unreduced.
"""

import os
import random
import sys
import unittest

import torch
import torch.distributed as c10d

if not c10d.is_available():
    print("c10d not available, skipping tests", file=sys.stderr)
    sys.exit(0)

import torch.nn.functional as F
from torch import nn
from tests.compat.internal.torch.common_distributed import (  # compat edit: the ported harness
    MultiProcessTestCase,
)

import bagua.torch_api as bagua
from tests.compat.internal.common_utils import find_free_port  # compat edit: the ported helper
from bagua.torch_api.data_parallel.distributed import DistributedDataParallel_V1_9_0 as DistributedDataParallel

# compat edit: skip_if_lt_x_gpu and `from . import test_c10d_common` are no longer imported (the
# test runs on 2 CPU processes; see the docstring); run_tests is unittest.main; TEST_WITH_TSAN
# has torch's definition (torch's testing common_utils needs expecttest, not installed)
TEST_WITH_TSAN = os.getenv("PYTORCH_TEST_WITH_TSAN", "0") == "1"


@unittest.skipIf(
    TEST_WITH_TSAN,
    "TSAN is not fork-safe since we're forking in a multi-threaded environment",
)
class DistributedDataParallelTest(MultiProcessTestCase):
    world_size = 2  # compat edit: AbstractDistributedDataParallelTest's world_size

    def setUp(self):
        super(DistributedDataParallelTest, self).setUp()
        # NCCL_BLOCKING_WAIT overrides NCCL_ASYNC_ERROR_HANDLING hence tests
        # that use NCCL_BLOCKING_WAIT will test it as expected.
        os.environ["NCCL_ASYNC_ERROR_HANDLING"] = "1"
        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(find_free_port(8000, 8100)),
                "BAGUA_SERVICE_PORT": str(find_free_port(9000, 9100)),
            }
        )
        self._spawn_processes()

    def _test_find_unused_parameters_kwarg(self, gradient_as_bucket_view=False):
        """
        Note: this test can be sped up by only running it on a CPU module
        once DistributedDataParallel supports them.
        """
        torch.set_num_threads(1)  # compat edit: was torch.cuda.set_device(self.rank); one thread per rank
        bagua.init_process_group()
        process_group = c10d.distributed_c10d._get_default_group()

        class FindUnusedParametersModule(nn.Module):
            def __init__(self):
                super(FindUnusedParametersModule, self).__init__()
                self.fc1 = nn.Linear(2, 10, bias=False)
                self.fc2 = nn.Linear(10, 4, bias=False)
                self.fc3 = nn.Linear(4, 4, bias=False)
                self.relu = nn.ReLU()

            def forward(self, x):
                x = self.relu(self.fc1(x))
                x = self.relu(self.fc2(x))
                # Return the fc3 module so that the caller can invoke it
                # outside of the forward function. While this is bad practice,
                # we can use it to trigger a reducer error.
                return (F.softmax(x, dim=1), self.fc3)

        device_id = torch.device("cpu")  # compat edit: the CPU (was the rank's GPU, self.rank)
        batch_size = 4
        criterion = nn.CrossEntropyLoss()
        input = torch.rand([batch_size, 2], dtype=torch.float).to(device_id)
        target = torch.LongTensor([random.randrange(4) for _ in range(batch_size)]).to(
            device_id
        )

        ddp_model = None

        def test_find_unused_parameters(
            find_unused_parameters
        ):
            model = DistributedDataParallel(
                FindUnusedParametersModule().float().to(device_id),
                device_ids=[device_id],
                process_group=process_group,
                find_unused_parameters=find_unused_parameters,
            )
            nonlocal ddp_model
            ddp_model = model

            output, fc3 = model(input)
            # output = fc3(output)
            loss = criterion(output, target)
            loss.backward()

        test_find_unused_parameters(find_unused_parameters=True)
        bagua_build_params = [name for name,
                              _ in ddp_model.inner.bagua_build_params()]
        self.assertEqual(set(bagua_build_params),
                         set(['fc1.weight', 'fc2.weight']))

        # compat edit: deliberate difference (see the docstring): backward raises here
        with self.assertRaisesRegex(RuntimeError, "find_unused_parameters=True"):
            test_find_unused_parameters(find_unused_parameters=False)
        bagua_build_params = [name for name,
                              _ in ddp_model.inner.bagua_build_params()]
        self.assertEqual(set(bagua_build_params), set(
            ['fc1.weight', 'fc2.weight', 'fc3.weight']))

    # compat edit: @skip_if_lt_x_gpu(2) removed (runs on 2 CPU processes)
    def test_find_unused_parameters_kwarg_debug_detail(self):
        os.environ.update(
            {
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                "RANK": str(self.rank),
                "LOCAL_RANK": str(self.rank),
            }
        )

        self._test_find_unused_parameters_kwarg()


if __name__ == "__main__":
    assert (
        not torch.cuda._initialized
    ), "test_distributed must not have initialized CUDA context on main process"

    unittest.main()  # compat edit: was run_tests() of torch's testing helpers
