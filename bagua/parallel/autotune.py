"""Autotuning: the wrapper searches its own system parameters while training runs.

``bagua.DistributedDataParallel(..., autotune=True)`` (or ``BAGUA_AUTOTUNE=1``) measures the
step time of a few configurations of what ``ddp.tunables()`` declares (bucket size, stripes,
the algorithm's own: none of them changes a result) during the first steps of training, then
keeps the best. In process, no service, no port:

- steps ``1..warmup_steps`` run untimed; then the configuration in use (the default) is the
  first trial, and optuna (ask/tell, in memory, seeded) proposes the next ones on rank 0;
- a trial is one settling step (new buffers, cold caches) and ``steps_per_trial`` timed steps;
  a step's time is the wall time from one training forward to the next on each rank, and the
  trial's score the median of its steps, the largest over ranks (the slowest rank sets the pace);
- at the step boundary where a trial ends, every rank learns the score (one small allreduce)
  and rank 0's next configuration (one broadcast), and applies it before the forward
  (``ddp.configure``); every rank therefore changes at the same step;
- a trial whose first timed step is ``cut_factor`` times slower than the best so far ends there;
  a configuration seen before is not measured again;
- tuning ends after ``max_trials`` trials, after ``patience`` trials without a better one, or when
  the space is exhausted: the best configuration stays for the rest of training, rank 0 shows one
  line and ``ddp.autotune_result`` holds it. ``BAGUA_AUTOTUNE_LOG=path`` writes every trial as
  CSV (rank 0);
- when the whole model fits in the smallest bucket size, every bucket size makes the same
  buckets: the bucket size is not searched, and with nothing else to tune the search is skipped
  with one line.

Rank 0's line is visible by default, as Lightning's rank-zero messages are: the logger
``bagua.parallel.autotune`` is at INFO, and its record goes to stderr when the program has not
configured logging. ``AutotuneConfig(quiet=True)`` logs it at DEBUG instead.

``AutotuneConfig(initial=result.config)`` applies a configuration found before and skips the
search; so does loading a checkpoint (``ddp.algorithm_state_dict()``, ``bagua.checkpoint``) that
holds one into a wrapper with autotuning on.

Example::

    ddp = bagua.DistributedDataParallel(model, [opt], "bytegrad", autotune=True)
    for step, (x, y) in enumerate(loader):
        ...
    print(ddp.autotune_result)   # AutotuneResult(config={'bucket_size_bytes': 4194304, ...}, ...)
"""

from __future__ import annotations

import csv
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from .. import comm
from .._install import install_hint
from ..algorithms.base import check_positive_int
from ..algorithms.tunable import Tunable
from . import bucketing

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)  # rank 0's one line shows by default (see the module docstring)

AUTOTUNE_ENV = "BAGUA_AUTOTUNE"
AUTOTUNE_LOG_ENV = "BAGUA_AUTOTUNE_LOG"
SAMPLERS = ("tpe", "gp", "random")


@dataclass(frozen=True)
class AutotuneConfig:
    """How the autotuner searches.

    Args:
        max_trials: configurations measured at most, the default included.
        steps_per_trial: timed steps per trial (after one settling step).
        warmup_steps: untimed steps before the first trial.
        patience: stop after this many trials in a row without a better one.
        cut_factor: a trial whose first timed step is this many times slower than the best
            so far ends there.
        space: ``{name: choices}`` to search fewer values or fewer parameters (default: all
            of ``ddp.tunables()`` with their own choices).
        initial: a configuration found before (``ddp.autotune_result.config``): applied at
            wrap time, no search, no optuna needed.
        sampler: optuna's ``"tpe"`` (default), ``"gp"`` (needs scipy) or ``"random"``.
        seed: the sampler's seed.
        quiet: rank 0's line about the result (or a skipped search) at DEBUG, not INFO.

    Example::

        AutotuneConfig(max_trials=8, space={"bucket_size_bytes": [2 << 20, 8 << 20, 32 << 20]})
    """

    max_trials: int = 12
    steps_per_trial: int = 3
    warmup_steps: int = 5
    patience: int = 6
    cut_factor: float = 3.0
    space: Optional[dict[str, tuple]] = None
    initial: Optional[dict[str, Any]] = None
    sampler: str = "tpe"
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        for name in ("max_trials", "steps_per_trial", "patience"):
            check_positive_int(f"AutotuneConfig.{name}", getattr(self, name))
        check_positive_int("AutotuneConfig.warmup_steps", self.warmup_steps, minimum=0)
        if not isinstance(self.cut_factor, (int, float)) or self.cut_factor <= 1:
            raise ValueError(f"AutotuneConfig.cut_factor must be a number > 1, got {self.cut_factor!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"AutotuneConfig.sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        for what in ("space", "initial"):
            value = getattr(self, what)
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"AutotuneConfig.{what} must be a dict, got {type(value).__name__}")


