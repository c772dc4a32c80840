"""The digits task of train_digits.py as a LightningModule, trained with ``BaguaStrategy``.

Lightning launches the ranks itself (``--devices 2``) or runs under torchrun:

    python examples/lightning_digits.py --devices 2 --algorithm bytegrad
    torchrun --standalone --nproc-per-node 2 examples/lightning_digits.py --devices 2

The one Bagua line is ``Trainer(strategy=BaguaStrategy(algorithm=...))``; ``import
bagua.lightning`` (done by importing BaguaStrategy) also makes ``Trainer(strategy="bagua")``
work. With ``--algorithm qadam`` configure_optimizers returns a ``bagua.optim.QAdamOptimizer``,
which that algorithm needs.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import ALGORITHMS, load_data, make_model, materialize  # noqa: E402

import bagua  # noqa: E402
from bagua.lightning import BaguaStrategy  # noqa: E402


class Digits(pl.LightningModule):
    def __init__(self, algorithm: str, lr: float, batch_size: int):
        super().__init__()
        self.save_hyperparameters()
        self.net = make_model()
        train, self.test_set = load_data()
        self.train_set = materialize(train)  # the expensive transform once, in memory

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.algorithm == "qadam":
            return bagua.optim.QAdamOptimizer(self.parameters(), lr=self.hparams.lr or 0.003, warmup_steps=50)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr or 0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.test_set, batch_size=256)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="gradient_allreduce")
    parser.add_argument("--devices", type=int, default=2, help="processes on this machine (CPU ranks)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=None, help="default 0.1 with SGD, 0.003 with qadam")
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    model = Digits(args.algorithm, args.lr, args.batch_size)
    trainer = pl.Trainer(
        strategy=BaguaStrategy(algorithm=args.algorithm), accelerator="cpu", devices=args.devices,
        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
    )
    trainer.fit(model)
    metrics = trainer.validate(model, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"final validation accuracy: {metrics['val_acc']:.4f} (world size {trainer.world_size}, "
              f"algorithm {args.algorithm})")


if __name__ == "__main__":
    main()
