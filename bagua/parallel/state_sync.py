"""Keeping the replicas' state identical: the model check, parameter/buffer broadcasts and the
optimizer-state broadcast that ``bagua.DistributedDataParallel`` runs at wrap time (and after
``join()``), and the coalesced buffer broadcast it runs every step.

Example::

    check_same_model(model, group)
    broadcast_tensors(list(model.parameters()), group, src=group.ranks[0])
    sync_optimizer_states([opt], group, src=group.ranks[0])
"""

from __future__ import annotations

import ast
import zlib
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import comm
from ..comm import BaguaProcessGroup
from ..comm.checks import trusted


def check_same_model(module: torch.nn.Module, group: BaguaProcessGroup) -> None:
    """Compare parameter/buffer names, shapes, dtypes and ``requires_grad`` across ranks before
    any collective on them, so a mismatch is a clear error on every rank rather than a hang."""
    entries = [(n, tuple(t.shape), str(t.dtype)) for n, t in module.named_parameters()]
    entries += [(n, tuple(t.shape), str(t.dtype)) for n, t in module.named_buffers()]
    entries += [(n, "requires_grad") for n, p in module.named_parameters() if p.requires_grad]
    lines = _differences(repr(entries), group)
    if lines:
        raise ValueError(
            "bagua.DistributedDataParallel: the model differs across ranks (parameter/buffer names, "
            "shapes, dtypes or requires_grad); every rank must build the same model. " + "; ".join(lines)
        )


def _differences(text: str, group: BaguaProcessGroup) -> list[str]:
    """Compare the repr of a list of literals across ranks: [] if every rank has the same,
    else one line per rank whose entries differ from the first rank's."""
    mine = torch.tensor([len(text), zlib.crc32(text.encode())], dtype=torch.int64)
    table = comm.allgather(mine, group=group).view(-1, 2).tolist()
    if all(row == table[0] for row in table):
        return []
    everyone = _allgather_text(text, group)
    reference = set(_parse_entries(everyone[0]))
    lines = []
    for rank, theirs_text in zip(group.ranks, everyone):
        theirs = set(_parse_entries(theirs_text))
        if theirs != reference:
            extra, missing = sorted(theirs - reference, key=repr)[:3], sorted(reference - theirs, key=repr)[:3]
            lines.append(f"rank {rank}: has {extra} that rank {group.ranks[0]} lacks, lacks {missing}")
    return lines


def _allgather_text(text: str, group: BaguaProcessGroup) -> list[str]:
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    sizes = comm.allgather(torch.tensor([data.numel()]), group=group).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = comm.allgather(padded, group=group).view(len(sizes), -1)
    return [bytes(row[:size].tolist()).decode() for row, size in zip(rows, sizes)]


def _parse_entries(text: str) -> list:
    """Parse the repr of a list of tuples of str/int/tuples (no code runs: literal_eval)."""
    return [tuple(e) if isinstance(e, list) else e for e in ast.literal_eval(text)]


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: BaguaProcessGroup, src: int) -> None:
    """Overwrite ``tensors`` (the same list on every rank) with ``src``'s values, one broadcast
    per dtype and device (coalesced through a temporary flat buffer)."""
    with torch.no_grad():
        for same in _by_kind(tensors):
            flat = _flatten(same)
            comm.broadcast(flat, src=src, group=group)
            _unflatten_into(flat, same)


def broadcast_module(module: torch.nn.Module, src: int = 0, group: BaguaProcessGroup | None = None) -> None:
    """Make every rank's parameters and buffers ``src``'s (every rank calls it), e.g. before
    evaluating a model trained with an algorithm whose ranks end with different weights.

    Example::

        bagua.parallel.broadcast_module(model)     # rank 0's weights everywhere
    """
    group = group if group is not None else comm.get_default_group()
    check_same_model(module, group)
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), group, src)


