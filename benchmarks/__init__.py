"""Bagua's benchmarks, by area; each runs from the repository root as ``python -m benchmarks.<area>.<name>``.

- ``comm``: collectives; ``step``: the training step and the algorithms; ``tradeoff``: the
  bandwidth x latency sweep and the cost model; ``accuracy``: time to accuracy; ``scale``: many
  ranks, elastic; ``data``: cache and samplers; ``optim``: the fused optimizer; ``gpu``:
  ``make gpu-check``
- ``network``: the emulated network (``python -m benchmarks.network.netns``); ``jobs``: how every
  driver starts its rank jobs; ``records``: where runs are recorded (``results/``, ``figures/``)
- ``smoke``: every benchmark at its smallest (``make bench-smoke``); ``performance``:
  docs/performance.md from ``results/`` (``python -m benchmarks.performance``)

Example::

    python -m benchmarks.step.ddp --parts loopback
"""
