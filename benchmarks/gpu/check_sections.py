"""The sections of ``check.py`` (``make gpu-check``), each ``name(section, out, quick, save)``: it
adds checks, measurements and targets to ``section`` (see ``check.check/measure/target``) and calls
``save()`` after each part, so a crash keeps what was done. Each runs in a process of its own.

Example::

    python -m benchmarks.gpu.check --sections kernels      # runs kernel_sweep's section alone
"""

from __future__ import annotations

import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable

import torch

from benchmarks.gpu.check import check, measure, target
from benchmarks.jobs import ROOT

# "cpu" only for check.py --dry-run-cpu (the Triton kernels in Triton's interpreter, tiny
# sizes, timings meaningless): it checks this script without a GPU
DEVICE = os.environ.get("BAGUA_GPU_CHECK_DEVICE", "cuda")
MB = 1 << 20
FULL_SIZES = [1, 2, 127, 2048, 2049, 65_537, MB + 3, 16 * MB + 5, 64 * MB]
QUICK_SIZES = [1, 127, 2049, MB + 3]
DRY_RUN_SIZES = [1, 127, 2049, 5000]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# allowed |triton - reference| <= rtol * |reference| + atol per dtype: float32 math rounded to the
# dtype, so a last-bit difference in float32 may move a rounded result by one unit in the last place
TOLERANCE = {torch.float32: (2e-6, 1e-7), torch.bfloat16: (2.0**-7, 1e-6), torch.float16: (2.0**-10, 1e-6)}


# ---- tests: pytest -m gpu --------------------------------------------------------------------

_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def tests(section: dict, out: Path, quick: bool, save: Callable[[], None]) -> None:
    """Every test marked ``gpu``; each test case is one check, recorded as pytest reports it (so
    a deadline keeps the ones done); a skip on a GPU machine fails. Failures' messages come from
    the junit report at the end."""
    junit = out / "junit_gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-o", "addopts=",
           "--continue-on-collection-errors", f"--junitxml={junit}", "-rs"]  # fmt: skip
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append("--timeout=150")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
        seen = _OUTCOME.match(line)
        if seen:
            name, outcome = seen.groups()
            check(section, name, outcome in ("PASSED", "XFAIL"), "" if outcome == "PASSED" else outcome.lower())
            save()
    measure(section, "pytest exit code", proc.wait(), "")
    if junit.exists():  # the reasons of failures and skips
        reasons = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if problem is not None:
                path = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
                reasons[path] = f"{problem.tag}: {(problem.get('message') or '')[:500]}"
        for c in section["checks"]:
            c["detail"] = reasons.get(c["name"], c["detail"])
    if not section["checks"]:
        check(section, "pytest -m gpu ran tests", False, f"exit code {proc.returncode}")
    save()


# ---- kernels: Triton against the torch reference ----------------------------------------------

