"""Bagua's compressed gradient averaging inside Hugging Face's ``transformers.Trainer``.

The byte-level GPT-2 language model of ``train_lm.py`` (its model and its data, the Python
standard library's source through bagua's LMDB cache), trained by the plain ``Trainer``: the
Trainer (through ``accelerate``) builds torch's own ``DistributedDataParallel`` wrapper, and a
``TrainerCallback`` gives that wrapper bagua's averaging as a torch DDP communication hook
(``bagua.comm_hooks``). Nothing else of the Trainer changes.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --hook none
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --hook bytegrad --streams 4
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --hook onebit_grad --option warmup_steps=100

The hook goes on the wrapper at ``on_train_begin``: the earliest callback event at which the
Trainer has built it. The callbacks' ``model`` argument is the bare model, not the wrapper; the
wrapper is the Trainer's ``model_wrapped`` (so the callback holds the Trainer). With
``--grad-accum N`` the Trainer accumulates under ``no_sync()``: torch DDP calls the hook only on
the last micro-batch of each optimizer step, so the hook's step count (its warm-up's clock) counts
optimizer steps. The Trainer is told ``ddp_find_unused_parameters=False`` (every parameter gets a
gradient; the hook works either way) and evaluates the untrained model with ``eval_on_start=True``: a ``trainer.evaluate()`` before ``trainer.train()``
leaves the model without any DDP wrapper (accelerate marks it prepared for evaluation, then never
wraps it for training), so the replicas would train apart, with or without a hook.

``--streams K`` starts torch.distributed on bagua's striping backend before the Trainer exists
(``init_process_group("bagua", pg_options=StripeOptions(streams=K))``; accelerate then uses that
group): every large message between machines, torch DDP's buckets, the hook's and the Trainer's
own, travels over K connections (ranks within one machine keep one).

Rank 0 prints the last step's training loss and the evaluation loss on held-out files (before and
after training) and writes ``hf_trainer_<hook>.json`` into ``--out-dir``: the losses per step, the
wall time of each step, the bytes bagua sent (this rank's, when the hook ran) beside what torch's
fp32 ring allreduce sends for the same steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
HOOKS = ("none", "bytegrad", "onebit_grad")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", choices=HOOKS, default="bytegrad",
                        help="bagua's algorithm as torch DDP's communication hook; none: the plain Trainer "
                             "(torch DDP's fp32 allreduce)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the hook's algorithm (repeatable), e.g. --option warmup_steps=100")
    parser.add_argument("--streams", type=int, default=None,
                        help="connections each large message between machines is striped over (the 'bagua' "
                             "torch backend; default: Gloo, one)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="documents per rank and micro-batch")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear warm-up, cosine decay)")
    parser.add_argument("--warmup-steps", type=int, default=30,
                        help="the learning rate's warm-up (and onebit_grad's exact warm-up unless --option sets it)")
    parser.add_argument("--val-docs", type=int, default=256, help="held-out documents evaluated")
    parser.add_argument("--max-files", type=int, default=None, help="use this many corpus files (quick runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), f"bagua-lm-cache-{os.getuid()}"))
    parser.add_argument("--out-dir", default="hf_trainer_run")
    args = parser.parse_args(argv)
    for name in ("steps", "grad_accum", "layers", "width", "heads", "context", "batch_size", "val_docs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.streams is not None and args.streams < 1:
        parser.error(f"--streams must be at least 1, got {args.streams}")
    if args.width % args.heads:
        parser.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    from train_lm import parse_options

    try:
        args.options = parse_options(args.option)
    except ValueError as e:
        parser.error(str(e))
    if args.options and args.hook == "none":
        parser.error("--option is for the hook's algorithm; --hook none has none")
    return args


class BaguaCommHookCallback(TrainerCallback):
    """Give the torch ``DistributedDataParallel`` wrapper a Trainer builds bagua's ``algorithm``
    as its communication hook, once, before the first backward.

    Args:
        trainer: the ``transformers.Trainer`` (the callbacks receive the bare model; the wrapper is
            the Trainer's ``model_wrapped``, built when ``train()`` starts).
        algorithm: ``"bytegrad"`` or ``"onebit_grad"``.
        **options: the algorithm's options (``bagua.comm_hooks.CompressionHookState``).

    Example::

        trainer = Trainer(model, args, train_dataset=..., data_collator=...)
        hook = BaguaCommHookCallback(trainer, "bytegrad")
        trainer.add_callback(hook)
        trainer.train()   # hook.state: the hook's state (steps, residuals: state_dict())
    """

    def __init__(self, trainer, algorithm: str, **options: Any):
        self.trainer, self.algorithm, self.options = trainer, algorithm, options
        self.state = None  # bagua.comm_hooks.CompressionHookState, once registered
        self._ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None

    def on_train_begin(self, args, state, control, **kwargs):
        import bagua.comm_hooks

        ddp = self.trainer.model_wrapped
        while not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and hasattr(ddp, "_orig_mod"):
            ddp = ddp._orig_mod  # torch.compile's wrapper around the DDP wrapper (--torch_compile)
        if ddp is self._ddp:
            return  # a later train() on the same wrapper: the hook is already there
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            if args.world_size > 1:
                raise RuntimeError(
                    f"BaguaCommHookCallback: the Trainer trains {type(self.trainer.model_wrapped).__name__} on "
                    f"{args.world_size} processes, not torch's DistributedDataParallel: a torch DDP communication "
                    f"hook needs torch DDP (no FSDP, DeepSpeed). A trainer.evaluate() before trainer.train() also "
                    f"leaves the model unwrapped (accelerate marks it prepared for evaluation, then never wraps it "
                    f"for training: no gradient averaging at all): evaluate first with "
                    f"TrainingArguments(eval_on_start=True)")
            return  # one process: nothing to average
        self.state = bagua.comm_hooks.register(ddp, self.algorithm, **self.options)
        self._ddp = ddp

    def on_train_end(self, args, state, control, **kwargs):
        if self.state is not None:
            self.state.close()  # the CPU hook's background thread (a later train() starts it again)


class StepRecorder(TrainerCallback):
    """Each optimizer step's wall time (from the end of the one before, data loading included) and
    the logged training losses (``logging_steps=1``: every step's, averaged over ranks) and the
    evaluation losses."""

    def __init__(self):
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.eval_losses: list[tuple[int, float]] = []  # (step, loss)
        self._last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_times.append(now - self._last)
        self._last = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._last = time.perf_counter()  # evaluations are not step time
        if metrics and "eval_loss" in metrics:
            self.eval_losses.append((state.global_step, float(metrics["eval_loss"])))


def evaluation_split(args: argparse.Namespace):
    """``--val-docs`` held-out documents, evenly spread over the validation files (as train_lm's)."""
    from stdlib_corpus import StdlibDocuments

    val = StdlibDocuments("val", context=args.context, max_files=args.max_files)
    chosen = np.unique(np.linspace(0, len(val) - 1, min(args.val_docs, len(val))).astype(int))
    return torch.utils.data.Subset(val, chosen.tolist())


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import PrinterCallback, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    import bagua
    import train_lm
    from stdlib_corpus import pad_batch

    if args.streams is not None and "WORLD_SIZE" in os.environ:  # before the Trainer: accelerate takes this group
        torch.distributed.init_process_group("bagua", pg_options=bagua.comm.StripeOptions(streams=args.streams))

    hf_logging.set_verbosity_error()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    out = Path(args.out_dir)
    training_args = TrainingArguments(
        # Gloo between torchrun's processes (a backend without them: accelerate looks for a group)
        output_dir=str(out / "trainer"), use_cpu=True, ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        max_steps=args.steps, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        per_device_eval_batch_size=32, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps, weight_decay=train_lm.WEIGHT_DECAY, adam_beta1=train_lm.BETAS[0],
        adam_beta2=train_lm.BETAS[1], seed=args.seed, data_seed=args.seed,
        # every parameter of GPT-2 gets a gradient every step: no search for unused ones (the
        # Trainer's default for a PreTrainedModel, a graph walk and a bitmap allreduce a step)
        ddp_find_unused_parameters=False,
        # the loss before training, evaluated inside train(): a trainer.evaluate() before train() would
        # leave the model without its DDP wrapper (accelerate 1.15 marks it prepared, then never wraps it)
        eval_on_start=True,
        remove_unused_columns=False,  # the collator builds exactly the model's inputs
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_level="error",
    )  # fmt: skip
    world = training_args.world_size
    model = train_lm.build_model(args)  # seeded: the same initial weights in every run
    train_set, _, _ = train_lm.datasets(args, training_args.process_index)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=evaluation_split(args),
                      data_collator=pad_batch)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # it prints every log line (one a step here)
    recorder = StepRecorder()
    trainer.add_callback(recorder)
    hook = None
    if args.hook != "none":
        options = dict(args.options)
        if args.hook == "onebit_grad":
            options.setdefault("warmup_steps", args.warmup_steps)
        hook = BaguaCommHookCallback(trainer, args.hook, **options)
        trainer.add_callback(hook)

    trainer.train()  # eval_on_start: the untrained model's loss (not trainer.evaluate() before: see above)
    wall = sum(recorder.step_times)  # training only, evaluations left out
    final_eval = trainer.evaluate()["eval_loss"]
    start_eval = recorder.eval_losses[0][1]

    parameters = sum(p.numel() for p in model.parameters())  # GPT-2's tied embedding counted once, as DDP does
    result = {
        "hook": args.hook, "options": args.options, "streams": args.streams, "world_size": world,
        "steps": trainer.state.global_step, "grad_accum": args.grad_accum, "parameters": parameters,
        "train_losses": recorder.losses, "final_train_loss": recorder.losses[-1] if recorder.losses else None,
        "eval_loss_start": start_eval, "eval_loss": final_eval, "step_times": recorder.step_times, "wall_s": wall,
        "hook_steps": hook.state.steps if hook is not None and hook.state is not None else None,
        "bagua_bytes_sent": bagua.comm.bytes_sent() if bagua.is_initialized() else None,
        "striped_calls": bagua.comm.striped_calls(),  # this rank's calls cut over several connections
        # what torch's fp32 ring allreduce sends per rank for the same steps: 2 (n-1)/n x 4 bytes a value
        "fp32_ring_bytes": int(2 * (world - 1) / world * 4 * parameters * trainer.state.global_step),
    }  # fmt: skip
    if trainer.is_world_process_zero():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"hf_trainer_{args.hook}.json").write_text(json.dumps(result, indent=1))
        sent = (f", bagua sent {result['bagua_bytes_sent'] / 1e6:.2f} MB "
                f"({result['bagua_bytes_sent'] / max(1, result['fp32_ring_bytes']):.3f} of fp32 ring allreduce)"
                if result["bagua_bytes_sent"] is not None else "")  # fmt: skip
        print(f"final: hook {args.hook}: train loss {result['final_train_loss']:.4f}, eval loss {final_eval:.4f} "
              f"(from {start_eval:.4f}) after {result['steps']} steps, {wall:.1f} s{sent}", flush=True)
    train_set.close()
    if bagua.is_initialized():
        bagua.destroy_process_group()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
