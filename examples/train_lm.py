"""Train a GPT-2-architecture byte-level language model on the Python standard library's source.

Real text with no download (the ``.py`` files of this interpreter's standard library, see
``stdlib_corpus.py``), a model built from ``transformers.GPT2Config`` (vocabulary 256: bytes, no
tokenizer, no weights), and the whole toolkit as a user would adopt it:

- documents of different lengths, batches padded to their longest member, and
  ``LoadBalancingDistributedBatchSampler`` keyed by length under a token budget, so every rank
  gets the same work per step (``--sampler torch`` for torch's ``DistributedSampler`` instead);
- the reading of documents cached in LMDB (``CachedDataset``);
- the optimizer fused (``fuse_optimizer``: AdamW, one kernel over flat buffers);
- any algorithm (``--algorithm``; qadam, and qadam1 (its 1-bit momentum), with ``QAdamOptimizer``), under torchrun or through the
  Lightning strategy (``--lightning``).

    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --steps 300
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --algorithm bytegrad --plot
    python examples/train_lm.py --lightning --devices 2 --steps 100

It shows a progress bar with tokens/s (on a terminal), every ``--eval-every`` steps the last
training batch's loss (rank 0's batch, with dropout: noisier and higher than the validation loss),
the validation loss and perplexity, and the bytes each step sent with what they would take on a
100 Mbit/s link; then a final line with the validation loss and the training time, and how it
compares with the other runs in ``--out-dir``. Each run writes ``lm_curve_<algorithm>.csv`` there,
and ``--plot`` draws every run's curve found there in ``lm_loss.png``: run two algorithms into
one directory to see them side by side.

On one machine, compression (``--algorithm bytegrad``) trains slower than ``gradient_allreduce``:
loopback moves bytes for free and the codec costs CPU. Its gain is in the bytes: the evaluation
lines show them and their time on a 100 Mbit/s link; ``python -m benchmarks.network.netns`` (root)
runs the example on emulated machines behind such a link. Validation runs on a fixed set of held-out documents split across ranks; for algorithms that
leave replicas apart (decentralized, low_precision_decentralized, async) every evaluation is of the
replicas' average (what stopping the run there would give), the replicas themselves kept.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replicas import average_parameters, averaged_copy, parameters_identical_on_all_ranks  # noqa: E402
from stdlib_corpus import VOCAB, StdlibDocuments, pad_batch  # noqa: E402

import bagua  # noqa: E402

REPLICAS_APART = ("decentralized", "low_precision_decentralized", "async")  # evaluated as the replicas' average
ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async", "qadam",
              "qadam1", "onebit_grad")  # qadam1: qadam with a 1-bit momentum (bits=1)
BASELINE = "torch-ddp"  # torch.nn.parallel.DistributedDataParallel on the same loop, to compare with
BASELINE_FP16 = "torch-ddp-fp16"  # the same with torch's fp16 compression hook (a torch user's no-install option)
SLOW_LINK_BIT_S = 100e6  # what the bytes a step sent would take on a 100 Mbit/s link, in the evaluation lines
CURVE_COLUMNS = ["step", "train_seconds", "tokens", "train_loss", "val_loss"]  # train_loss: the last batch's


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--algorithm", choices=ALGORITHMS + (BASELINE, BASELINE_FP16), default="gradient_allreduce",
                        help=f"how ranks communicate; {BASELINE}: torch's DistributedDataParallel, the baseline; "
                             f"{BASELINE_FP16}: the same with torch's fp16_compress_hook")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the algorithm (repeatable), e.g. --option warmup_steps=100; "
                             "the value is read as a Python literal (a number, True, a string)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--width", type=int, default=256, help="embedding width (256 with 8 layers: ~6.4M parameters)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--context", type=int, default=256, help="tokens (bytes) a document is cut to")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="documents per rank and step; with the balanced sampler, the token budget is batch-size x (context + 1)")
    parser.add_argument("--sampler", choices=("balanced", "torch"), default="balanced",
                        help="balanced: bagua's batches of similar lengths and equal work per rank; torch: DistributedSampler")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="adamw (qadam: QAdamOptimizer) or SGD with momentum 0.9 (to tell an "
                             "algorithm's effect on Adam's moments from its own)")
    parser.add_argument("--warmup-steps", type=int, default=50, help="steps of the learning rate's linear warm-up")
    parser.add_argument("--schedule-steps", type=int, default=None,
                        help="the cosine decay ends here, then the rate stays at a tenth of the peak (None: --steps)")
    parser.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                        help="after the linear warm-up: cosine decay to a tenth of the peak, or the peak throughout")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--val-docs", type=int, default=512, help="held-out documents per evaluation")
    parser.add_argument("--max-files", type=int, default=None, help="use this many corpus files (quick runs; None: all)")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialization and the data's order")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), f"bagua-lm-cache-{os.getuid()}"),
                        help="the LMDB cache of the training documents, kept across runs")
    parser.add_argument("--no-fuse", action="store_true", help="keep the optimizer unfused")
    parser.add_argument("--out-dir", default="lm_run", help="where the curve (CSV) and the plot go")
    parser.add_argument("--plot", action="store_true", help="write lm_loss.png: validation loss against wall time")
    parser.add_argument("--lightning", action="store_true", help="train through Lightning's Trainer with BaguaStrategy")
    parser.add_argument("--devices", type=int, default=1, help="--lightning without torchrun: ranks Lightning launches")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "layers", "width", "heads", "context", "batch_size", "eval_every", "val_docs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.width % args.heads:
        parser.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    if args.optimizer == "sgd" and args.algorithm in ("qadam", "qadam1"):
        parser.error(f"--algorithm {args.algorithm} averages Adam's momentum: it trains with QAdamOptimizer, not SGD")
    try:
        args.options = parse_options(args.option)
    except ValueError as e:
        parser.error(str(e))
    return args


def parse_options(pairs: list[str]) -> dict:
    """``["warmup_steps=100", "hierarchical=True"]`` -> ``{"warmup_steps": 100, "hierarchical": True}``
    (each value a Python literal, else the string itself)."""
    import ast

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--option takes KEY=VALUE with KEY a name, got {pair!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


# ---- model, data, optimizer --------------------------------------------------------------------

def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A GPT-2-architecture causal LM over bytes, from a config (no weights downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.context + 1, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, bos_token_id=None, eos_token_id=None)  # fmt: skip
    return GPT2LMHeadModel(config)


def datasets(args: argparse.Namespace, rank: int) -> tuple[torch.utils.data.Dataset, StdlibDocuments, np.ndarray]:
    """(the training documents through an LMDB cache, the validation documents, training lengths)."""
    train = StdlibDocuments("train", context=args.context, max_files=args.max_files)
    cached = bagua.data.CachedDataset(train, backend="lmdb", dataset_name=f"stdlib-train-{train.fingerprint()}",
                                      path=args.cache_dir)  # fmt: skip
    return cached, StdlibDocuments("val", context=args.context, max_files=args.max_files), train.lengths


def batch_sampler(args: argparse.Namespace, dataset, lengths: np.ndarray, rank: int, world: int):
    """Per rank: the balanced batches (similar lengths, a token budget, equal work per rank) or
    torch's DistributedSampler in batches of ``--batch-size``."""
    if args.sampler == "torch":
        inner = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
        return BatchSampler(inner, args.batch_size, drop_last=True), inner
    inner = bagua.data.LoadBalancingDistributedSampler(dataset, complexities=lengths, num_replicas=world, rank=rank,
                                                       shuffle=True, seed=args.seed, random_level=0.5)  # fmt: skip
    batches = bagua.data.LoadBalancingDistributedBatchSampler(inner, max_complexity=args.batch_size * (args.context + 1))
    return batches, batches


