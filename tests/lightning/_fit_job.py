"""Real Lightning fits with BaguaStrategy, run by tests/lightning/test_strategy.py.

    python _fit_job.py OUTDIR SCENARIO [SCENARIO ...]     # Lightning launches rank 1 itself
    torchrun --nproc-per-node 2 _fit_job.py OUTDIR torchrun_instance

Lightning's launcher re-runs this command line for rank 1, so both ranks run the same scenarios
in order, in one process group. Each scenario writes OUTDIR/<scenario>.rank<r>.pt (losses,
weights, flags) for the test to compare; a scenario that raises writes its error instead.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import bagua
from bagua.algorithms import ByteGradAlgorithm
from bagua.lightning import BaguaStrategy
from bagua.optim import QAdamOptimizer

SAMPLES, FEATURES, CLASSES = 256, 16, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


class Net(pl.LightningModule):
    """A small MLP; ``batchnorm`` adds buffers, ``manual`` takes two synced steps per batch."""

    def __init__(self, optimizer: str = "sgd", batchnorm: bool = True, manual: bool = False,
                 raise_at: int = -1, sync_dist: bool = True, batch_size: int = 16):
        super().__init__()
        self.save_hyperparameters()
        layers = [torch.nn.Linear(FEATURES, 32)] + ([torch.nn.BatchNorm1d(32)] if batchnorm else [])
        self.net = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))
        self.automatic_optimization = not manual
        self.train_losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.hparams.raise_at:
            raise RuntimeError(f"planned failure at step {self.global_step}")
        x, y = batch
        if self.hparams.manual:
            opt = self.optimizers()
            for half in (slice(0, len(x) // 2), slice(len(x) // 2, None)):  # two backwards, two steps
                loss = F.cross_entropy(self(x[half]), y[half])
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
        else:
            loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=self.hparams.sync_dist)
        self.train_losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "qadam":
            return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=4)
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(dataset(), batch_size=64)


def trainer(strategy, max_epochs: int = 3, **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu", devices=2, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(strategy, net: dict | None = None, **kwargs) -> dict:
    """Fit Net(**net), initialized from seed 0 (rank 0's weights are broadcast anyway)."""
    torch.manual_seed(0)
    model = Net(**(net or {}))
    t = trainer(strategy, **kwargs)
    t.fit(model)
    return {
        "losses": model.train_losses, "weights": weights(model),
        "unwrapped": t.strategy.model is model and not hasattr(model, "_bagua_wrapper"),
        "metrics": {k: float(v) for k, v in t.callback_metrics.items()}, "model": model,
    }


class BytesPerBatch(pl.Callback):
    """bagua.comm's bytes sent between each training batch's start and end (forward, backward, step)."""

    def __init__(self):
        self.total = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = bagua.comm.bytes_sent()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.total += bagua.comm.bytes_sent() - self._start


class SaveMidFit(pl.Callback):
    """trainer.save_checkpoint while the model is wrapped (end of the first epoch)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)
            self.weights = weights(pl_module)


def algorithm_fit(name: str, outdir: str) -> dict:
    kwargs = {"sync_interval_ms": 5} if name == "async" else {}
    result = fit(BaguaStrategy(name, **kwargs), {"optimizer": "qadam" if name == "qadam" else "sgd"})
    model = result.pop("model")
    trainer(BaguaStrategy(name, **kwargs)).validate(model, verbose=False)
    result["weights_after_validate"] = weights(model)
    return result


def by_name(outdir: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    model = Net()
    mid = SaveMidFit(os.path.join(outdir, "mid.ckpt"))
    t = trainer("bagua", enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=outdir, save_last=True), mid])
    strategy_type = type(t.strategy).__name__
    t.fit(model)
    t.save_checkpoint(os.path.join(outdir, "after.ckpt"))
    return {"strategy": strategy_type, "weights": weights(model), "mid_weights": mid.weights}


def resume(optimizer: str, outdir: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight = fit(BaguaStrategy(), {"optimizer": optimizer}, max_epochs=2)
    ckpt_dir = os.path.join(outdir, f"resume_{optimizer}")
    fit(BaguaStrategy(), {"optimizer": optimizer}, max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    torch.manual_seed(1)  # a different initialization: everything must come from the checkpoint
    model = Net(optimizer=optimizer)
    trainer(BaguaStrategy(), max_epochs=2).fit(model, ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    return {"straight": straight["weights"], "resumed": weights(model)}


class StepsAtStart(pl.Callback):
    """The wrapper's step count when each fit's first training batch begins."""

    def __init__(self):
        self.steps: list[int] = []

    def on_train_start(self, trainer, pl_module):
        self.steps.append(trainer.strategy.model.step)


def switch_algorithm(outdir: str) -> dict:
    """Fit one epoch under bytegrad, then resume the checkpoint under decentralized."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_dir, seen = os.path.join(outdir, "switch_algorithm"), StepsAtStart()
    fit(BaguaStrategy("bytegrad"), max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    torch.manual_seed(1)
    model = Net()
    trainer(BaguaStrategy("decentralized"), max_epochs=2, callbacks=[seen]).fit(
        model, ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    return {"steps_at_start": seen.steps, "losses": model.train_losses, "weights": weights(model)}


def accumulate(outdir: str) -> dict:
    runs = {}
    for label, batch, accumulate_batches in (("plain", 8, 1), ("accumulated", 8, 2), ("double_batch", 16, 1)):
        counter = BytesPerBatch()
        net = {"batchnorm": False, "sync_dist": False, "batch_size": batch}
        run = fit(BaguaStrategy(), net, max_epochs=1, accumulate_grad_batches=accumulate_batches,
                  callbacks=[counter], limit_val_batches=0)
        runs[label] = {"weights": run["weights"], "bytes_per_sample": counter.total / (SAMPLES // 2)}
    return runs


def raises(outdir: str) -> dict:
    torch.manual_seed(0)
    model = Net(raise_at=3)
    started = time.monotonic()
    try:
        trainer(BaguaStrategy("async", sync_interval_ms=5)).fit(model)
    except RuntimeError as error:
        message = str(error)
    else:
        message = ""
    return {"message": message, "seconds": time.monotonic() - started, "unwrapped": not hasattr(model, "_bagua_wrapper")}


def qadam_wrong_optimizer(outdir: str) -> dict:
    try:
        fit(BaguaStrategy("qadam"), {"optimizer": "sgd"})
    except ValueError as error:
        return {"message": str(error)}
    return {"message": ""}


def collectives(outdir: str) -> dict:
    """Lightning's reduce / all_gather / broadcast of the strategy, rank r contributing r + 1."""
    t = trainer(BaguaStrategy(), max_epochs=1, limit_train_batches=1, limit_val_batches=0)
    t.fit(Net())
    strategy, value = t.strategy, float(bagua.get_rank() + 1)
    x = torch.full((2,), value, requires_grad=True)
    strategy.all_gather(x, sync_grads=True).sum().backward()
    return {
        "mean": strategy.reduce(torch.tensor(value)).item(),
        "sum": strategy.reduce(torch.tensor(value), reduce_op="sum").item(),
        "max": strategy.reduce(torch.tensor(value), reduce_op="max").item(),
        "int_mean": strategy.reduce(torch.tensor(int(value))).item(),
        "torch_op_sum": strategy.reduce(torch.tensor(value), reduce_op=torch.distributed.ReduceOp.SUM).item(),
        "gathered": strategy.all_gather(torch.full((2,), value)).tolist(),
        "broadcast": strategy.broadcast({"from": bagua.get_rank()}),
        "gather_grad": x.grad.tolist(),
    }


class AutotuneSeen(pl.Callback):
    """The wrapper's autotuning log and result, read while it is still wrapped."""

    def on_train_epoch_end(self, trainer, pl_module):
        self.log, self.result = trainer.strategy.model.autotune_log, trainer.strategy.model.autotune_result


def autotune(outdir: str) -> dict:
    seen = AutotuneSeen()
    config = bagua.AutotuneConfig(max_trials=3, steps_per_trial=1, warmup_steps=1,
                                  space={"bucket_size_bytes": (256, 4096)})
    result = fit(BaguaStrategy("bytegrad", autotune=config), {"optimizer": "sgd"}, callbacks=[seen])
    return {**result, "trials": len(seen.log), "tuned": seen.result is not None}


def ddp_comm_hook(outdir: str) -> dict:
    """Lightning's own DDPStrategy (torch DDP) with bagua's 8-bit hook, through the callback."""
    from lightning.pytorch.strategies import DDPStrategy

    from bagua.lightning import CommHook

    sent = BytesPerBatch()
    hook = CommHook("bytegrad")
    result = fit(DDPStrategy(), callbacks=[hook, sent])
    result["unwrapped"] = True  # DDPStrategy keeps its wrapper: not this test's concern
    return {**result, "bytes": sent.total, "hook_steps": hook.hook_state.steps}


def torchrun_instance(outdir: str) -> dict:
    return fit(BaguaStrategy(ByteGradAlgorithm()))


SCENARIOS = {
    **{f"algo_{name}": (lambda outdir, name=name: algorithm_fit(name, outdir)) for name in (
        "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async", "qadam")},
    "by_name": by_name,
    "resume_sgd": lambda outdir: resume("sgd", outdir),
    "resume_qadam": lambda outdir: resume("qadam", outdir),
    "switch_algorithm": switch_algorithm,
    "accumulate": accumulate,
    "manual": lambda outdir: fit(BaguaStrategy(), {"manual": True}),
    "bf16": lambda outdir: fit(BaguaStrategy("bytegrad"), precision="bf16-mixed"),
    "raises": raises,
    "qadam_wrong_optimizer": qadam_wrong_optimizer,
    "collectives": collectives,
    "autotune": autotune,
    "ddp_comm_hook": ddp_comm_hook,
    "torchrun_instance": torchrun_instance,
}


def main() -> None:
    outdir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        try:
            result = SCENARIOS[name](outdir)
            result.pop("model", None)
        except Exception:
            result = {"error": traceback.format_exc()}
        result["world_size"] = bagua.get_world_size() if bagua.is_initialized() else 0
        torch.save(result, os.path.join(outdir, f"{name}.rank{bagua.get_rank()}.pt"))


if __name__ == "__main__":
    main()