@dataclass(frozen=True)
class AutotuneResult:
    """What tuning found: ``config`` (give it back as ``AutotuneConfig(initial=config)``), its
    step time and the default's (seconds, median over the trial, slowest rank), the trials
    measured and the training step from which ``config`` ran."""

    config: dict[str, Any]
    step_time_s: float
    default_step_time_s: float
    trials: int
    applied_at_step: int

    @property
    def speedup(self) -> float:
        """Default step time / tuned step time."""
        return self.default_step_time_s / self.step_time_s

    def describe(self) -> str:
        """One readable line."""
        return (f"bagua autotune: {_describe(self.config)}: {self.step_time_s * 1e3:.1f} ms/step vs {self.default_step_time_s * 1e3:.1f} "
                f"ms with the default ({self.speedup:.2f}x), {self.trials} trials, in use from step {self.applied_at_step}")


def resolve_autotune(autotune: Union[None, bool, AutotuneConfig]) -> Optional[AutotuneConfig]:
    """The wrapper's ``autotune=`` argument (None: ``BAGUA_AUTOTUNE``) as a config, or None (off)."""
    if autotune is None:
        value = os.environ.get(AUTOTUNE_ENV, "0").strip().lower()
        if value not in ("", "0", "1", "false", "true"):
            raise ValueError(f"environment variable {AUTOTUNE_ENV} must be 0 or 1, got {value!r}")
        autotune = value in ("1", "true")
    if autotune is False:
        return None
    if autotune is True:
        return AutotuneConfig()
    if isinstance(autotune, AutotuneConfig):
        return autotune
    raise TypeError(f"autotune must be True, False or a bagua.AutotuneConfig, got {type(autotune).__name__}")


