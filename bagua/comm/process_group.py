"""Process groups: the global group plus intra-node and inter-node subgroups.

``init_process_group()`` reads the environment that torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and builds, on top of
``torch.distributed``:

- the global group (all ranks);
- one intra-node group per node (the ranks that share a machine);
- one inter-node group per local rank (rank ``l`` of every node); the one of local
  rank 0 links the node leaders.

With ``streams=K`` each of them (and each ``new_group``) whose ranks span several machines also
gets K-1 extra torch groups over the same ranks, its stripes, over which large collectives
spread (see ``stripes.py``).

Ranks are assumed laid out as torchrun lays them out: node ``n`` holds ranks
``n * LOCAL_WORLD_SIZE ... (n + 1) * LOCAL_WORLD_SIZE - 1``.

Example::

    import bagua
    bagua.init_process_group()          # under torchrun, or alone as a world of one
    print(bagua.get_rank(), bagua.get_world_size())
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import stripes as _stripes
from .attempt import torchrun_attempt_store

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class NotInitializedError(RuntimeError):
    """Raised when a communication function is used before ``init_process_group()``."""


@dataclass(frozen=True)
class BaguaProcessGroup:
    """A set of ranks and the torch.distributed group that links them.

    ``ranks`` are global ranks in group order; ``group`` is the torch group handle
    (``None`` stands for torch's default group). ``backend`` names what moves the bytes.
    ``stripes`` are the extra torch groups over the same ranks that large collectives spread
    over (``streams=K``: K-1 of them), in pieces of at least ``min_chunk`` bytes.
    """

    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup]
    backend: str
    stripes: tuple[dist.ProcessGroup, ...] = field(default=(), compare=False, repr=False)
    min_chunk: int = field(default=_stripes.DEFAULT_MIN_CHUNK_BYTES, compare=False, repr=False)
    _streams_in_use: list[int] = field(default_factory=list, compare=False, repr=False)  # [k] once limited

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.ranks)

    @property
    def streams(self) -> int:
        """How many stripes a large collective on this group may use: all of them (``1 +
        len(stripes)``) unless ``use_streams`` chose fewer."""
        return self._streams_in_use[0] if self._streams_in_use else 1 + len(self.stripes)

    def use_streams(self, k: int) -> None:
        """From now on spread large collectives over at most ``k`` of this group's stripes (every
        member calls it, between collectives). Results do not change (see ``stripes.py``).

        Example::

            group.use_streams(2)     # of the 4 that init_process_group(streams=4) made
        """
        available = 1 + len(self.stripes)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= available:
            raise ValueError(
                f"streams must be an integer in [1, {available}] (this group has {available} stripes; "
                f"bagua.init_process_group(streams=K) makes more), got {k!r}"
            )
        self._streams_in_use[:] = [k]

    def rank_of(self, global_rank: int) -> int:
        """This group's rank of a global rank."""
        if global_rank not in self.ranks:
            raise ValueError(f"rank {global_rank} is not a member of this group (ranks {list(self.ranks)})")
        return self.ranks.index(global_rank)

    @property
    def rank(self) -> int:
        """The calling process's rank within this group (a ValueError on a non-member)."""
        return self.rank_of(dist.get_rank())

    def backend_for(self, device_type: str) -> str | None:
        """The backend that moves this group's tensors of ``device_type`` ("gloo", "nccl", ...),
        or None if none does."""
        return _backends_by_device(self.backend).get(device_type)

    @property
    def is_member(self) -> bool:
        """Whether the calling process is one of ``ranks``. ``new_group`` called by another rank
        (or with no ranks) returns a group it is not a member of, as torch's ``new_group`` does:
        its ``ranks`` and ``size`` are there, its ``rank`` and every collective on it are a
        ValueError saying so."""
        return dist.get_rank() in self.ranks

    def device_types(self) -> frozenset[str]:
        """Device types whose tensors this group's backend can move."""
        return frozenset(_backends_by_device(self.backend))


_DEVICES_OF = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",)}  # Gloo moves CUDA tensors through host memory


def _backends_by_device(backend: str) -> dict[str, str]:
    """{device type: backend} of a torch backend string: ``"cpu:gloo,cuda:nccl"`` names one per
    device type; a bare name serves every type it can."""
    table: dict[str, str] = {}
    parts = [part.rpartition(":") for part in backend.lower().split(",")]
    for device, _, name in sorted(parts, key=lambda p: not p[0]):  # explicit device types first
        for d in (device,) if device else _DEVICES_OF.get(name, ("cpu",)):
            table.setdefault(d, name)
    return table


