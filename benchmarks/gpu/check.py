"""`make gpu-check`: the whole GPU path proven in one prepared run on one CUDA GPU.

Sections, in this order, each in its own process with its own deadline (a crash or a hang in one
costs only that one, and the report is rewritten after each):

- ``kernels``: every Triton kernel compiled for the device against its torch reference, sizes
  from 1 element to 64M.
- ``speed``: ratios measured in the same run: the 8-bit codec against copy bandwidth, the fused
  optimizers against torch's ``fused=True`` / ``foreach=True``, ``fuse_step`` against the unfused
  loop.
- ``wrapper``: one rank on NCCL, bagua's step time against torch DDP on the same model.
- ``tests``: every test marked ``gpu`` (``pytest -m gpu``): the wrapper on NCCL and on Gloo with
  CUDA tensors (every algorithm against the CPU path), SyncBatchNorm, the fused optimizer, the
  cache, sampler and checkpoints with CUDA tensors, the kernels' own CUDA tests.

Writes ``gpu_check.json`` (everything) and ``gpu_check.md`` (a summary) into ``--out`` (default:
``$OUT``, else ``gpu_check_out``), beside each section's log and pytest's junit report. Exit
codes: 0 every check passed (missed speed targets are reported, not failures), 1 a check failed
or a section broke, 2 bad arguments, 3 no CUDA GPU, 4 a prerequisite is missing (the message
names each and how to bring it).

Usage::

    make gpu-check                                   # all sections, at most 7.5 minutes
    python -m benchmarks.gpu.check --sections kernels speed --out /tmp/gc   # from the repository root
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.jobs import ROOT, worker

SECTIONS = {"kernels": 90, "speed": 100, "wrapper": 100, "tests": 160}  # name: deadline, s (7.5 minutes in all)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU, EXIT_MISSING = 0, 1, 2, 3, 4
# importable name -> what to do when it is missing (the device image has no network: carry wheels)
PREREQUISITES = {
    "torch": "install PyTorch with CUDA",
    "triton": "install triton (the project's gpu extra)",
    "numpy": "pip install numpy",
    "lmdb": "carry a wheel: pip download --no-deps --only-binary=:all: lmdb (see the device README)",
    "xxhash": "carry a wheel: pip download --no-deps --only-binary=:all: xxhash",
    "pytest": "pip install pytest",
    "bagua": "install this checkout: pip install --no-deps --no-build-isolation -e .",
    "bagua.kernels": "install this checkout (bagua.kernels is kernels/): pip install --no-deps --no-build-isolation -e .",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="folder for gpu_check.json and gpu_check.md (default: $OUT, else gpu_check_out)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="which sections to run, in order (default: all)")
    parser.add_argument("--budget-s", type=float, default=float(sum(SECTIONS.values())),
                        help=f"the whole run's time limit; a section gets what is left (default {sum(SECTIONS.values())})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="check this script without a GPU: CPU tensors, the Triton kernels in Triton's "
                             "interpreter, tiny sizes; its timings and targets mean nothing")  # fmt: skip
    parser.add_argument("--section-worker", metavar="NAME", help=argparse.SUPPRESS)  # internal: run one section
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: where the worker writes its result
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    return args


def missing_prerequisites(names: dict[str, str] = PREREQUISITES) -> dict[str, str]:
    """{module: what to do} for each prerequisite that does not import."""
    missing = {}
    for name, fix in names.items():
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install raising anything
            missing[name] = f"{type(e).__name__}: {e}. Fix: {fix}"
    return missing


def environment() -> dict:
    """The device and the software versions, for the report."""
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")  # fmt: skip
    return info


# ---- the report ------------------------------------------------------------------------------

def new_section(name: str) -> dict:
    """A section's result: named checks (pass/fail), measurements, and targets (met or not)."""
    return {"name": name, "status": "not run", "seconds": 0.0, "checks": [], "measurements": [], "targets": [], "log_tail": ""}


def check(section: dict, name: str, passed: bool, detail: str = "") -> bool:
    section["checks"].append({"name": name, "passed": bool(passed), "detail": detail})
    return bool(passed)


def measure(section: dict, name: str, value: float, unit: str) -> None:
    section["measurements"].append({"name": name, "value": value, "unit": unit})


def target(section: dict, name: str, value: float, goal: str, met: bool) -> None:
    section["targets"].append({"name": name, "value": value, "goal": goal, "met": bool(met)})


def section_failed(section: dict) -> bool:
    return section["status"] not in ("passed", "not run") or any(not c["passed"] for c in section["checks"])


