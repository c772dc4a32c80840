"""``python -m benchmarks.performance``: write docs/performance.md and every figure of README.md and
docs/ from benchmarks/results/; ``--check`` writes nothing and names what is stale.

Example::

    python -m benchmarks.performance --check
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .generate import stale, write


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.performance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale figure")
    args = parser.parse_args(argv)
    problems = stale() if args.check else write()
    for line in problems:
        print(line)
    if problems and args.check:
        print(f"{len(problems)} stale: python -m benchmarks.performance rewrites its own; the others name their "
              "command")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
