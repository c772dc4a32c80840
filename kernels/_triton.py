"""Triton plumbing shared by every kernel module (the codecs and the optimizers): the optional
import, whether the CPU interpreter is on, making a tensor's CUDA device current, the clear error
when a Triton path cannot run, the launch plan over a flat buffer (full blocks unmasked, the tail
masked) and the round-to-nearest-even store.

Private to ``bagua.kernels``. Example::

    from ._triton import device_guard, launches, require_triton
    require_triton(x, "encode_triton")
    with device_guard(x):
        for grid, first, masked in launches(x.numel(), 1024):
            kernel[(grid,)](x[first:], ..., MASKED=masked)
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

from .._install import install_hint

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


def require_triton(t: object, fn: str) -> None:
    """A clear error when the Triton function ``fn`` cannot run on ``t``: Triton is missing, or
    ``t`` is a CPU tensor and the interpreter is off."""
    if triton is None:
        raise RuntimeError(
            f"{fn} needs Triton, which is not importable ({TRITON_IMPORT_ERROR}); install the gpu "
            f"extra ({install_hint('gpu')}) or use the torch reference ({fn.replace('triton', 'reference')})"
        )
    if isinstance(t, torch.Tensor) and not t.is_cuda and not triton_interpreting():
        raise ValueError(
            f"{fn} runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got a tensor on "
            f"{t.device}; call the dispatching function, which sends CPU tensors to the torch reference"
        )


def launches(numel: int, block: int) -> Iterator[tuple[int, int, bool]]:
    """(grid, first element, MASKED): the full blocks unmasked (vectorized whatever numel is),
    then the partial tail block masked."""
    nfull, tail = divmod(numel, block)
    if nfull:
        yield nfull, 0, False
    if tail:
        yield 1, nfull * block, True


def row_launches(numel: int, block: int, rows: int) -> Iterator[tuple[int, int, bool, int]]:
    """(grid, first element, MASKED, ROWS) for kernels whose programs take ``ROWS`` whole blocks:
    the full blocks ``rows`` to a program, the few left over one to a program, then the partial
    tail block masked, alone. None of the programs needs a row mask.

    Example::

        list(row_launches(10 * 256 + 5, 256, 4))   # [(2, 0, False, 4), (2, 2048, False, 1), (1, 2560, True, 1)]
    """
    for grid, first, masked in launches(numel, block):
        if masked or rows == 1:
            yield grid, first, masked, 1
            continue
        grouped = grid // rows
        if grouped:
            yield grouped, first, False, rows
        if grid % rows:
            yield grid % rows, first + grouped * rows * block, False, 1


if triton is not None:

    @triton.jit
    def store_rne(ptrs, x, mask, MASKED: tl.constexpr):
        """Stores float32 x at ptrs, converting to the pointee type with round to nearest even
        (Triton's interpreter truncates float32 -> bfloat16; this matches torch on every path)."""
        if ptrs.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            bits = tl.where(x != x, 0x7FC0, bits)
            y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(ptrs.dtype.element_ty)
        if MASKED:
            tl.store(ptrs, y, mask=mask)
        else:
            tl.store(ptrs, y)
else:  # pragma: no cover
    store_rne = None
