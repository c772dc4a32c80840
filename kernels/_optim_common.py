"""Shared plumbing of the single-pass optimizer kernels (adam, sgd, lion): the Triton names and
launch helpers (from ``_triton``, at the optimizers' block size), the argument checks, the float32
loads and the cache-sized chunking of the torch references.

Private to ``bagua.kernels``; see :mod:`bagua.kernels.adam` for the public shape of a kernel.
"""

from __future__ import annotations

from typing import Iterator

import torch

from . import _triton
from ._triton import (  # noqa: F401
    HAS_TRITON, TRITON_IMPORT_ERROR, device_guard, require_triton, store_rne, tl, triton, triton_interpreting,
)

BLOCK_SIZE = 2048  # elements per program: 16 per thread at 4 warps, 128-bit vector accesses
NUM_WARPS = 4
REF_CHUNK_ELEMS = 1 << 16  # reference: 256 KiB of fp32 per operand, the working set stays in L2
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensors(fn: str, named: dict[str, torch.Tensor | None]) -> int:
    """Same numel, device, contiguity and a float dtype for every given tensor; returns numel."""
    numel = device = None
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{fn}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous, got strides {tuple(t.stride())}")
        if t.is_sparse:
            raise ValueError(f"{fn}: {name} is sparse; the kernels update dense tensors only")
        if numel is None:
            numel, device = t.numel(), t.device
        elif t.numel() != numel or t.device != device:
            raise ValueError(
                f"{fn}: {name} has {t.numel()} elements on {t.device}, expected {numel} on {device} "
                f"(all tensors of one update must match)"
            )
    return int(numel or 0)


def launches(numel: int, block: int = BLOCK_SIZE) -> Iterator[tuple[int, int, bool]]:
    """``_triton.launches`` at the optimizers' block size."""
    return _triton.launches(numel, block)


def ref_chunks(numel: int, chunk: int | None = None) -> Iterator[slice]:
    """Cache-sized slices covering [0, numel): each multi-pass reference op then re-reads data
    that is still in cache instead of streaming the whole buffer from memory once per op."""
    step = chunk or REF_CHUNK_ELEMS
    for s in range(0, numel, step):
        yield slice(s, min(numel, s + step))


def as_f32(t: torch.Tensor) -> torch.Tensor:
    """t itself when float32 (then updated in place), else a float32 copy."""
    return t if t.dtype == torch.float32 else t.float()


def write_back(dst: torch.Tensor, val: torch.Tensor) -> None:
    """Stores the float32 result into dst (rounded to nearest even) unless it already is dst."""
    if val.data_ptr() != dst.data_ptr() or val.dtype != dst.dtype:
        dst.copy_(val)


if triton is not None:

    @triton.jit
    def load_f32(ptrs, mask, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        return tl.load(ptrs).to(tl.float32)
else:  # pragma: no cover
    load_f32 = None
