"""Algorithm (what to do, declared) and AlgorithmImpl (how, through fixed hooks), plus a registry.

An ``Algorithm`` is a small declarative object that a user builds (``GradientAllReduceAlgorithm(
hierarchical=True)``, or by name with ``Algorithm.init("bytegrad")``). The wrapper,
``bagua.DistributedDataParallel``, calls ``algorithm.reify(process_group)`` once and drives the
returned ``AlgorithmImpl`` through these hooks, in this order each step:

====================================  ===========================================================
``tensors_to_communicate(ddp)``       once: the (name, tensor) pairs to put in buckets
``bucket_tensors(named, size_bytes)`` once: group them into buckets (default: by size and dtype)
``init_operations(ddp, bucket)``      once per bucket: append the ops the engine runs on it
``on_wrapped(ddp)``                   once, when wrapping is complete (start background work)
``on_forward_pre(ddp)``               every training forward (train mode, grad enabled, outside
                                      ``no_sync()``), before the module runs
``on_tensor_ready(ddp, name, param)`` every parameter whose gradient was just accumulated (only
                                      if overridden: else the wrapper readies whole buckets)
``on_backward_end(ddp)``              after backward, once the engine's ops finished
``on_optimizer_step_pre(ddp)``        before each wrapped optimizer's update; with
                                      ``step(closure)``, after the closure ran
``on_optimizer_step_post(ddp)``       after each wrapped optimizer's ``step()``
``on_weights_loaded(ddp)``            after ``load_state_dict`` of the wrapped module
====================================  ===========================================================

Between steps the wrapper may change system parameters (``ddp.configure``, the autotuner):
``tunables(ddp)`` declares which ones and their choices (none may change a result),
``set_tunable(ddp, name, value)`` applies one of the algorithm's own (the ops are then appended
anew), and ``on_rebucket(ddp, carry)`` moves per-bucket state when the buckets are rebuilt.

``ready_on_backward(ddp)`` tells the wrapper whether this step's buckets become ready through
backward (gradient algorithms) or through the algorithm itself (``ddp.for_algorithms.mark_all_ready()``);
``averages_gradients(ddp)`` whether the ops of buckets that become ready through backward average
the gradients (default) or only read them; ``keeps_produced_gradients(ddp)`` whether it keeps
the gradient tensors backward produces (``ddp.for_algorithms.produced_gradient()``). An algorithm whose ops change between phases (qadam's
warm-up) appends them anew between steps with ``ddp.for_algorithms.reset_operations()``.

A new algorithm is one file: subclass both and register the declarative class. See
``docs/writing_an_algorithm.md`` for a worked example.

Example::

    @Algorithm.register("my_allreduce")
    class MyAllReduce(Algorithm):
        def reify(self, process_group):
            return MyAllReduceImpl(process_group)
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence

import torch

from ..comm import BaguaProcessGroup, Bucket
from .tunable import Tunable, powers_of_two

if TYPE_CHECKING:  # the wrapper imports us, not the other way round
    from ..parallel.ddp import DistributedDataParallel

NamedTensor = tuple[str, torch.Tensor]
#: bucket sizes the autotuner tries: 1 MiB to 64 MiB
BUCKET_SIZES = powers_of_two(1 << 20, 64 << 20)
#: the first bucket's size (torch DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``): see ``bucket_tensors``
FIRST_BUCKET_BYTES = 1 << 20
#: carries per-bucket state across a rebucket: {id(old bucket): flat} -> {id(new bucket): flat}
Carry = Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]]


def _home(tensor: torch.Tensor) -> int | None:
    """The buffer ``tensor`` is a view into, when it is one (else None)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > tensor.nbytes else None


