#!/usr/bin/env python3
"""Gloo point-to-point exchange time vs message piece size, over a shaped link.

Two ranks send each other ``N`` bytes at once (both directions busy), as one message or cut
into pieces (sends and receives interleaved), after an idle gap; prints the median time per
(size, piece) next to the link's ideal. This is why ``bagua.comm``'s compressed allreduce
posts its exchanges in 512 KB pieces.

Run (root, iproute2; from the repository root)::

    python -m benchmarks.network.netns --ranks 2 --rate 100mbit -- \\
        python -m benchmarks.comm.p2p_pieces --rate-mbit 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def exchange(nbytes: int, piece: int, peer: int) -> float:
    send, recv = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    sends = [dist.P2POp(dist.isend, p, peer) for p in torch.split(send, piece)]
    recvs = [dist.P2POp(dist.irecv, p, peer) for p in torch.split(recv, piece)]
    ops = [op for pair in zip(sends, recvs) for op in pair]
    dist.barrier()
    time.sleep(0.2)  # idle link, as between two collectives
    dist.barrier()
    start = time.perf_counter()
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="the link rate, for the ideal column")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for nbytes in (2 << 20, 4 << 20):
        for piece in (64 << 10, 512 << 10, 1 << 20, nbytes):
            times = [exchange(nbytes, piece, 1 - rank) for _ in range(args.repeat)]
            ideal = nbytes * 8 / (args.rate_mbit * 1e6)
            rows.append((nbytes, piece, statistics.median(times), ideal))
    if rank == 0:
        print(f"{'bytes each way':>14} {'piece':>9} {'median ms':>10} {'ideal ms':>9} {'ideal/median':>12}")
        for nbytes, piece, median, ideal in rows:
            print(f"{nbytes >> 20:>12}MB {piece >> 10:>7}KB {median * 1e3:>10.0f} {ideal * 1e3:>9.0f} {ideal / median:>12.2f}")
        one = {n: m for n, p, m, _ in rows if p == n}
        pieces = {n: m for n, p, m, _ in rows if p == 512 << 10}
        print("KEY: one message / 512KB pieces time: " + ", ".join(f"{n >> 20}MB {one[n] / pieces[n]:.2f}x" for n in one))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
