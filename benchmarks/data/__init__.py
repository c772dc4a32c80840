"""``bagua.data``: the cached dataset and the load-balanced samplers.

- ``cache``: epoch time with and without the cache, hit throughput against the raw stores
- ``sampler``: straggler ratios, padding, scale, and a 2-rank training run
- ``lm_sampler``: the LM example's tokens/s with the load-balanced batch sampler against torch's

Example (from the repository root)::

    python -m benchmarks.data.cache --quick
"""