class Tuner:
    """Runs the search for one wrapper; ``on_step_begin`` is called at every training step."""

    def __init__(self, ddp: "DistributedDataParallel", config: AutotuneConfig):
        self.config = config
        tunables = bucketing.tunables(ddp)
        self.space = _search_space(tunables, config.space)
        self.default = {name: t.current for name, t in self.space.items()}
        self.log: list[dict[str, Any]] = []  #: every trial, identical on every rank
        self.result: Optional[AutotuneResult] = None
        self._src = ddp.comm_group.ranks[0]
        self._study = None
        if config.initial is not None:
            unknown = sorted(set(config.initial) - set(tunables))
            if unknown:
                raise ValueError(f"AutotuneConfig.initial: {unknown} not tunable here; tunable: {sorted(tunables)}")
            self._take(ddp, dict(config.initial))
            return
        if not self.space:
            raise ValueError(
                f"autotune: nothing to tune for {ddp.algorithm!r} (its tunables() declare no system parameter "
                f"that leaves its results unchanged); leave autotune off"
            )
        smallest = _smallest_bucket_holding_the_model(ddp, self.space)
        self.space = _distinct(ddp, self.space)
        if not self.space:
            self.result = AutotuneResult(dict(self.default), float("nan"), float("nan"), 0, ddp.step)
            self._show(ddp, f"bagua autotune: skipped: the whole model ({_model_bytes(ddp)} bytes) fits in the "
                            f"smallest bucket size tried ({_readable('bucket_size_bytes', smallest)}), so every "
                            f"configuration is the same; keeping {_describe(self.default)}")
            return
        optuna = _import_optuna()
        if ddp.comm_group.rank == 0:
            self._study = _new_study(optuna, config)
        self._measured: dict[tuple, float] = {}
        self._trial: Optional[dict[str, Any]] = None  # the configuration being measured
        self._optuna_trial = None
        self._times: list[float] = []
        self._steps_in_trial = 0
        self._last_begin: Optional[float] = None
        self._best: Optional[tuple[float, dict[str, Any]]] = None
        self._since_best = 0
        self._csv = os.environ.get(AUTOTUNE_LOG_ENV) if ddp.comm_group.rank == 0 else None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def on_step_begin(self, ddp: "DistributedDataParallel") -> None:
        """Called before every training forward (``ddp.step`` steps done so far)."""
        if self.finished:
            return
        now = time.perf_counter()
        previous, self._last_begin = self._last_begin, now
        if ddp.step < self.config.warmup_steps:
            return
        if self._trial is None:
            self._begin_search(ddp)
            return
        self._steps_in_trial += 1
        if self._steps_in_trial == 1:
            return  # the settling step just ended
        self._times.append(now - previous)
        if len(self._times) == 1 and self._best is not None:
            first = self._slowest(ddp, self._times[0])
            if first > self.config.cut_factor * self._best[0]:
                self._end_trial(ddp, first, "cut")
                return
        if len(self._times) == self.config.steps_per_trial:
            self._end_trial(ddp, self._slowest(ddp, statistics.median(self._times)), "complete")

    def _begin_search(self, ddp: "DistributedDataParallel") -> None:
        """The first trial: the configuration in use. The space is read again now (a
        communication hook registered after wrapping leaves fewer tunables)."""
        self.space = _search_space(bucketing.tunables(ddp), self.config.space)
        self.default = {name: t.current for name, t in self.space.items()}
        self.space = _distinct(ddp, self.space)
        if not self.space:
            logger.warning("autotune: nothing left to tune for %r (a communication hook owns the buckets)", ddp.algorithm)
            self.result = AutotuneResult({}, float("nan"), float("nan"), 0, ddp.step)
            return
        if self._csv:
            _write_csv_row(self._csv, ["trial", "first_step", *self.space, "step_time_s", "outcome"], "w")
        self._start(ddp, dict(self.default), None)

    def adopt(self, ddp: "DistributedDataParallel", settings: dict[str, Any]) -> None:
        """A configuration tuned before (a checkpoint's): apply what of it is tunable here and
        end the search, on every rank."""
        tunable = bucketing.tunables(ddp)
        usable = {name: value for name, value in settings.items() if name in tunable}
        if len(usable) < len(settings):
            logger.warning("autotune: the checkpoint's %s are not tunable here; tuned before: %s",
                           sorted(set(settings) - set(usable)), settings)
        self._take(ddp, usable)

    def _take(self, ddp: "DistributedDataParallel", settings: dict[str, Any]) -> None:
        """Apply a configuration found before and end the search (nothing measured)."""
        ddp.configure(**settings)
        self._trial = None
        self.result = AutotuneResult(settings, float("nan"), float("nan"), 0, ddp.step)

    def stop(self, ddp: "DistributedDataParallel") -> None:
        """End tuning now on every rank (e.g. ``join()`` begins): the best so far stays."""
        if not self.finished:
            self._finish(ddp)

    # --- trials ----------------------------------------------------------------------------------
    def _slowest(self, ddp: "DistributedDataParallel", seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        comm.allreduce(value, op=comm.ReduceOp.MAX, group=ddp.comm_group)
        return float(value.item())

    def _start(self, ddp: "DistributedDataParallel", settings: dict[str, Any], optuna_trial: Any) -> None:
        self._trial, self._optuna_trial = settings, optuna_trial
        self._times, self._steps_in_trial = [], 0
        self.log.append({"trial": len(self.log), "step": ddp.step, "config": dict(settings)})
        ddp.configure(**settings)

    def _end_trial(self, ddp: "DistributedDataParallel", score: float, outcome: str) -> None:
        entry = self.log[-1]
        entry.update(step_time_s=score, outcome=outcome)
        self._record(entry)
        self._measured[_key(self._trial)] = score
        if self._study is not None and self._optuna_trial is not None:
            self._study.tell(self._optuna_trial, score)
        if self._best is None or score < self._best[0]:
            self._best, self._since_best = (score, dict(self._trial)), 0
        else:
            self._since_best += 1
        if len(self.log) >= self.config.max_trials or self._since_best >= self.config.patience:
            self._finish(ddp)
            return
        settings, optuna_trial = self._propose() if self._study is not None else (None, None)
        settings = comm.broadcast_object(settings, src=self._src, group=ddp.comm_group)
        if settings is None:  # the space is exhausted
            self._finish(ddp)
            return
        self._start(ddp, settings, optuna_trial)

    def _propose(self) -> tuple[Optional[dict[str, Any]], Any]:
        """Rank 0: the sampler's next configuration not measured yet, and its optuna trial
        (None, None: none left)."""
        distributions = _distributions(self.space)
        for _ in range(200):
            trial = self._study.ask(distributions)
            settings = {name: _decode(self.space[name], trial.params[name]) for name in self.space}
            seen = self._measured.get(_key(settings))
            if seen is None:
                return settings, trial
            self._study.tell(trial, seen)  # the sampler learns it again; nothing is measured
        return None, None

    def _finish(self, ddp: "DistributedDataParallel") -> None:
        if self._best is None:  # stopped before the default was measured: nothing to compare
            self.result = AutotuneResult(dict(self.default), float("nan"), float("nan"), 0, ddp.step)
            ddp.configure(**self.default)
            return
        score, best = self._best
        default_time = self._measured.get(_key(self.default), float("nan"))
        ddp.configure(**best)
        self.result = AutotuneResult(best, score, default_time, len(self.log), ddp.step + 1)
        self._trial = None
        self._show(ddp, self.result.describe())

    def _show(self, ddp: "DistributedDataParallel", line: str) -> None:
        """Rank 0's one line: INFO (DEBUG when quiet) on this module's logger, and on stderr when
        the program has configured no logging handler (as Lightning shows its rank-zero messages)."""
        if ddp.comm_group.rank != 0:
            return
        level = logging.DEBUG if self.config.quiet else logging.INFO
        if logger.hasHandlers():
            logger.log(level, line)
        elif logger.isEnabledFor(level):
            logging.StreamHandler().handle(logger.makeRecord(logger.name, level, __file__, 0, line, None, None))

    def _record(self, entry: dict[str, Any]) -> None:
        if self._csv:
            row = [entry["trial"], entry["step"], *(entry["config"][name] for name in self.space),
                   f"{entry['step_time_s']:.6f}", entry["outcome"]]
            _write_csv_row(self._csv, row, "a")


def _search_space(tunables: dict[str, Tunable], restrict: Optional[dict[str, tuple]]) -> dict[str, Tunable]:
    """The tunables to search: all, or the ``restrict`` ones with the given choices."""
    if restrict is None:
        return {name: t for name, t in tunables.items() if len(t.choices) > 1 or t.current not in t.choices}
    unknown = sorted(set(restrict) - set(tunables))
    if unknown:
        raise ValueError(f"AutotuneConfig.space: {unknown} not tunable here; tunable: {sorted(tunables)}")
    space = {}
    for name, choices in restrict.items():
        choices = tuple(choices)
        if name != "bucket_size_bytes" and not all(tunables[name].allows(c) for c in choices):
            raise ValueError(f"AutotuneConfig.space[{name!r}]: choose among {list(tunables[name].choices)}, got {list(choices)}")
        space[name] = Tunable(choices, tunables[name].current)
    return space


def _ordered(t: Tunable) -> bool:
    return all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in t.choices)


