"""Speed that costs accuracy is not speed: each algorithm's steps and time to torch DDP's loss.

- ``time_to_accuracy``: the LM of ``examples/train_lm.py`` trained by every algorithm, curves on
  loopback and step times on emulated links; writes docs/convergence.md's tables and
  ``bagua/measured_accuracy.py``

Example (from the repository root)::

    python -m benchmarks.accuracy.time_to_accuracy --report
"""
