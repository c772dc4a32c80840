"""Fused optimizer benchmark: ``fuse_step`` against the unfused torch optimizers on a model-like
set of tensors.

CPU section (always): 406 tensors / 9.6M fp32 elements (transformer-like shapes). Per optimizer,
the unfused ``step()`` against ``fuse_step()``; for Adam also foreach=False, foreach=True,
fused=True, a flat multi-pass step (the optimizer's own step on one flat view: each op streams
the whole buffer), the same in cache-sized chunks, the kernel's torch reference over flat buffers,
and the default ``fuse_step`` (torch's fused single-pass CPU kernel on the flat buffers). Times:
minimum (and median) wall clock over ``--reps`` interleaved rounds.

GPU section (CUDA only; skipped with a message otherwise): 256 tensors / 64M fp32 elements,
medians of ``triton.testing.do_bench``: device-to-device copy bandwidth (read + write), torch Adam
foreach=True and fused=True, bagua ``fuse_step`` for Adam, AdamW, SGD-momentum and Lion (Triton
single-pass kernels; % of copy bandwidth counting 28 / 28 / 20 / 20 bytes per element), a
per-parameter Adam loop, and Adadelta (foreach=False, no kernel of its own) unfused vs fused.

Usage::

    python -m benchmarks.optim.fused               # both sections (GPU when present)
    python -m benchmarks.optim.fused --section cpu --reps 7

The last line printed is the key ratio (GPU: bagua fused Adam vs torch fused=True; CPU: Adam
fuse_step vs torch fused=True). Results: benchmarks/results/fused_optimizer.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch

from bagua.kernels import adam as adam_k
from bagua.optim import Lion, fuse_optimizer
from bagua.optim import fused as fused_mod


MIN_TENSORS = 14  # model_like_shapes: one block of 12, the embedding, a vector


def model_like_shapes(n_tensors: int, n_elems: int) -> list[tuple[int, ...]]:
    """Transformer-like parameter shapes: blocks of 12 tensors (qkv, proj, 2 MLP matrices, their
    biases, 2 LayerNorms), then an embedding and vectors up to ``n_tensors`` and ~``n_elems``."""
    blocks = (n_tensors - 2) // 12
    d = max(8, int(math.sqrt(0.85 * n_elems / (12 * blocks))) // 8 * 8)
    shapes: list[tuple[int, ...]] = []
    for _ in range(blocks):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    while len(shapes) < n_tensors - 1:
        shapes.append((d,))
    used = sum(math.prod(s) for s in shapes)
    shapes.insert(0, (max(1, (n_elems - used) // d), d))  # the embedding takes the rest
    return shapes


def make_params(shapes, device, dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device=device, dtype=dtype))
        p.grad = (torch.randn(s, generator=g) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    return params


def cpu_times_ms(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, tuple[float, float]]:
    """(min, median) ms per function, timed in interleaved rounds (one call of each per round) so
    that load from other processes on a shared machine hits every configuration alike; the
    minimum is the estimate least disturbed by that load."""
    for fn in fns.values():
        fn()  # warm-up (allocates lazily created state)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(1e3 * (time.perf_counter() - t0))
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def _with(fn: Callable[[], None], **module_attrs) -> Callable[[], None]:
    """fn run with attributes of bagua.optim.fused temporarily set (chunk size, CPU fused types)."""

    def run():
        old = {k: getattr(fused_mod, k) for k in module_attrs}
        for k, v in module_attrs.items():
            setattr(fused_mod, k, v)
        try:
            fn()
        finally:
            for k, v in old.items():
                setattr(fused_mod, k, v)

    return run


O = torch.optim
CPU_OPTIMIZERS: list[tuple[str, Callable]] = [
    ("SGD", lambda ps: O.SGD(ps, lr=0.01)),
    ("SGD momentum nesterov", lambda ps: O.SGD(ps, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    ("Adam", lambda ps: O.Adam(ps, lr=1e-3)),
    ("AdamW amsgrad", lambda ps: O.AdamW(ps, lr=1e-3, weight_decay=0.01, amsgrad=True)),
    ("Adamax", lambda ps: O.Adamax(ps, lr=1e-3)),
    ("Adadelta", lambda ps: O.Adadelta(ps)),
    ("Adagrad", lambda ps: O.Adagrad(ps, lr=1e-2)),
    ("RMSprop", lambda ps: O.RMSprop(ps, lr=1e-3, momentum=0.9)),
    ("Rprop", lambda ps: O.Rprop(ps, lr=1e-3)),
    ("NAdam", lambda ps: O.NAdam(ps, lr=1e-3)),
    ("RAdam", lambda ps: O.RAdam(ps, lr=1e-3)),
    ("ASGD", lambda ps: O.ASGD(ps, lr=1e-3)),
    ("Lion (bagua)", lambda ps: Lion(ps, lr=1e-4)),
]


def _step_fn(opt, fused: bool) -> Callable[[], None]:
    return opt.fuse_step if fused else opt.step


def cpu_section(reps: int, n_tensors: int, n_elems: int) -> float:
    shapes = model_like_shapes(n_tensors, n_elems)
    total = sum(math.prod(s) for s in shapes)
    print(f"\n## CPU: {len(shapes)} tensors, {total / 1e6:.2f}M fp32 elements, "
          f"{torch.get_num_threads()} torch threads, chunk {fused_mod.CPU_CHUNK_ELEMS} elements")  # fmt: skip
    base = make_params(shapes, "cpu")

    def fresh():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in base]
        for p, b in zip(ps, base):
            p.grad = b.grad.clone()
        return ps

    print(f"\ntimes: min (median) of {reps} interleaved rounds, ms")
    print("(flat multi-pass: the optimizer's own step on one flat view per run, no chunks, no fused kernel)")
    print(f"\n{'optimizer':<24}{'unfused step()':>18}{'flat multi-pass':>18}{'fuse_step()':>18}"
          f"{'vs unfused':>12}{'vs flat':>9}")  # fmt: skip
    for name, make in CPU_OPTIMIZERS:
        t = cpu_times_ms({
            "u": make(fresh()).step,
            "m": _with(fuse_optimizer(make(fresh())).fuse_step, CPU_CHUNK_ELEMS=1 << 40, _CPU_FUSED_TYPES=()),
            "f": fuse_optimizer(make(fresh())).fuse_step,
        }, reps)  # fmt: skip
        (u, um), (m, mm), (f, fm) = t["u"], t["m"], t["f"]
        print(f"{name:<24}{u:>9.1f} ({um:>6.1f}){m:>10.1f} ({mm:>6.1f}){f:>10.1f} ({fm:>6.1f})"
              f"{u / f:>11.2f}x{m / f:>8.2f}x")  # fmt: skip

    print("\n### Adam (lr=1e-3) on the same set")
    no_fused = dict(_CPU_FUSED_TYPES=())
    configs = {
        "torch Adam foreach=False (per-param loop)": O.Adam(fresh(), lr=1e-3, foreach=False).step,
        "torch Adam foreach=True": O.Adam(fresh(), lr=1e-3, foreach=True).step,
        "torch Adam fused=True (per param)": O.Adam(fresh(), lr=1e-3, fused=True).step,
        "flat multi-pass (own step, one chunk)": _with(fuse_optimizer(O.Adam(fresh(), lr=1e-3)).fuse_step,
                                                       CPU_CHUNK_ELEMS=1 << 40, **no_fused),
    }
    for chunk in (1 << 16, 1 << 18, 1 << 20):
        configs[f"own step in chunks of {chunk >> 10}K"] = _with(
            fuse_optimizer(O.Adam(fresh(), lr=1e-3)).fuse_step, CPU_CHUNK_ELEMS=chunk, **no_fused)
    configs["kernels.adam reference (chunked), flat"] = (
        lambda flat: (lambda: adam_k.adam_step_reference(*flat, step=5, lr=1e-3))
    )([torch.randn(total) * 0.02, torch.randn(total) * 1e-3, torch.zeros(total), torch.zeros(total)])
    configs["fuse_step default: torch fused CPU kernel, flat"] = fuse_optimizer(O.Adam(fresh(), lr=1e-3)).fuse_step
    t = cpu_times_ms(configs, reps)
    for label, (mn, med) in t.items():
        print(f"{label:<48}{mn:>9.1f} ({med:>6.1f})")
    best = t["fuse_step default: torch fused CPU kernel, flat"][0]
    t_torch_fused = t["torch Adam fused=True (per param)"][0]
    print(f"CPU key ratio: Adam fuse_step {best:.1f} ms vs torch fused=True {t_torch_fused:.1f} ms: "
          f"{t_torch_fused / best:.2f}x")  # fmt: skip
    return t_torch_fused / best


def gpu_section(n_tensors: int, n_elems: int, dry_run_cpu: bool = False) -> dict | None:
    """The GPU measurements (a dict of every row; None without a GPU); ``dry_run_cpu`` runs the same code on CPU tensors with the Triton
    kernels in Triton's interpreter (set TRITON_INTERPRET=1) to check the script without a GPU;
    its timings mean nothing."""
    if dry_run_cpu:
        dev = torch.device("cpu")
        fused_mod._KERNELS_ON_CPU = True

        def bench(fn) -> float:
            return min(cpu_times_ms({"fn": fn}, 2)["fn"])

        name_of_device = "CPU dry run (Triton interpreter), timings meaningless"
    else:
        if not torch.cuda.is_available():
            print("\n## GPU: skipped: no CUDA device here (run on a machine with one for the GPU targets)")
            return None
        import triton.testing

        def bench(fn) -> float:
            return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

        dev = torch.device("cuda")
        name_of_device = torch.cuda.get_device_name(dev)
    shapes = model_like_shapes(n_tensors, n_elems)
    total = sum(math.prod(s) for s in shapes)
    print(f"\n## GPU: {name_of_device}; {len(shapes)} tensors, {total / 1e6:.1f}M fp32 elements")
    base = make_params(shapes, dev)

    def fresh():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in base]
        for p, b in zip(ps, base):
            p.grad = b.grad.clone()
        return ps

    # correctness first: fused (Triton) vs unfused, a few steps
    ref_ps, f_ps = fresh(), fresh()
    o_ref = O.AdamW(ref_ps, lr=1e-3, weight_decay=0.01)
    o_f = fuse_optimizer(O.AdamW(f_ps, lr=1e-3, weight_decay=0.01))
    for _ in range(5):
        o_ref.step()
        o_f.fuse_step()
    with torch.no_grad():
        err = max(float((a - b).abs().max()) for a, b in zip(f_ps, ref_ps))
        moved = max(float((b - p0).abs().max()) for b, p0 in zip(ref_ps, base))
    print(f"correctness: fused AdamW vs torch AdamW after 5 steps: max |difference| {err:.2e}, "
          f"{err / moved:.1e} of the largest change of a parameter")  # fmt: skip

    src = torch.empty(total, device=dev)
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src))
    copy_bw = 8 * total / t_copy / 1e9  # TB/s
    print(f"\ndevice-to-device copy: {t_copy:.3f} ms, {copy_bw:.2f} TB/s (read + write)")

    rows = []

    def row(label, ms, bytes_per_elem=None, ref_ms=None):
        share = bytes_per_elem * total / ms / 1e9 / copy_bw if bytes_per_elem else None
        bw = f"{bytes_per_elem * total / ms / 1e9:.2f} TB/s ({100 * share:.0f}% copy)" if bytes_per_elem else ""
        extra = f"{ref_ms / ms:.2f}x" if ref_ms else ""
        rows.append({"label": label, "ms": ms, "share_of_copy": share, "speedup": ref_ms / ms if ref_ms else None})
        print(f"{label:<44}{ms:>9.3f} ms  {bw:<26}{extra}")
        return ms

    # (optimizer, bytes per element, its torch fused=True / foreach=True / bagua fuse_step)
    for name, nbytes, make in (
        ("Adam", 28, lambda ps, **kw: O.Adam(ps, lr=1e-3, **kw)),
        ("AdamW", 28, lambda ps, **kw: O.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw)),
        ("SGD momentum", 20, lambda ps, **kw: O.SGD(ps, lr=1e-3, momentum=0.9, **kw)),
    ):
        t_fused = row(f"torch {name} fused=True", bench(make(fresh(), fused=True).step), nbytes)
        t_foreach = row(f"torch {name} foreach=True", bench(make(fresh(), foreach=True).step), nbytes)
        row(f"bagua fuse_step {name} (vs fused=True)", bench(fuse_optimizer(make(fresh())).fuse_step), nbytes, t_fused)
        rows[-1]["vs_foreach"] = t_foreach / rows[-1]["ms"]
    row("torch Adam foreach=False (per-param loop)", bench(O.Adam(fresh(), lr=1e-3, foreach=False).step), 28)
    t_lion = row("bagua Lion unfused (per-param kernels)", bench(Lion(fresh(), lr=1e-4).step), 20)
    row("bagua fuse_step Lion (vs unfused)", bench(fuse_optimizer(Lion(fresh(), lr=1e-4)).fuse_step), 20, t_lion)
    t_ad = row("torch Adadelta foreach=False (unfused)", bench(O.Adadelta(fresh(), foreach=False).step))
    row("bagua fuse_step Adadelta (generic, vs unfused)", bench(fuse_optimizer(O.Adadelta(fresh(), foreach=False)).fuse_step), None, t_ad)
    adam = next(r for r in rows if r["label"].startswith("bagua fuse_step Adam "))
    print(f"GPU key ratio: bagua fused Adam vs torch fused=True: {adam['speedup']:.2f}x "
          f"({100 * adam['share_of_copy']:.0f}% of copy bandwidth)")  # fmt: skip
    return {"device": name_of_device, "tensors": len(shapes), "elements": total, "copy_tbs": copy_bw,
            "fused_adamw_max_abs_err": err, "rows": rows, "key_ratio": adam["speedup"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=["cpu", "gpu", "all"], default="all")
    parser.add_argument("--reps", type=int, default=7, help="CPU: timed steps per configuration (median)")
    parser.add_argument("--cpu-tensors", type=int, default=406, help=f"at least {MIN_TENSORS} (default 406)")
    parser.add_argument("--cpu-elems", type=float, default=9.6e6)
    parser.add_argument("--gpu-tensors", type=int, default=256, help=f"at least {MIN_TENSORS} (default 256)")
    parser.add_argument("--gpu-elems", type=float, default=64 * 2**20)
    parser.add_argument("--gpu-dry-run-cpu", action="store_true",
                        help="check the GPU section without a GPU: CPU tensors, Triton interpreter "
                             "(needs TRITON_INTERPRET=1; use tiny --gpu-tensors/--gpu-elems)")  # fmt: skip
    args = parser.parse_args(argv)
    for flag in ("cpu_tensors", "gpu_tensors"):
        if getattr(args, flag) < MIN_TENSORS:
            parser.error(f"--{flag.replace('_', '-')} must be at least {MIN_TENSORS} (one transformer block of 12 "
                         f"tensors, an embedding and a vector), got {getattr(args, flag)}")
    gpu_ratio = cpu_ratio = None
    if args.section in ("gpu", "all"):
        gpu = gpu_section(args.gpu_tensors, int(args.gpu_elems), args.gpu_dry_run_cpu)
        gpu_ratio = gpu["key_ratio"] if gpu else None
    if args.section in ("cpu", "all"):
        cpu_ratio = cpu_section(args.reps, args.cpu_tensors, int(args.cpu_elems))
    if gpu_ratio is not None:
        print(f"key ratio: bagua fused Adam / torch fused=True (GPU) = {gpu_ratio:.2f}x")
    elif cpu_ratio is not None:
        print(f"key ratio: Adam fuse_step / torch fused=True (CPU) = {cpu_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