def _distributions(space: dict[str, Tunable]) -> dict[str, Any]:
    """optuna distributions: an ordered tunable searches the index of its choice (neighbours
    are close), any other one its choices as categories."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    return {name: IntDistribution(0, len(t.choices) - 1) if _ordered(t) else CategoricalDistribution(t.choices)
            for name, t in space.items()}


def _decode(t: Tunable, param: Any) -> Any:
    return t.choices[param] if _ordered(t) else param


def _key(settings: dict[str, Any]) -> tuple:
    return tuple(sorted(settings.items()))


def _import_optuna():
    try:
        import optuna
    except ImportError:
        raise ImportError(
            f"autotune=True searches with optuna, which is not installed: {install_hint('autotune')} "
            "(or pass AutotuneConfig(initial=...) with a configuration found before)"
        ) from None
    return optuna


def _new_study(optuna, config: AutotuneConfig):
    startup = max(2, config.max_trials // 3)
    if config.sampler == "tpe":
        sampler = optuna.samplers.TPESampler(seed=config.seed, n_startup_trials=startup, multivariate=True)
    elif config.sampler == "gp":
        sampler = optuna.samplers.GPSampler(seed=config.seed, n_startup_trials=startup)
    else:
        sampler = optuna.samplers.RandomSampler(seed=config.seed)
    for name in ("optuna.storages._in_memory", "optuna.study._tell"):  # one line at the end, not one per trial
        logging.getLogger(name).setLevel(logging.WARNING)
    return optuna.create_study(direction="minimize", sampler=sampler)


def _write_csv_row(path: str, row: list, mode: str) -> None:
    with open(path, mode, newline="") as f:
        csv.writer(f).writerow(row)


def _smallest_bucket_holding_the_model(ddp: "DistributedDataParallel", space: dict[str, Tunable]) -> Optional[int]:
    """The smallest bucket size ``space`` tries when the whole model fits in it, else None."""
    sizes = space.get("bucket_size_bytes")
    smallest = min(*sizes.choices, sizes.current) if sizes is not None else None
    return smallest if smallest is not None and _model_bytes(ddp) <= smallest else None


def _distinct(ddp: "DistributedDataParallel", space: dict[str, Tunable]) -> dict[str, Tunable]:
    """``space`` without the bucket size when the whole model fits in the smallest one tried:
    every size then makes the same buckets, and its trials would measure noise."""
    if _smallest_bucket_holding_the_model(ddp, space) is None:
        return space
    return {name: t for name, t in space.items() if name != "bucket_size_bytes"}


def _model_bytes(ddp: "DistributedDataParallel") -> int:
    """What the buckets hold: every tensor the algorithm communicates."""
    return sum(b.flat.numel() * b.flat.element_size() for b in ddp.buckets)


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_readable(k, v)}" for k, v in settings.items())


def _readable(name: str, value: Any) -> str:
    if name == "bucket_size_bytes" and isinstance(value, int) and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


__all__ = ["AutotuneConfig", "AutotuneResult", "resolve_autotune"]
