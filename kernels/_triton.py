"""Triton plumbing shared by every kernel module (the codec and the optimizers): the optional
import, whether the CPU interpreter is on, and making a tensor's CUDA device current.

Private to ``bagua.kernels``. Example::

    from ._triton import HAS_TRITON, device_guard
    with device_guard(x):
        kernel[grid](x, ...)
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional (the ``gpu`` extra): the CPU paths work without it.
    import triton
    import triton.language as tl
except ImportError as _err:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: ImportError | None = _err
else:
    TRITON_IMPORT_ERROR = None

HAS_TRITON = triton is not None


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class device_guard:
    """Makes t's CUDA device current for a launch (a no-op for CPU tensors / the interpreter)."""

    def __init__(self, t: torch.Tensor):
        self._ctx = torch.cuda.device(t.device) if t.is_cuda else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            return self._ctx.__exit__(*exc)
        return False
