"""Lightning strategy: ``Trainer(strategy=BaguaStrategy(algorithm=...))`` trains with any Bagua algorithm.

A thin layer over the public API: the strategy joins bagua's process group from Lightning's
cluster environment, wraps the LightningModule in ``bagua.DistributedDataParallel`` for fitting
(with the optimizers ``configure_optimizers`` returned), and sends Lightning's own collectives
(``self.log(..., sync_dist=True)``, barriers, broadcasts) through ``bagua.comm``.

``Trainer(strategy="bagua")`` works once ``bagua`` (or ``lightning_bagua``) and Lightning are both
imported, in either order (see ``bagua._lightning_name``); ``lightning_bagua`` is Lightning's
documented spelling of this module.

Example::

    import lightning.pytorch as pl
    from bagua.lightning import BaguaStrategy

    trainer = pl.Trainer(strategy=BaguaStrategy(algorithm="bytegrad"), accelerator="cpu", devices=2)
    trainer.fit(model, datamodule=dm)

    trainer = pl.Trainer(strategy="bagua", devices=2)     # gradient_allreduce
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Union

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as error:  # pragma: no cover - exercised only without the extra
    from ._install import install_hint

    raise ImportError(
        f"Bagua's Lightning strategy (bagua.lightning, lightning_bagua) needs Lightning 2.6 or newer: "
        f"{install_hint('lightning')}"
    ) from error

import bagua
from bagua import comm
from bagua.algorithms import Algorithm, QAdamAlgorithm
from bagua.algorithms.base import check_options, resolve

__all__ = ["BaguaStrategy", "CommHook"]


class BaguaStrategy(DDPStrategy):
    """Data-parallel training with a Bagua algorithm, one process per device (CPU or CUDA).

    Args:
        algorithm: a registered name (``bagua.algorithms.registered_names()``) or an
            ``Algorithm`` instance. ``"qadam"`` needs ``configure_optimizers`` to return exactly
            one ``bagua.optim.QAdamOptimizer`` (LR schedulers allowed).
        bucket_size_bytes: as for ``bagua.DistributedDataParallel``.
        find_unused_parameters: as for ``bagua.DistributedDataParallel``.
        autotune: as for ``bagua.DistributedDataParallel`` (``True`` tunes during the first
            training steps; default ``BAGUA_AUTOTUNE``).
        accelerator: as for Lightning's ``DDPStrategy``; so are ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend`` and ``timeout``.
        **algorithm_kwargs: options of the named algorithm, e.g. ``hierarchical=True``.

    At the end of ``fit`` the synchronous algorithms (gradient_allreduce, bytegrad, qadam)
    leave identical weights on every rank, async averages them once more so they are
    identical too, and decentralized / low_precision_decentralized leave each rank its own
    replica (``validate``/``test``/``predict`` then use rank 0's, broadcast first).

    Example::

        trainer = pl.Trainer(strategy=BaguaStrategy("decentralized", peer_selection_mode="shift_one"),
                             accelerator="cpu", devices=2, max_epochs=3)
    """

    strategy_name = "bagua"

    def __init__(
        self,
        algorithm: Union[str, Algorithm] = "gradient_allreduce",
        *,
        bucket_size_bytes: Optional[int] = None,
        find_unused_parameters: bool = False,
        autotune: Union[None, bool, "bagua.AutotuneConfig"] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **algorithm_kwargs: Any,
    ) -> None:
        check_options("BaguaStrategy", algorithm, algorithm_kwargs)  # in the launching process, before any worker starts
        self._algorithm = algorithm
        self._algorithm_kwargs = algorithm_kwargs
        if bucket_size_bytes is not None and (
            not isinstance(bucket_size_bytes, int) or isinstance(bucket_size_bytes, bool) or bucket_size_bytes < 1
        ):
            raise ValueError(f"BaguaStrategy: bucket_size_bytes must be a positive int, got {bucket_size_bytes!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        self._bucket_size_bytes = bucket_size_bytes
        self._find_unused_parameters = bool(find_unused_parameters)
        self._autotune = autotune
        self._user_backend = process_group_backend
        self._failed = False

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this strategy in Lightning's ``strategy_registry`` as ``"bagua"``."""
        strategy_registry.register(
            cls.strategy_name, cls, description="Bagua's distributed algorithms (bagua.lightning)", override=True
        )

    # --- processes ------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        """Join bagua's process group as Lightning's cluster environment describes this process
        (once per process: a ``validate`` after ``fit`` reuses it)."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if bagua.is_initialized():
            return
        env = self.cluster_environment
        bagua.init_process_group(
            backend=self._user_backend,  # None: NCCL for CUDA tensors with Gloo beside it, or Gloo
            timeout=self._timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            local_world_size=self.num_processes,
            master_addr=env.main_address,
            master_port=env.main_port,
        )

    # --- the model ----------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)  # before wrapping: bagua wraps with the optimizers
            self.model = bagua.DistributedDataParallel(
                self.model,
                optimizers=self.optimizers,
                algorithm=self._algorithm_for(self.optimizers),
                bucket_size_bytes=self._bucket_size_bytes,
                find_unused_parameters=self._find_unused_parameters,
                autotune=self._autotune,
            )
        else:  # no wrapper: every rank evaluates rank 0's weights
            bagua.parallel.broadcast_module(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _algorithm_for(self, optimizers: list[torch.optim.Optimizer]) -> Algorithm:
        """A name is built now, with the optimizers ``configure_optimizers`` returned (qadam's)."""
        if isinstance(self._algorithm, QAdamAlgorithm) and not any(opt is self._algorithm.optimizer for opt in optimizers):
            raise ValueError(
                "BaguaStrategy: the QAdamAlgorithm's optimizer is not one that configure_optimizers "
                "returned; pass algorithm='qadam' and return a bagua.optim.QAdamOptimizer from "
                "configure_optimizers"
            )
        return resolve("BaguaStrategy", self._algorithm, optimizers, self._algorithm_kwargs,
                       how_to_pass="returned by configure_optimizers; LR schedulers allowed")

    @property
    def _wrapper(self) -> Optional[bagua.DistributedDataParallel]:
        return self.model if isinstance(self.model, bagua.DistributedDataParallel) else None

    def _evaluation_step(self, context: Callable[[], Any], step: str, args: tuple, kwargs: dict) -> Any:
        """Evaluation calls the LightningModule itself: no step, no traffic of the wrapper's."""
        assert self.lightning_module is not None
        with context():
            return getattr(self.lightning_module, step)(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(self.precision_plugin.val_step_context, "validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(self.precision_plugin.test_step_context, "test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(self.precision_plugin.predict_step_context, "predict_step", args, kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward inside communicates nothing (the wrapper's ``no_sync``)."""
        wrapper = self._wrapper
        with wrapper.no_sync() if wrapper is not None else contextlib.nullcontext():
            yield None

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization runs backward inside ``training_step`` (inside the wrapper's
        forward): each ``manual_backward`` is declared to the wrapper."""
        wrapper = self._wrapper
        if wrapper is not None and self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            wrapper.prepare_for_backward(closure_loss)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to do: the wrapper finishes its communication at the end of backward."""

    # --- checkpoints: the plain module's keys, plus the wrapper's step and algorithm state ------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        wrapper = self._wrapper
        if wrapper is not None:
            checkpoint["bagua"] = wrapper.algorithm_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Lightning's optimizer states from ``checkpoint``, then the algorithm's state saved with them."""
        super().load_optimizer_state_dict(checkpoint)
        wrapper = self._wrapper
        if wrapper is not None and "bagua" in checkpoint:
            wrapper.load_algorithm_state_dict(checkpoint["bagua"])

    # --- Lightning's collectives, through bagua.comm ------------------------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if bagua.is_initialized():
            comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not bagua.is_initialized():
            return obj
        return comm.broadcast_object(obj, src=src)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce ``tensor`` in place across ranks (Lightning's ``self.log(sync_dist=True)``):
        ``"mean"``/``"avg"``/None, ``"sum"``, ``"min"``, ``"max"`` or torch's ``ReduceOp``."""
        if not isinstance(tensor, torch.Tensor) or not bagua.is_initialized():
            return tensor
        group = _bagua_group(group)
        op = comm.as_reduce_op("avg" if reduce_op is None or reduce_op == "mean" else reduce_op)
        if op is comm.ReduceOp.AVG and not tensor.is_floating_point():  # as Lightning: an integer mean
            comm.allreduce(tensor, op=comm.ReduceOp.SUM, group=group)
            return tensor.copy_(tensor / group.size)
        comm.allreduce(tensor, op=op, group=group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension (``sync_grads``: gradients
        flow back to each rank's own input)."""
        if not bagua.is_initialized():
            return tensor
        group = _bagua_group(group)
        if sync_grads:
            return _AllGather.apply(tensor, group)
        with torch.no_grad():
            return comm.allgather(tensor.contiguous().unsqueeze(0), group=group)

    # --- the end --------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown then stops the wrapper without waiting for the other ranks
        super().on_exception(exception)

    def teardown(self) -> None:
        """Close the wrapper (async's ranks average their weights once more) and unwrap."""
        wrapper = self._wrapper
        if wrapper is not None:
            try:
                wrapper.close(synchronize=not self._failed)
            finally:
                self.model = self.lightning_module
        self._failed = False
        super().teardown()


class CommHook(pl.Callback):
    """Bagua's compression for Lightning's own ``DDPStrategy``: ``bagua.comm_hooks``' hook on the
    torch ``DistributedDataParallel`` it builds, registered at the start of ``fit``.

    On CUDA, ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=bagua.comm_hooks.compressed_hook)``
    does the same; Lightning registers a strategy's hook on CUDA only, this callback on any device.
    Its state (steps, error-feedback residuals) goes into Lightning's checkpoints, which rank 0
    writes: on resume the other ranks' residuals restart at zero, with a warning.

    Args:
        algorithm: as ``bagua.comm_hooks.CompressionHookState`` (checked here, before any rank
            starts).
        **options: as ``bagua.comm_hooks.CompressionHookState`` (checked here too).

    Example::

        trainer = pl.Trainer(strategy="ddp", callbacks=[CommHook("bytegrad")], devices=2)
    """

    def __init__(self, algorithm: str = "bytegrad", **options: Any) -> None:
        from bagua.comm_hooks import CompressionHookState

        self.hook_state = CompressionHookState(algorithm, **options)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        from bagua.comm_hooks import compressed_hook

        model = trainer.strategy.model
        if not isinstance(model, TorchDDP):
            raise TypeError(
                f"CommHook needs Lightning's DDPStrategy (strategy='ddp'), whose model is torch's "
                f"DistributedDataParallel; got {type(trainer.strategy).__name__} with a {type(model).__name__}"
                + (" (BaguaStrategy takes the algorithm itself: BaguaStrategy(algorithm=...))"
                   if isinstance(trainer.strategy, BaguaStrategy) else ""))
        self.hook_state.name_parameters(pl_module)
        model.register_comm_hook(self.hook_state, compressed_hook)

    def state_dict(self) -> dict[str, Any]:
        return self.hook_state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.hook_state.load_state_dict(state_dict)


def _bagua_group(group: Any) -> comm.BaguaProcessGroup:
    if group is None:
        return comm.get_default_group()
    if isinstance(group, comm.BaguaProcessGroup):
        return group
    return comm.from_torch_group(group)


class _AllGather(torch.autograd.Function):
    """allgather whose backward gives each rank the sum, over ranks, of the gradients of its slice."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: comm.BaguaProcessGroup) -> torch.Tensor:
        ctx.group = group
        return comm.allgather(tensor.contiguous().unsqueeze(0), group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        comm.allreduce(grad, op=comm.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.group.ranks.index(comm.get_rank())], None


BaguaStrategy.register_strategies(StrategyRegistry)
