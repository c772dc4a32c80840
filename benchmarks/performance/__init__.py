"""docs/performance.md and every performance figure in README.md and docs/, from benchmarks/results/.

Each figure is one entry of the registry (``registry.FIGURES``, written by area in ``areas/``):
the results file it is computed from, how (a function of the file's parsed content: a dict for
``.json``, the text for ``.md``), how it is written, the area of the page it belongs to and the
claim it supports. Its date, machine and command come from the results file where the file
records them, else from ``registry.RECORDED`` (one entry per results file, which also names the
section of ``benchmarks/RESULTS.md`` that holds the file's history and reasoning).

The generator (``generate``, its markdown in ``markdown``) writes:

- ``docs/performance.md``, whole (never edit it by hand);
- every generated block ``<!-- BEGIN GENERATED: NAME (python -m benchmarks.performance; do not
  edit) -->`` ... ``<!-- END GENERATED: NAME -->`` in README.md and docs/*.md (``markdown.BLOCKS``:
  the README's ``headline``);
- every inline figure ``<!--fig:NAME-->VALUE<!--/fig-->`` there (VALUE rewritten from the registry);
- ``docs/figures/``: a copy of each plot of ``benchmarks/figures/`` that a page of docs/ links as
  ``figures/NAME.png`` (the site is built from docs/ alone).

``--check`` writes nothing and exits 1 naming every stale figure, block and plot copy, and every
generated block of the other generators (``python -m benchmarks.tradeoff.sweep --report``,
``python -m benchmarks.accuracy.time_to_accuracy --report``) that no longer matches their output.

    python -m benchmarks.performance            # write
    python -m benchmarks.performance --check    # compare (tests/docs/test_figures.py runs it)

Adding a figure is one entry in its area's module (``areas/machines.py`` here), e.g.::

    fig("hier_flat_4x4", "machines_heldout.json",
        lambda r: r["key"]["bytegrad_flat_over_hier"]["4x4-100mbit"], "{:.2f}x",
        claim="hierarchical bytegrad against flat", setting="4 machines x 4 ranks, 100 Mbit/s")

and then ``<!--fig:hier_flat_4x4-->1.96x<!--/fig-->`` may stand anywhere in README.md or docs/.
"""

from .generate import expected, stale, write
from .markdown import BLOCK_RE, FIG_RE
from .registry import FIGURES, NOT_SHOWN, RECORDED
from .results import Results

__all__ = ["BLOCK_RE", "FIGURES", "FIG_RE", "NOT_SHOWN", "RECORDED", "Results", "expected", "stale", "write"]
