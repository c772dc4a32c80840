"""MinMax-UInt8 codec: per-block float32 (min, max) header and one 8-bit code per element.

The same math three ways: Triton kernels (``encode_triton`` / ``decode_triton``), a plain-torch
reference (``encode_reference`` / ``decode_reference``, the production path on CPU), and the
dispatching ``encode`` / ``decode`` (Triton for CUDA tensors, the reference otherwise).

Wire layout for ``numel`` elements and block size ``B`` (``nb = ceil(numel / B)`` blocks), a 1-D
``torch.uint8`` tensor of ``8 * nb + numel`` bytes (see :func:`wire_numel`)::

    [ min_0, max_0, min_1, max_1, ..., min_{nb-1}, max_{nb-1} ]   nb pairs of float32 (8*nb bytes)
    [ code_0, code_1, ..., code_{numel-1} ]                       numel uint8 codes, element order

Quantization of a block, all in float32 (inputs may be float32, float16 or bfloat16)::

    inv   = 255 / (max - min)  if max > min else 0      (capped at FLT_MAX)
    code  = clamp(floor((x - min) * inv + 0.5), 0, 255)
    scale = (max - min) / 255
    x'    = min + code * scale                            (then cast to the output dtype)

A constant block round-trips exactly; otherwise one encode/decode errs by at most ``scale / 2``
(plus float32 rounding). A block holding NaN or +-Inf (or whose ``max - min`` overflows float32)
is marked by NaN in its header and zero codes; ``encode`` then raises ``ValueError`` instead of
sending garbage.

Example::

    >>> import torch
    >>> from bagua.kernels import minmax_uint8 as mm
    >>> x = torch.randn(5000)
    >>> wire = mm.encode(x)                    # uint8, 8 * 5 + 5000 bytes
    >>> y = mm.decode(wire, x.numel())
    >>> bool((x - y).abs().max() < 0.02)
    True
"""

from __future__ import annotations

import torch

from . import _codec
from ._codec import SUPPORTED_DTYPES, ref_chunks, ref_scratch  # noqa: F401 (SUPPORTED_DTYPES: in __all__)
from ._triton import HAS_TRITON, device_guard, launches, store_rne, tl, triton  # noqa: F401 (HAS_TRITON: in __all__)

__all__ = list(_codec.PUBLIC_NAMES)

DEFAULT_BLOCK_SIZE = 1024
WIRE = _codec.BlockWire("MinMaxUInt8", header_floats=2, elements_per_byte=1)

_FLT_MAX = 3.4028234663852886e38  # largest finite float32: cap of `inv` for denormal ranges


