"""Input checks for collectives: local ones (always) and a cross-rank agreement check.

A collective whose ranks disagree on shape, dtype, op or root hangs, aborts the process
inside Gloo, or silently returns garbage. ``check_agreement`` trades one small allgather
for a clear error on every rank instead. It runs before each public collective unless
``init_process_group(check_collectives=False)`` (or ``BAGUA_CHECK_COLLECTIVES=0``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Sequence

import torch

from ._torch_compat import all_gather_flat
from .process_group import BaguaProcessGroup

_KINDS = (
    "allreduce", "allgather", "alltoall", "alltoall_v", "reduce_scatter", "broadcast",
    "reduce", "gather", "scatter", "compressed_allreduce",
)
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool,
)
_MAX_DIMS = 8
_HEADER = 6 + _MAX_DIMS  # kind, dtype, ndim, numel, op, root, dims...


_trust = threading.local()


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Skip the cross-rank agreement check inside this block, on this thread.

    For callers that verified once that every rank issues the same sequence of calls
    (the Engine verifies its bucket layout at construction).
    """
    previous = getattr(_trust, "on", False)
    _trust.on = True
    try:
        yield
    finally:
        _trust.on = previous


def is_trusted() -> bool:
    """Whether the calling thread is inside ``trusted()``."""
    return getattr(_trust, "on", False)


def describe(tensor: torch.Tensor) -> str:
    """``float32[4, 3]``: a tensor's dtype and shape for messages."""
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"


def check_tensor(what: str, tensor: object, pg: BaguaProcessGroup, name: str = "tensor") -> torch.Tensor:
    """Raise a clear error unless ``tensor`` is a contiguous tensor this group can move."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{what}: {name} has unsupported dtype {tensor.dtype}; use one of "
                        f"{', '.join(str(d).replace('torch.', '') for d in _DTYPES)}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: {name} is sparse; collectives need a dense tensor (call .to_dense())")
    if tensor.device.type not in pg.device_types():
        raise ValueError(
            f"{what}: {name} is on {tensor.device}, but backend {pg.backend!r} moves only "
            f"{sorted(pg.device_types())} tensors; move it with .to(...) first"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what}: {name} {describe(tensor)} is not contiguous; pass tensor.contiguous() "
            f"(for in-place ops, copy the result back afterwards)"
        )
    return tensor


def check_root(what: str, root: int, pg: BaguaProcessGroup, name: str) -> int:
    """Raise unless ``root`` is a global rank inside ``pg``."""
    if not isinstance(root, int) or isinstance(root, bool) or root not in pg.ranks:
        raise ValueError(f"{what}: {name} must be a global rank in this group {list(pg.ranks)}, got {root!r}")
    return root


def check_splits(what: str, splits: Sequence[int], pg: BaguaProcessGroup, name: str) -> list[int]:
    """Raise unless ``splits`` has one non-negative int per rank of ``pg``."""
    splits = list(splits)
    if len(splits) != pg.size or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in splits):
        raise ValueError(
            f"{what}: {name} must hold {pg.size} non-negative ints (one per rank), got {splits!r}"
        )
    return splits


def _row(kind: str, tensor: torch.Tensor, op: int, root: int, splits: Sequence[int], width: int) -> torch.Tensor:
    dims = list(tensor.shape)[:_MAX_DIMS]
    head = [_KINDS.index(kind), _DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel(), op, root]
    head += dims + [-1] * (_MAX_DIMS - len(dims))
    row = head + list(splits) + [0] * (width - _HEADER - len(splits))
    return torch.tensor(row, dtype=torch.int64)


def _explain(table: list[list[int]], pg: BaguaProcessGroup) -> Optional[str]:
    """What the ranks disagree on, or None. Same verdict on every rank."""
    def who(col_fn) -> str:
        return ", ".join(f"rank {r}: {col_fn(row)}" for r, row in zip(pg.ranks, table))

    def tensor_of(row) -> str:
        dims = [d for d in row[6:6 + min(row[2], _MAX_DIMS)]]
        return f"{str(_DTYPES[row[1]]).replace('torch.', '')}{dims}"

    if len({row[0] for row in table}) > 1:
        return "ranks called different collectives (" + who(lambda r: _KINDS[r[0]]) + ")"
    kind = _KINDS[table[0][0]]
    if len({row[1] for row in table}) > 1:
        return "ranks passed different dtypes (" + who(tensor_of) + ")"
    if len({row[4] for row in table}) > 1:
        return "ranks passed different ops (" + who(lambda r: r[4]) + ")"
    if len({row[5] for row in table}) > 1:
        if kind == "compressed_allreduce":  # the root slot carries the codec's fingerprint
            return "ranks passed different compression codecs (or codec settings)"
        return "ranks passed different src/dst ranks (" + who(lambda r: r[5]) + ")"
    if kind == "alltoall_v":
        w = pg.size
        if len({tuple(row[7:6 + row[2]]) for row in table}) > 1:
            return "ranks passed tensors whose trailing dims differ (" + who(tensor_of) + ")"
        ins = [row[_HEADER:_HEADER + w] for row in table]
        outs = [row[_HEADER + w:_HEADER + 2 * w] for row in table]
        for i in range(w):
            for j in range(w):
                if outs[j][i] != ins[i][j]:
                    return (f"splits disagree: rank {pg.ranks[i]} sends {ins[i][j]} rows to rank "
                            f"{pg.ranks[j]}, which expects {outs[j][i]}")
        return None
    if len({tuple(row[2:4]) + tuple(row[6:_HEADER]) for row in table}) > 1:
        return "ranks passed tensors of different shapes (" + who(tensor_of) + ")"
    return None


def check_agreement(
    what: str,
    kind: str,
    tensor: torch.Tensor,
    pg: BaguaProcessGroup,
    op: int = -1,
    root: int = -1,
    splits: Sequence[int] = (),
) -> list[list[int]]:
    """Compare this call's signature with every rank's; raise the same ValueError everywhere on a mismatch.

    ``splits`` (alltoall_v only) is ``input_splits + output_splits``; ``root`` carries the
    src/dst rank, or for a compressed allreduce a fingerprint of the codec. Returns every
    rank's ``splits``, in group order.
    """
    width = _HEADER + 2 * pg.size
    row = _row(kind, tensor, op, root, splits, width)
    device = tensor.device if tensor.device.type == "cuda" and "nccl" in pg.backend and "gloo" not in pg.backend else "cpu"
    row = row.to(device)
    table = torch.empty(pg.size * width, dtype=torch.int64, device=device)
    all_gather_flat(table, row, group=pg.group)
    rows = table.view(pg.size, width).tolist()
    problem = _explain(rows, pg)
    if problem:
        raise ValueError(f"{what}: {problem}. Every rank must make the same call with matching tensors.")
    return [row[_HEADER:_HEADER + len(splits)] for row in rows]
