"""The plumbing of ``make gpu-check`` on CPU: arguments, the no-GPU exit, the prerequisite check,
the report writer, and one section run end to end through Triton's interpreter (--dry-run-cpu)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu import check as gpu_check
from benchmarks.jobs import ROOT

SCRIPT = [sys.executable, "-m", "benchmarks.gpu.check"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_without_a_gpu_it_exits_at_once_with_its_own_code(tmp_path):
    res = subprocess.run([*SCRIPT, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == gpu_check.EXIT_NO_GPU == 3
    assert "no CUDA GPU" in res.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--sections", "nonsense"], "invalid choice: 'nonsense'"),
    (["--budget-s", "0"], "--budget-s must be positive, got 0.0"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == gpu_check.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_defaults_run_every_section_into_out(monkeypatch):
    monkeypatch.setenv("OUT", "/somewhere")
    args = gpu_check.parse_args([])
    assert args.out == "/somewhere" and args.sections == list(gpu_check.SECTIONS)
    assert sum(gpu_check.SECTIONS.values()) <= 8 * 60, "the sections' deadlines must fit the 8-minute run"


def test_missing_prerequisites_are_each_named_with_the_fix():
    missing = gpu_check.missing_prerequisites({"json": "never", "no_such_module_for_gpu_check": "carry its wheel"})
    assert list(missing) == ["no_such_module_for_gpu_check"]
    assert "ModuleNotFoundError" in missing["no_such_module_for_gpu_check"]
    assert "Fix: carry its wheel" in missing["no_such_module_for_gpu_check"]
    assert set(gpu_check.PREREQUISITES) >= {"torch", "triton", "lmdb", "bagua.kernels"}


def test_report_names_failed_checks_missed_targets_and_broken_sections(tmp_path):
    ok, bad, broken = (gpu_check.new_section(n) for n in ("kernels", "speed", "wrapper"))
    ok["status"] = "passed"
    gpu_check.check(ok, "adam float32 n=1", True)
    bad["status"] = "failed"
    gpu_check.check(bad, "fused AdamW equals torch AdamW", False, "max |diff| 0.5")
    gpu_check.target(bad, "Adam share of copy", 0.42, ">= 0.90", False)
    gpu_check.measure(bad, "copy", 3.0, "TB/s")
    broken.update(status="timeout after 120 s", log_tail="Traceback: stuck in NCCL init")
    report = {"started": "now", "environment": {"device": "NVIDIA H100", "torch": "2.11"},
              "sections": {s["name"]: s for s in (ok, bad, broken)}, "exit_code": 1}
    gpu_check.write_report(tmp_path, report)
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["speed"]["targets"][0]["value"] == 0.42
    md = (tmp_path / "gpu_check.md").read_text()
    assert "NVIDIA H100" in md
    assert "- speed: fused AdamW equals torch AdamW: max |diff| 0.5" in md
    assert "| speed | Adam share of copy | 0.42 | >= 0.90 | NO |" in md
    assert "## wrapper: timeout after 120 s" in md and "stuck in NCCL init" in md
    assert [gpu_check.section_failed(s) for s in (ok, bad, broken)] == [False, True, True]


def test_a_section_runs_end_to_end_on_cpu_through_the_interpreter(tmp_path):
    res = subprocess.run([*SCRIPT, "--dry-run-cpu", "--sections", "kernels", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    kernels = report["sections"]["kernels"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert kernels["status"] == "passed"
    names = {c["name"] for c in kernels["checks"]}
    for family in ("adam float32", "adamw amsgrad bfloat16", "sgd nesterov float16", "lion float32", "minmax_uint8 decode bfloat16"):
        assert any(n.startswith(family) for n in names), family
    assert len(kernels["checks"]) > 100
