"""Load-balanced sampling: straggler ratios, padding efficiency, scale, and a 2-rank training run.

Run: ``.venv/bin/python -m benchmarks.data.sampler`` (add ``--quick`` for a smaller run).

1. Synthetic: lognormal lengths (heavy-tailed), 8 and 64 ranks, batch 16. For torch's
   ``DistributedSampler``, ``LoadBalancingDistributedSampler`` and the sampler plus
   ``LoadBalancingDistributedBatchSampler`` (a padded-token budget of 16 x the mean length):
   * straggler ratio = sum over steps of the slowest rank's work / sum over steps of the mean
     rank's work (how much longer a synchronous epoch takes than a perfectly balanced one),
     with work = real tokens (unpadded) or batch size x longest sample (padded);
   * padding efficiency = real tokens / padded tokens.
2. Scale: construction and one epoch for 10 million complexities (time, peak traced memory).
3. Plot of per-step work per rank for both samplers -> benchmarks/figures/sampler_step_work.png.
4. End to end: 2 ranks (torchrun, Gloo on CPU) train a character-level GRU language model on
   lines of the Python standard library's own source files, gradients averaged with
   ``bagua.comm.allreduce``; step time and time waiting in the allreduce per sampler.

The last printed line holds the key ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import sysconfig
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np

from benchmarks.jobs import ROOT, loopback, run, worker
from benchmarks.records import FIGURES

BATCH = 16
LOGNORMAL = (4.0, 0.9)  # mean ~ 82 tokens; torch's sampler: ~1.45 unpadded straggler ratio at 8 ranks


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.ceil(np.random.default_rng(seed).lognormal(*LOGNORMAL, n))


def _torch_ranks(n: int, replicas: int) -> list[list[int]]:
    from torch.utils.data import DistributedSampler

    return [list(DistributedSampler(range(n), num_replicas=replicas, rank=r, seed=0)) for r in range(replicas)]


def _lb_ranks(lengths: np.ndarray, replicas: int) -> list[list[int]]:
    from bagua.data import LoadBalancingDistributedSampler

    s = LoadBalancingDistributedSampler(range(len(lengths)), complexities=lengths, num_replicas=replicas, rank=0)
    return [s.indices_for_rank(r) for r in range(replicas)]


def fixed_batches(per_rank: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Each rank's stream cut into DataLoader batches of ``batch`` (last partial batch dropped)."""
    steps = len(per_rank[0]) // batch
    return [[idx[i * batch:(i + 1) * batch] for i in range(steps)] for idx in per_rank]


def budget_batches(lengths: np.ndarray, replicas: int, budget: float) -> list[list[list[int]]]:
    from bagua.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    s = LoadBalancingDistributedSampler(range(len(lengths)), complexities=lengths, num_replicas=replicas, rank=0)
    bs = LoadBalancingDistributedBatchSampler(s, max_complexity=budget)
    return [bs.batches_for_rank(r) for r in range(replicas)]


