"""init_process_group: ranks, sizes, and the intra-/inter-node groups (two nodes simulated)."""

import os
import sys
import time

import torch

import bagua
from tests.harness import run_ranks


def _layout(rank: int) -> dict:
    comm = bagua.comm
    intra, inter = comm.get_intra_node_group(), comm.get_inter_node_group()
    # A hierarchical allreduce by hand: reduce in the node, allreduce among leaders, broadcast.
    t = torch.full((5,), float(rank + 1))
    comm.reduce(t, dst=intra.ranks[0], group=intra)
    if bagua.get_local_rank() == 0:
        comm.allreduce(t, group=inter)
    comm.broadcast(t, src=intra.ranks[0], group=intra)
    node_sum = torch.full((1,), float(rank))
    comm.allreduce(node_sum, group=intra)
    return {
        "rank": bagua.get_rank(), "world": bagua.get_world_size(),
        "local_rank": bagua.get_local_rank(), "local_size": bagua.get_local_size(),
        "intra": intra.ranks, "inter": inter.ranks, "intra_rank": intra.rank,
        "hier": t.tolist(), "node_sum": node_sum.item(),
    }


def test_two_simulated_nodes_get_intra_and_inter_node_groups():
    results = run_ranks(_layout, 4, local_world_size=2)
    for rank, r in enumerate(results):
        node = rank // 2
        assert (r["rank"], r["world"], r["local_rank"], r["local_size"]) == (rank, 4, rank % 2, 2)
        assert r["intra"] == (2 * node, 2 * node + 1)
        assert r["inter"] == (rank % 2, rank % 2 + 2)
        assert r["intra_rank"] == rank % 2
        assert r["hier"] == [10.0] * 5  # 1 + 2 + 3 + 4, same as a flat allreduce
        assert r["node_sum"] == float(4 * node + 1)


def _single_node(rank: int) -> tuple:
    comm = bagua.comm
    return comm.get_intra_node_group().ranks, comm.get_inter_node_group().ranks, comm.get_default_group().size


def test_one_node_intra_group_is_everyone_inter_group_is_self():
    for rank, (intra, inter, size) in enumerate(run_ranks(_single_node, 3)):
        assert intra == (0, 1, 2) and inter == (rank,) and size == 3


def _twice(rank: int) -> str:
    try:
        bagua.init_process_group()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_init_twice_is_an_error():
    assert all("already called" in r for r in run_ranks(_twice, 2))


def _custom_group(rank: int) -> float:
    group = bagua.comm.new_group([0, 2])
    t = torch.full((3,), float(rank))
    if rank in group.ranks:
        bagua.comm.allreduce(t, group=group)
    bagua.comm.barrier()  # rank 1 makes nothing: it must not leave while the others still connect
    return t[0].item()


def test_new_group_reduces_only_among_its_members():
    assert run_ranks(_custom_group, 3) == [2.0, 1.0, 2.0]


def test_world_of_one_without_torchrun(monkeypatch):
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    bagua.init_process_group()
    try:
        assert (bagua.get_rank(), bagua.get_world_size(), bagua.get_local_rank(), bagua.get_local_size()) == (0, 1, 0, 1)
        t = torch.arange(4.0)
        bagua.comm.allreduce(t, op="avg", compression="minmax_uint8")
        assert torch.equal(t, torch.arange(4.0))
        assert torch.equal(bagua.comm.allgather(t), t)
    finally:
        bagua.destroy_process_group()
    assert not bagua.is_initialized() and not dist.is_initialized()


def _gloo_threads_after_destroy(rank: int) -> tuple:
    dynamo_before_init = "torch._dynamo" in sys.modules
    bagua.init_process_group()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo
    bagua.comm.allreduce(model.weight.data)
    opt.step()
    bagua.destroy_process_group()
    deadline = time.monotonic() + 2.0  # a device's loop thread is joined as its last user goes
    while True:
        threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        gloo = [name for name in threads if "gloo" in name]
        if not gloo or time.monotonic() > deadline:
            return dynamo_before_init, gloo
        time.sleep(0.05)


def test_destroy_process_group_stops_gloo_threads_even_after_an_optimizer_was_built():
    # Gloo threads alive at interpreter exit can abort the process while they drop a finished
    # collective ("terminate called without an active exception").
    for dynamo_before_init, gloo_threads in run_ranks(_gloo_threads_after_destroy, 2, init=False, fresh_interpreters=True):
        assert not dynamo_before_init, "torch._dynamo was imported before init: this test checks nothing"
        assert gloo_threads == []


