"""Ported from the original's tests/contrib/test_sync_bn.py (every test kept).

torch's own ``nn.SyncBatchNorm``, the original's reference, runs on CUDA only; the reference here
is what it computes (BatchNorm over every rank's batch together), on the CPU.
"""

import os
import unittest

import bagua.torch_api as bagua
from bagua.torch_api.contrib.sync_batchnorm import SyncBatchNorm

import torch

from tests.compat.internal.common_utils import find_free_port  # compat edit: the ported helper
from tests.compat.internal.multi_process import run_processes  # compat edit: ranks with a deadline


class Result_Forward(object):
    def __init__(self):
        bn_layer = SyncBatchNorm(num_features=8)
        self.bn_output = torch.zeros(32, 8, 16, 16).float()  # compat edit: .cuda() removed (CPU)
        self.running_mean = torch.empty_like(bn_layer.running_mean)
        self.running_var = torch.empty_like(bn_layer.running_var)


class Result_Backward(object):
    def __init__(self):
        bn_layer = SyncBatchNorm(num_features=8)
        self.weight_grad = torch.empty_like(bn_layer.weight.data)
        self.bias_grad = torch.empty_like(bn_layer.bias.data)
        self.input_grad = torch.zeros(32, 8, 16, 16).float()  # compat edit: .cuda() removed (CPU)


# compat edit: _init_torch_env (torch.distributed with NCCL, for torch.nn.SyncBatchNorm) removed:
# the CPU reference below runs on one process


def _init_bagua_env(rank, env):
    # set deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(rank)
    # initialize subprocess env
    os.environ["WORLD_SIZE"] = env["WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"]
    os.environ["MASTER_ADDR"] = env["MASTER_ADDR"]
    os.environ["MASTER_PORT"] = env["MASTER_PORT"]
    os.environ["BAGUA_SERVICE_PORT"] = env["BAGUA_SERVICE_PORT"]

    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)

    # init bagua distributed process group
    # compat edit: torch.cuda.set_device(rank) removed (CPU)
    bagua.init_process_group()


def run_torch_sync_bn(rank, nprocs, torch_results_forward, results_backward, envs):
    # compat edit: torch.nn.SyncBatchNorm raises on CPU tensors. The reference is what it computes:
    # BatchNorm2d over every rank's batch (each as run_bagua_sync_bn draws it after
    # torch.manual_seed(rank)), this rank's slice of the output and of the input grad of the loss
    # summed over all ranks, and the weight/bias grads of this rank's own loss (which
    # torch.nn.SyncBatchNorm leaves unreduced).
    inputs = []
    for r in range(nprocs):
        torch.manual_seed(r)
        inputs.append(torch.randn(32, 8, 16, 16).float())
    input_d = torch.cat(inputs)
    input_d.requires_grad_()
    sync_bn_ddp = torch.nn.BatchNorm2d(num_features=8)
    sync_bn_ddp_out = sync_bn_ddp(input_d)
    own = slice(rank * 32, (rank + 1) * 32)

    ddp_ret1 = torch_results_forward[rank]
    ddp_ret1.bn_output.copy_(sync_bn_ddp_out[own])
    ddp_ret1.running_mean.copy_(sync_bn_ddp.running_mean)
    ddp_ret1.running_var.copy_(sync_bn_ddp.running_var)

    weight_grad, bias_grad = torch.autograd.grad(
        sync_bn_ddp_out[own].sum(), [sync_bn_ddp.weight, sync_bn_ddp.bias], retain_graph=True
    )
    sync_bn_ddp_out.sum().backward()

    ddp_ret2 = results_backward[rank]
    ddp_ret2.weight_grad.copy_(weight_grad)
    ddp_ret2.bias_grad.copy_(bias_grad)
    ddp_ret2.input_grad.copy_(input_d.grad[own])


def run_bagua_sync_bn(rank, nprocs, bagua_results_forward, results_backward, envs):
    _init_bagua_env(rank, envs)

    input_b = torch.randn(32, 8, 16, 16).float()  # compat edit: .cuda() removed (CPU)
    input_b.requires_grad_()
    sync_bn_bagua = SyncBatchNorm(num_features=8)

    # compat edit: sync_bn_bagua.cuda(rank) and input_b.cuda(rank) removed (CPU)
    sync_bn_bagua_out = sync_bn_bagua(input_b)

    bagua_ret1 = bagua_results_forward[rank]
    bagua_ret1.bn_output.copy_(sync_bn_bagua_out)
    bagua_ret1.running_mean.copy_(sync_bn_bagua.running_mean)
    bagua_ret1.running_var.copy_(sync_bn_bagua.running_var)

    sync_bn_bagua_out.sum().backward()

    bagua_ret2 = results_backward[rank]
    bagua_ret2.weight_grad.copy_(sync_bn_bagua.weight.grad)
    bagua_ret2.bias_grad.copy_(sync_bn_bagua.bias.grad)
    bagua_ret2.input_grad.copy_(input_b.grad)


class Test_Sync_Bn(unittest.TestCase):
    def test_syncbn(self):
        nprocs = 2  # compat edit: was torch.cuda.device_count(), one rank per GPU
        print(nprocs)
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port(8000, 8100)),
        }

        torch_results_forward = [Result_Forward() for _ in range(nprocs)]
        torch_results_backward = [Result_Backward() for _ in range(nprocs)]
        # compat edit: run_processes (a deadline of 60 s, a hung rank killed) instead of
        # spawn-context processes joined without a timeout
        exitcodes = run_processes(
            run_torch_sync_bn,
            [(i, nprocs, torch_results_forward, torch_results_backward, env) for i in range(nprocs)],
        )
        for exitcode in exitcodes:
            self.assertTrue(exitcode == 0)

        env = {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port(8000, 8100)),
            "BAGUA_SERVICE_PORT": str(find_free_port(9000, 9100)),
        }

        bagua_results_forward = [Result_Forward() for _ in range(nprocs)]
        bagua_results_backward = [Result_Backward() for _ in range(nprocs)]
        exitcodes = run_processes(  # compat edit: as above
            run_bagua_sync_bn,
            [(i, nprocs, bagua_results_forward, bagua_results_backward, env) for i in range(nprocs)],
        )
        for exitcode in exitcodes:
            self.assertTrue(exitcode == 0)

        for rank in range(nprocs):
            self.assertTrue(
                torch.all(
                    torch.isclose(
                        torch_results_forward[rank].bn_output,
                        bagua_results_forward[rank].bn_output,
                    )
                ).item()
            )
            self.assertTrue(
                torch.all(
                    torch.isclose(
                        torch_results_forward[rank].running_mean,
                        bagua_results_forward[rank].running_mean,
                    )
                ).item()
            )
            self.assertTrue(
                torch.all(
                    torch.isclose(
                        torch_results_forward[rank].running_var,
                        bagua_results_forward[rank].running_var,
                    )
                ).item()
            )

            self.assertTrue(
                torch.all(
                    torch.isclose(
                        torch_results_backward[rank].weight_grad,
                        bagua_results_backward[rank].weight_grad,
                    )
                ).item()
            )
            self.assertTrue(
                torch.all(
                    torch.isclose(
                        torch_results_backward[rank].bias_grad,
                        bagua_results_backward[rank].bias_grad,
                    )
                ).item()
            )
            self.assertTrue(
                torch.all(
                    torch.isclose(
                        torch_results_backward[rank].input_grad,
                        bagua_results_backward[rank].input_grad,
                    )
                ).item()
            )


if __name__ == "__main__":
    unittest.main()