def _optimizer_cases():
    from bagua.kernels import adam, lion, sgd

    return [
        # (name, triton fn, reference fn, state tensor names, hyperparameters)
        ("adam", adam.adam_step_triton, adam.adam_step_reference, 2, dict(step=7, lr=1e-3, weight_decay=0.01)),
        ("adamw amsgrad", adam.adam_step_triton, adam.adam_step_reference, 3,
         dict(step=7, lr=1e-3, weight_decay=0.05, decoupled_weight_decay=True, amsgrad=True)),
        ("adam maximize", adam.adam_step_triton, adam.adam_step_reference, 2, dict(step=1, lr=1e-2, maximize=True)),
        ("sgd nesterov", sgd.sgd_step_triton, sgd.sgd_step_reference, 1,
         dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
        ("sgd first step", sgd.sgd_step_triton, sgd.sgd_step_reference, 1, dict(lr=0.1, momentum=0.9, first=True)),
        ("sgd plain", sgd.sgd_step_triton, sgd.sgd_step_reference, 0, dict(lr=0.1)),
        ("lion", lion.lion_step_triton, lion.lion_step_reference, 1, dict(lr=1e-4, weight_decay=0.1)),
    ]  # fmt: skip


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _fresh(n: int, count: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """param, grad and ``count`` states (non-negative, as second moments are) on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    param = torch.randn(n, device=DEVICE, generator=g).to(dtype)
    grad = (torch.randn(n, device=DEVICE, generator=g) * 1e-2).to(dtype)
    states = [(torch.randn(n, device=DEVICE, generator=g) * 1e-2).abs().to(dtype) for _ in range(count)]
    return [param, grad, *states]


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    rtol, atol = TOLERANCE[want.dtype]
    g, w = got.double(), want.double()
    diff = (g - w).abs()
    ok = bool(torch.isfinite(g).all()) and bool((diff <= rtol * w.abs() + atol).all())
    equal = float((got.view(-1) == want.view(-1)).float().mean()) if want.numel() else 1.0
    return ok, f"max |diff| {float(diff.max()) if diff.numel() else 0.0:.3g}, bit-equal {100 * equal:.4f}%"


def kernels(section: dict, out: Path, quick: bool, save: Callable[[], None]) -> None:
    """Each optimizer kernel and the MinMax-UInt8 codec at every size and dtype against the
    torch reference of the same math on the same GPU (the codec: bitwise, and against the CPU
    reference up to 1M elements)."""
    from bagua.kernels import minmax_uint8 as mm

    sizes = DRY_RUN_SIZES if DEVICE != "cuda" else QUICK_SIZES if quick else FULL_SIZES
    for name, triton_fn, reference_fn, n_states, hp in _optimizer_cases():
        for dtype in DTYPES:
            for n in sizes:
                want = _fresh(n, n_states, dtype, seed=n)
                got = [t.clone() for t in want]
                reference_fn(*want, **hp)
                triton_fn(*got, **hp)
                _sync()
                results = [_compare(a, b) for a, b in zip(got, want)]
                ok = all(r[0] for r in results)
                check(section, f"{name} {str(dtype)[6:]} n={n}", ok, "; ".join(r[1] for r in results))
                del want, got
            save()
    for dtype in DTYPES:
        for n in sizes:
            g = torch.Generator(device=DEVICE).manual_seed(n)
            x = (torch.randn(n, device=DEVICE, generator=g) * 3 + 1).to(dtype)
            wire_ref = mm.encode_reference(x)
            wire = mm.encode_triton(x)
            same = torch.equal(wire, wire_ref)
            if n <= MB + 3:
                same = same and torch.equal(wire.cpu(), mm.encode_reference(x.cpu()))
            check(section, f"minmax_uint8 encode {str(dtype)[6:]} n={n}", same,
                  "" if same else f"{int((wire != wire_ref).sum())} of {wire.numel()} wire bytes differ")  # fmt: skip
            y = torch.full((n,), float("nan"), device=DEVICE, dtype=dtype)  # poisoned: every element must be written
            mm.decode_triton(wire_ref, n, out=y)
            y_ref = mm.decode_reference(wire_ref, n, dtype=dtype)
            same = torch.equal(y, y_ref)
            check(section, f"minmax_uint8 decode {str(dtype)[6:]} n={n}", same,
                  "" if same else f"max |diff| {float((y.float() - y_ref.float()).abs().nan_to_num(float('inf')).max()):.3g}")  # fmt: skip
            del x, wire, wire_ref, y, y_ref
        save()
    x = torch.randn(MB, device=DEVICE)
    x[777_777] = float("nan")
    try:
        mm.encode(x)
        refused = False
    except ValueError:
        refused = True
    check(section, f"minmax_uint8 encode refuses NaN on {DEVICE}", refused)


# ---- speed: ratios in the same run --------------------------------------------------------------

def speed(section: dict, out: Path, quick: bool, save: Callable[[], None]) -> None:
    """The codec against copy bandwidth; the fused optimizers against torch's fused and foreach."""
    from bagua.kernels import minmax_uint8 as mm
    from benchmarks.gpu import codec
    from benchmarks.optim import fused

    dry_run = DEVICE != "cuda"
    rows = [] if dry_run else codec.measure(mm, [16 * MB] if quick else [16 * MB, 64 * MB], rep=50 if quick else 200)
    for r in rows:
        for what in ("encode", "decode"):
            measure(section, f"minmax_uint8 {what} n={r['n']}", r[f"{what}_gbs"], "GB/s")
        measure(section, f"copy n={r['n']}", r["copy_gbs"], "GB/s")
    if rows:
        worst = min(min(r["encode_pct_copy"], r["decode_pct_copy"]) for r in rows)
        target(section, "minmax_uint8 encode/decode, % of copy bandwidth (n >= 16M)", worst, ">= 80", worst >= 80)
    save()

    tensors, elements = (14, 5000) if dry_run else (64, 16 * MB) if quick else (256, 64 * MB)
    result = fused.gpu_section(tensors, elements, dry_run_cpu=dry_run)
    err = result["fused_adamw_max_abs_err"]
    check(section, "fused AdamW equals torch AdamW after 5 steps", err <= 1e-6, f"max |diff| {err:.3g}")
    measure(section, "device-to-device copy", result["copy_tbs"], "TB/s")
    for row in result["rows"]:
        measure(section, row["label"], row["ms"], "ms")
        if row["speedup"] is not None:
            target(section, f"{row['label']}: speedup", row["speedup"], ">= 1.00x", row["speedup"] >= 1.0)
    adam = next(r for r in result["rows"] if r["label"].startswith("bagua fuse_step Adam "))
    target(section, "bagua fused Adam, share of copy bandwidth", adam["share_of_copy"], ">= 0.90", adam["share_of_copy"] >= 0.9)
    save()


# ---- wrapper: one rank on NCCL against torch DDP --------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (what the step is bound by, GPT-2 layers, width, batch, context): the first keeps the GPU busy,
# as training on it does; the second is so small that the host's kernel launches and the
# wrappers' per-parameter Python hooks set the pace
WORKLOADS = [("GPU-bound", 12, 768, 32, 256), ("launch-bound", 6, 512, 16, 256)]


def _language_model(layers: int, width: int) -> tuple[torch.nn.Module, str]:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(256, width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, 256))  # fmt: skip
        return model.to(DEVICE), "MLP over byte embeddings (transformers is missing)"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=256, n_embd=width, n_layer=layers, n_head=width // 64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # the same losses from both wrappers
    return GPT2LMHeadModel(config).to(DEVICE), f"GPT-2 architecture, {layers} layers x {width}, bytes"


def _loss(model, x):
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256).float(), x[:, 1:].reshape(-1))


