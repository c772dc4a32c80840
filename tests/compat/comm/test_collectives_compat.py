"""bagua.torch_api.communication beyond the ported tests: every collective's values in its
out-of-place and in-place forms, src/dst as communicator ranks, ReduceOp mapping, alltoall_v with
displacements, node communicators of two simulated machines, init through a store, misuse errors."""

import os

import pytest
import torch
import torch.distributed as dist

from bagua.comm import NotInitializedError
from bagua.torch_api import communication as C
from tests.harness import run_ranks


def _collectives(rank: int) -> dict:
    x = torch.arange(4.0) + 10 * rank  # rank 0: [0, 1, 2, 3], rank 1: [10, 11, 12, 13]
    out = {}

    def keep(name, tensor):
        out[name] = tensor.tolist()

    recv = torch.zeros(2, 2)  # another shape, as many elements: the original counted elements
    C.allreduce(x, recv, op=C.ReduceOp.MAX)
    keep("allreduce_max", recv)
    for name, op in (("product_torch_op", dist.ReduceOp.PRODUCT), ("avg_int", 10), ("min", C.ReduceOp.MIN)):
        t = x.clone()
        C.allreduce_inplace(t, op=op)
        keep(name, t)
    keep("x_after_out_of_place", x)
    ints = torch.tensor([rank + 1, 5], dtype=torch.int64)
    C.allreduce_inplace(ints)
    keep("int64_sum", ints)

    recv = torch.full((4,), -1.0)
    C.reduce(x, recv, dst=1, op=C.ReduceOp.SUM)
    keep("reduce", recv)
    t = x.clone()
    C.reduce_inplace(t, 1, C.ReduceOp.AVG)
    keep("reduce_inplace", t)

    recv = torch.full((8,), -1.0)
    C.allgather(x, recv)
    keep("allgather", recv)
    t = torch.full((2, 4), -1.0)
    t[rank] = x
    C.allgather_inplace(t)
    keep("allgather_inplace", t.view(-1))

    recv = torch.full((8,), -1.0)
    C.gather(x, recv, dst=1)
    keep("gather", recv)
    t = torch.full((8,), -1.0) if rank == 1 else x.clone()
    if rank == 1:
        t[4:] = x  # dst's own part already in place
    C.gather_inplace(t, 4, dst=1)
    keep("gather_inplace", t)

    recv = torch.full((4,), -1.0)
    C.scatter(torch.arange(8.0) + 100 * rank, recv, src=1)
    keep("scatter", recv)
    t = torch.arange(4.0) if rank == 0 else torch.full((2,), -1.0)
    C.scatter_inplace(t, 2, src=0)
    keep("scatter_inplace", t)

    recv = torch.full((2,), -1.0)
    C.reduce_scatter(x, recv, op=C.ReduceOp.SUM)
    keep("reduce_scatter", recv)
    t = x.clone()
    C.reduce_scatter_inplace(t)
    keep("reduce_scatter_inplace", t)

    recv = torch.full((4,), -1.0)
    C.alltoall(x, recv)
    keep("alltoall", recv)
    t = x.clone()
    C.alltoall_inplace(t)
    keep("alltoall_inplace", t)

    # rank 0 keeps x[3] and sends x[0:2]; rank 1 sends x[1:4] and keeps x[0]; unequal counts,
    # scattered displacements, one displacement list longer than nranks (the original read nranks)
    recv = torch.full((6,), -1.0)
    if rank == 0:
        C.alltoall_v(x, [1, 2], [3, 0], recv, [1, 3], [5, 0, 99])
    else:
        C.alltoall_v(x, [3, 1], [1, 0], recv, [2, 1], [0, 4])
    keep("alltoall_v", recv)
    t = x.clone()
    C.alltoall_v_inplace(t, [1, 2] if rank == 0 else [2, 1], [3, 0] if rank == 0 else [2, 0])
    keep("alltoall_v_inplace", t)

    t = x.clone()
    C.broadcast(t, src=1)
    keep("broadcast", t)
    out["broadcast_object"] = C.broadcast_object({"from": rank}, src=1)
    a, b = torch.full((2, 2), float(rank)), torch.full((3,), 10.0 + rank)
    C.broadcast_coalesced([a, b], src=1)
    keep("broadcast_coalesced", torch.cat([a.view(-1), b]))
    C.allreduce_coalesced_inplace([a, b], op=C.ReduceOp.SUM)
    keep("allreduce_coalesced", torch.cat([a.view(-1), b]))

    if rank == 0:
        C.send(x, 1)
    else:
        recv = torch.zeros(2, 2)
        C.recv(recv, 0)
        keep("recv", recv.view(-1))
    C.barrier(comm=C.CommMember.WORLD)

    only_rank_1 = C.new_group([1]).get_global_communicator()
    t = x.clone()
    C.allreduce_inplace(t, op=C.ReduceOp.SUM, comm=only_rank_1)  # rank 0: not a member, returns at once
    keep("subgroup_of_one", t)
    out["subgroup_comm"] = repr(only_rank_1) if rank == 0 else (only_rank_1.rank(), only_rank_1.nranks())
    return out