@dataclass(frozen=True)
class _State:
    global_group: BaguaProcessGroup
    intra_node_group: BaguaProcessGroup
    inter_node_group: BaguaProcessGroup
    local_rank: int
    local_size: int
    check_collectives: bool
    streams: int
    min_chunk: int
    timeout: datetime.timedelta  # every group made after init waits this long for its peers


_state: Optional[_State] = None
_groups_made: dict[tuple[int, ...], int] = {}  # new_group calls per set of ranks, for the groups' names
_naming = threading.Lock()
_teardown: list[Callable[[], None]] = []  # run before the exit handler destroys the groups
_exit_handler_registered = False


def _env_int(name: str, default: Optional[int]) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(
                f"environment variable {name} is not set; launch with torchrun "
                f"(e.g. `torchrun --nproc-per-node 2 train.py`) or set it"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def _given_or_env(arg: str, value: Optional[int], env: str, default: Optional[int]) -> int:
    """An explicit argument (an int), else the environment variable ``env``, else ``default``."""
    if value is None:
        return _env_int(env, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"bagua.init_process_group: {arg} must be an int, got {value!r}")
    return value


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        # CPU tensors keep working through Gloo beside NCCL for CUDA tensors.
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_process_group(
    backend: Optional[str] = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    check_collectives: Optional[bool] = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    local_world_size: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    store: Optional[dist.Store] = None,
    streams: Optional[int] = None,
) -> None:
    """Join the job described by torchrun's environment (or by the arguments) and build Bagua's groups.

    Args:
        backend: a torch.distributed backend string; default NCCL for CUDA tensors when
            CUDA is usable (with Gloo beside it for CPU tensors), Gloo otherwise.
        timeout: how long a collective may wait for its peers before it fails with an
            error naming the operation; it holds for every group bagua makes, then and later
            (``new_group``, each wrapper's communicator, hierarchical groups, stripes).
        check_collectives: before each public collective, compare shapes, dtypes, ops and
            roots across ranks and raise a clear error on a mismatch (one small extra
            message per call). Default: the env ``BAGUA_CHECK_COLLECTIVES`` (``1``/``0``),
            else on.
        streams: K, the connections each group spreads a large collective over (Bagua-Net's
            ``BAGUA_NET_NSTREAMS``, read when not given; default 1: one connection, no extra
            group). Every group gets K-1 extra torch groups over its ranks, and a collective on
            ``n`` bytes is cut into ``min(K, n // BAGUA_NET_MIN_CHUNKSIZE)`` pieces (default
            1 MiB), each on its own group: faster where each TCP flow is capped below the link
            (clouds). Gloo tensors only; for NCCL it sets ``NCCL_SOCKET_NTHREADS`` and
            ``NCCL_NSOCKS_PERTHREAD`` (K sockets per connection) unless either is set, which
            matters only when NCCL runs over sockets (no InfiniBand/RoCE).

    The job's layout comes from torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); a launcher that knows it otherwise
    (Lightning's cluster environments) passes ``rank``, ``world_size``, ``local_rank``,
    ``local_world_size``, ``master_addr`` and ``master_port``, which take precedence. Without
    either the process forms a world of one (rank 0). Where ``torch.distributed`` is initialized
    already (a torch DDP job), bagua joins its default group and needs no address. A ``store`` (a ``torch.distributed.Store``
    every rank reaches) replaces the address: the ranks meet through it, and ``rank`` and
    ``world_size`` must then be given. Calling it twice is an error.

    Example::

        bagua.init_process_group()                       # torchrun env, NCCL or Gloo
        bagua.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
        bagua.init_process_group(rank=1, world_size=2, master_addr="10.0.0.1", master_port=29500)
        bagua.init_process_group(rank=1, world_size=2, store=torch.distributed.FileStore("/shared/rdzv", 2))
        bagua.init_process_group(streams=4)              # large collectives over 4 connections per peer
    """
    global _state
    if _state is not None:
        raise RuntimeError("bagua.init_process_group() was already called in this process")
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if store is not None:
        _check_store_arguments(store, rank, world_size, master_addr is not None or master_port is not None)
    streams = _stripes.streams_setting(streams)
    min_chunk = _stripes.min_chunk_setting()

    world_size = _given_or_env("world_size", world_size, "WORLD_SIZE", 1)
    rank = _given_or_env("rank", rank, "RANK", 0 if world_size == 1 else None)
    local_size = _given_or_env("local_world_size", local_world_size, "LOCAL_WORLD_SIZE", world_size)
    local_rank = _given_or_env("local_rank", local_rank, "LOCAL_RANK", rank % local_size if local_size > 0 else 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}), got {rank}")
    if local_size < 1 or world_size % local_size != 0:
        raise ValueError(
            f"WORLD_SIZE ({world_size}) must be a multiple of LOCAL_WORLD_SIZE ({local_size}): "
            f"every node must run the same number of processes"
        )
    if not 0 <= local_rank < local_size or local_rank != rank % local_size:
        raise ValueError(
            f"LOCAL_RANK={local_rank} does not match RANK={rank} with LOCAL_WORLD_SIZE="
            f"{local_size}; ranks must be laid out node by node as torchrun does"
        )
    # An address given as arguments goes to torch as a tcp:// URL (the environment is left
    # alone); otherwise torch reads MASTER_ADDR/MASTER_PORT itself (env://), as under torchrun.
    explicit_address = master_addr is not None or master_port is not None
    if store is None and world_size == 1 and not explicit_address:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    master_addr = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR")
    master_port = _given_or_env("master_port", master_port, "MASTER_PORT", 0)
    if store is None and (not master_addr or not master_port) and not dist.is_initialized():
        name = "MASTER_ADDR" if not master_addr else "MASTER_PORT"
        raise ValueError(
            f"environment variable {name} is not set; launch with torchrun, set it, or pass "
            f"{name.lower()}= to bagua.init_process_group"
        )
    init_method = f"tcp://{_url_host(master_addr)}:{master_port}" if explicit_address else None

    if check_collectives is None:
        check_collectives = os.environ.get("BAGUA_CHECK_COLLECTIVES", "1") not in ("0", "false", "False")
    backend = backend or _default_backend()
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if "nccl" in backend:
        _give_nccl_sockets(streams)
    if not dist.is_initialized():
        _import_dynamo_first()
        if store is None:
            store = torchrun_attempt_store(master_addr, master_port, world_size, rank, timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    backend_name = str(dist.get_backend())

    num_nodes = world_size // local_size
    node = rank // local_size

    def job_group(ranks: list[int], group: Optional[dist.ProcessGroup]) -> BaguaProcessGroup:
        # Every rank takes part in creating every group and its stripes, in the same order.
        count = _stripes.stripe_count_for(ranks, local_size, streams)
        extra = tuple(dist.new_group(ranks, timeout=timeout) for _ in range(count - 1))
        return BaguaProcessGroup(tuple(ranks), group, backend_name, extra, min_chunk)

    global_group = job_group(list(range(world_size)), None)
    if num_nodes == 1:
        intra = global_group
        inter = BaguaProcessGroup((rank,), None, backend_name)  # a group of one: no traffic
    else:
        for n in range(num_nodes):
            ranks = list(range(n * local_size, (n + 1) * local_size))
            g = job_group(ranks, dist.new_group(ranks, timeout=timeout))
            if n == node:
                intra = g
        for l in range(local_size):
            ranks = [n * local_size + l for n in range(num_nodes)]
            g = job_group(ranks, dist.new_group(ranks, timeout=timeout))
            if l == local_rank:
                inter = g
    _state = _State(global_group, intra, inter, local_rank, local_size, bool(check_collectives), streams, min_chunk,
                    timeout)
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_destroy_at_exit)
        _exit_handler_registered = True
    logger.info(
        "bagua: rank %d/%d (local %d/%d, node %d/%d), backend %s, %d stream(s)",
        rank, world_size, local_rank, local_size, node, num_nodes, backend_name, streams,
    )


