"""Where the benchmarks record their runs, and the numbers their reports share.

``RESULTS`` (``benchmarks/results/``) holds the results files that docs/performance.md is
generated from, ``FIGURES`` (``benchmarks/figures/``) the plots; ``save_run`` writes one run's
record as JSON; ``quantile`` and ``fmt_bytes`` are the reports' statistics and byte counts.

Example::

    save_run(".bench/comm.json", 240.0, [], {"uint8_speedup": 3.6}, jobs=jobs)
    fmt_bytes(16_500)                     # '16.5KB'
    quantile([1.0, 2.0, 3.0, 4.0], 0.25)  # 1.75
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
FIGURES = BENCHMARKS / "figures"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` with linear interpolation."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def fmt_bytes(n: Optional[float]) -> str:
    """``1.05MB``, ``16.5KB``, ``512B``; ``-`` for None."""
    if n is None:
        return "-"
    for unit, mult in (("MB", 1e6), ("KB", 1e3)):
        if n >= mult:
            return f"{n / mult:.3g}{unit}"
    return f"{n:.0f}B"


def save_run(path: str, elapsed: float, failed: Sequence[str], key: dict[str, Any], **results: Any) -> None:
    """Write one run's record (date, argv, time taken, failed jobs, key ratios, ``results``) as JSON.

    Example::

        save_run(".bench/comm.json", 240.0, [], {"uint8_speedup": 3.6}, jobs=jobs)
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "elapsed_s": elapsed,
              "failed": list(failed), "key": key, **results}
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")


def add_run_options(parser: argparse.ArgumentParser, timeout_s: float, plot: Path, rebuilt: str) -> None:
    """A driver's options that ``finish_run`` and its report read: ``--timeout`` per job, ``--out``,
    ``--plot`` (default ``plot``), ``--no-plot``, and ``--from-json`` (report saved runs again:
    ``rebuilt`` says what comes back from them).

    Example::

        add_run_options(p, 900.0, FIGURES / "comm_busbw.png", "tables and plot (rounds are pooled)")
    """
    parser.add_argument("--timeout", type=float, default=timeout_s, help=f"seconds per job (default {timeout_s:g})")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--plot", default=str(plot), help=f"plot path (default {plot.relative_to(BENCHMARKS.parent)})")
    parser.add_argument("--no-plot", action="store_true", help="don't write the plot")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                        help=f"don't run anything: rebuild {rebuilt} from --out files")


def finish_run(out: Optional[str], elapsed: float, failed: Sequence[str], key: dict[str, Any],
               plot: Optional[Callable[[Path], Any]] = None, plot_path: Optional[str] = None, **results: Any) -> int:
    """The end of a driver's report: name what failed, save the run's record (``out``), draw its plot
    (``plot(plot_path)``, where both are given); the exit status (1 when anything failed).

    Example::

        return finish_run(args.out, elapsed, failed, key, plot, args.plot, jobs=jobs)
    """
    if failed:
        print(f"\nFAILED or skipped: {', '.join(failed)}")
    if out:
        save_run(out, elapsed, failed, key, **results)
    if plot is not None and plot_path:
        plot(Path(plot_path))
        print(f"wrote {plot_path}")
    return 0 if not failed else 1