def test_collectives_out_of_place_and_in_place_on_two_ranks():
    r0, r1 = run_ranks(_collectives, 2)
    assert r0["allreduce_max"] == r1["allreduce_max"] == [[10.0, 11.0], [12.0, 13.0]]
    assert r0["product_torch_op"] == [0.0, 11.0, 24.0, 39.0]
    assert r0["avg_int"] == r1["avg_int"] == [5.0, 6.0, 7.0, 8.0]
    assert r1["min"] == [0.0, 1.0, 2.0, 3.0]
    assert r0["x_after_out_of_place"] == [0.0, 1.0, 2.0, 3.0]
    assert r0["int64_sum"] == [3, 10]
    assert (r0["reduce"], r1["reduce"]) == ([-1.0] * 4, [10.0, 12.0, 14.0, 16.0])
    assert (r0["reduce_inplace"], r1["reduce_inplace"]) == ([0.0, 1.0, 2.0, 3.0], [5.0, 6.0, 7.0, 8.0])
    everything = [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    for r in (r0, r1):
        assert r["allgather"] == r["allgather_inplace"] == everything
    assert (r0["gather"], r1["gather"]) == ([-1.0] * 8, everything)
    assert (r0["gather_inplace"], r1["gather_inplace"]) == ([0.0, 1.0, 2.0, 3.0], everything)
    assert (r0["scatter"], r1["scatter"]) == ([100.0, 101.0, 102.0, 103.0], [104.0, 105.0, 106.0, 107.0])
    assert (r0["scatter_inplace"], r1["scatter_inplace"]) == ([0.0, 1.0, 2.0, 3.0], [2.0, 3.0])
    assert (r0["reduce_scatter"], r1["reduce_scatter"]) == ([10.0, 12.0], [14.0, 16.0])
    # in place: this rank's part first, the rest keeps the input
    assert r0["reduce_scatter_inplace"] == [10.0, 12.0, 2.0, 3.0]
    assert r1["reduce_scatter_inplace"] == [14.0, 16.0, 12.0, 13.0]
    assert r0["alltoall"] == r0["alltoall_inplace"] == [0.0, 1.0, 10.0, 11.0]
    assert r1["alltoall"] == r1["alltoall_inplace"] == [2.0, 3.0, 12.0, 13.0]
    assert r0["alltoall_v"] == [11.0, 12.0, 13.0, -1.0, -1.0, 3.0]
    assert r1["alltoall_v"] == [0.0, 1.0, -1.0, -1.0, 10.0, -1.0]
    assert (r0["alltoall_v_inplace"], r1["alltoall_v_inplace"]) == ([12.0, 13.0, 2.0, 3.0], [10.0, 11.0, 0.0, 1.0])
    for r in (r0, r1):
        assert r["broadcast"] == [10.0, 11.0, 12.0, 13.0]
        assert r["broadcast_object"] == {"from": 1}
        assert r["broadcast_coalesced"] == [1.0] * 4 + [11.0] * 3
        assert r["allreduce_coalesced"] == [2.0] * 4 + [22.0] * 3
    assert r1["recv"] == [0.0, 1.0, 2.0, 3.0]
    assert (r0["subgroup_of_one"], r1["subgroup_of_one"]) == ([0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0])
    assert (r0["subgroup_comm"], r1["subgroup_comm"]) == ("CommMember.NON_COMM_MEMBER", (0, 1))


def _describe(comm) -> object:
    return comm.ranks if isinstance(comm, C.Communicator) else repr(comm)


def _two_nodes_through_a_store(rank: int, path: str) -> dict:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name)
    C.init_process_group(dist.FileStore(path, 4), rank=rank, world_size=4, local_world_size=2)
    default = C._get_default_group()
    group = C.new_group([3, 1, 2])  # node 0 holds rank 1, node 1 ranks 2 and 3; first rank 1 has local rank 1
    comms = {
        "default": [default.get_global_communicator(), default.get_intra_node_communicator(),
                    default.get_inter_node_communicator()],
        "group": [group.get_global_communicator(), group.get_intra_node_communicator(),
                  group.get_inter_node_communicator()],
    }
    out = {name: [_describe(c) for c in cs] for name, cs in comms.items()}
    sums = []
    for comm in comms["group"]:
        t = torch.tensor([float(rank)])
        C.allreduce_inplace(t, comm=comm)
        sums.append(t.item())
    out["group_sums"] = sums
    t = torch.tensor([float(rank)])
    C.broadcast(t, src=1, comm=default.get_inter_node_communicator())  # inter rank 1: global rank 2
    out["inter_broadcast"] = t.item()

    torch_group = dist.new_group([0, 2])
    out["from_torch_group"] = _describe(C.from_torch_group(torch_group).get_global_communicator())
    if rank in (0, 2):
        comm = torch_group.bagua_patch().bagua_get_global_communicator()
        out["bagua_pg"] = (torch_group.bagua_pg.ranks, comm.rank(), comm.nranks())
    C.barrier()  # rank 0 hosts the store: nobody leaves before the others are done with it
    return out


