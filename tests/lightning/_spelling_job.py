"""One real 2-rank Lightning fit per spelling of the strategy, run by tests/lightning/test_strategy.py.

    python _spelling_job.py OUTDIR SPELLING      # Lightning launches rank 1 with the same command

The imports happen in the order the spelling names, before anything else of bagua's or
Lightning's; the Trainer is built before the test's model module (which imports
bagua.lightning) is, so ``strategy="bagua"`` can only work through what ``import bagua`` did.
Writes OUTDIR/<spelling>.rank<r>.pt, or the error.
"""

from __future__ import annotations

import os
import sys
import traceback

SPELLING = sys.argv[2]
if SPELLING == "lightning_bagua":  # the Lightning documentation's spelling
    import lightning.pytorch as pl
    from lightning_bagua import BaguaStrategy

    STRATEGY = BaguaStrategy("bytegrad")
elif SPELLING == "lightning_then_bagua":
    import lightning.pytorch as pl

    import bagua  # noqa: F401

    STRATEGY = "bagua"
elif SPELLING == "bagua_then_lightning":
    import bagua  # noqa: F401
    import lightning.pytorch as pl

    STRATEGY = "bagua"
else:
    raise SystemExit(f"unknown spelling {SPELLING!r}")

import bagua  # noqa: E402  (already imported by every spelling)
import torch  # noqa: E402


def main() -> None:
    outdir = sys.argv[1]
    result: dict = {"strategy_module_before_trainer": "bagua.lightning" in sys.modules}
    try:
        trainer = pl.Trainer(strategy=STRATEGY, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             limit_val_batches=0)
        from _fit_job import Net, weights

        torch.manual_seed(0)
        model = Net()
        trainer.fit(model)
        result.update(strategy=type(trainer.strategy).__module__ + "." + type(trainer.strategy).__name__,
                      losses=model.train_losses, weights=weights(model))
    except Exception:
        result["error"] = traceback.format_exc()
    result["world_size"] = bagua.get_world_size() if bagua.is_initialized() else 0
    torch.save(result, os.path.join(outdir, f"{SPELLING}.rank{bagua.get_rank() if bagua.is_initialized() else 0}.pt"))


if __name__ == "__main__":
    main()
