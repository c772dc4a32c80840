"""benchmarks/machines.py's report: epochs from a job's rows, the ratio to torch DDP, the model's
error per variant and the targets' verdicts; machines_prediction.py: the model's points."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import machines  # noqa: E402
import machines_prediction  # noqa: E402


def _job(step_s: dict[str, float]) -> dict:
    return {"reps": 2, "block": 2, "elapsed_s": 60.0,
            "variants": {name: {"epoch_s": s * 4} for name, s in step_s.items()}}  # 4 timed steps each


def test_the_report_compares_with_the_model_and_judges_the_targets():
    steps = {"ddp": 2.0, "bytegrad": 1.0, "bytegrad-hier": 0.5}
    prediction = {"points": {"4x2-100mbit": {"variants": {
        "ddp": {"epoch_s": 200.0}, "bytegrad": {"epoch_s": 100.0}, "bytegrad-hier": {"epoch_s": 40.0}}}}}
    results = {"points": {"4x2-100mbit": {"date": "2026-11-29 00:00", "job": _job(steps)}}}
    lines, key = machines.report(results, prediction)
    assert machines.epochs(results["points"]["4x2-100mbit"]["job"])["ddp"] == pytest.approx(200.0)
    assert key["bytegrad_flat_over_hier"]["4x2-100mbit"] == pytest.approx(2.0) and key["hier_target_met"]
    assert key["worst_model_error"] == pytest.approx(-0.2) and key["worst_model_point"] == "bytegrad-hier at 4x2-100mbit"
    assert key["model_within_25pct"] and key["hier_never_slower"]
    steps["bytegrad-hier"] = 1.1  # hierarchical 10% slower than flat: both targets fail
    results["points"]["4x2-100mbit"]["job"] = _job(steps)
    _, key = machines.report(results, prediction)
    assert not key["hier_target_met"] and not key["hier_never_slower"] and not key["model_within_25pct"]


def test_the_prediction_covers_every_point_and_variant():
    import json

    here = Path(machines_prediction.__file__).parent / "results"
    fit, sweep = (json.loads((here / name).read_text()) for name in ("tradeoff_model.json", "tradeoff.json"))
    points = machines_prediction.predictions(fit, sweep)
    assert set(points) == {"4x2-100mbit", "4x2-1gbit-5ms", "8x2-100mbit", "8x2-1gbit-5ms"}
    for point in points.values():
        assert set(point["variants"]) == {name for name, _, _ in machines_prediction.VARIANTS}
        # hierarchically a machine sends its share once: half the flat compressed allreduce's bytes or less
        rows = point["variants"]
        assert rows["bytegrad-hier"]["bytes_per_step"] <= rows["bytegrad"]["bytes_per_step"] / 2 + 1
    assert points["8x2-100mbit"]["compute_scale"] > points["4x2-100mbit"]["compute_scale"] > 1