def test_node_communicators_of_two_machines_initialized_through_a_store(tmp_path):
    results = run_ranks(_two_nodes_through_a_store, 4, str(tmp_path / "store"), local_world_size=2, init=False)
    nm = "CommMember.NON_COMM_MEMBER"
    expected_default = {0: [[0, 1]] + [[0, 2]], 1: [[0, 1], nm], 2: [[2, 3], [0, 2]], 3: [[2, 3], nm]}
    expected_group = {0: [nm, nm, nm], 1: [[1, 2, 3], [1], [1, 3]], 2: [[1, 2, 3], [2, 3], nm],
                      3: [[1, 2, 3], [2, 3], [1, 3]]}
    expected_sums = {0: [0.0, 0.0, 0.0], 1: [6.0, 1.0, 4.0], 2: [6.0, 5.0, 2.0], 3: [6.0, 5.0, 4.0]}
    for rank, r in enumerate(results):
        assert r["default"] == [[0, 1, 2, 3]] + expected_default[rank]
        assert r["group"] == expected_group[rank]
        assert r["group_sums"] == expected_sums[rank]
        assert r["inter_broadcast"] == (2.0 if rank in (0, 2) else float(rank))
        assert r["from_torch_group"] == ([0, 2] if rank in (0, 2) else nm)
        assert r.get("bagua_pg") == (([0, 2], rank // 2, 2) if rank in (0, 2) else None)


def _misuse(rank: int) -> dict:
    errors = {}

    def error_of(name, call):
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the test inspects every kind
            errors[name] = f"{type(e).__name__}: {e}"

    error_of("allreduce_size", lambda: C.allreduce(torch.ones(4), torch.zeros(3)))
    error_of("allgather_size", lambda: C.allgather(torch.ones(4), torch.zeros(4)))
    error_of("reduce_scatter_size", lambda: C.reduce_scatter(torch.ones(5), torch.zeros(2)))
    error_of("gather_inplace_size", lambda: C.gather_inplace(torch.ones(3), 2, dst=0))
    error_of("recv_dtype", lambda: C.allreduce(torch.ones(4), torch.zeros(4, dtype=torch.int64)))
    error_of("not_contiguous", lambda: C.allreduce_inplace(torch.ones(4, 4).t()))
    error_of("bitwise_op", lambda: C.allreduce_inplace(torch.ones(2, dtype=torch.int64), op=C.ReduceOp.BXOR))
    error_of("dst_out_of_range", lambda: C.reduce_inplace(torch.ones(2), dst=2))
    error_of("alltoall_v_past_end", lambda: C.alltoall_v(torch.ones(4), [2, 2], [0, 3], torch.zeros(4), [2, 2], [0, 2]))
    error_of("alltoall_v_short", lambda: C.alltoall_v_inplace(torch.ones(4), [4], [0]))
    group = C.new_group([1])
    error_of("group_as_comm", lambda: C.barrier(comm=group))
    if rank == 0:
        error_of("non_member_rank", lambda: group.get_global_communicator().rank())
        error_of("native_of_non_member", lambda: group.native)
    error_of("get_backend", lambda: C.get_backend("model"))
    error_of("init_twice", lambda: C.init_process_group())
    error_of("store_without_rank", lambda: C.init_process_group(dist.HashStore(), world_size=2, local_world_size=2))
    C.barrier()
    return errors


def test_misuse_errors_say_what_the_call_expects():
    errors = run_ranks(_misuse, 2)[0]
    expected = {
        "allreduce_size": "ValueError: bagua.torch_api.allreduce: recv_tensor has 3 elements, but must have as "
                          "many as send_tensor (4)",
        "allgather_size": "recv_tensor has 4 elements, but must have comm.nranks() times send_tensor's (8)",
        "reduce_scatter_size": "send_tensor has 5 elements, but must have comm.nranks() times recv_tensor's (4)",
        "gather_inplace_size": "tensor has 3 elements, but must have nranks * count on dst (4)",
        "recv_dtype": "TypeError: bagua.torch_api.allreduce: recv_tensor is torch.int64 but send_tensor is "
                      "torch.float32",
        "not_contiguous": "ValueError: bagua.torch_api.allreduce_inplace: tensor must be a dense contiguous tensor",
        "bitwise_op": "ReduceOp.BXOR (a bitwise reduction) is not supported",
        "dst_out_of_range": "dst must be a rank of the communicator, in [0, 2), got 2",
        "alltoall_v_past_end": "send_counts[1]=2 elements from send_displs[1]=3 run past the end of the send "
                               "tensor (4 elements)",
        "alltoall_v_short": "counts must hold a non-negative int for each of the 2 ranks, got [4]",
        "group_as_comm": "TypeError: bagua.torch_api.barrier: comm must be a communicator",
        "non_member_rank": "ValueError: this rank is not in the communicator",
        "native_of_non_member": "ValueError: rank 0 is not in this process group (ranks [1])",
        "get_backend": "NotImplementedError: bagua.torch_api.get_backend('model')",
        "init_twice": "RuntimeError: bagua.init_process_group() was already called",
        "store_without_rank": "ValueError: bagua.torch_api.init_process_group(store=...) needs rank >= 0",
    }
    for name, text in expected.items():
        assert errors[name] is not None and text in errors[name], (name, errors[name])
    assert "group.get_global_communicator()" in errors["group_as_comm"]


def test_calls_before_init_say_to_call_init_process_group():
    assert not C.is_initialized()
    for call in (lambda: C.allreduce_inplace(torch.ones(2)), lambda: C.new_group([0]), C._get_default_group,
                 lambda: C.broadcast_object({}, 0)):
        with pytest.raises(NotInitializedError, match=r"call bagua.torch_api.init_process_group\(\) first"):
            call()


def test_reduce_op_keeps_the_original_values():
    assert {op.name: int(op) for op in C.ReduceOp} == {
        "SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "BOR": 7, "BAND": 8, "BXOR": 9, "AVG": 10,
    }
