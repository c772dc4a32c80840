"""The bandwidth x latency study and the cost model (``bagua.advise``) it fits.

- ``sweep``: every algorithm's epoch time on emulated links of many speeds and latencies
- ``fit``: the cost model fitted to the sweep, checked on held-out settings
- ``report``: the sweep's tables, figures and generated sections, from its results file
- ``machines_prediction``, ``machines``: the model's prediction for machines of several ranks,
  committed first, then measured

Example (from the repository root)::

    python -m benchmarks.tradeoff.sweep --report
"""