def _give_nccl_sockets(streams: int) -> None:
    """Before the first NCCL communicator: K sockets per NCCL connection, unless the user chose."""
    chosen = _stripes.nccl_socket_env(streams)
    if chosen:
        logger.info(
            "bagua: streams=%d: set %s for NCCL (used only when NCCL runs over sockets, not InfiniBand/RoCE)",
            streams, " ".join(f"{k}={v}" for k, v in chosen.items()),
        )
    elif streams > 1:
        logger.info(
            "bagua: streams=%d: NCCL's sockets per connection left as the user set them (%s=%s, %s=%s)", streams,
            _stripes.NCCL_THREADS_ENV, os.environ.get(_stripes.NCCL_THREADS_ENV, "unset"),
            _stripes.NCCL_SOCKETS_ENV, os.environ.get(_stripes.NCCL_SOCKETS_ENV, "unset"),
        )


def _check_store_arguments(
    store: object, rank: Optional[int], world_size: Optional[int], explicit_address: bool
) -> None:
    if not isinstance(store, dist.Store):
        raise TypeError(
            f"bagua.init_process_group: store must be a torch.distributed.Store, got {type(store).__name__}"
        )
    if rank is None or world_size is None:
        raise ValueError("bagua.init_process_group: with store=, pass rank= and world_size= as well")
    if explicit_address:
        raise ValueError("bagua.init_process_group: pass either store= or master_addr=/master_port=, not both")