def write_report(out: Path, report: dict) -> None:
    """gpu_check.json (everything) and gpu_check.md (the summary), rewritten whole each time."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(summary_markdown(report))


def summary_markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = [
        f"# gpu-check {report.get('started', '')}",
        "",
        f"Device: {env.get('device', 'none')} ({env.get('memory_gib', '?')} GiB); torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, Triton {env.get('triton')}, Python {env.get('python')}",
        "",
        "| section | status | seconds | checks passed | targets met |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for s in report["sections"].values():
        checks, targets = s["checks"], s["targets"]
        lines.append(
            f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {sum(c['passed'] for c in checks)}/{len(checks)} "
            f"| {sum(t['met'] for t in targets)}/{len(targets)} |"
        )
    failed = [(s["name"], c) for s in report["sections"].values() for c in s["checks"] if not c["passed"]]
    if failed:
        lines += ["", "## Failed checks", ""] + [f"- {name}: {c['name']}: {c['detail']}" for name, c in failed]
    targets = [(s["name"], t) for s in report["sections"].values() for t in s["targets"]]
    if targets:
        lines += ["", "## Targets", "", "| section | target | measured | goal | met |", "| --- | --- | ---: | --- | --- |"]
        lines += [f"| {name} | {t['name']} | {t['value']:.3g} | {t['goal']} | {'yes' if t['met'] else 'NO'} |" for name, t in targets]
    broken = [s for s in report["sections"].values() if s["status"] not in ("passed", "failed", "not run")]
    for s in broken:
        lines += ["", f"## {s['name']}: {s['status']}", "", "```", s["log_tail"][-3000:], "```"]
    lines += ["", f"Exit code: {report.get('exit_code', '?')}", ""]
    return "\n".join(lines)


# ---- running the sections --------------------------------------------------------------------

def run_section(name: str, deadline_s: float, out: Path, quick: bool) -> dict:
    """Run one section in a child process with a deadline; its result, or what broke it. Its
    output goes to ``out/<name>.log``; its result passes through a temporary file."""
    part = Path(tempfile.mkdtemp(prefix="gpu_check_")) / f"{name}.json"
    log = out / f"{name}.log"
    cmd = worker("benchmarks.gpu.check", "--section-worker", name, "--part", part, "--out", out)
    if quick:
        cmd.append("--quick")
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=deadline_s, cwd=ROOT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    result = json.loads(part.read_text()) if part.exists() else new_section(name)
    result["seconds"] = time.monotonic() - t0
    result["log_tail"] = log.read_text(errors="replace")[-6000:]
    if code is None:
        result["status"] = f"timeout after {deadline_s:.0f} s"
    elif not part.exists() or result["status"] == "not run":
        result["status"] = f"crashed (exit code {code})"
    return result


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    missing = missing_prerequisites({"torch": PREREQUISITES["torch"]})
    if missing:
        print(f"gpu-check: {missing['torch']}", file=sys.stderr)
        return EXIT_MISSING
    import torch

    if args.dry_run_cpu:
        os.environ.update(BAGUA_GPU_CHECK_DEVICE="cpu", TRITON_INTERPRET="1")
    elif not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check. "
              "Run it on a machine with one (see docs and the device README).", file=sys.stderr)  # fmt: skip
        return EXIT_NO_GPU
    missing = missing_prerequisites()
    if missing:
        print("gpu-check: missing prerequisites:\n" + "\n".join(f"  {k}: {v}" for k, v in missing.items()), file=sys.stderr)
        return EXIT_MISSING
    report = {"started": started, "environment": environment(), "arguments": vars(args),
              "sections": {name: new_section(name) for name in args.sections}}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + args.budget_s
    for name in args.sections:
        left = t_end - time.monotonic()
        if left < 10:
            report["sections"][name]["status"] = "skipped: the run's time budget is spent"
            continue
        print(f"gpu-check: {name} (deadline {min(SECTIONS[name], left):.0f} s)", flush=True)
        report["sections"][name] = result = run_section(name, min(SECTIONS[name], left), out, args.quick)
        print(f"gpu-check: {name}: {result['status']} in {result['seconds']:.0f} s, "
              f"{sum(c['passed'] for c in result['checks'])}/{len(result['checks'])} checks passed", flush=True)
        report["exit_code"] = EXIT_FAILED if any(map(section_failed, report["sections"].values())) else EXIT_OK
        write_report(out, report)
    report["exit_code"] = EXIT_FAILED if any(map(section_failed, report["sections"].values())) else EXIT_OK
    write_report(out, report)
    print(summary_markdown(report))
    return report["exit_code"]


def run_worker(args: argparse.Namespace) -> int:
    """Inside the child: run one section and write its result to ``--part``."""
    from benchmarks.gpu import check_sections

    section = new_section(args.section_worker)
    part = Path(args.part)

    def save() -> None:  # what is done so far survives a crash later in the section
        part.write_text(json.dumps(section, default=str))

    try:
        getattr(check_sections, args.section_worker)(section, Path(args.out), args.quick, save)
        section["status"] = "failed" if any(not c["passed"] for c in section["checks"]) else "passed"
    except Exception as e:
        import traceback

        traceback.print_exc()
        section["status"] = f"error: {type(e).__name__}: {e}"
    save()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_worker(args) if args.section_worker else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