def wrapper(section: dict, out: Path, quick: bool, save: Callable[[], None]) -> None:
    """bagua gradient_allreduce vs torch DDP, one rank on NCCL, bf16 autocast, the same fused
    AdamW, on each of WORKLOADS: per-step time (median of interleaved rounds) and the same losses."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    import bagua

    bagua.init_process_group()
    backend = bagua.comm.get_default_group().backend_for(DEVICE)
    check(section, f"the default group sends {DEVICE} tensors with {'NCCL' if DEVICE == 'cuda' else 'Gloo'}",
          backend == ("nccl" if DEVICE == "cuda" else "gloo"), bagua.comm.get_default_group().backend)  # fmt: skip
    for bound, layers, width, batch, context in WORKLOADS:
        if DEVICE != "cuda":
            layers, width, batch, context = 2, 64, 2, 16
        _compare_wrappers(section, bagua, bound, layers, width, (batch, context), quick)
        save()
    bagua.destroy_process_group()


def _compare_wrappers(section: dict, bagua, bound: str, layers: int, width: int, shape: tuple[int, int], quick: bool) -> None:
    runs = {}
    for kind in ("torch", "bagua"):
        model, described = _language_model(layers, width)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        if kind == "torch":
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if DEVICE == "cuda" else None)
        else:
            ddp = bagua.DistributedDataParallel(model, optimizers=[opt], algorithm="gradient_allreduce")
        runs[kind] = (ddp, opt, [])
    g = torch.Generator(device=DEVICE).manual_seed(0)
    data = [torch.randint(0, 256, shape, device=DEVICE, generator=g) for _ in range(8)]
    params = sum(p.numel() for p in model.parameters())
    what = f"{bound}: {described}, {params / 1e6:.1f}M parameters in {len(list(model.parameters()))} tensors, batch {shape[0]} x {shape[1]}"

    phases: dict[str, dict[str, list[float]]] = {k: {p: [] for p in ("forward", "zero_grad", "backward", "step")} for k in runs}

    def step(kind: str, i: int) -> None:  # and the host time of each phase (enqueueing, no waiting)
        ddp, opt, losses = runs[kind]
        t0 = time.perf_counter()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = _loss(ddp, data[i % len(data)])
        t1 = time.perf_counter()
        opt.zero_grad()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        losses.append(loss.detach())
        for phase, (a, b) in zip(phases[kind], ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            phases[kind][phase].append(1e3 * (b - a))

    for i in range(5):  # warm-up, and the same first losses from the same weights and data
        for kind in runs:
            step(kind, i)
    first = {k: torch.stack(v[2][:5]).float().cpu() for k, v in runs.items()}
    rel = float(((first["bagua"] - first["torch"]).abs() / first["torch"].abs()).max())
    check(section, f"{bound}: bagua's first 5 losses equal torch DDP's (bf16 autocast)", rel <= 1e-3, f"max relative diff {rel:.2g}")
    steps_per_round, rounds = (2, 2) if DEVICE != "cuda" else (5, 4) if quick else (10, 9)
    times: dict[str, list[float]] = {k: [] for k in runs}
    host: dict[str, list[float]] = {k: [] for k in runs}  # enqueueing a step, without waiting for the GPU
    for r in range(rounds):
        for kind in (("torch", "bagua") if r % 2 == 0 else ("bagua", "torch")):
            _sync()
            t0 = time.perf_counter()
            for i in range(steps_per_round):
                step(kind, i)
                host[kind].append(time.perf_counter())
            _sync()
            t1 = time.perf_counter()
            times[kind].append(1e3 * (t1 - t0) / steps_per_round)
            stamps = [t0] + host[kind][-steps_per_round:]
            host[kind][-steps_per_round:] = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    paired = [b / t for b, t in zip(times["bagua"], times["torch"])]  # the rounds run back to back
    for kind in runs:
        measure(section, f"{what}: {kind} DDP step (median of {rounds} rounds of {steps_per_round})",
                statistics.median(times[kind]), "ms")  # fmt: skip
        measure(section, f"{what}: {kind} DDP host time to enqueue a step (median)", statistics.median(host[kind]), "ms")
        for phase, spent in phases[kind].items():  # the timed rounds' steps
            measure(section, f"{bound}: {kind} DDP host time of {phase} (median)", statistics.median(spent[-steps_per_round * rounds:]), "ms")
    measure(section, f"{bound}: the lowest paired per-round ratio bagua/torch", min(paired), "x")
    measure(section, f"{bound}: the highest paired per-round ratio bagua/torch", max(paired), "x")
    ratio = statistics.median(paired)
    target(section, f"{bound}: bagua gradient_allreduce step time / torch DDP (1 rank, NCCL; median of paired rounds)",
           ratio, "<= 1.02", ratio <= 1.02)  # fmt: skip
    _profile_host(runs, step, bound)


def _profile_host(runs: dict, step: Callable[[str, int], None], bound: str) -> None:
    """Print where each wrapper's steps spend host and device time (3 steps, torch.profiler) to
    the section's log, for a ratio that misses its target."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    for kind in runs:
        with profile(activities=activities) as prof:
            for i in range(3):
                step(kind, i)
            _sync()
        print(f"\n## {bound}: {kind} DDP, 3 steps, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
