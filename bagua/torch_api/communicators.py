"""The original's process groups and communicators (``bagua.torch_api.communication`` re-exports them).

``init_process_group`` with the original's signature; ``new_group(ranks)`` makes a
``BaguaProcessGroup`` whose ``get_global_communicator()``, ``get_intra_node_communicator()`` and
``get_inter_node_communicator()`` give the ``Communicator`` that collectives take as ``comm=``
(``CommMember.NON_COMM_MEMBER`` on a rank outside it); ``from_torch_group`` and torch
``ProcessGroup.bagua_patch()`` for groups made with ``torch.distributed``.

Example::

    from bagua.torch_api.communication import new_group
    odd = new_group([r for r in range(bagua.get_world_size()) if r % 2])
    comm = odd.get_global_communicator()        # CommMember.NON_COMM_MEMBER on even ranks
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence, Union

import torch.distributed as dist

from .. import comm as native

__all__ = [
    "BaguaProcessGroup", "CommMember", "Communicator", "CommunicatorArg", "from_torch_group", "get_backend",
    "init_process_group", "is_initialized", "new_group",
]


class Communicator:
    """A set of ranks that collectives run over (the ``comm=`` argument of every collective).

    ``rank()`` is this process's rank in it, ``nranks()`` its size, ``ranks`` the global ranks
    in order; ``group`` is the ``bagua.comm`` group that does the work.

    Example::

        comm = group.get_global_communicator()
        bagua.torch_api.broadcast(t, src=comm.nranks() - 1, comm=comm)
    """

    def __init__(self, group: native.BaguaProcessGroup):
        self.group = group

    @property
    def ranks(self) -> list[int]:
        """The global ranks in the communicator, in order."""
        return list(self.group.ranks)

    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.group.rank

    def nranks(self) -> int:
        """The number of ranks in the communicator."""
        return self.group.size

    def __repr__(self) -> str:
        return f"Communicator(ranks={self.ranks})"


class _Marker:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return f"CommMember.{self._name}"


class _NonMember(_Marker):
    """What ``get_*_communicator()`` returns on a rank outside the communicator."""

    def _refuse(self) -> int:
        raise ValueError(
            "this rank is not in the communicator (get_*_communicator() returned CommMember.NON_COMM_MEMBER): "
            "it has no rank or size here; collectives given it return at once"
        )

    rank = nranks = _refuse


class CommMember:
    """``WORLD``: the default group's global communicator; ``NON_COMM_MEMBER``: see ``_NonMember``."""

    WORLD = _Marker("WORLD")
    NON_COMM_MEMBER = _NonMember("NON_COMM_MEMBER")


CommunicatorArg = Union[Communicator, _Marker, None]


