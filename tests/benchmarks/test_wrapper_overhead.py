"""benchmarks/step/wrapper_overhead.py: the ratio it reports and the floor it times."""

from __future__ import annotations

import math

import pytest

from benchmarks.step import wrapper_overhead


def test_the_extra_per_tensor_and_the_ratio_are_over_the_bare_model():
    phases = {"plain": {"zero_grad": 10.0, "forward": 100.0, "backward": 200.0, "step": 50.0},
              "torch": {"zero_grad": 10.0, "forward": 110.0, "backward": 290.0, "step": 50.0},
              "bagua": {"zero_grad": 5.0, "forward": 105.0, "backward": 250.0, "step": 50.0}}
    extra = wrapper_overhead.extra_per_tensor(phases, 10)
    assert extra["torch"] == pytest.approx(10.0) and extra["bagua"] == pytest.approx(5.0)
    assert extra["ratio"] == pytest.approx(0.5)


def test_the_variants_take_turns_of_a_block_of_steps_each():
    assert list(wrapper_overhead.in_turns("ab", 3, 2, 0)) == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("b", 2)]
    assert list(wrapper_overhead.in_turns("ab", 1, 1, 1)) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_the_floor_times_every_way_against_a_plain_backward():
    floors = wrapper_overhead.floor(tensors=8, steps=4, block=2, warmup=1)
    assert set(floors) == set(wrapper_overhead.FLOOR_WAYS)
    assert all(math.isfinite(us) for us in floors.values())
