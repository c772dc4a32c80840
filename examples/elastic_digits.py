"""Elastic training of the digits MLP: checkpoints, exact resume after a failure, any world size.

Run it under torchrun with restarts; kill a worker (or let --fail-at-step do it) and the job
resumes from its last checkpoint, at the step and sample where it was:

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/elastic_digits.py --fail-at-step 50

Across machines, with a world size that may change (here 1 to 4 nodes; a node that dies or
joins restarts every worker at the new size, from the last checkpoint):

    torchrun --nnodes 1:4 --nproc-per-node 1 --max-restarts 10 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id digits --rdzv-conf last_call_timeout=5 \\
        examples/elastic_digits.py --checkpoint-dir /shared/ckpt

What it takes (the recipe, see docs/elastic.md):
- ``bagua.data.ElasticDistributedSampler`` (torch's DistributedSampler order, plus a resumable
  position) and ``bagua.data.ResumableDataLoader`` (counts the batches the loop received);
- ``bagua.checkpoint.save_checkpoint`` every few steps into a directory every node sees, and
  ``latest_checkpoint`` + ``load_checkpoint`` at start: weights, optimizer, the algorithm's
  state, the sampler's position and every rank's RNG states;
- the *global* batch is kept when the world size changes (each rank takes global / world), so
  the learning rate stays right: pick a global batch divisible by every size the job may have.

The job is done when the last epoch is: run it again and it loads the final checkpoint and
trains nothing (delete the checkpoint directory to start over).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import bagua
from train_digits import (
    ALGORITHMS, accuracy, average_parameters, digits_tensors, make_algorithm, make_model, make_optimizer,
    parameters_identical_on_all_ranks,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=48,
                        help="samples per step over all ranks, kept when the world size changes (default 48: "
                             "divisible by 1, 2, 3 and 4 ranks)")
    parser.add_argument("--lr", type=float, default=None, help="default 0.1 (SGD), 0.003 (qadam)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="gradient_allreduce")
    parser.add_argument("--checkpoint-dir", default="checkpoints/elastic-digits",
                        help="where checkpoints go; every node must see it (default %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    parser.add_argument("--fail-at-step", type=int, default=None,
                        help="to watch a recovery: in a run that starts without a checkpoint, the last "
                             "rank kills itself (SIGKILL) after this step")
    parser.add_argument("--sample-log", default=None,
                        help="a directory: each rank appends the samples of every step (JSON lines), to "
                             "check that each epoch trains on every sample once across restarts")
    args = parser.parse_args(argv)
    for name in ("epochs", "global_batch", "checkpoint_every", "keep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // bagua.get_local_size()))
    log = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}: "
                         f"pick one divisible by every world size this job may run at")

    train, test = digits_tensors()
    indexed = TensorDataset(*train.tensors, torch.arange(len(train)))  # (x, y, sample index)
    sampler = bagua.data.ElasticDistributedSampler(indexed, shuffle=True, seed=args.seed)
    loader = bagua.data.ResumableDataLoader(indexed, batch_size=args.global_batch // world, sampler=sampler)

    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = make_optimizer(args.algorithm, model.parameters(), args.lr)
    ddp = bagua.DistributedDataParallel(model, optimizers=[optimizer], algorithm=make_algorithm(args.algorithm, optimizer))
    checkpoint = dict(model=ddp, optimizers=[optimizer], sampler=sampler)

    step, first_epoch = 0, 0
    path = bagua.checkpoint.latest_checkpoint(args.checkpoint_dir)
    if path is not None:
        step = bagua.checkpoint.load_checkpoint(path, **checkpoint)
        first_epoch = sampler.epoch  # the rest of the epoch it stopped in, or the next one if that had ended
        log(f"resumed from {path}: step {step}, epoch {first_epoch}, world size {world}")
    else:
        log(f"starting: world size {world}, {args.global_batch // world} samples per rank and step")
    samples = _sample_log(args.sample_log, rank)

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss = None  # a resumed epoch may have nothing left
        for x, y, index in loader:
            step += 1
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.fuse_step()
            samples(step=step, epoch=epoch, world=world, samples=index.tolist())
            if step % args.checkpoint_every == 0:
                _save(args, step, checkpoint)
            if args.fail_at_step == step and path is None and rank == world - 1:
                print(f"rank {rank}: failing on purpose after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if loss is not None:
            log(f"epoch {epoch:3d}  step {step:5d}  world size {world}  loss {loss.item():.4f}  "
                f"test acc {accuracy(model, test):.4f}")
    if step % args.checkpoint_every:
        _save(args, step, checkpoint)  # the finished state: a rerun trains nothing

    if not parameters_identical_on_all_ranks(list(model.parameters())):
        average_parameters(list(model.parameters()))  # decentralized/async replicas: evaluate their average
    ddp.close()
    log(f"final test accuracy: {accuracy(model, test):.4f} (world size {world}, step {step})")
    bagua.destroy_process_group()


def _save(args: argparse.Namespace, step: int, checkpoint: dict) -> None:
    bagua.checkpoint.save_checkpoint(Path(args.checkpoint_dir) / f"step-{step:07d}.pt", step=step,
                                     keep_last=args.keep, **checkpoint)


def _sample_log(directory, rank: int):
    """A function appending one JSON line per step to ``directory`` (nothing without one): the
    record, the wall-clock time, and the attempt (rank 0's start time, the same on every rank)."""
    if directory is None:  # the same on every rank: all of them skip the gather below
        return lambda **record: None
    attempt = bagua.comm.allgather_object(time.time_ns())[0]
    os.makedirs(directory, exist_ok=True)
    out = open(os.path.join(directory, f"{attempt}-rank{rank}.jsonl"), "a", buffering=1)
    return lambda **record: out.write(json.dumps({"attempt": attempt, "rank": rank, "time": time.time(), **record}) + "\n")


if __name__ == "__main__":
    main()
