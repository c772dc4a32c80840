"""Data-parallel training of a small MLP on scikit-learn's digits with bagua.comm.

The same file runs on 2 ranks and as one process; with the same global batch both reach
about the same test accuracy, which is the point of data parallelism:

    torchrun --standalone --nproc-per-node 2 examples/train_digits.py
    python examples/train_digits.py
    python examples/train_digits.py --compression minmax_uint8     # any flag works both ways

Each rank trains on its own shard of the training set; after every backward the ranks
average their gradients with one allreduce of one flat buffer (a ``bagua.comm.Bucket``),
so every rank applies the same update and the replicas stay identical. Gradient averaging
can be compressed (``--compression fp16|bf16|minmax_uint8``): then every byte on the wire is
encoded. (``bagua.DistributedDataParallel`` will do all this for you, overlapped with
backward; here it is spelled out by hand.)
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import bagua

COMPRESSIONS = ("none", "fp16", "bf16", "minmax_uint8")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size, split evenly across ranks (default 64)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none",
                        help="codec for the gradient allreduce (default none: exact)")
    args = parser.parse_args()
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    return args


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The 1797 8x8 digits shipped with scikit-learn: a fixed, stratified 80/20 split (the same
    whatever --seed), standardized with the training set's statistics. Identical on every rank."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-6  # some border pixels are always 0
    def tensors(xs, ys):
        return TensorDataset(torch.tensor((xs - mean) / std, dtype=torch.float32), torch.tensor(ys))
    return tensors(x_train, y_train), tensors(x_test, y_test)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    acc = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return acc


def parameters_identical_on_all_ranks(params: list[torch.Tensor]) -> bool:
    """Exact check: the elementwise MAX and MIN over ranks agree only if every rank holds
    the very same values."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    hi, lo = flat.clone(), flat.clone()
    bagua.comm.allreduce(hi, op=bagua.comm.ReduceOp.MAX)
    bagua.comm.allreduce(lo, op=bagua.comm.ReduceOp.MIN)
    return torch.equal(hi, lo)


def main() -> None:
    args = parse_args()
    bagua.init_process_group()  # under torchrun: its env; alone: a world of one
    rank, world = bagua.get_rank(), bagua.get_world_size()
    # Share this machine's cores among its ranks (2 ranks on 2 cores: one thread each).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // bagua.get_local_size()))
    if args.batch_size % world != 0:
        raise ValueError(
            f"--batch-size (global) must be divisible by the world size {world}, got {args.batch_size}"
        )
    compression = None if args.compression == "none" else args.compression

    train_set, test_set = load_data()
    # Each rank gets its own 1/world of the (shuffled) training set. The shuffle depends only on
    # seed and epoch, and rank r takes every world-th index from offset r, so rank r's k-th batch
    # of size B/world and the other ranks' k-th batches together form the k-th batch of size B of
    # a single process: the two runs see the same global batches (up to the last one, which the
    # sampler pads with a repeated sample when the set does not split evenly).
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler)

    torch.manual_seed(args.seed)  # same init on every rank...
    model = make_model()
    params = list(model.parameters())
    for p in params:
        bagua.comm.broadcast(p.data, src=0)  # ...and made certain: every rank starts from rank 0's
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    grads: bagua.comm.Bucket | None = None  # created after the first backward, when grads exist

    if rank == 0:
        print(f"digits: {len(train_set)} train / {len(test_set)} test samples, world size {world}, "
              f"global batch {args.batch_size} ({args.batch_size // world} per rank), "
              f"compression {args.compression}")
        if world == 1 and compression is not None:
            print("note: a world of one sends nothing, so --compression has no effect here")
    grad_bytes = 0  # what this rank put on the wire for gradient averaging

    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        stats = torch.zeros(3, dtype=torch.float64)  # loss * n, correct, n over this rank's samples
        batches = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=True if rank else None)
        for x, y in batches:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            # set_to_none=False: zero the grads in place instead of dropping them. Autograd then
            # accumulates into the existing tensors, which stay views of the bucket's flat buffer;
            # with None, the next backward would allocate fresh grads outside the bucket.
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if grads is None:
                # Copies the grads into one flat buffer and makes each p.grad a view of it.
                grads = bagua.comm.Bucket([p.grad for p in params], name="grads")
            # Average gradients across ranks: one collective for the whole model.
            sent_before = bagua.comm.bytes_sent()
            bagua.comm.allreduce(grads.flat, op=bagua.comm.ReduceOp.AVG, compression=compression)
            grad_bytes += bagua.comm.bytes_sent() - sent_before
            optimizer.step()

            n = y.numel()
            stats += torch.tensor([loss.item() * n, (logits.argmax(dim=1) == y).sum().item(), n],
                                  dtype=torch.float64)
        batches.close()
        if not grads.is_intact():  # e.g. zero_grad(set_to_none=True) slipped in
            raise RuntimeError("a gradient left the bucket's flat buffer, so it was not averaged")

        bagua.comm.allreduce(stats, op=bagua.comm.ReduceOp.SUM)  # totals over all ranks' samples
        train_loss, train_acc = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()
        test_acc = accuracy(model, test_set)  # the test set is tiny: every rank evaluates all of it
        if rank == 0:
            print(f"epoch {epoch:3d}  train loss {train_loss:.4f}  train acc {train_acc:.4f}  "
                  f"test acc {test_acc:.4f}  time {time.perf_counter() - start:.2f}s", flush=True)

    identical = parameters_identical_on_all_ranks(params)
    if rank == 0:
        print(f"gradient averaging: rank 0 sent {grad_bytes / 1e6:.2f} MB "
              f"({grads.nbytes / 1e3:.1f} kB of fp32 gradients per step)")
        print(f"parameters identical on all ranks: {identical}")
        print(f"final test accuracy: {test_acc:.4f} (world size {world}, compression {args.compression})")
        other = ("python examples/train_digits.py" if world > 1
                 else "torchrun --standalone --nproc-per-node 2 examples/train_digits.py")
        print(f"compare with the other run (same flags): {other}")
    bagua.destroy_process_group()


if __name__ == "__main__":
    main()
