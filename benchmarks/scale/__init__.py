"""Many ranks, and ranks that come and go.

- ``check``: every algorithm correct at 16 and 32 ranks (machines of several ranks, on loopback)
- ``elastic``: restarts under torchrun, agents leaving and joining a c10d job, checkpoint cost

Example (from the repository root)::

    python -m benchmarks.scale.check --layouts 2x2 --steps 2
"""