class AlgorithmImpl:
    """The hooks the wrapper calls; the defaults communicate nothing.

    Args:
        process_group: the ranks that train together: a communicator of the wrapper's own, so
            the user's collectives never interleave with the algorithm's.
    """

    #: the algorithm works through the wrapped optimizers' ``step()``: wrapping without
    #: ``optimizers=[...]`` is then an error instead of silently training something else
    needs_optimizers: ClassVar[bool] = False
    #: the layout of ``state_dict()``: raise it when the layout changes. A checkpoint records the
    #: algorithm and this version; state of another algorithm or version is not handed to
    #: ``load_state_dict`` (``bagua.parallel.algorithm_state`` says what carries over)
    state_version: ClassVar[int] = 1
    #: ``ddp.join()`` can shadow this algorithm's communication for ranks out of data (true of
    #: algorithms whose whole step is the buckets' ops during backward)
    supports_join: ClassVar[bool] = False
    #: ``state_dict()`` differs from rank to rank (error-feedback residuals), even where the
    #: replicas are identical: checkpoints keep every rank's
    state_per_rank: ClassVar[bool] = False

    def __init__(self, process_group: BaguaProcessGroup):
        self.process_group = process_group

    def tensors_to_communicate(self, ddp: "DistributedDataParallel") -> list[NamedTensor]:
        """The tensors to bucket, in the order backward is expected to produce them.

        Default: the gradients of the parameters that require one, last layer first
        (``ddp.for_algorithms.gradient_slot(name)``: the tensor that becomes the bucket view backward
        accumulates into, before any gradient exists).
        """
        return [(name, ddp.for_algorithms.gradient_slot(name)) for name, _ in reversed(ddp.named_trainable_parameters)]

    def bucket_tensors(self, named: list[NamedTensor], bucket_size_bytes: int) -> list[list[NamedTensor]]:
        """Split ``named`` into consecutive groups of one dtype and device, each about
        ``bucket_size_bytes`` (a tensor larger than that gets a bucket of its own), except the
        first, which closes at ``FIRST_BUCKET_BYTES`` (as torch DDP's): ``named`` comes in the
        order backward produces gradients, so the link starts working after the model's last
        layers instead of after a full bucket of them (with 25 MiB buckets, most of a 10M-parameter
        MLP's backward). Tensors that are views into a shared buffer (a fused optimizer's) are not
        mixed with others, so each bucket can adopt its stretch of that buffer without copying."""
        buckets: list[list[NamedTensor]] = []
        size, kind = 0, None
        for name, tensor in named:
            this = (tensor.dtype, tensor.device, _home(tensor))
            cap = min(bucket_size_bytes, FIRST_BUCKET_BYTES) if len(buckets) == 1 else bucket_size_bytes
            if not buckets or size >= cap or this != kind:
                buckets.append([])
                size, kind = 0, this
            buckets[-1].append((name, tensor))
            size += tensor.nbytes
        return buckets

    def init_operations(self, ddp: "DistributedDataParallel", bucket: Bucket) -> None:
        """Append to ``bucket`` the ops the engine runs once all its tensors are ready."""

    def on_wrapped(self, ddp: "DistributedDataParallel") -> None:
        """Called once when the wrapper is complete, on every rank (e.g. start a background thread)."""

    def ready_on_backward(self, ddp: "DistributedDataParallel") -> bool:
        """Whether this step's buckets become ready as backward produces gradients (default)."""
        return True

    def keeps_produced_gradients(self, ddp: "DistributedDataParallel") -> bool:
        """Whether this step's ``on_tensor_ready`` keeps the gradient tensors backward produces
        (``ddp.for_algorithms.produced_gradient()``, e.g. as a snapshot of their bits). Default
        no: backward then accumulates straight into zeroed bucket views, producing none. Yes:
        each gradient is made afresh and copied into its view (qadam's speculation keeps it)."""
        return False

    def averages_gradients(self, ddp: "DistributedDataParallel") -> bool:
        """Whether this step's buckets average the gradients (default: whenever they become ready
        on backward). An algorithm that only reads them as backward produces them (qadam's
        momentum, overlapped) returns False: a parameter backward did not reach is then no
        error and keeps its gradient as it was (None stays None), and its bucket is launched
        at the end of backward all the same."""
        return self.ready_on_backward(ddp)

    def on_forward_pre(self, ddp: "DistributedDataParallel") -> None:
        """Called before every training forward of the wrapped module (not for forwards in
        eval mode, under ``torch.no_grad()`` or inside ``ddp.no_sync()``)."""

    def on_tensor_ready(self, ddp: "DistributedDataParallel", name: str, param: torch.nn.Parameter) -> None:
        """Called when backward has accumulated ``param.grad``, for an algorithm that overrides
        it: the wrapper then takes its per-parameter path (``bagua.parallel.backward``). Not
        overridden, it is never called: the wrapper marks each bucket ready as a whole when its
        last gradient is accumulated, as this default does one tensor at a time."""
        if self.ready_on_backward(ddp):
            ddp.for_algorithms.mark_ready(name)

    def on_backward_end(self, ddp: "DistributedDataParallel") -> None:
        """Called after backward, once every launched bucket's ops have finished."""

    def on_optimizer_step_pre(self, ddp: "DistributedDataParallel") -> None:
        """Called before each wrapped optimizer updates the weights: at ``step()``, or with
        ``step(closure)`` once the closure (forward and backward) has run."""

    def on_optimizer_step_post(self, ddp: "DistributedDataParallel") -> None:
        """Called after ``optimizer.step()`` of each wrapped optimizer (not when it raised)."""

    def on_weights_loaded(self, ddp: "DistributedDataParallel") -> None:
        """Called after ``load_state_dict`` replaced the wrapped module's weights (on every rank,
        as a resume does): drop anything derived from the old weights."""

    def broadcasts_buffers(self, ddp: "DistributedDataParallel") -> bool:
        """Whether this step ends with rank 0's buffers broadcast (``broadcast_buffers=True``);
        default yes. Algorithms whose ranks never wait for each other return False."""
        return True

    def replicas_identical(self, ddp: "DistributedDataParallel") -> bool:
        """Whether every rank holds the same weights between steps (default yes); algorithms
        whose replicas legitimately differ return False, and checkpoints then keep every rank's."""
        return True

    def tunables(self, ddp: "DistributedDataParallel") -> dict[str, Tunable]:
        """The system parameters of this algorithm that the autotuner may set, by name, with
        their choices; each must leave every result unchanged. Default: the bucket size (the
        wrapper rebuckets; gradients, weights, optimizer and algorithm state carry over), for
        algorithms whose ops work element by element or per tensor."""
        return {"bucket_size_bytes": Tunable(BUCKET_SIZES, ddp.bucket_size_bytes)}

    def set_tunable(self, ddp: "DistributedDataParallel", name: str, value: object) -> None:
        """Apply ``value`` to tunable ``name``, one this algorithm declared other than the
        wrapper's own (``bucket_size_bytes``, ``streams``), between steps on every rank; the
        wrapper appends every bucket's ops anew afterwards."""
        raise ValueError(f"{type(self).__name__} has no tunable {name!r}")

    def on_rebucket(self, ddp: "DistributedDataParallel", carry: Carry) -> None:
        """The buckets were rebuilt between steps (``ddp.rebucket``): move per-bucket state over.
        ``carry({id(old bucket): flat})`` returns ``{id(new bucket): flat}``, each tensor's
        values where the new layout keeps them. Default: no per-bucket state."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume this algorithm exactly (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict()`` returned."""

    def close(self, ddp: "DistributedDataParallel") -> None:
        """Release background resources (threads); called by ``ddp.close()``."""

    def on_exit(self, ddp: "DistributedDataParallel") -> None:
        """The process is exiting with this wrapper still open: stop background threads promptly
        (every rank exits too; nothing more is owed to the training), before the groups go."""


