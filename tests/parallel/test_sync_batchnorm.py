"""SyncBatchNorm on CPU ranks against BatchNorm over the concatenated batch on one process."""

from __future__ import annotations

import pytest
import torch

import bagua
from bagua.parallel import SyncBatchNorm, convert_sync_batchnorm
from tests.harness import run_ranks

BATCH_SIZES = (5, 3)  # unequal on purpose


def _batch(rank: int, shape: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(BATCH_SIZES[rank], *shape, generator=g) * 3 + 1


def _loss_weights(rank: int, shape: tuple) -> torch.Tensor:
    """Weights of the loss (a plain sum would give input gradients of exactly zero)."""
    g = torch.Generator().manual_seed(200 + rank)
    return torch.rand(BATCH_SIZES[rank], *shape, generator=g)


def _step(bn: torch.nn.Module, x: torch.Tensor, w: torch.Tensor):
    """One forward and backward of sum(bn(x) * w); returns (out, input grad, weight grad, bias grad)."""
    x = x.clone().requires_grad_()
    out = bn(x)
    (out * w).sum().backward()
    grads = (x.grad, bn.weight.grad.clone(), bn.bias.grad.clone())
    bn.weight.grad = bn.bias.grad = None
    return (out.detach(), *grads)


def _reference(rank: int, shape: tuple, bn: torch.nn.Module, steps: int):
    """What rank ``rank`` must see: BatchNorm over both ranks' batches, its own slice of the
    output and input gradient, and the weight/bias gradients of its own part of the loss."""
    xs = [_batch(r, shape) for r in range(2)]
    ws = [_loss_weights(r, shape) for r in range(2)]
    lo = sum(BATCH_SIZES[:rank])
    hi = lo + BATCH_SIZES[rank]
    for _ in range(steps):
        x = torch.cat(xs).requires_grad_()
        out = bn(x)
        own = torch.zeros_like(out)
        own[lo:hi] = 1
        weight_grad, bias_grad = torch.autograd.grad((out * torch.cat(ws) * own).sum(), [bn.weight, bn.bias],
                                                     retain_graph=True)
        (input_grad,) = torch.autograd.grad((out * torch.cat(ws)).sum(), [x])
    return out.detach()[lo:hi], input_grad[lo:hi], weight_grad, bias_grad


def _compare(rank: int, shape: tuple, momentum, steps: int, process_group=None):
    C = shape[0]
    ours = SyncBatchNorm(C, momentum=momentum, process_group=process_group)
    ref = torch.nn.BatchNorm1d(C, momentum=momentum) if len(shape) == 1 else torch.nn.BatchNorm2d(C, momentum=momentum)
    with torch.no_grad():
        for bn in (ours, ref):
            bn.weight.copy_(torch.linspace(0.5, 2.0, C))
            bn.bias.copy_(torch.linspace(-1.0, 1.0, C))
    for _ in range(steps):
        got = _step(ours, _batch(rank, shape), _loss_weights(rank, shape))
    want = _reference(rank, shape, ref, steps)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{shape} {name}: {m}")
    torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-6, atol=1e-6)
    assert int(ours.num_batches_tracked) == steps
    return ours


def _against_concatenated_batch(rank: int):
    _compare(rank, (4, 3, 3), momentum=0.1, steps=2)      # BatchNorm2d input, unequal batches
    bn = _compare(rank, (6,), momentum=None, steps=3)     # BatchNorm1d input, cumulative average
    # a torch.distributed group is accepted as process_group
    _compare(rank, (4, 3, 3), momentum=0.1, steps=1, process_group=torch.distributed.new_group([0, 1]))

    # Evaluation normalizes with the running statistics, without communication.
    bagua.comm.reset_traffic()
    bn.eval()
    x = _batch(rank, (6,))
    want = (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    torch.testing.assert_close(bn(x), want.detach())
    assert bagua.comm.bytes_sent() == 0

    # A group of one rank normalizes locally: plain BatchNorm of this rank's batch.
    alone = bagua.comm.new_group([rank])
    ours, ref = SyncBatchNorm(4, process_group=alone), torch.nn.BatchNorm2d(4)
    x = _batch(rank, (4, 3, 3))
    torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(ours.running_var, ref.running_var)
    return True


def test_matches_batchnorm_over_the_concatenated_batch():
    assert run_ranks(_against_concatenated_batch, 2, timeout=120) == [True, True]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _ddp_step(rank: int):
    model = convert_sync_batchnorm(_model(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, optimizers=[opt])
    ddp(_batch(rank, (5,))).sum().backward()
    return [p.grad.clone() for p in model.parameters()], model[1].running_var.clone()


def test_under_distributed_data_parallel_equals_one_process_on_the_whole_batch():
    results = run_ranks(_ddp_step, 2, timeout=120)
    reference = _model(0)
    loss = reference(torch.cat([_batch(r, (5,)) for r in range(2)])).sum() / 2  # DDP averages over 2 ranks
    loss.backward()
    for grads, running_var in results:
        for got, p in zip(grads, reference.parameters()):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(running_var, reference[1].running_var)


def test_convert_shares_parameters_and_buffers():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4),
                                torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(4, affine=False)))
    model.eval()
    bn2d, bn1d = model[1], model[2][1]
    converted = convert_sync_batchnorm(model, process_group="group-marker")
    assert converted is model
    assert type(model[1]) is SyncBatchNorm and type(model[2][1]) is SyncBatchNorm
    assert model[1].weight is bn2d.weight and model[1].running_mean is bn2d.running_mean
    assert model[2][1].weight is None and model[2][1].running_var is bn1d.running_var
    assert not model[1].training and model[1].process_group == "group-marker"
    single = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm3d(2))
    assert type(single) is SyncBatchNorm and single.num_features == 2


def test_without_a_process_group_it_is_plain_batchnorm():
    x = torch.randn(6, 3, 2)
    ours, ref = SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(ours.running_var, ref.running_var)


def test_bad_input_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="at least 2D input"):
        SyncBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match="expected 3 channels in dim 1, got input of shape \\[2, 4\\]"):
        SyncBatchNorm(3)(torch.randn(2, 4))
