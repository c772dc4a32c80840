"""Tunable: a system parameter that the autotuner may set, declared by an algorithm or the wrapper.

A tunable is a short ordered list of values (``choices``) and the value in use (``current``).
Whatever an algorithm declares tunable must leave its results unchanged: only how fast the
bytes move may differ (bucket sizes, segment sizes, stripe counts). The autotuner
(``bagua.DistributedDataParallel(..., autotune=True)``) searches the product of the choices.

Example::

    Tunable(powers_of_two(1 << 16, 1 << 22), current=1 << 20)   # a segment size in elements
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tunable:
    """An ordered list of values the autotuner may choose from, and the one in use.

    Args:
        choices: the values, in order (numbers ascending; the tuner treats neighbours as close).
        current: the value in use now (need not be one of ``choices``: the default bucket size
            of 25 MiB is measured as it is, as the baseline).
    """

    choices: tuple[Any, ...]
    current: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not self.choices:
            raise ValueError("a Tunable needs at least one choice")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"a Tunable's choices must be distinct, got {self.choices}")

    def allows(self, value: Any) -> bool:
        """Whether ``value`` may be applied: one of the choices, or the value in use."""
        return value in self.choices or value == self.current


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """The powers of two from ``low`` to ``high`` (both powers of two), ascending.

    Example::

        powers_of_two(1 << 20, 1 << 22)    # (1048576, 2097152, 4194304)
    """
    if low < 1 or high < low or low & (low - 1) or high & (high - 1):
        raise ValueError(f"powers_of_two needs powers of two low <= high, got {low}, {high}")
    values, v = [], low
    while v <= high:
        values.append(v)
        v *= 2
    return tuple(values)


__all__ = ["Tunable", "powers_of_two"]
