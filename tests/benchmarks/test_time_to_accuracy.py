"""benchmarks/accuracy/time_to_accuracy.py: variant specs, the analysis of curves, and the figures that the
guide and ``bagua.advise`` show, which must be those of the results files."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.accuracy import time_to_accuracy as tta

ROOT = Path(__file__).resolve().parents[2]


def test_variants_take_options_and_bad_ones_are_named():
    assert tta.parse_variant("qadam[variance=frozen, bits=1]") == ("qadam", ["variance=frozen", "bits=1"])
    assert tta.parse_variant("torch-ddp-fp16") == ("torch-ddp-fp16", [])
    for bad, message in (("sgd", "a variant is one of"), ("qadam[frozen]", "options are KEY=VALUE")):
        with pytest.raises(ValueError, match=message):
            tta.parse_variant(bad)


def _curve(vals: list[float], every: int = 10, step_s: float = 1.0) -> list:
    return [(i * every, i * every * step_s, 0, 0.0, v) for i, v in enumerate(vals)]


def test_analysis_finds_steps_and_time_to_the_target_on_each_link():
    ddp = {"curve": _curve([5.0, 3.0, 2.5, 2.0]), "step_times": [1.0] * 30, "bytes_per_step": 8e6}
    fast = {"curve": _curve([5.0, 3.2, 2.6, 2.2, 2.0, 1.9]), "step_times": [0.5] * 50, "bytes_per_step": 2e6}
    never = {"curve": _curve([5.0, 3.5, 3.0, 2.9, 2.8, 2.7]), "step_times": [0.1] * 50, "bytes_per_step": 1e6}
    timed = {name: {"curve": _curve([5.0]), "step_times": [t] * 20} for name, t in
             (("torch-ddp", 4.0), ("bytegrad", 1.0), ("qadam", 0.5))}  # a slow link: the step times alone
    jobs = {tta.CURVES: {"torch-ddp": ddp, "bytegrad": fast, "qadam": never}, "100mbit": timed}
    result = tta.analyse(jobs, ["100mbit"], steps=30, warmup=0, timing=20)
    link = result["table"]["100mbit"]
    assert result["target"] == 2.0
    assert link["torch-ddp"]["reached"] == (30, 120.0)  # 30 steps of 4 s
    assert link["bytegrad"]["reached"] == (40, 40.0)  # 40 steps of 1 s: 3x sooner
    assert link["qadam"]["reached"] is None and link["qadam"]["final"] == 2.7
    assert result["table"][tta.CURVES]["bytegrad"]["val_at_steps"] == 2.2
    text, key = tta.report({**result, "ranks": 4, "lr": 3e-3, "date": "today"})
    assert key == pytest.approx(3.0)
    assert "| bytegrad | 2.00 | 1.000 | 40 | 1.33 | 40 | 3.00x | 2.2000 | +10.00% | 1.9000 |" in text
    assert f"not in {tta.LONGER}x" in text


def test_the_guide_and_the_advisers_figures_are_the_results_files():
    guide, module = tta.generated()
    assert guide.strip() in (ROOT / "docs" / "convergence.md").read_text()
    results = ROOT / "benchmarks" / "results" / "time_to_accuracy.json"
    assert module is not None and results.exists()
    assert module == (ROOT / "bagua" / "measured_accuracy.py").read_text()
    spec = importlib.util.spec_from_file_location("measured", ROOT / "bagua" / "measured_accuracy.py")
    measured = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measured)
    table = json.loads(results.read_text())["table"]
    assert measured.MEASURED["torch-ddp"] == {"steps_multiplier": 1.0, "loss_vs_ddp": 0.0}
    assert set(measured.MEASURED) >= {"torch-ddp", "qadam", "qadam-1bit", "bytegrad", "gradient_allreduce", "async"}
    assert len(measured.MEASURED) == len(table[tta.CURVES]) + len(tta.TIMED_ON_EVERY_LINK) + len(tta.EXACT_AS_DDP)


def _run_results(dec_vals: list[float], ddp_vals=(5.0, 3.0, 2.5, 2.0)) -> dict:
    curves = {"torch-ddp": {"curve": _curve(list(ddp_vals)), "step_times": [1.0] * 30},
              "decentralized": {"curve": _curve(dec_vals), "step_times": [1.0] * 50}}
    timed = {name: {"curve": _curve([5.0]), "step_times": [t] * 20} for name, t in (("torch-ddp", 2.0), ("decentralized", 1.0))}
    return {"run": "decay", "lr": 3e-3, "model_flags": ["x"], "ranks": 4, "elapsed_s": 1.0, "date": "today",
            "jobs": {tta.CURVES: curves, "100mbit": timed}}


def test_curves_of_a_second_run_of_the_same_settings_replace_the_first_runs(tmp_path, monkeypatch):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(_run_results([5.0, 3.5, 3.0, 2.9, 2.8, 2.7])))
    second.write_text(json.dumps(_run_results([5.0, 3.1, 2.6, 2.1, 2.0, 1.9])))
    saved = {}
    monkeypatch.setattr(tta, "results_path", lambda run, tag="": first)
    monkeypatch.setattr(tta, "save", lambda result, args: saved.update(result) or 0)
    monkeypatch.setitem(tta.RUNS, "decay", ([], 4, 30, 10, 20))  # DDP's 30 steps, as the curves above
    args = argparse.Namespace(run="decay", tag="")
    assert tta.replace_curves(args, second) == 0
    assert saved["table"]["100mbit"]["decentralized"]["reached"] == (40, 40.0)  # the second run's curve, this run's times
    assert saved["curves_replaced"]["variants"] == ["decentralized"]
    second.write_text(json.dumps(_run_results([5.0, 3.1, 2.6, 2.1, 2.0, 1.9], ddp_vals=(5.0, 3.0, 2.5, 2.01))))
    with pytest.raises(SystemExit, match="not the same run"):
        tta.replace_curves(args, second)
