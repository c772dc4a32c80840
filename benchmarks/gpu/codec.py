"""The block codecs' Triton kernels (MinMax-UInt8, or Sign1 with ``--codec sign1``) on a CUDA GPU:
correctness against the torch reference, then throughput against device-to-device copy bandwidth.

Encode reads 4 bytes and writes ~1 byte (Sign1: ~1/8) per fp32 element, decode the reverse, so
both are memory bound and the yardstick is a plain copy (``torch.empty_like(x).copy_(x)``, read
+ write bytes). Times are medians of ``triton.testing.do_bench``. The encode timing skips the
NaN/Inf check (``check_finite=False``): that check reads only the header values but is a host
sync; its cost is shown separately in the "enc+check us" column.

Usage::

    python -m benchmarks.gpu.codec                      # n = 1M, 4M, 16M, 64M fp32 elements
    python -m benchmarks.gpu.codec --sizes 16M 64M --block-size 1024
    python -m benchmarks.gpu.codec --codec sign1

The last line printed is the key ratio: the lowest % of copy bandwidth reached by encode or decode
over the sizes >= 16M elements. Record results in benchmarks/RESULTS.md (date, machine).
"""

from __future__ import annotations

import argparse
import sys

import torch

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    try:
        if text and text[-1] in _SUFFIX:
            return int(float(text[:-1]) * _SUFFIX[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be an int with an optional K/M/G suffix, got {text!r}") from None


def _fmt_size(n: int) -> str:
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def check_correctness(mm, block_size: int, device: str) -> None:
    """Triton on `device` vs the CPU reference: identical wire bytes and decoded values."""
    for n in (1, 1000, block_size + 1, 1_000_003):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            g = torch.Generator().manual_seed(n)
            x = (torch.randn(n, generator=g) * 3 + 1).to(dtype)
            ref = mm.encode_reference(x, block_size)
            got = mm.encode_triton(x.to(device), block_size).cpu()
            if not torch.equal(got, ref):
                raise SystemExit(
                    f"FAIL encode n={n} {dtype}: {int((got != ref).sum())} of {ref.numel()} wire bytes differ"
                )
            y_ref = mm.decode_reference(ref, n, block_size, dtype=dtype)
            y_got = mm.decode_triton(ref.to(device), n, block_size, dtype=dtype).cpu()
            if not torch.equal(y_got, y_ref):
                raise SystemExit(f"FAIL decode n={n} {dtype}: max diff {(y_got.float() - y_ref.float()).abs().max()}")
    x = torch.randn(4096, device=device)
    x[3000] = float("nan")
    try:
        mm.encode(x, block_size)
    except ValueError:
        pass
    else:
        raise SystemExit("FAIL: encode accepted NaN input")
    print(f"correctness: Triton == reference, bit for bit (block_size={block_size}); NaN input raises")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=_parse_size, default=[1 << 20, 1 << 22, 1 << 24, 1 << 26],
                        help="fp32 element counts (K/M/G suffixes allowed); default 1M 4M 16M 64M")
    parser.add_argument("--codec", choices=("minmax_uint8", "sign1"), default="minmax_uint8")
    parser.add_argument("--block-size", type=int, default=1024, help="the codec's block size (default 1024)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("benchmarks.gpu.codec needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure. "
              "The CPU path is covered by tests/kernels/test_minmax_uint8.py.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError as err:
        print(f"benchmarks.gpu.codec needs Triton ({err}); install the gpu extra: pip install 'bagua-torch[gpu]' (in a clone: pip install -e '.[gpu]')", file=sys.stderr)
        return 2
    import importlib

    mm = importlib.import_module(f"bagua.kernels.{args.codec}")

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
          f"triton {triton.__version__}, block_size {args.block_size}")
    check_correctness(mm, args.block_size, "cuda")

    rows = measure(mm, args.sizes, args.block_size, args.warmup, args.rep)
    header = (f"{'n':>6} {'copy GB/s':>10} {'enc GB/s':>9} {'enc %copy':>10} {'dec GB/s':>9} "
              f"{'dec %copy':>10} {'enc us':>9} {'dec us':>9} {'enc+check us':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{_fmt_size(r['n']):>6} {r['copy_gbs']:>10.1f} {r['encode_gbs']:>9.1f} {r['encode_pct_copy']:>9.1f}% "
              f"{r['decode_gbs']:>9.1f} {r['decode_pct_copy']:>9.1f}% {r['encode_us']:>9.1f} {r['decode_us']:>9.1f} "
              f"{r['encode_checked_us']:>13.1f}")
    key = [r[k] for r in rows if r["n"] >= 1 << 24 for k in ("encode_pct_copy", "decode_pct_copy")]
    if key:
        print(f"key ratio: {mm.WIRE.codec} encode/decode reach >= {min(key):.1f}% of copy bandwidth (n >= 16M)")
    else:
        print("key ratio: n/a (no size >= 16M elements was measured)")
    return 0


def measure(mm, sizes: list[int], block_size: int = 1024, warmup: int = 25, rep: int = 200) -> list[dict]:
    """Per fp32 size: copy, encode and decode bandwidth (GB/s, bytes read + written) and the
    encode/decode share of copy bandwidth, from medians of ``do_bench`` on the current GPU."""
    from triton.testing import do_bench

    def bench(fn) -> float:  # seconds, median
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e3

    rows = []
    for n in sizes:
        x = torch.randn(n, device="cuda")
        wire = torch.empty(mm.wire_numel(n, block_size), dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        mm.encode(x, block_size, out=wire)
        t_copy = bench(lambda: torch.empty_like(x).copy_(x))
        t_enc = bench(lambda: mm.encode(x, block_size, out=wire, check_finite=False))
        t_dec = bench(lambda: mm.decode(wire, n, block_size, out=y))
        t_enc_check = bench(lambda: mm.encode(x, block_size, out=wire))
        copy_bw = 2 * x.nbytes / t_copy
        enc_bw = (x.nbytes + wire.nbytes) / t_enc
        dec_bw = (wire.nbytes + y.nbytes) / t_dec
        rows.append({
            "n": n, "copy_gbs": copy_bw / 1e9, "encode_gbs": enc_bw / 1e9, "decode_gbs": dec_bw / 1e9,
            "encode_pct_copy": 100 * enc_bw / copy_bw, "decode_pct_copy": 100 * dec_bw / copy_bw,
            "encode_us": t_enc * 1e6, "decode_us": t_dec * 1e6, "encode_checked_us": t_enc_check * 1e6,
        })  # fmt: skip
        del x, wire, y
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sys.exit(main())