def work(lengths: np.ndarray, per_rank_batches: list[list[list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, ranks) arrays of unpadded and padded work."""
    steps = len(per_rank_batches[0])
    real = np.zeros((steps, len(per_rank_batches)))
    padded = np.zeros_like(real)
    for r, batches in enumerate(per_rank_batches):
        for t, b in enumerate(batches):
            c = lengths[b]
            real[t, r] = c.sum()
            padded[t, r] = len(b) * c.max()
    return real, padded


def straggler(w: np.ndarray) -> float:
    return float(w.max(1).sum() / w.mean(1).sum())


def synthetic(n: int) -> tuple[list[dict], dict]:
    lengths = lognormal_lengths(n)
    budget = BATCH * float(lengths.mean())
    # A few samples exceed the budget alone (they form batches of their own): say so once.
    print(f"samples longer than the budget {budget:.0f}: {int((lengths > budget).sum())} (each a batch of its own)")
    logging.getLogger("bagua.data").setLevel(logging.ERROR)
    rows, for_plot = [], {}
    for replicas in (8, 64):
        cases = {
            "torch DistributedSampler": fixed_batches(_torch_ranks(n, replicas), BATCH),
            "LB sampler": fixed_batches(_lb_ranks(lengths, replicas), BATCH),
            "LB sampler + batch sampler": budget_batches(lengths, replicas, budget),
        }
        for name, batches in cases.items():
            real, padded = work(lengths, batches)
            rows.append(dict(
                replicas=replicas, sampler=name, steps=real.shape[0],
                samples_per_batch=float(np.mean([len(b) for b in batches[0]])),
                straggler_unpadded=straggler(real), straggler_padded=straggler(padded),
                padding_efficiency=float(real.sum() / padded.sum()),
            ))
            if replicas == 8:
                for_plot[name] = (real, padded)
    return rows, for_plot


def scale(n: int = 10_000_000) -> dict:
    from bagua.data import LoadBalancingDistributedSampler

    out = {}
    for kind, lengths in (("integer", lognormal_lengths(n)), ("float", np.random.default_rng(1).lognormal(*LOGNORMAL, n))):
        t = time.perf_counter()
        s = LoadBalancingDistributedSampler(range(n), complexities=lengths, num_replicas=8, rank=0)
        construct = time.perf_counter() - t
        t = time.perf_counter()
        count = sum(1 for _ in s)
        epoch = time.perf_counter() - t
        del s
        tracemalloc.start()
        s = LoadBalancingDistributedSampler(range(n), complexities=lengths, num_replicas=8, rank=0)
        construct_mb = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.reset_peak()
        s._plan()
        epoch_mb = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        del s
        out[kind] = dict(construct_s=construct, epoch_s=epoch, construct_peak_mb=construct_mb,
                         epoch_peak_mb=epoch_mb, samples=count)
    return out


def plot(for_plot: dict, path: Path, steps: int = 60) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(for_plot)
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7), sharey="row", squeeze=False)
    for j, name in enumerate(names):
        for i, (label, w) in enumerate(zip(("unpadded (real tokens)", "padded tokens"), for_plot[name])):
            ax = axes[i, j]
            w = w[:steps]
            for r in range(w.shape[1]):
                ax.plot(w[:, r], lw=0.8, alpha=0.8)
            ax.set_title(f"{name}\n{label}: straggler {straggler(for_plot[name][i]):.3f}", fontsize=9)
            ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel("work per rank")
    fig.suptitle(f"Per-step work of each of 8 ranks (lognormal lengths, batch {BATCH}; one line per rank)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------
# End to end: 2 ranks, character-level GRU language model on stdlib source lines.


def stdlib_lines(limit: int, max_len: int = 400) -> list[bytes]:
    """Non-blank lines of the installed standard library's top-level .py files, shuffled (seed 0)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for path in sorted(root.glob("*.py")):
        for line in path.read_bytes().splitlines():
            line = line.rstrip()
            if line.strip() and len(line) <= max_len:
                lines.append(line)
    order = np.random.default_rng(0).permutation(len(lines))[:limit]
    return [lines[i] for i in order]


def _worker(args: argparse.Namespace) -> None:
    import torch

    import bagua
    from bagua.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
    from torch.utils.data import DataLoader, DistributedSampler

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes inside Gloo calls
    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    lines = stdlib_lines(args.lines)
    data = [torch.frombuffer(bytearray(line), dtype=torch.uint8).long() for line in lines]
    lengths = np.array([len(x) for x in data], dtype=float)

    def collate(batch):
        # Inputs: bytes + 1 (0 is padding); targets: the next byte, -100 where padded.
        x = torch.nn.utils.rnn.pad_sequence([b + 1 for b in batch], batch_first=True)
        y = torch.nn.utils.rnn.pad_sequence([torch.cat([b[1:], b.new_tensor([10])]) for b in batch],
                                            batch_first=True, padding_value=-100)
        return x, y

    class CharGRU(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(257, 32, padding_idx=0)
            self.gru = torch.nn.GRU(32, 96, batch_first=True)
            self.out = torch.nn.Linear(96, 256)

        def forward(self, x):
            h, _ = self.gru(self.emb(x))
            return self.out(h)

    results: dict = {}
    for name in args.samplers.split(",") * args.repeats:
        torch.manual_seed(0)
        model = CharGRU()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        if name == "torch":
            loader = DataLoader(data, batch_size=args.batch, collate_fn=collate,
                                sampler=DistributedSampler(data, num_replicas=world, rank=rank, seed=0))
        elif name == "lb":
            loader = DataLoader(data, batch_size=args.batch, collate_fn=collate,
                                sampler=LoadBalancingDistributedSampler(data, complexities=lengths, seed=0))
        else:
            sampler = LoadBalancingDistributedSampler(data, complexities=lengths, seed=0)
            budget = args.batch * float(lengths.mean())
            loader = DataLoader(data, collate_fn=collate,
                                batch_sampler=LoadBalancingDistributedBatchSampler(sampler, max_complexity=budget))
        bagua.comm.barrier()
        compute = wait = 0.0
        steps = tokens = padded = 0
        losses, step_real, step_padded = [], [], []
        start = time.perf_counter()
        for x, y in loader:
            t0 = time.perf_counter()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            t1 = time.perf_counter()
            bagua.comm.allreduce(flat, op="avg")
            t2 = time.perf_counter()
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            opt.step()
            compute += t1 - t0
            wait += t2 - t1
            steps += 1
            step_real.append(int((y != -100).sum()))
            step_padded.append(y.numel())
            tokens += step_real[-1]
            padded += step_padded[-1]
            losses.append(loss.item())
        bagua.comm.barrier()
        total = time.perf_counter() - start
        previous = results.get(name)
        if previous is not None and previous["epoch_s"] <= total:
            previous["epoch_s_all"].append(total)
            continue
        results[name] = dict(epoch_s_all=(previous or {}).get("epoch_s_all", []) + [total], steps=steps, epoch_s=total, step_ms=1e3 * total / max(steps, 1),
                             compute_s=compute, allreduce_wait_s=wait, tokens=tokens, padded=padded,
                             first_loss=losses[0], last_loss=float(np.mean(losses[-20:])),
                             step_real=step_real, step_padded=step_padded)
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(results))
    bagua.destroy_process_group()


def end_to_end(lines: int, batch: int, repeats: int, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "e2e.json"
        run(loopback(2, worker("benchmarks.data.sampler", "--worker", "--out", out, "--lines", lines, "--batch", batch,
                               "--samplers", "torch,lb,lb+batch", "--repeats", repeats)), timeout)
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def main() -> None:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--lines", type=int, default=16000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samplers", default="torch,lb,lb+batch")
    p.add_argument("--repeats", type=int, default=2, help="end-to-end epochs per sampler (interleaved; best kept)")
    p.add_argument("--json", default="", help="also write all numbers to this file")
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return

    n = 100_000 if args.quick else 1_000_000
    print(f"== straggler ratios: {n} lognormal{LOGNORMAL} lengths (ceil), batch {BATCH}, "
          f"budget {BATCH} x mean length for the batch sampler")
    rows, for_plot = synthetic(n)
    print(f"{'ranks':>5} {'sampler':<28} {'steps':>6} {'smp/batch':>9} {'strag unpad':>11} "
          f"{'strag pad':>9} {'pad eff':>7}")
    for r in rows:
        print(f"{r['replicas']:>5} {r['sampler']:<28} {r['steps']:>6} {r['samples_per_batch']:>9.1f} "
              f"{r['straggler_unpadded']:>11.4f} {r['straggler_padded']:>9.4f} {r['padding_efficiency']:>7.3f}")
    fig = FIGURES / "sampler_step_work.png"
    plot(for_plot, fig)
    print(f"plot: {fig.relative_to(ROOT)}")

    sc = scale(1_000_000 if args.quick else 10_000_000)
    print(f"\n== scale: {sc['integer']['samples'] * 8} complexities, 8 replicas")
    for kind, v in sc.items():
        print(f"{kind:>8} complexities: construct {v['construct_s']:.2f} s (peak {v['construct_peak_mb']:.0f} MB "
              f"traced), one epoch {v['epoch_s']:.2f} s (peak {v['epoch_peak_mb']:.0f} MB)")

    lines = 4000 if args.quick else args.lines
    print(f"\n== end to end: 2 ranks (torchrun, Gloo, 1 thread each), char-GRU LM on {lines} stdlib lines, "
          f"batch {args.batch} (batch sampler: budget {args.batch} x mean length), best of "
          f"{1 if args.quick else args.repeats} interleaved epochs each (fresh model each)")
    e2e = end_to_end(lines, args.batch, 1 if args.quick else args.repeats, timeout=1200)
    print(f"{'sampler':<9} {'steps':>5} {'epoch s':>8} {'step ms':>7} {'compute r0/r1 s':>15} "
          f"{'ar wait r0/r1 s':>15} {'strag unpad':>11} {'strag pad':>9} {'pad eff':>7} {'loss first->last':>16}")
    for name in e2e[0]:
        a, b = e2e[0][name], e2e[1][name]
        eff = (a["tokens"] + b["tokens"]) / (a["padded"] + b["padded"])
        real = np.array([a["step_real"], b["step_real"]], dtype=float).T
        pad = np.array([a["step_padded"], b["step_padded"]], dtype=float).T
        a["straggler_unpadded"], a["straggler_padded"] = straggler(real), straggler(pad)
        print(f"{name:<9} {a['steps']:>5} {a['epoch_s']:>8.2f} {a['step_ms']:>7.1f} "
              f"{a['compute_s']:>7.2f}/{b['compute_s']:<7.2f} {a['allreduce_wait_s']:>7.2f}/{b['allreduce_wait_s']:<7.2f} "
              f"{a['straggler_unpadded']:>11.3f} {a['straggler_padded']:>9.3f} "
              f"{eff:>7.3f} {a['first_loss']:>7.2f}->{a['last_loss']:<7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(synthetic=rows, scale=sc, e2e=e2e), indent=1))

    def get(replicas, sampler, key):
        return next(r[key] for r in rows if r["replicas"] == replicas and r["sampler"] == sampler)

    t, l, lb = e2e[0]["torch"], e2e[0]["lb"], e2e[0]["lb+batch"]
    print("key: " + "; ".join(
        f"{R} ranks: straggler unpadded torch {get(R, 'torch DistributedSampler', 'straggler_unpadded'):.3f} -> "
        f"LB {get(R, 'LB sampler', 'straggler_unpadded'):.3f}, padded LB {get(R, 'LB sampler', 'straggler_padded'):.3f}, "
        f"pad eff LB+batch {get(R, 'LB sampler + batch sampler', 'padding_efficiency'):.3f}"
        for R in (8, 64)
    ) + f"; 2-rank epoch time LB/torch {l['epoch_s'] / t['epoch_s']:.2f}, LB+batch/torch {lb['epoch_s'] / t['epoch_s']:.2f}")


if __name__ == "__main__":
    main()