class WeightCommunicationImpl(AlgorithmImpl):
    """Base for algorithms that communicate the weights, every ``interval`` steps (the
    decentralized ones): the weights are bucketed (each becomes a view of a flat buffer),
    nothing becomes ready during backward, and ``self.communicating`` says whether the
    current step communicates."""

    def __init__(self, process_group: BaguaProcessGroup, interval: int):
        super().__init__(process_group)
        self.interval = interval
        self.communicating = False

    def tensors_to_communicate(self, ddp: "DistributedDataParallel") -> list[NamedTensor]:
        return [(name, p) for name, p in reversed(ddp.named_trainable_parameters)]

    def ready_on_backward(self, ddp: "DistributedDataParallel") -> bool:
        return False

    def replicas_identical(self, ddp: "DistributedDataParallel") -> bool:
        return False  # each rank averages with its peers only

    def on_forward_pre(self, ddp: "DistributedDataParallel") -> None:
        self.communicating = ddp.step % self.interval == 0  # ddp.step: steps before this one


class Algorithm:
    """A declarative description of how ranks communicate; ``reify`` builds its implementation."""

    _registry: ClassVar[dict[str, type["Algorithm"]]] = {}
    name: ClassVar[str] = ""
    #: the optimizer class that the constructor takes first (qadam's ``QAdamOptimizer``), or None:
    #: built by name, the algorithm gets the one such optimizer of the wrapper's ``optimizers``
    optimizer_class: ClassVar[Optional[type]] = None

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        """Build the implementation that the wrapper drives, for ``process_group``."""
        raise NotImplementedError(f"{type(self).__name__} must implement reify(process_group)")

    @classmethod
    def register(cls, name: str) -> Callable[[type["Algorithm"]], type["Algorithm"]]:
        """Class decorator: make ``Algorithm.init(name, **kwargs)`` build this class."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an algorithm name must be a non-empty string, got {name!r}")

        def decorate(algorithm_cls: type["Algorithm"]) -> type["Algorithm"]:
            if not (isinstance(algorithm_cls, type) and issubclass(algorithm_cls, Algorithm)):
                raise TypeError(f"Algorithm.register({name!r}) decorates Algorithm subclasses, got {algorithm_cls!r}")
            known = cls._registry.get(name)
            if known is not None and known is not algorithm_cls:
                raise ValueError(f"algorithm name {name!r} is already registered to {known.__qualname__}")
            cls._registry[name] = algorithm_cls
            algorithm_cls.name = name
            return algorithm_cls

        return decorate

    @classmethod
    def init(cls, name: str, **kwargs) -> "Algorithm":
        """Build a registered algorithm by name, e.g. ``Algorithm.init("bytegrad", hierarchical=True)``."""
        try:
            algorithm_cls = cls._registry[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown algorithm {name!r}; registered: {', '.join(registered_names())}"
            ) from None
        try:
            return algorithm_cls(**kwargs)
        except TypeError as error:
            raise TypeError(
                f"Algorithm.init({name!r}, ...): {error}; see help({algorithm_cls.__module__}.{algorithm_cls.__qualname__})"
            ) from error

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def registered_names() -> list[str]:
    """The names ``Algorithm.init`` accepts, sorted."""
    return sorted(Algorithm._registry)


def algorithm_name(algorithm: Algorithm) -> str:
    """The name a checkpoint records for ``algorithm``: its class's registered name
    (``"bytegrad"``), or the qualified class name of a class that is not itself registered
    (a user's subclass of a registered algorithm inherits the name, not the registration).

    Example::

        algorithm_name(Algorithm.init("bytegrad"))     # 'bytegrad'
    """
    cls = type(algorithm)
    if cls.name and Algorithm._registry.get(cls.name) is cls:
        return cls.name
    return f"{cls.__module__}.{cls.__qualname__}"


def check_options(what: str, algorithm: "Algorithm | str", options: dict[str, Any]) -> Optional[type[Algorithm]]:
    """Check ``algorithm`` and the ``options`` given next to it (by ``what``: the wrapper, the
    Lightning strategy) before anything is built; the registered class for a name, None for an
    instance (which takes no options: they belong to its constructor).

    Example::

        check_options("BaguaStrategy", "decentralized", {"peer_selection_mode": "shift_one"})
    """
    if isinstance(algorithm, Algorithm):
        if options:
            raise ValueError(
                f"{what} got an unexpected keyword argument {sorted(options)[0]!r}: algorithm is already an "
                f"instance ({type(algorithm).__name__}); an algorithm's options go to its constructor"
            )
        return None
    if not isinstance(algorithm, str):
        raise TypeError(
            f"{what}: algorithm must be a name ({', '.join(registered_names())}) or a "
            f"bagua.algorithms.Algorithm, got {type(algorithm).__name__}"
        )
    if algorithm not in Algorithm._registry:
        raise ValueError(f"unknown algorithm {algorithm!r}; registered: {', '.join(registered_names())}")
    algorithm_cls = Algorithm._registry[algorithm]
    parameters = list(inspect.signature(algorithm_cls).parameters.values())[algorithm_cls.optimizer_class is not None:]
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"{what} got an unexpected keyword argument {unknown[0]!r}: it is no option of algorithm "
            f"{algorithm!r} ({algorithm_cls.__module__}.{algorithm_cls.__qualname__} accepts "
            f"{', '.join(accepted) or 'no option'})"
        )
    try:  # the values too: a throwaway instance runs the constructor's checks (an optimizer's: on a dummy one)
        if algorithm_cls.optimizer_class is None:
            algorithm_cls(**options)
        else:
            algorithm_cls(algorithm_cls.optimizer_class([torch.zeros(1, requires_grad=True)]), **options)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{what}: {error}") from None
    return algorithm_cls


def resolve(
    what: str,
    algorithm: "Algorithm | str",
    optimizers: Sequence[Any] = (),
    options: Optional[dict[str, Any]] = None,
    how_to_pass: str = "optimizers=[opt]",
) -> Algorithm:
    """The algorithm to wrap with: an instance as it is, or a registered name built with
    ``options``; an algorithm built around its optimizer (``optimizer_class``, e.g. qadam) gets
    the one optimizer of that class in ``optimizers`` (``how_to_pass`` says where it comes from,
    in the error when there is not exactly one).

    Example::

        resolve("bagua.DistributedDataParallel", "qadam", [qadam_optimizer], {"hierarchical": True})
    """
    options = dict(options or {})
    algorithm_cls = check_options(what, algorithm, options)
    if algorithm_cls is None:
        return algorithm
    wanted = algorithm_cls.optimizer_class
    if wanted is None:
        return algorithm_cls(**options)
    if len(optimizers) != 1 or not isinstance(optimizers[0], wanted):
        raise ValueError(
            f"{what}: algorithm {algorithm!r} by name is built around its optimizer and needs exactly one "
            f"{wanted.__module__}.{wanted.__qualname__} ({how_to_pass}), got "
            f"[{', '.join(type(opt).__name__ for opt in optimizers)}]"
        )
    return algorithm_cls(optimizers[0], **options)


def check_choice(what: str, value: object, choices: tuple) -> None:
    """Raise a ValueError naming ``what`` when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {list(choices)}, got {value!r}")


def check_positive_int(what: str, value: object, minimum: int = 1) -> None:
    """Raise a ValueError naming ``what`` unless ``value`` is an int >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")

