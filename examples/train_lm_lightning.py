"""``train_lm.py --lightning``: the same model, data and schedule as a LightningModule, trained
by ``Trainer(strategy=BaguaStrategy(algorithm=...))``.

    python examples/train_lm.py --lightning --devices 2 --algorithm bytegrad --steps 200

The batches come from the same load-balanced batch sampler (``use_distributed_sampler=False``:
the sampler already splits the data by rank); validation is the same fixed set of held-out
documents, every ``--eval-every`` steps.
"""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import bagua
from bagua.lightning import BaguaStrategy
from stdlib_corpus import pad_batch
from train_lm import (batch_sampler, build_model, compared, datasets, make_optimizer, schedule, token_loss,
                      validation_loss, write_outputs)


class ByteLM(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = build_model(args)
        self.curve: list[tuple] = []
        self._start = self._eval_time = 0.0
        self._tokens = 0

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set, self.lengths = datasets(self.args, self.global_rank)

    def train_dataloader(self):
        batches, self._epochs = batch_sampler(self.args, self.train_set, self.lengths, self.global_rank, self.trainer.world_size)
        return DataLoader(self.train_set, batch_sampler=batches, collate_fn=pad_batch)

    def on_train_epoch_start(self) -> None:
        self._epochs.set_epoch(self.current_epoch)

    def on_train_start(self) -> None:
        self._validate(0, float("nan"))
        self._start = time.perf_counter()

    def training_step(self, batch, batch_idx):
        loss, n = token_loss(self.model, batch)
        self._tokens += n
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        step = self.global_step
        if step % self.args.eval_every == 0 or step == self.args.steps:
            self._validate(step, float(outputs["loss"]))

    def _validate(self, step: int, train_loss: float) -> None:
        t0 = time.perf_counter()
        val = validation_loss(self.model, self.val_set, self.args.val_docs, self.global_rank, self.trainer.world_size)
        seen = torch.tensor([self._tokens], dtype=torch.float64)
        bagua.comm.allreduce(seen, op=bagua.comm.ReduceOp.SUM)
        elapsed = t0 - self._start - self._eval_time if step else 0.0
        self.curve.append((step, elapsed, int(seen[0]), train_loss, val))
        if self.global_rank == 0:
            print(f"step {step:5d}  val loss {val:.4f}  ppl {math.exp(val):.1f}  "
                  f"{seen[0] / max(elapsed, 1e-9):.0f} tokens/s", flush=True)
        self._eval_time += time.perf_counter() - t0 if step else 0.0

    def configure_optimizers(self):
        opt = make_optimizer(self.args, self.model)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(self.args, opt), "interval": "step"}}


def fit(args) -> None:
    pl.seed_everything(args.seed, verbose=False)
    module = ByteLM(args)
    trainer = pl.Trainer(
        strategy=BaguaStrategy(algorithm=args.algorithm), accelerator="cpu", devices=args.devices,
        max_steps=args.steps, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=not args.no_progress, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    final = module.curve[-1]
    if trainer.is_global_zero:
        runs = write_outputs(args, {"curve": module.curve})
        print(f"final: validation loss {final[4]:.4f} (ppl {math.exp(final[4]):.2f}) after {final[0]} steps, "
              f"{final[2]} tokens, {final[1]:.1f} s of training (world size {trainer.world_size}, "
              f"algorithm {args.algorithm}, Lightning)", flush=True)
        for line in compared(args.algorithm, runs):
            print(line, flush=True)