class BaguaProcessGroup:
    """A process group of the original API: ``ranks`` (sorted global ranks) and three communicators.

    The global communicator links all of ``ranks``; the intra-node one, those of ``ranks`` on
    this machine; the inter-node one, those of ``ranks`` whose local rank is the first rank's
    (one per machine: the group's node leaders). ``native`` is the ``bagua.comm`` group of the
    global communicator. The global communicator is made by ``new_group``; a node one when first
    asked for (by each of its members, in the same order relative to their other groups).

    Example::

        group = bagua.torch_api.communication.new_group([0, 1])
        comm = group.get_intra_node_communicator()
    """

    def __init__(self, ranks: list[int], stream: Optional[Any] = None):
        self.ranks = ranks
        self.stream = stream
        self._communicators: dict[tuple[int, ...], Union[Communicator, _NonMember]] = {}

    def get_global_communicator(self) -> Union[Communicator, _NonMember]:
        """The communicator over all of ``ranks``."""
        return self._communicator(self.ranks)

    def get_intra_node_communicator(self) -> Union[Communicator, _NonMember]:
        """The communicator over the group's ranks on this machine."""
        local_size, rank = native.get_local_size(), native.get_rank()
        return self._communicator([r for r in self.ranks if r // local_size == rank // local_size])

    def get_inter_node_communicator(self) -> Union[Communicator, _NonMember]:
        """The communicator over the group's node leaders: one rank per machine, at the first rank's local rank."""
        local_size = native.get_local_size()
        return self._communicator([r for r in self.ranks if r % local_size == self.ranks[0] % local_size])

    @property
    def native(self) -> native.BaguaProcessGroup:
        """The ``bagua.comm`` group of the global communicator (ValueError on a rank outside the group)."""
        comm = self.get_global_communicator()
        if not isinstance(comm, Communicator):
            raise ValueError(f"rank {native.get_rank()} is not in this process group (ranks {self.ranks})")
        return comm.group

    def _communicator(self, ranks: list[int]) -> Union[Communicator, _NonMember]:
        key = tuple(ranks)
        if key not in self._communicators:
            group = native.new_group(ranks)
            self._communicators[key] = Communicator(group) if group.is_member else CommMember.NON_COMM_MEMBER
        return self._communicators[key]

    def _adopt(self, group: native.BaguaProcessGroup) -> None:
        """Use an existing ``bagua.comm`` group as the communicator of its ranks."""
        self._communicators[group.ranks] = Communicator(group)

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(ranks={self.ranks})"


def _require_init(what: str) -> None:
    if not native.is_initialized():
        raise native.NotInitializedError(
            f"{what} needs the process group: call bagua.torch_api.init_process_group() first"
        )


def init_process_group(
    store: Optional[dist.Store] = None, rank: int = -1, world_size: int = -1, local_world_size: int = -1
) -> None:
    """Join the job and build the default process group (the original's signature).

    Without ``store`` the job is read from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); a ``rank``/``world_size``/
    ``local_world_size`` other than -1 overrides its variable. With a ``torch.distributed.Store``
    the ranks meet through it, and all three are required, as in the original. Calling it twice
    is a RuntimeError, as in the original. There is no autotune service to start.

    Example::

        bagua.init_process_group()                                   # under torchrun
        bagua.init_process_group(store, rank=r, world_size=4, local_world_size=2)
    """
    if store is None:
        given = {"rank": rank, "world_size": world_size, "local_world_size": local_world_size}
        native.init_process_group(**{name: value for name, value in given.items() if value != -1})
        return
    if rank < 0 or world_size <= 0 or local_world_size <= 0:
        raise ValueError(
            "bagua.torch_api.init_process_group(store=...) needs rank >= 0, world_size > 0 and "
            f"local_world_size > 0, got rank={rank}, world_size={world_size}, local_world_size={local_world_size}"
        )
    native.init_process_group(
        store=store, rank=rank, world_size=world_size,
        local_rank=rank % local_world_size, local_world_size=local_world_size,
    )


def is_initialized() -> bool:
    """Whether ``init_process_group`` has run."""
    return native.is_initialized()


_default_group: Optional[tuple[native.BaguaProcessGroup, BaguaProcessGroup]] = None  # (bagua.comm's, ours)


def _get_default_group() -> BaguaProcessGroup:
    """The group of all ranks that ``init_process_group`` made (its communicators are the groups
    ``bagua.comm`` built then: no new ones)."""
    global _default_group
    _require_init("bagua.torch_api.communication._get_default_group()")
    world = native.get_default_group()
    if _default_group is None or _default_group[0] is not world:
        group = BaguaProcessGroup(list(world.ranks))
        group._adopt(world)
        group._adopt(native.get_intra_node_group())
        if native.get_local_rank() == 0:  # the default group's inter-node communicator links node leaders
            group._adopt(native.get_inter_node_group())
        _default_group = (world, group)
    return _default_group[1]


def _rank_not_in_group(group: Optional[BaguaProcessGroup] = None) -> bool:
    """Whether this rank is outside ``group`` (None: the default group, which holds every rank).
    The original's tests use it."""
    return group is not None and group.get_global_communicator() is CommMember.NON_COMM_MEMBER


def new_group(ranks: Optional[Sequence[int]] = None, stream: Optional[Any] = None) -> BaguaProcessGroup:
    """A new process group of ``ranks`` (default: all ranks), with communicators of its own.

    The members call it with the same ranks, in the same order relative to their other
    ``new_group`` calls; other ranks may call it too (the original asked every rank to) and do
    nothing: they get a group they are not a member of (``ranks=[]``: no rank is), whose
    communicators are ``CommMember.NON_COMM_MEMBER`` (see ``bagua.comm.new_group``). ``stream``
    is ignored.

    Example::

        odd = bagua.torch_api.communication.new_group([1, 3])
        bagua.torch_api.allreduce(t, t, comm=odd.get_global_communicator())
    """
    _require_init("bagua.torch_api.communication.new_group()")
    group = BaguaProcessGroup(list(range(native.get_world_size())) if ranks is None else sorted(ranks), stream)
    group.get_global_communicator()
    return group


def from_torch_group(group: dist.ProcessGroup, stream: Optional[Any] = None) -> BaguaProcessGroup:
    """A process group of the ranks of a ``torch.distributed`` group, with communicators of its
    own (as in the original). Every rank calls it; on a rank outside the torch group (torch
    gave it ``GroupMember.NON_GROUP_MEMBER`` and nothing about the group) the result has no ranks
    and every communicator is ``CommMember.NON_COMM_MEMBER``.

    Example::

        group = bagua.torch_api.communication.from_torch_group(torch.distributed.new_group([0, 1]))
    """
    _require_init("bagua.torch_api.communication.from_torch_group()")
    if not isinstance(group, dist.ProcessGroup) and group == dist.GroupMember.NON_GROUP_MEMBER:
        return BaguaProcessGroup([], stream)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"from_torch_group: group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return new_group(dist.get_process_group_ranks(group), stream)


# The original's patch of torch's ProcessGroup: ``pg.bagua_patch()`` makes (once) the Bagua
# process group of ``pg``, ``pg.bagua_pg`` returns it. A torch group that goes away takes its
# entry along (the Bagua group holds no reference to it).
_torch_to_bagua_pg_map: "weakref.WeakKeyDictionary[dist.ProcessGroup, BaguaProcessGroup]" = weakref.WeakKeyDictionary()


def _bagua_patch(self: dist.ProcessGroup, stream: Optional[Any] = None) -> dist.ProcessGroup:
    if self not in _torch_to_bagua_pg_map:
        _torch_to_bagua_pg_map[self] = from_torch_group(self, stream)
    return self


def _bagua_pg(self: dist.ProcessGroup) -> BaguaProcessGroup:
    if self not in _torch_to_bagua_pg_map:
        raise RuntimeError("this torch process group has no Bagua process group yet: call group.bagua_patch() first")
    return _torch_to_bagua_pg_map[self]


def _patch_torch_process_group() -> None:
    dist.ProcessGroup.bagua_patch = _bagua_patch
    dist.ProcessGroup.bagua_pg = property(_bagua_pg)
    for kind in ("global", "inter_node", "intra_node"):
        getter = f"get_{kind}_communicator"
        setattr(dist.ProcessGroup, f"bagua_{getter}", lambda self, getter=getter: getattr(self.bagua_pg, getter)())


_patch_torch_process_group()


def get_backend(model_name: str):
    """The original's Rust communication backend of a model: it does not exist here."""
    raise NotImplementedError(
        f"bagua.torch_api.get_backend({model_name!r}) returned the original's Rust communication backend, "
        "which does not exist here: bagua.comm.Engine schedules the buckets of a model wrapped by "
        "model.with_bagua(...) (or bagua.DistributedDataParallel); for collectives use the functions of "
        "bagua.torch_api or bagua.comm"
    )
