"""benchmarks/tradeoff/machines.py's report: epochs from a job's rows, the ratio to torch DDP, the model's
error per variant and the targets' verdicts; machines_prediction.py: the model's points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.records import RESULTS
from benchmarks.tradeoff import machines, machines_prediction


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
    points = machines_prediction.predictions(recorded("tradeoff_model.json"), recorded("tradeoff.json"))
    assert set(points) == {"4x2-100mbit", "4x2-1gbit-5ms", "8x2-100mbit", "8x2-1gbit-5ms"}
    for point in points.values():
        assert set(point["variants"]) == {name for name, _, _ in machines_prediction.VARIANTS}
        # hierarchically a machine sends its share once: half the flat compressed allreduce's bytes or less
        rows = point["variants"]
        assert rows["bytegrad-hier"]["bytes_per_step"] <= rows["bytegrad"]["bytes_per_step"] / 2 + 1
    assert points["8x2-100mbit"]["compute_scale"] > points["4x2-100mbit"]["compute_scale"] > 1


def test_the_contention_fit_recovers_the_exponent_of_the_measured_compute():
    sweep = {"machine": {"cpus": 2, "load_start": 1.0}}
    fit = {"compute_s": {"torch-ddp": 0.1}}

    def measured(world: int, contention: float) -> dict:
        scale = machines_prediction.compute_scale(sweep, world, 4, contention=contention)
        job = _job({"local": 0.1 * scale}) | {"world": world}
        return {"date": "", "job": job}

    results = {"points": {f"{w}": measured(w, 1.3) for w in (8, 16)}}
    assert machines_prediction.fit_contention(results, fit, sweep) == pytest.approx(1.3)
    results = {"points": {"8": measured(8, 1.0)}}  # the cores shared at no cost: the linear model back
    assert machines_prediction.fit_contention(results, fit, sweep) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="machines.py"):
        machines_prediction.fit_contention({"points": {}}, fit, sweep)
    fit, sweep = recorded("tradeoff_model.json"), recorded("tradeoff.json")
    held_out = machines_prediction.predictions(fit, sweep, layouts=machines_prediction.HELD_OUT_LAYOUTS, contention=1.3)
    linear = machines_prediction.predictions(fit, sweep, layouts=machines_prediction.HELD_OUT_LAYOUTS)
    assert set(held_out) == {"6x2-100mbit", "6x2-1gbit-5ms", "4x4-100mbit", "4x4-1gbit-5ms"}
    assert held_out["4x4-100mbit"]["compute_scale"] > linear["4x4-100mbit"]["compute_scale"]


def test_the_comm_bound_report_sets_the_ratio_beside_the_ceiling_of_its_bytes():
    rows = {"ddp": 4.0, "bytegrad": 2.0, "bytegrad-hier": 1.0, "local": 0.2}
    job = _job(rows) | {"params": 12.7e6}
    job["variants"]["bytegrad"]["model_bytes_per_step"] = 30e6 / 8 * 1.0  # 0.3 s at 100 Mbit/s
    job["variants"]["bytegrad-hier"]["model_bytes_per_step"] = 15e6 / 8 * 1.0
    lines, key = machines.comm_bound_report({"points": {"4x2-100mbit": {"date": "", "job": job}}})
    point = key["4x2-100mbit"]
    assert point["bytegrad_flat_over_hier"] == pytest.approx(2.0) and point["target_met"]
    assert point["ceiling"] == pytest.approx((0.2 + 0.3) / (0.2 + 0.15))
    assert "the bytes allow 1.43x" in lines[-1]



def recorded(name: str) -> dict:
    """A results file as committed."""
    return json.loads((RESULTS / name).read_text())


def test_the_router_fit_recovers_a_known_cost_per_message_between_machines():
    """Step times made by the model with a known router cost on the 1 Gbit/s + 5 ms link (none on the
    other): the fit finds both."""
    fit, sweep = recorded("tradeoff_model.json"), recorded("tradeoff.json")
    truth = {"100mbit": 0.0, "1gbit-5ms": 3e-5}
    made = machines_prediction.predictions(fit, sweep, contention=1.3, router=truth)
    results = {"points": {k: {"date": "", "job": _job({n: r["step_s"] for n, r in p["variants"].items()})}
                          for k, p in made.items()}}
    found = machines_prediction.fit_router(results, fit, sweep, contention=1.3)
    assert found["1gbit-5ms"] == pytest.approx(3e-5, rel=0.01) and found["100mbit"] < 1e-7
    # what it adds grows with the ranks sharing the cores: 16 ranks' router is slower than 8 ranks'
    assert made["8x2-1gbit-5ms"]["router_message_s"] > made["4x2-1gbit-5ms"]["router_message_s"] > 3e-5


def test_each_set_of_shapes_names_its_own_files():
    layouts = [layouts for layouts, *_ in machines_prediction.SETS.values()]
    assert len({shape for shapes in layouts for shape in shapes}) == sum(len(shapes) for shapes in layouts)  # disjoint
    for _, *paths in machines_prediction.SETS.values():
        assert all(not Path(p).is_absolute() for p in paths)
    assert len({path for _, *paths in machines_prediction.SETS.values() for path in paths}) == 3 * len(layouts)
