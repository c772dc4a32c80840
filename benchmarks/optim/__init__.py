"""``bagua.optim``: the fused optimizer step against torch's optimizers.

- ``fused``: ``fuse_step`` against the unfused, foreach and fused torch optimizers (CPU; GPU when
  present)

Example (from the repository root)::

    python -m benchmarks.optim.fused --section cpu
"""
