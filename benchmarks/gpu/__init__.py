"""The GPU path, on a machine with a CUDA GPU.

- ``check`` (and ``check_sections``): ``make gpu-check``, every GPU check in one prepared run
- ``codec``: the Triton codecs' speed against copy bandwidth

Example (from the repository root)::

    python -m benchmarks.gpu.check --sections kernels speed --out /tmp/gc
"""