def is_initialized() -> bool:
    """Whether ``init_process_group()`` has run in this process."""
    return _state is not None


def _require_state(what: str = "this call") -> _State:
    if _state is None:
        raise NotInitializedError(
            f"{what} needs the process group: call bagua.init_process_group() first "
            f"(under torchrun, or alone for a world of one)"
        )
    return _state


def _import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before any process group exists.

    The first torch optimizer imports it anyway; imported after ``init_process_group`` it keeps
    references to the default group that outlive ``destroy_process_group``, so Gloo's worker
    threads run on into interpreter shutdown, and one that drops a finished collective there
    aborts the process ("terminate called without an active exception"; ~1 in 10 two-rank runs
    of the demo on a 2-core machine). Imported first, it holds none, and destroying the group
    joins those threads.
    """
    try:
        import torch._dynamo  # noqa: F401
    except ImportError:  # builds without dynamo have no such cache either
        pass


def at_teardown(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` when the process exits with its groups still up, before they are torn
    down (e.g. to stop a thread that communicates). Returns a function that unregisters it.

    Example::

        forget = bagua.comm.at_teardown(lambda: worker.stop())
    """
    _teardown.append(callback)
    return lambda: _teardown.remove(callback) if callback in _teardown else None


def _destroy_at_exit() -> None:
    """atexit: stop what still communicates, then tear the groups down while the interpreter is
    alive. Gloo's threads otherwise run into interpreter shutdown, and torchrun sees a finished
    job die of SIGABRT ("terminate called without an active exception", pytorch#190489). A no-op
    when the script destroyed the groups itself."""
    if _state is None:
        return
    for callback in reversed(list(_teardown)):
        try:
            callback()
        except Exception as error:  # exiting anyway: say so, tear down what is left
            logger.warning("bagua: stopping %r at exit failed: %s", callback, error)
    destroy_process_group()


def destroy_process_group() -> None:
    """Leave the job: tear down every group made by ``init_process_group()``."""
    global _state
    if _state is None:
        return
    _state = None
    _groups_made.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    """This process's global rank."""
    _require_state("bagua.get_rank()")
    return dist.get_rank()


def get_world_size() -> int:
    """The number of processes in the job."""
    _require_state("bagua.get_world_size()")
    return dist.get_world_size()


def get_local_rank() -> int:
    """This process's rank on its machine."""
    return _require_state("bagua.get_local_rank()").local_rank


def get_local_size() -> int:
    """The number of processes on each machine."""
    return _require_state("bagua.get_local_size()").local_size


def get_default_group() -> BaguaProcessGroup:
    """The group of all ranks."""
    return _require_state("bagua.comm.get_default_group()").global_group


def get_intra_node_group() -> BaguaProcessGroup:
    """The ranks on this process's machine."""
    return _require_state("bagua.comm.get_intra_node_group()").intra_node_group


def get_inter_node_group() -> BaguaProcessGroup:
    """The ranks with this process's local rank, one per machine (leaders: local rank 0)."""
    return _require_state("bagua.comm.get_inter_node_group()").inter_node_group


