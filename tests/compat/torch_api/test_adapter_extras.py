"""What the ported torch_api tests reach only in part: ``apply_flattened_call`` (the original's
average for ``torch.distributed.all_reduce``), ``bagua_buckets``' algorithm state under the
original's names (and the error for another algorithm), and ``inner.bagua_build_params()``."""

import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _extras(rank: int) -> dict:
    import bagua.torch_api  # noqa: F401  (adds with_bagua to nn.Module)
    from bagua.torch_api.algorithms import decentralized, gradient_allreduce
    from bagua.torch_api.data_parallel import DistributedDataParallel as DDP
    from bagua.torch_api.utils import apply_flattened_call, apply_flattened_call_all

    out = {}
    a, b = torch.full((2,), float(rank)), torch.full((3,), 10.0 * rank)
    apply_flattened_call([a, b], dist.all_reduce)  # summed, then divided by the world size
    out["averaged"] = (a.tolist(), b.tolist())
    ints, floats = torch.tensor([rank]), torch.tensor([0.5])
    apply_flattened_call_all([floats, ints], lambda flat: flat.add_(1))  # one call per tensor type
    out["per_type"] = (ints.tolist(), floats.tolist())

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], decentralized.DecentralizedAlgorithm(hierarchical=False))
    (bucket,) = model.bagua_buckets
    out["peer_weight_before_a_step"] = torch.equal(bucket._peer_weight, bucket.flattened_tensor())
    model(torch.randn(5, 3)).sum().backward()
    averaged = bucket._peer_weight.clone()
    opt.step()
    out["peer_weight"] = averaged
    out["bucket"] = (bucket.bytes(), len(bucket.tensors))

    ddp = DDP(model, optimizers=[opt], algorithm=gradient_allreduce.GradientAllReduceAlgorithm())
    try:
        ddp.bagua_buckets[0]._weight
    except AttributeError as error:
        out["wrong_algorithm"] = str(error)
    out["build_params"] = [name for name, _ in ddp.inner.bagua_build_params()]
    return out


def test_apply_flattened_call_bucket_state_and_build_params():
    results = run_ranks(_extras, 2)
    for r in results:
        assert r["averaged"] == ([0.5, 0.5], [5.0, 5.0, 5.0])
        assert r["bucket"] == (4 * (3 * 4 + 4 + 4 * 2 + 2), 4)
        assert "LowPrecisionDecentralizedAlgorithm only" in r["wrong_algorithm"]
        assert "GradientAllReduceImpl" in r["wrong_algorithm"]
        assert r["build_params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert results[0]["per_type"] == ([1], [1.5]) and results[1]["per_type"] == ([2], [1.5])
    assert results[0]["peer_weight_before_a_step"] and results[1]["peer_weight_before_a_step"]
    # "all": every rank averaged the same weights (rank 0's, broadcast at wrapping)
    assert torch.equal(results[0]["peer_weight"], results[1]["peer_weight"])


def _empty_group(rank: int) -> dict:
    import bagua.torch_api as bagua
    from bagua.torch_api.communication import CommMember, _rank_not_in_group

    group = bagua.communication.new_group(ranks=[])  # the original's decentralized test builds one
    comm = group.get_global_communicator()
    t = torch.full((2,), float(rank))
    bagua.allreduce_inplace(t, comm=comm)  # a non-member's collective returns at once, doing nothing
    return {"not_in": _rank_not_in_group(group), "non_member": comm is CommMember.NON_COMM_MEMBER,
            "intra": group.get_intra_node_communicator() is CommMember.NON_COMM_MEMBER, "t": t.tolist()}


def test_new_group_of_no_ranks_is_a_group_no_rank_is_in():
    for rank, out in enumerate(run_ranks(_empty_group, 2)):
        assert out == {"not_in": True, "non_member": True, "intra": True, "t": [float(rank)] * 2}