def _by_kind(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` (each once) grouped by dtype and device, in order of first appearance."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    return list(by_kind.values())


def _flatten(same: list[torch.Tensor]) -> torch.Tensor:
    """A new flat tensor holding ``same``'s values, one after the other."""
    return torch.cat([t.detach().reshape(-1) for t in same])


def _unflatten_into(flat: torch.Tensor, same: list[torch.Tensor]) -> None:
    """Copy ``flat`` (as ``_flatten`` laid it out) back into ``same``."""
    torch._foreach_copy_(same, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in same]), same)])


class BufferBroadcast:
    """The module's buffers broadcast from a source rank, one message per dtype (torch DDP's
    ``broadcast_buffers``, coalesced), on a communicator of its own so that it can overlap with
    backward: ``start`` snapshots the buffers (on the source) after forward, ``finish`` copies
    what arrived into the live buffers (elsewhere) once backward is over. Backward never sees a
    buffer change under it."""

    def __init__(self, buffers: Callable[[], list[torch.Tensor]], group: BaguaProcessGroup):
        self.buffers = buffers  # the buffers to send, looked up at each broadcast (a module may replace one)
        self.ranks = list(group.ranks)
        self.group: BaguaProcessGroup | None = None  # made at the first broadcast, on every rank
        self._pending: list[tuple[comm.Handle, torch.Tensor, list[torch.Tensor]]] = []
        self._receiving = False

    def start(self, src: int) -> None:
        """Launch the broadcast of ``src``'s current buffers (every rank calls it)."""
        self.finish()
        if self.group is None:
            self.group = comm.new_group(self.ranks)
        self._receiving = comm.get_rank() != src
        with torch.no_grad(), trusted():  # every rank holds the same buffers: checked at wrap time
            for same in _by_kind(self.buffers()):
                flat = _flatten(same)
                self._pending.append((comm.broadcast(flat, src=src, group=self.group, async_op=True), flat, same))

    def finish(self) -> None:
        """Wait for a started broadcast and take its values (no-op when none is pending)."""
        pending, self._pending = self._pending, []
        for handle, flat, same in pending:
            handle.wait()
            if self._receiving:
                with torch.no_grad():
                    _unflatten_into(flat, same)


def sync_optimizer_states(optimizers: Sequence[torch.optim.Optimizer], group: BaguaProcessGroup, src: int) -> None:
    """Make every rank's optimizer state ``src``'s (as parameters are): a resume that loaded a
    checkpoint on some ranks only would otherwise diverge. Hyperparameters are configuration, not
    state: ranks whose param groups differ (sizes or hyperparameters) get a clear error.

    Cheap when nothing differs (the usual case): one small allgather of fingerprints.
    """
    for index, opt in enumerate(optimizers):
        what = f"optimizers[{index}] ({type(opt).__name__})"
        lines = _differences(repr(_param_group_entries(opt)), group)
        if lines:
            raise ValueError(
                f"bagua.DistributedDataParallel: {what} has different param groups across ranks "
                f"(their sizes or hyperparameters); every rank must build the same optimizer, or load "
                f"the same checkpoint. " + "; ".join(lines)
            )
        state = opt.state_dict()
        if not _differences(repr([_fingerprint(state["state"])]), group):
            continue
        theirs = comm.broadcast_object(state if comm.get_rank() == src else None, src=src, group=group)
        if comm.get_rank() != src:
            opt.load_state_dict(theirs)


def _param_group_entries(opt: torch.optim.Optimizer) -> list[tuple]:
    entries = []
    for i, group in enumerate(opt.param_groups):
        entries.append((i, "params", tuple(tuple(p.shape) for p in group["params"])))
        entries += [(i, key, _hyperparameter(value)) for key, value in sorted(group.items()) if key != "params"]
    return entries


def _hyperparameter(value: Any) -> Any:
    """A literal for comparing a param-group value across ranks (a tensor by its values)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.detach().cpu().reshape(-1).tolist())
    if isinstance(value, (tuple, list)):
        return tuple(_hyperparameter(v) for v in value)
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return repr(value)  # not a literal that literal_eval reads back
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _fingerprint(state: dict) -> str:
    """A digest of an optimizer state dict's structure and values (tensors by shape, dtype and
    a float64 checksum of their values)."""
    parts = []
    for key in sorted(state, key=repr):
        for name, value in sorted(state[key].items(), key=lambda kv: repr(kv[0])):
            if isinstance(value, torch.Tensor):
                detached = value.detach()
                checksum = detached.double().sum().item() if detached.is_floating_point() else int(detached.long().sum())
                parts.append((key, name, tuple(value.shape), str(value.dtype), checksum))
            else:
                parts.append((key, name, repr(value)))
    return f"{zlib.crc32(repr(parts).encode()):08x}"
