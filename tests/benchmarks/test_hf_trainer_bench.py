"""benchmarks/step/hf_trainer.py's report: each hook's step time is the median of its jobs' medians after
the skipped steps, and the speed-up is the plain Trainer's over it, with the target's verdict."""

from __future__ import annotations

import pytest

from benchmarks.step import hf_trainer


def _record(first: float, rest: float, loss: float = 3.0) -> dict:
    return {"step_times": [first, first] + [rest] * 6, "final_train_loss": loss, "eval_loss": loss,
            "parameters": 12_700_000, "striped_calls": 40, "bagua_bytes_sent": 1000}


def test_the_ratio_is_of_medians_after_the_skipped_steps():
    runs = {"none": [_record(9.0, 4.0), _record(9.0, 5.0)], "bytegrad": [_record(3.0, 1.0), _record(3.0, 1.5)],
            "onebit_grad": [_record(3.0, 0.4)]}
    summary, lines = hf_trainer.summarize(runs, skip=2)
    assert summary["rows"]["none"]["step_s"] == pytest.approx(4.5)  # the median of 4.0 and 5.0: no 9.0
    assert summary["key"]["bytegrad_speedup"] == pytest.approx(4.5 / 1.25)
    assert summary["key"]["onebit_grad_speedup"] == pytest.approx(4.5 / 0.4)
    assert any("3.60x (target >=3x: met)" in line for line in lines)


def test_a_missed_target_says_so():
    summary, lines = hf_trainer.summarize({"none": [_record(2.0, 2.0)], "bytegrad": [_record(1.0, 1.0)]}, skip=2)
    assert summary["key"]["bytegrad_speedup"] == pytest.approx(2.0)
    assert any("NOT met" in line for line in lines)
