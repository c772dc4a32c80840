"""The training step: ``bagua.DistributedDataParallel`` and its algorithms against torch DDP.

- ``ddp`` (and ``ddp_report``): step and epoch time of every algorithm, on loopback and emulated links
- ``timing``: the interleaved step timing that ``ddp``, ``compiled_overlap``, the tradeoff sweep
  and the compressed breakdown share
- ``wrapper_overhead``: the wrapper's host cost per parameter tensor, one rank
- ``compiled_overlap``: ``torch.compile`` with the graph split at the buckets or not
- ``autotune``: the autotuner against the exhaustive grid
- ``hf_trainer``, ``lightning_strategy``: the Hugging Face ``Trainer`` with bagua's hooks, and
  ``BaguaStrategy`` against Lightning's DDP

Example (from the repository root)::

    python -m benchmarks.step.ddp --parts loopback
"""
