"""Tokens/s of the LM example with the load-balanced batch sampler against torch's
``DistributedSampler``, 4 ranks on this machine (torchrun, loopback), and the padding in each.

torch's sampler takes ``--batch-size`` documents per rank and step, padded to the longest; the
load-balanced batch sampler takes documents of similar length under the same token budget
(batch size x (context + 1) per rank and step), the same on every rank. Both runs train the same
model from the same seed for ``--steps`` steps; tokens/s counts real (unpadded) tokens over
training time (evaluation excluded), so padding and waiting for the slowest rank both show.

    python -m benchmarks.data.lm_sampler           # about 10 minutes on 2 cores
    python -m benchmarks.data.lm_sampler --steps 30 --width 64 --layers 2

The last line is the key ratio: balanced tokens/s over torch's.
"""

from __future__ import annotations

import argparse
import re
import sys

from benchmarks.jobs import ROOT, RankFailedError, loopback, run

EVAL = re.compile(r"step +(\d+) .* (\d+) tokens/s  padding (\d+\.\d)%")
FINAL = re.compile(r"final: validation loss (\d+\.\d+) .* after (\d+) steps, (\d+) tokens, (\d+\.\d) s of training")


def train(sampler: str, args: argparse.Namespace) -> dict:
    cmd = loopback(args.ranks, [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--sampler", sampler,
                                "--steps", str(args.steps), "--eval-every", str(args.steps), "--val-docs", "64",
                                "--no-progress", "--layers", str(args.layers), "--width", str(args.width),
                                "--context", str(args.context), "--batch-size", str(args.batch_size),
                                "--out-dir", f"/tmp/lm_sampler_{sampler}"])  # fmt: skip
    try:
        out = run(cmd, args.timeout, echo=False).outputs[0]
    except RankFailedError as e:
        raise SystemExit(f"{sampler}: {e}") from None
    step, tok_s, pad = EVAL.findall(out)[-1]
    loss, steps, tokens, secs = FINAL.findall(out)[-1]
    return {"tokens_per_s": float(tok_s), "padding": float(pad) / 100, "tokens": int(tokens), "seconds": float(secs),
            "val_loss": float(loss)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    rows = {s: train(s, args) for s in ("torch", "balanced")}
    print(f"\n{args.ranks} ranks, {args.steps} steps, batch {args.batch_size} (torch) / token budget "
          f"{args.batch_size * (args.context + 1)} per rank (balanced), context {args.context}")
    print("| sampler | tokens/s | padded tokens | real tokens | training s | val loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['padding']:.1%} | {r['tokens']} | {r['seconds']:.1f} | {r['val_loss']:.4f} |")
    print(f"key ratio: balanced / torch tokens/s = {rows['balanced']['tokens_per_s'] / rows['torch']['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