BETAS = (0.9, 0.95)  # every variant's Adam: the usual betas of transformer pre-training
WEIGHT_DECAY = 0.01


def perplexity(loss: float) -> float:
    """exp(loss), inf where a diverged run's loss is beyond float range (the run goes on and reports)."""
    return math.exp(loss) if loss < 700 else float("inf")


def make_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW (qadam: ``QAdamOptimizer`` with the same betas and decoupled weight decay, its own
    options of ``--option`` applied) or, with ``--optimizer sgd``, SGD with momentum; fused unless
    ``--no-fuse``."""
    lr = args.lr
    if args.algorithm in ("qadam", "qadam1"):
        options = {"warmup_steps": max(1, args.warmup_steps), "betas": BETAS, "weight_decay": WEIGHT_DECAY,
                   "decoupled_weight_decay": True, **optimizer_options(args.options)}
        opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=lr, **options)
    elif args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return opt if args.no_fuse else bagua.optim.fuse_optimizer(opt)


def optimizer_options(options: dict) -> dict:
    """The ``--option`` entries that are ``QAdamOptimizer``'s own (the others are the algorithm's)."""
    import inspect

    accepted = inspect.signature(bagua.optim.QAdamOptimizer).parameters
    return {k: v for k, v in options.items() if k in accepted}


def schedule(args: argparse.Namespace, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to a tenth of the peak at ``--schedule-steps`` (default
    ``--steps``), a tenth after that; with ``--lr-schedule constant`` the peak after the warm-up."""
    horizon = args.schedule_steps or args.steps

    def factor(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.lr_schedule == "constant":
            return 1.0
        done = min(1.0, (step - args.warmup_steps) / max(1, horizon - args.warmup_steps))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def make_algorithm(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int, options: Optional[dict] = None):
    """The algorithm ``name`` with ``options`` (``--option``); qadam and onebit_grad with an exact
    warm-up of ``warmup_steps`` unless an option says otherwise (the learning rate's: the large
    early gradients stay uncompressed)."""
    options = dict(options or {})
    if name in ("qadam", "qadam1"):
        own = {k: v for k, v in options.items() if k not in optimizer_options(options)}
        return bagua.algorithms.QAdamAlgorithm(optimizer, **{"bits": 1 if name == "qadam1" else 8, **own})
    if name == "async":
        return bagua.algorithms.AsyncModelAverageAlgorithm(**{"sync_interval_ms": 50, "warmup_steps": 20, **options})
    if name == "onebit_grad":
        return bagua.algorithms.OneBitGradAlgorithm(**{"warmup_steps": warmup_steps, **options})
    return bagua.algorithms.Algorithm.init(name, **options)


def token_loss(model, batch: dict[str, torch.Tensor], reduction: str = "mean") -> tuple[torch.Tensor, int]:
    """Next-byte cross entropy over the real (unpadded) positions, and how many there are."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction=reduction)
    return loss, int((targets != -100).sum())


@torch.no_grad()
def validation_loss(model, val: StdlibDocuments, n_docs: int, rank: int, world: int) -> float:
    """Mean next-byte loss (nats) over a fixed set of ``n_docs`` held-out documents spread over
    the split, each rank evaluating its share; the same number whatever the world size."""
    chosen = np.unique(np.linspace(0, len(val) - 1, min(n_docs, len(val))).astype(int))[rank::world]
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(0, len(chosen), 32):
        loss, n = token_loss(model, pad_batch([val[int(j)] for j in chosen[i:i + 32]]), reduction="sum")
        total += torch.tensor([float(loss), n], dtype=torch.float64)
    model.train(was_training)
    bagua.comm.allreduce(total, op=bagua.comm.ReduceOp.SUM)
    return float(total[0] / total[1])


# ---- the loop ----------------------------------------------------------------------------------

def train(args: argparse.Namespace, log=print) -> dict:
    """Train as ``args`` say on the current process group; return the curve and the results."""
    from tqdm import tqdm

    rank, world = bagua.get_rank(), bagua.get_world_size()
    train_set, val_set, lengths = datasets(args, rank)
    batches, epoch_setter = batch_sampler(args, train_set, lengths, rank, world)
    loader = DataLoader(train_set, batch_sampler=batches, collate_fn=pad_batch)
    model = build_model(args)
    # receives the replicas' average for evaluations (built as the model is: the same seeded draws,
    # so the training that follows draws the same dropout masks as without it)
    shadow = build_model(args) if args.algorithm in REPLICAS_APART else None
    opt = make_optimizer(args, model)
    step_fn = opt.step if args.no_fuse else opt.fuse_step
    scheduler = schedule(args, opt)
    if args.algorithm in (BASELINE, BASELINE_FP16):
        algorithm, ddp = None, torch.nn.parallel.DistributedDataParallel(model)
        if args.algorithm == BASELINE_FP16:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            ddp.register_comm_hook(None, fp16_compress_hook)
    else:
        algorithm = make_algorithm(args.algorithm, opt, args.warmup_steps, args.options)
        ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
    params = sum(p.numel() for p in model.parameters())
    log(f"stdlib LM: {len(train_set)} train / {len(val_set)} val documents, {params / 1e6:.2f}M parameters, "
        f"world {world}, algorithm {args.algorithm}, sampler {args.sampler}")  # fmt: skip

    def evaluate() -> float:
        judged = model if shadow is None else averaged_copy(model, shadow)
        return validation_loss(judged, val_set, args.val_docs, rank, world)

    curve = [(0, 0.0, 0, float("nan"), evaluate())]
    log(f"step {0:5d}  val loss {curve[0][4]:.4f}  ppl {perplexity(curve[0][4]):.1f}")
    step, epoch, tokens, padded, start = 0, 0, 0, 0, time.perf_counter()
    sent_before = bagua.comm.bytes_sent()  # what this rank's bagua communication sent (not torch DDP's)
    step_times: list[float] = []  # seconds of each step, data loading included
    eval_time = 0.0  # evaluations pause the clock: the curve is against training time
    # on a terminal only: written to a file, the bar's redraws would be glued to the log's lines
    bar = tqdm(total=args.steps, desc="train", unit="step",
               disable=bool(rank) or args.no_progress or not sys.stderr.isatty())
    while step < args.steps:
        epoch_setter.set_epoch(epoch)
        step_start = time.perf_counter()
        for batch in loader:
            loss, n = token_loss(ddp, batch)
            opt.zero_grad(set_to_none=False)  # gradients stay views of the fused optimizer's flat buffer
            loss.backward()
            step_fn()
            scheduler.step()
            step_times.append(time.perf_counter() - step_start)
            step, tokens, padded = step + 1, tokens + n, padded + batch["attention_mask"].numel() - n
            elapsed = time.perf_counter() - start - eval_time
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens * world / max(elapsed, 1e-9):.0f}")
            if step % args.eval_every == 0 or step == args.steps:
                t0 = time.perf_counter()
                val = evaluate()
                seen = torch.tensor([tokens, padded], dtype=torch.float64)
                bagua.comm.allreduce(seen, op=bagua.comm.ReduceOp.SUM)
                curve.append((step, elapsed, int(seen[0]), loss.item(), val))
                per_step = ddp.bytes_sent_last_step if algorithm else None
                sent = (f"{per_step / 1e6:.2f} MB/step ({8 * per_step / SLOW_LINK_BIT_S:.2f} s at 100 Mbit/s)"
                        if per_step is not None else "n/a (torch DDP)")
                log(f"step {step:5d}  batch loss {loss.item():.4f}  val loss {val:.4f}  ppl {perplexity(val):.1f}  "
                    f"{seen[0] / elapsed:.0f} tokens/s  padding {seen[1] / seen.sum():.1%}  sent {sent}")  # fmt: skip
                eval_time += time.perf_counter() - t0
            if step == args.steps:
                break
            step_start = time.perf_counter()
        epoch += 1
    bar.close()
    wall = time.perf_counter() - start - eval_time
    bytes_per_step = (bagua.comm.bytes_sent() - sent_before) / max(1, step) if algorithm is not None else None
    identical = parameters_identical_on_all_ranks(list(model.parameters()))
    if isinstance(algorithm, bagua.algorithms.AsyncModelAverageAlgorithm):
        algorithm.abort(ddp)  # stops the background averaging on every rank, identical weights
    elif not identical:
        average_parameters(list(model.parameters()))
    final = validation_loss(model, val_set, args.val_docs, rank, world)
    if algorithm is not None:
        ddp.close()
    train_set.close()
    return {"curve": curve, "final_val_loss": final, "wall_s": wall, "tokens": curve[-1][2], "step_times": step_times,
            "identical_after_training": identical, "parameters": params, "bytes_per_step": bytes_per_step}


def write_outputs(args: argparse.Namespace, result: dict, log=print) -> dict[str, list[dict]]:
    """This run's curve as ``lm_curve_<algorithm>.csv`` in ``--out-dir`` (rank 0), saying so when
    it replaces an earlier run's; with ``--plot`` every curve there in ``lm_loss.png``. Returns
    every run's curve found there, by algorithm (this one's included)."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lm_curve_{args.algorithm}.csv"
    if path.exists():
        log(f"replacing the earlier {args.algorithm} run's curve in {path}")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CURVE_COLUMNS)
        w.writerows(result["curve"])
    runs = {p.stem.removeprefix("lm_curve_"): list(csv.DictReader(open(p))) for p in sorted(out.glob("lm_curve_*.csv"))}
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rows in runs.items():
            ax.plot([float(r["train_seconds"]) for r in rows], [float(r["val_loss"]) for r in rows], marker="o",
                    label=name, linewidth=2.5 if name == args.algorithm else 1.2)
        ax.set(xlabel="training time (s)", ylabel="validation loss (nats/byte)", title="stdlib byte LM")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "lm_loss.png", dpi=120)
        log(f"plotted {', '.join(runs)} in {out / 'lm_loss.png'}")
    return runs