def _init_through_a_store(rank: int, path: str) -> tuple:
    import torch.distributed as dist

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name)  # the store and the arguments alone must bring the ranks together
    bagua.init_process_group(store=dist.FileStore(path, 2), rank=rank, world_size=2, local_world_size=1)
    t = torch.full((2,), float(rank + 1))
    bagua.comm.allreduce(t)
    return t.tolist(), bagua.get_local_rank(), bagua.comm.get_inter_node_group().ranks


def test_init_with_a_store_instead_of_an_address(tmp_path):
    results = run_ranks(_init_through_a_store, 2, str(tmp_path / "rendezvous"), init=False)
    assert results == [([3.0, 3.0], 0, (0, 1)), ([3.0, 3.0], 0, (0, 1))]


def test_init_with_a_store_needs_rank_and_world_size_and_no_address(tmp_path):
    import pytest
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "rendezvous"), 1)
    with pytest.raises(ValueError, match="pass rank= and world_size="):
        bagua.init_process_group(store=store, rank=0)
    with pytest.raises(ValueError, match="either store= or master_addr="):
        bagua.init_process_group(store=store, rank=0, world_size=1, master_port=29500)
    with pytest.raises(TypeError, match="torch.distributed.Store"):
        bagua.init_process_group(store="localhost:29500", rank=0, world_size=1)
    assert not bagua.is_initialized()


def _groups_after_uneven_memberships(rank: int) -> list:
    import torch.distributed as dist

    dist.new_group([0])  # a torch subgroup (every rank calls): rank 0 now has one group more
    first = bagua.comm.new_group([0, 1]) if rank in (0, 1) else None
    second = bagua.comm.new_group([2, 1]) if rank in (1, 2) else None  # rank 1 belongs to more groups than 2
    again = bagua.comm.new_group([0, 1]) if rank in (0, 1) else None  # the same ranks: a group of its own
    sums = []
    for group in (first, second, again):
        if group is not None:
            t = torch.tensor([float(rank)])
            bagua.comm.allreduce(t, group=group)
            sums.append(t.item())
    bagua.comm.barrier()  # rank 0 hosts the store: it stays until everyone is done with it
    return sums


def test_new_group_works_whatever_groups_its_members_belonged_to_before():
    # torch's own name for a members-only group counts the groups each member already has: these
    # members would meet under different names and hang
    assert run_ranks(_groups_after_uneven_memberships, 3, timeout=60, comm_timeout_s=20) == [
        [1.0, 1.0], [1.0, 3.0, 1.0], [3.0],
    ]


def _unsorted_group(rank: int) -> tuple:
    group = bagua.comm.new_group([1, 0])
    gathered = bagua.comm.allgather(torch.tensor([float(rank)]), group=group)
    return group.ranks, group.rank, gathered.tolist()


def test_a_group_listed_out_of_order_numbers_its_ranks_as_torch_does():
    for rank, (ranks, group_rank, gathered) in enumerate(run_ranks(_unsorted_group, 2)):
        assert ranks == (0, 1) and group_rank == rank and gathered == [0.0, 1.0]


def _non_members(rank: int) -> dict:
    nobody, first = bagua.comm.new_group([]), bagua.comm.new_group([0])
    out = {"nobody": (nobody.ranks, nobody.size, nobody.is_member), "first": first.is_member}
    t = torch.ones(2)
    for name, call in [("rank", lambda: first.rank), ("allreduce", lambda: bagua.comm.allreduce(t, group=first)),
                       ("barrier", lambda: bagua.comm.barrier(group=nobody))]:
        try:
            call()
            out[name] = "ok"
        except ValueError as error:
            out[name] = str(error)
    bagua.comm.allreduce(t)  # the default group is unaffected
    out["sum"] = t.tolist()
    return out


def test_a_non_member_gets_a_group_it_is_not_in_and_clear_errors_from_its_collectives():
    """As torch's new_group: a rank outside ``ranks`` (or ``ranks=[]``) gets a group, not an error."""
    rank0, rank1 = run_ranks(_non_members, 2)
    for out in (rank0, rank1):
        assert out["nobody"] == ((), 0, False) and out["sum"] == [2.0, 2.0]
        assert out["barrier"].startswith("rank ") and "is not a member of group []" in out["barrier"]
    assert (rank0["first"], rank0["rank"], rank0["allreduce"]) == (True, "ok", "ok")
    assert rank1["first"] is False
    assert rank1["rank"] == "rank 1 is not a member of this group (ranks [0])"
    assert rank1["allreduce"] == ("rank 1 is not a member of group [0]: only its members run collectives on it "
                                  "(check group.is_member first)")