def wire_numel(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Length in bytes of the wire tensor for ``numel`` input elements.

    Args:
        numel: number of encoded elements (>= 0).
        block_size: elements per (min, max) block, a positive power of two.

    Returns:
        ``8 * ceil(numel / block_size) + numel``.

    Example::

        >>> wire_numel(5000, 1024)
        5040
    """
    return WIRE.wire_numel(numel, block_size)


def _overflow(block: torch.Tensor) -> str:
    return (
        f"a range max - min that overflows float32 "
        f"(min {float(block.float().min())}, max {float(block.float().max())})"
    )


# --------------------------------------------------------------------------------------------
# plain-torch reference (the production path for CPU tensors)
# --------------------------------------------------------------------------------------------


def _encode_rows(rows: torch.Tensor, header: torch.Tensor, codes: torch.Tensor, scratch: torch.Tensor) -> None:
    """Encodes each row of ``rows`` [m, L] as one block into ``header`` [m, 2] and ``codes`` [m, L].

    ``scratch`` is a float32 buffer of at least m * L elements (reused across chunks). A partial
    last block is passed as its own row of its valid length, which is the same as padding it by
    repeating its last valid element: padding never changes min or max.
    """
    m, length = rows.shape
    # exact in the input dtype; both propagate NaN (amin + amax beat aminmax's slow CPU kernel)
    mn, mx = torch.amin(rows, dim=1).float(), torch.amax(rows, dim=1).float()
    rng = mx - mn
    bad = ~torch.isfinite(rng)  # NaN/Inf in the block, or max - min overflowed
    spread = mx > mn
    # tensor / tensor: a true IEEE division (a python scalar may be turned into a reciprocal multiply)
    inv = torch.where(spread, torch.full_like(rng, 255.0) / torch.where(spread, rng, 1.0), 0.0)
    inv.clamp_(max=_FLT_MAX)
    t = scratch[: m * length].view(m, length)
    torch.sub(rows, mn[:, None], out=t)  # half inputs are upcast exactly, then subtracted in float32
    # (x - min) * inv + 0.5 >= 0.5, so floor(clamp(v, 0, 255)) == clamp(floor(v), 0, 255) and the
    # float -> uint8 conversion (truncation) is the floor: the same bytes as the kernel, one pass less
    t.mul_(inv[:, None]).add_(0.5).clamp_(max=255.0)
    if bool(bad.any()):
        t[bad] = 0.0
        mn = mn.masked_fill(bad, float("nan"))
        mx = mx.masked_fill(bad, float("nan"))
    codes.copy_(t)
    header[:, 0] = mn
    header[:, 1] = mx


def _decode_rows(header: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Decodes ``codes`` [m, L] with ``header`` [m, 2] into ``out`` [m, L] (any float dtype)."""
    mn = header[:, 0:1]
    mx = header[:, 1:2]
    rng = mx - mn
    scale = rng / torch.full_like(rng, 255.0)
    y = out if out.dtype == torch.float32 else scratch[: out.numel()].view(out.shape)
    torch.mul(codes, scale, out=y)  # float(code) * scale, then + min: two roundings, no FMA
    y.add_(mn)
    if y is not out:
        out.copy_(y)  # round to nearest even, as the kernel


def _encode_reference_raw(x_flat: torch.Tensor, header: torch.Tensor, codes: torch.Tensor, block_size: int) -> None:
    rows_header = header.view(-1, 2)
    scratch = ref_scratch(x_flat.numel(), block_size, x_flat.device)
    for e0, rows, length in ref_chunks(x_flat.numel(), block_size):
        e1, b0 = e0 + rows * length, e0 // block_size
        _encode_rows(
            x_flat[e0:e1].view(rows, length), rows_header[b0 : b0 + rows], codes[e0:e1].view(rows, length), scratch
        )


def _decode_reference_raw(header: torch.Tensor, codes: torch.Tensor, numel: int, block_size: int,
                          out_flat: torch.Tensor) -> None:
    header = header.view(-1, 2)
    scratch = out_flat if out_flat.dtype == torch.float32 else ref_scratch(numel, block_size, out_flat.device)
    for e0, rows, length in ref_chunks(numel, block_size):
        e1, b0 = e0 + rows * length, e0 // block_size
        _decode_rows(header[b0 : b0 + rows], codes[e0:e1].view(rows, length), out_flat[e0:e1].view(rows, length), scratch)


# --------------------------------------------------------------------------------------------
# Triton kernels and launchers
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _minmax_uint8_encode_kernel(
        x_ptr, header_ptr, codes_ptr, numel, BLOCK: tl.constexpr, MASKED: tl.constexpr, CODES_ALIGN8: tl.constexpr
    ):
        # One program per block: load it once, min/max/non-finite, write (min, max) and the codes.
        # Full blocks run unmasked (MASKED=False) so that loads and stores vectorize whatever numel
        # is; the partial last block gets its own masked launch.
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        code_ptrs = codes_ptr + offs
        if CODES_ALIGN8:  # codes start 8*nb bytes after the header: 8-byte aligned, say so
            code_ptrs = tl.multiple_of(code_ptrs, 8)  # (Triton only detects 16) -> vector stores
        if MASKED:
            mask = offs < numel
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mn = tl.min(tl.where(mask, x, float("inf")), axis=0)
            mx = tl.max(tl.where(mask, x, float("-inf")), axis=0)
        else:
            x = tl.load(x_ptr + offs).to(tl.float32)
            mn = tl.min(x, axis=0)
            mx = tl.max(x, axis=0)
        # x - x is 0 for finite x and NaN for NaN/Inf: no reliance on NaN propagation of min/max
        n_nonfinite = tl.sum((x - x != 0.0).to(tl.int32), axis=0)
        rng = mx - mn
        bad = (n_nonfinite > 0) | (rng - rng != 0.0)
        inv = tl.where(mx > mn, tl.math.div_rn(255.0, tl.where(mx > mn, rng, 1.0)), 0.0)
        inv = tl.minimum(inv, 3.4028234663852886e38)  # _FLT_MAX
        q = tl.floor((x - mn) * inv + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), 255.0)
        q = tl.where(bad, 0.0, q).to(tl.uint8)
        if MASKED:
            tl.store(code_ptrs, q, mask=mask)
        else:
            tl.store(code_ptrs, q)
        tl.store(header_ptr + 2 * pid, tl.where(bad, float("nan"), mn))
        tl.store(header_ptr + 2 * pid + 1, tl.where(bad, float("nan"), mx))

    @triton.jit
    def _minmax_uint8_decode_kernel(
        header_ptr, codes_ptr, out_ptr, numel, BLOCK: tl.constexpr, MASKED: tl.constexpr, CODES_ALIGN8: tl.constexpr
    ):
        # One program per block: x' = min + code * scale, scale = (max - min) / 255.
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        code_ptrs = codes_ptr + offs
        if CODES_ALIGN8:
            code_ptrs = tl.multiple_of(code_ptrs, 8)
        mn = tl.load(header_ptr + 2 * pid)
        mx = tl.load(header_ptr + 2 * pid + 1)
        scale = tl.math.div_rn(mx - mn, 255.0)
        mask = offs < numel
        if MASKED:
            c = tl.load(code_ptrs, mask=mask, other=0)
        else:
            c = tl.load(code_ptrs)
        y = c.to(tl.float32) * scale + mn
        store_rne(out_ptr + offs, y, mask, MASKED)
else:  # pragma: no cover - without Triton only the references run
    _minmax_uint8_encode_kernel = _minmax_uint8_decode_kernel = None


def _encode_triton_raw(x_flat: torch.Tensor, header: torch.Tensor, codes: torch.Tensor, block_size: int) -> None:
    numel = x_flat.numel()
    with device_guard(x_flat):
        for grid, e0, masked in launches(numel, block_size):
            c, b0 = codes[e0:], e0 // block_size
            _minmax_uint8_encode_kernel[(grid,)](
                x_flat[e0:], header[2 * b0 :], c, numel - e0,
                BLOCK=block_size, MASKED=masked, CODES_ALIGN8=_codec.aligned8(c, block_size),
                num_warps=_codec.num_warps(block_size), enable_fp_fusion=False,
            )  # fmt: skip


encode, decode, encode_reference, decode_reference, encode_triton, decode_triton = _codec.public_functions(
    WIRE, DEFAULT_BLOCK_SIZE, (_encode_reference_raw, _decode_reference_raw), (_encode_triton_raw, _minmax_uint8_decode_kernel),
    _overflow, uses_tail_lengths=False,
)