def compared(algorithm: str, runs: dict[str, list[dict]]) -> list[str]:
    """One line per other run in the directory: its last validation loss and training time beside
    this run's (the last row of each curve).

    Example::

        compared("bytegrad", {"bytegrad": rows, "torch-ddp": other_rows})
        # ["vs torch-ddp: val loss 1.9811 after 58.0 s (this run: 1.9756 after 72.3 s)"]
    """
    mine = runs[algorithm][-1]
    return [f"vs {name}: val loss {float(rows[-1]['val_loss']):.4f} after {float(rows[-1]['train_seconds']):.1f} s "
            f"(this run: {float(mine['val_loss']):.4f} after {float(mine['train_seconds']):.1f} s)"
            for name, rows in runs.items() if name != algorithm and rows]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.lightning:
        from train_lm_lightning import fit

        return fit(args)
    bagua.init_process_group()
    rank = bagua.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // bagua.get_local_size()))
    log = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    result = train(args, log)
    if not result["identical_after_training"]:
        log("replicas differed after training (as this algorithm allows); the final loss is their average's")
    runs = write_outputs(args, result, log) if rank == 0 else {}
    log(f"final: validation loss {result['final_val_loss']:.4f} (ppl {perplexity(result['final_val_loss']):.2f}) "
        f"after {args.steps} steps, {result['tokens']} tokens, {result['wall_s']:.1f} s of training")
    for line in compared(args.algorithm, runs) if runs else ():
        log(line)
    bagua.destroy_process_group()


if __name__ == "__main__":
    main()