def new_group(ranks: list[int], timeout: Optional[datetime.timedelta] = None) -> BaguaProcessGroup:
    """A new communicator over the given global ranks. Every rank in ``ranks`` must call it,
    with the same list, in the same order relative to its other ``new_group`` calls; other
    ranks need not call it. Group ranks follow the global ranks' order (as torch numbers
    them), whatever order ``ranks`` lists them in. With ``streams=K`` it comes with K-1
    stripes of its own when its ranks span several machines.

    A collective on it (and on its stripes) that waits longer than ``timeout`` for a peer fails
    with a ``CollectiveError``; default: the timeout given to ``init_process_group``.

    A rank that is not in ``ranks`` (``ranks`` may then be empty) gets a group it is not a member
    of, as from torch's ``new_group``: nothing is made, ``is_member`` is False, and its ``rank``
    and any collective on it raise a ValueError saying so.

    Example::

        evens = bagua.comm.new_group([0, 2])
        quick = bagua.comm.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
        if evens.is_member:
            bagua.comm.allreduce(t, group=evens)
    """
    state = _require_state("bagua.comm.new_group()")
    if timeout is None:
        timeout = state.timeout
    elif not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"bagua.comm.new_group: timeout must be a datetime.timedelta or None, got {timeout!r}")
    world = dist.get_world_size()
    listed = [int(r) for r in ranks]
    if len(set(listed)) != len(listed) or not all(0 <= r < world for r in listed):
        raise ValueError(f"ranks must be distinct global ranks in [0, {world}), got {listed}")
    ranks = sorted(listed)  # torch's group ranks are in this order
    if dist.get_rank() not in ranks:
        return BaguaProcessGroup(tuple(ranks), dist.GroupMember.NON_GROUP_MEMBER, state.global_group.backend)
    # Always a communicator of its own, even for all ranks: collectives on it never interleave
    # with those of other groups (a background thread may own it).
    with _naming:
        key = tuple(ranks)
        serial = _groups_made.get(key, 0)
        _groups_made[key] = serial + 1
        group = _new_torch_group(ranks, _group_name(key, serial), timeout)
        stripe_count = _stripes.stripe_count_for(ranks, state.local_size, state.streams)
        extra = tuple(_new_torch_group(ranks, _group_name(key, serial, i), timeout) for i in range(1, stripe_count))
    return BaguaProcessGroup(tuple(ranks), group, state.global_group.backend, extra, state.min_chunk)


def _group_name(ranks: tuple[int, ...], serial: int, stripe: int = 0) -> str:
    """The torch name of stripe ``stripe`` of the ``serial``-th ``new_group`` over ``ranks``
    (stripe 0: the group itself)."""
    label = f"{ranks}/{serial}" + (f"/stripe{stripe}" if stripe else "")
    return "bagua-" + hashlib.sha1(label.encode()).hexdigest()


def _new_torch_group(ranks: list[int], name: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """``dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)`` named ``name``.

    Without ``timeout=`` torch gives the group its backend's default (30 minutes for Gloo), not
    the timeout the job's default group was made with.

    torch names such a group after its ranks and the number of groups the calling process
    already has; members that belong to different other groups (a torch subgroup of some
    ranks, an earlier ``new_group`` of others) then count differently, meet under different
    names and wait for each other forever. The name given here is the same on every member:
    the ranks and how many groups of those ranks came before.
    """
    c10d = dist.distributed_c10d
    torch_naming = getattr(c10d, "_hash_ranks_to_str", None)
    if torch_naming is None:  # a torch without this hook names the group itself
        return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    c10d._hash_ranks_to_str = lambda _ranks: name
    try:
        return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    finally:
        c10d._hash_ranks_to_str = torch_naming


def from_torch_group(group: "dist.ProcessGroup") -> BaguaProcessGroup:
    """The ``BaguaProcessGroup`` of a ``torch.distributed`` process group (e.g. one a torch DDP
    user already made with ``torch.distributed.new_group``). It has no stripes: its ranks made
    no extra groups together (``new_group`` makes a striped one).

    Example::

        pg = bagua.comm.from_torch_group(torch.distributed.new_group([0, 1]))
    """
    state = _require_state("bagua.comm.from_torch_group()")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a bagua.comm.BaguaProcessGroup or a torch.distributed.ProcessGroup, "
            f"got {type(group).__name__}"
        )
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks == state.global_group.ranks and group is dist.group.WORLD:
        return state.global_group
    return BaguaProcessGroup(ranks, group, state.global_group.backend)


@dataclass(frozen=True)
class NodeGroups:
    """Private intra-node and inter-node communicators for hierarchical algorithms: ``intra``
    links the ranks of this machine, ``inter`` the ranks of every machine with this local rank
    (the node leaders when ``is_leader``)."""

    intra: BaguaProcessGroup
    inter: BaguaProcessGroup
    is_leader: bool


def new_node_groups() -> NodeGroups:
    """New intra-node and inter-node communicators of this rank, for the whole job (every rank
    calls it), so that one hierarchical algorithm's traffic never interleaves with another's.

    Example::

        groups = bagua.comm.new_node_groups()
        hierarchical_allreduce(grads, groups=groups)
    """
    state = _require_state("bagua.comm.new_node_groups()")
    rank, local = dist.get_rank(), state.local_size
    node_ranks = [rank - state.local_rank + l for l in range(local)]
    peers = [n * local + state.local_rank for n in range(dist.get_world_size() // local)]
    intra = new_group(node_ranks) if len(node_ranks) > 1 else state.intra_node_group
    inter = new_group(peers) if len(peers) > 1 else state.inter_node_group
    return NodeGroups(intra, inter, state.local_rank == 0)


def _collective_checks_enabled() -> bool:
    return _require_state().check_collectives
