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

import logging

import torch

from .._install import install_hint
from ._triton import HAS_TRITON, tl, triton
from ._triton import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from ._triton import device_guard as _device_guard
from ._triton import triton_interpreting as _triton_interpreting

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "SUPPORTED_DTYPES",
    "HAS_TRITON",
    "wire_numel",
    "encode",
    "decode",
    "encode_reference",
    "decode_reference",
    "encode_triton",
    "decode_triton",
]

DEFAULT_BLOCK_SIZE = 1024
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_FLT_MAX = 3.4028234663852886e38  # largest finite float32: cap of `inv` for denormal ranges
_MAX_TRITON_BLOCK = 1 << 16  # one program holds a whole block in registers
_REF_CHUNK_ELEMS = 1 << 20  # reference works on 4 MiB of float32 at a time (mostly in cache)
_warned_no_triton = False


# --------------------------------------------------------------------------------------------
# sizes and argument checks
# --------------------------------------------------------------------------------------------


def _check_block_size(block_size: int) -> None:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size <= 0
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a positive power of two (e.g. 1024), got {block_size!r}")


def _check_numel(numel: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


def _num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


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
    _check_numel(numel)
    _check_block_size(block_size)
    return 8 * _num_blocks(numel, block_size) + numel


def _check_float_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{what} must have dtype float32, float16 or bfloat16, got {t.dtype}; "
            f"convert it first (e.g. tensor.float())"
        )
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous, got strides {tuple(t.stride())}; call .contiguous() first")


def _check_wire(wire: torch.Tensor, need: int, what: str, exact: bool) -> None:
    if not isinstance(wire, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(wire).__name__}")
    if wire.dtype != torch.uint8:
        raise ValueError(f"{what} must have dtype torch.uint8, got {wire.dtype}")
    if wire.dim() != 1 or not wire.is_contiguous():
        raise ValueError(f"{what} must be a 1-D contiguous tensor, got shape {tuple(wire.shape)}")
    if exact and wire.numel() != need:
        raise ValueError(f"{what} must have wire_numel = {need} bytes, got {wire.numel()}")
    if not exact and wire.numel() < need:
        raise ValueError(
            f"{what} is too short: {wire.numel()} bytes, but {need} are needed for this numel and "
            f"block_size (8 * num_blocks header + numel codes); was it encoded with another block_size?"
        )


def _check_encode_args(x: torch.Tensor, block_size: int, out: torch.Tensor | None) -> None:
    _check_float_tensor(x, "x")
    _check_block_size(block_size)
    if out is not None:
        _check_wire(out, wire_numel(x.numel(), block_size), "out", exact=True)
        if out.device != x.device:
            raise ValueError(f"out must be on the device of x ({x.device}), got {out.device}")


def _check_decode_args(
    wire: torch.Tensor, numel: int, block_size: int, out: torch.Tensor | None, dtype: torch.dtype
) -> None:
    _check_numel(numel)
    _check_block_size(block_size)
    _check_wire(wire, wire_numel(numel, block_size), "wire", exact=False)
    if out is None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return
    _check_float_tensor(out, "out")
    if out.numel() != numel:
        raise ValueError(f"out must have numel = {numel} elements, got {out.numel()}")
    if out.device != wire.device:
        raise ValueError(f"out must be on the device of wire ({wire.device}), got {out.device}")


def _new_wire(x: torch.Tensor, block_size: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is not None:
        return out
    return torch.empty(wire_numel(x.numel(), block_size), dtype=torch.uint8, device=x.device)


def _new_output(wire: torch.Tensor, numel: int, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if out is not None:
        return out
    return torch.empty(numel, dtype=dtype, device=wire.device)


def _aligned(region: torch.Tensor) -> bool:
    return region.storage_offset() % 4 == 0 and region.data_ptr() % 4 == 0


def _read_header(wire: torch.Tensor, nb: int) -> torch.Tensor:
    """The 2*nb float32 header values: a view of wire, or a copy when wire is not 4-byte aligned
    (e.g. one row of a [world, wire_len] receive buffer with an odd wire_len)."""
    region = wire[: 8 * nb]
    return region.view(torch.float32) if _aligned(region) else region.clone().view(torch.float32)


def _header_for_write(wire: torch.Tensor, nb: int) -> torch.Tensor:
    """Where to write the header: a view of wire, or a scratch buffer for :func:`_flush_header`."""
    region = wire[: 8 * nb]
    return region.view(torch.float32) if _aligned(region) else torch.empty(2 * nb, dtype=torch.float32, device=wire.device)


def _flush_header(wire: torch.Tensor, header: torch.Tensor, nb: int) -> None:
    region = wire[: 8 * nb]
    if header.data_ptr() != region.data_ptr():
        region.copy_(header.view(torch.uint8))


def _codes(wire: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    nb = _num_blocks(numel, block_size)
    return wire[8 * nb : 8 * nb + numel]


def _raise_if_nonfinite(x_flat: torch.Tensor, wire: torch.Tensor, block_size: int) -> None:
    """Checks the 2*nb header values (cheap); raises ValueError naming the first bad block."""
    numel = x_flat.numel()
    nb = _num_blocks(numel, block_size)
    if nb == 0:
        return
    header = _read_header(wire, nb)
    if bool(torch.isfinite(header).all()):
        return
    bad = ~torch.isfinite(header.view(nb, 2)).all(dim=1)
    n_bad = int(bad.sum())
    b = int(bad.nonzero()[0, 0])
    start, stop = b * block_size, min((b + 1) * block_size, numel)
    block = x_flat[start:stop]
    nonfinite = (~torch.isfinite(block)).nonzero()
    if nonfinite.numel() > 0:
        i = start + int(nonfinite[0, 0])
        what = f"NaN or Inf values (e.g. element {i} = {float(x_flat[i])})"
    else:
        what = (
            f"a range max - min that overflows float32 "
            f"(min {float(block.float().min())}, max {float(block.float().max())})"
        )
    raise ValueError(
        f"MinMaxUInt8 encode: input of {numel} elements has non-finite data in {n_bad} of {nb} "
        f"blocks of {block_size}; the first is block {b} (elements [{start}, {stop})) with {what}. "
        f"Refusing to encode garbage. This usually means training diverged: check the loss, lower "
        f"the learning rate, use a loss scaler (torch.amp.GradScaler) or gradient clipping, or skip "
        f"this step."
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


def _chunks(numel: int, block_size: int):
    """Yields (first element, rows, row length) covering numel: chunks of full blocks, then the tail."""
    nfull = numel // block_size
    step = max(1, _REF_CHUNK_ELEMS // block_size)
    for r0 in range(0, nfull, step):
        rows = min(step, nfull - r0)
        yield r0 * block_size, rows, block_size
    if numel > nfull * block_size:
        yield nfull * block_size, 1, numel - nfull * block_size


def _scratch(numel: int, block_size: int, device: torch.device) -> torch.Tensor:
    size = min(numel, max(block_size, (_REF_CHUNK_ELEMS // block_size) * block_size))
    return torch.empty(size, dtype=torch.float32, device=device)


def _encode_reference_raw(x_flat: torch.Tensor, wire: torch.Tensor, block_size: int) -> None:
    numel = x_flat.numel()
    nb = _num_blocks(numel, block_size)
    if nb == 0:
        return
    header, codes = _header_for_write(wire, nb), _codes(wire, numel, block_size)
    rows_header = header.view(nb, 2)
    scratch = _scratch(numel, block_size, x_flat.device)
    for e0, rows, length in _chunks(numel, block_size):
        e1, b0 = e0 + rows * length, e0 // block_size
        _encode_rows(
            x_flat[e0:e1].view(rows, length), rows_header[b0 : b0 + rows], codes[e0:e1].view(rows, length), scratch
        )
    _flush_header(wire, header, nb)


def _decode_reference_raw(wire: torch.Tensor, numel: int, block_size: int, out_flat: torch.Tensor) -> None:
    nb = _num_blocks(numel, block_size)
    if nb == 0:
        return
    header, codes = _read_header(wire, nb).view(nb, 2), _codes(wire, numel, block_size)
    scratch = out_flat if out_flat.dtype == torch.float32 else _scratch(numel, block_size, out_flat.device)
    for e0, rows, length in _chunks(numel, block_size):
        e1, b0 = e0 + rows * length, e0 // block_size
        _decode_rows(header[b0 : b0 + rows], codes[e0:e1].view(rows, length), out_flat[e0:e1].view(rows, length), scratch)


def _encode_with(raw, x: torch.Tensor, block_size: int, out: torch.Tensor | None, check_finite: bool) -> torch.Tensor:
    """Validate, allocate, run one encode implementation ``raw``, check finiteness."""
    _check_encode_args(x, block_size, out)
    wire = _new_wire(x, block_size, out)
    x_flat = x.view(-1)
    raw(x_flat, wire, block_size)
    if check_finite:
        _raise_if_nonfinite(x_flat, wire, block_size)
    return wire


def _decode_with(raw, wire: torch.Tensor, numel: int, block_size: int, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Validate, allocate, run one decode implementation ``raw``."""
    _check_decode_args(wire, numel, block_size, out, dtype)
    result = _new_output(wire, numel, out, dtype)
    raw(wire, numel, block_size, result.view(-1))
    return result


def encode_reference(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Plain-torch MinMax-UInt8 encode (any device); same math and bytes as the Triton kernel.

    Args/returns/raises as :func:`encode`.

    Example::

        >>> wire = encode_reference(torch.ones(10), block_size=256)
        >>> wire.numel()
        18
    """
    return _encode_with(_encode_reference_raw, x, block_size, out, check_finite)


def decode_reference(
    wire: torch.Tensor,
    numel: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch MinMax-UInt8 decode (any device); same math and values as the Triton kernel.

    Args/returns/raises as :func:`decode`.

    Example::

        >>> decode_reference(encode_reference(torch.ones(10)), 10)[:3]
        tensor([1., 1., 1.])
    """
    return _decode_with(_decode_reference_raw, wire, numel, block_size, out, dtype)


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
        if MASKED:
            mask = offs < numel
            c = tl.load(code_ptrs, mask=mask, other=0)
        else:
            c = tl.load(code_ptrs)
        y = c.to(tl.float32) * scale + mn
        if out_ptr.dtype.element_ty == tl.bfloat16:
            # explicit round-to-nearest-even float32 -> bfloat16, as torch and cvt.rn.bf16.f32 do
            # (Triton's interpreter truncates instead, which would break the bit-exact tests)
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            bits = tl.where(y != y, 0x7FC0, bits)
            y_out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y_out = y.to(out_ptr.dtype.element_ty)
        if MASKED:
            tl.store(out_ptr + offs, y_out, mask=mask)
        else:
            tl.store(out_ptr + offs, y_out)


def _require_triton(t: torch.Tensor, block_size: int, fn: str) -> None:
    """What the kernels need beyond encode/decode's own argument checks (which run next)."""
    if triton is None:
        raise RuntimeError(
            f"{fn} needs Triton, which is not importable ({_TRITON_IMPORT_ERROR}); install the gpu "
            f"extra ({install_hint('gpu')}) or use the torch reference ({fn.replace('triton', 'reference')})"
        )
    if isinstance(t, torch.Tensor) and not t.is_cuda and not _triton_interpreting():
        raise ValueError(
            f"{fn} runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got a tensor on "
            f"{t.device}; use encode/decode, which dispatch CPU tensors to the torch reference"
        )
    if isinstance(block_size, int) and block_size > _MAX_TRITON_BLOCK:
        raise ValueError(
            f"block_size must be <= {_MAX_TRITON_BLOCK} for the Triton kernels (one program holds a "
            f"block), got {block_size}"
        )


def _num_warps(block_size: int) -> int:
    return max(1, min(8, block_size // 256))


def _aligned8(codes: torch.Tensor, block_size: int) -> bool:
    """Every program's first code is 8-byte aligned (Triton itself only detects 16)."""
    return codes.data_ptr() % 8 == 0 and block_size % 8 == 0


def _launches(numel: int, block_size: int):
    """(grid, first element, first block, MASKED): the full blocks unmasked, then the tail masked."""
    nfull, tail = divmod(numel, block_size)
    if nfull:
        yield nfull, 0, 0, False
    if tail:
        yield 1, nfull * block_size, nfull, True


def _encode_triton_raw(x_flat: torch.Tensor, wire: torch.Tensor, block_size: int) -> None:
    numel = x_flat.numel()
    nb = _num_blocks(numel, block_size)
    if nb == 0:
        return
    header, codes = _header_for_write(wire, nb), _codes(wire, numel, block_size)
    with _device_guard(x_flat):
        for grid, e0, b0, masked in _launches(numel, block_size):
            c = codes[e0:]
            _minmax_uint8_encode_kernel[(grid,)](
                x_flat[e0:], header[2 * b0 :], c, numel - e0,
                BLOCK=block_size, MASKED=masked, CODES_ALIGN8=_aligned8(c, block_size),
                num_warps=_num_warps(block_size), enable_fp_fusion=False,
            )  # fmt: skip
    _flush_header(wire, header, nb)


def _decode_triton_raw(wire: torch.Tensor, numel: int, block_size: int, out_flat: torch.Tensor) -> None:
    nb = _num_blocks(numel, block_size)
    if nb == 0:
        return
    header, codes = _read_header(wire, nb), _codes(wire, numel, block_size)
    with _device_guard(wire):
        for grid, e0, b0, masked in _launches(numel, block_size):
            c = codes[e0:]
            _minmax_uint8_decode_kernel[(grid,)](
                header[2 * b0 :], c, out_flat[e0:], numel - e0,
                BLOCK=block_size, MASKED=masked, CODES_ALIGN8=_aligned8(c, block_size),
                num_warps=_num_warps(block_size), enable_fp_fusion=False,
            )  # fmt: skip


def encode_triton(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Triton MinMax-UInt8 encode: one program per block, a single pass over x.

    Runs on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``). Args/returns/raises as
    :func:`encode`; raises RuntimeError when Triton is not installed.

    Example::

        >>> wire = encode_triton(torch.randn(4096, device="cuda"))  # doctest: +SKIP
    """
    _require_triton(x, block_size, "encode_triton")
    return _encode_with(_encode_triton_raw, x, block_size, out, check_finite)


def decode_triton(
    wire: torch.Tensor,
    numel: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Triton MinMax-UInt8 decode: one program per block.

    Runs on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``). Args/returns/raises as
    :func:`decode`; raises RuntimeError when Triton is not installed.

    Example::

        >>> y = decode_triton(wire, 4096)  # doctest: +SKIP
    """
    _require_triton(wire, block_size, "decode_triton")
    return _decode_with(_decode_triton_raw, wire, numel, block_size, out, dtype)


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


def _use_triton(t: torch.Tensor, block_size: int) -> bool:
    global _warned_no_triton
    if not t.is_cuda:
        return False
    if triton is None:
        if not _warned_no_triton:
            _warned_no_triton = True
            logger.warning(
                "Triton is not importable (%s): MinMaxUInt8 on CUDA tensors falls back to the slower "
                "torch reference; install the gpu extra (%s) for the kernels",
                _TRITON_IMPORT_ERROR, install_hint("gpu"),
            )
        return False
    return block_size <= _MAX_TRITON_BLOCK


def encode(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Encodes a float tensor into MinMax-UInt8 wire bytes (Triton on CUDA, torch reference on CPU).

    Args:
        x: contiguous float32/float16/bfloat16 tensor of any shape, treated as flat.
        block_size: elements per (min, max) block, a positive power of two.
        out: optional preallocated 1-D contiguous uint8 tensor of ``wire_numel(x.numel(), block_size)``
            bytes on x's device.
        check_finite: raise on NaN/Inf (default). With False, a non-finite block is only marked
            (NaN header, zero codes), so it decodes to NaN: a marker that survives the wire, for
            callers that check later (e.g. after a collective, so that all ranks fail alike). It
            also skips the host sync of the check on CUDA.

    Returns:
        The 1-D uint8 wire tensor (``out`` if given): header of (min, max) float32 pairs, then codes.

    Raises:
        ValueError: bad arguments, or (with check_finite) x holds NaN/Inf, naming the first bad
            block. The check reads only the 2*nb header values, but on CUDA it is a host sync.

    Example::

        >>> wire = encode(torch.arange(8.0), block_size=4)
        >>> wire.numel(), wire[:16].view(torch.float32).tolist()
        (24, [0.0, 3.0, 4.0, 7.0])
    """
    if isinstance(x, torch.Tensor) and _use_triton(x, block_size if isinstance(block_size, int) else 0):
        return encode_triton(x, block_size, out, check_finite=check_finite)
    return encode_reference(x, block_size, out, check_finite=check_finite)


def decode(
    wire: torch.Tensor,
    numel: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decodes MinMax-UInt8 wire bytes (Triton on CUDA, torch reference on CPU).

    Args:
        wire: 1-D contiguous uint8 tensor of at least ``wire_numel(numel, block_size)`` bytes.
        numel: number of encoded elements.
        block_size: the block size used to encode.
        out: optional contiguous float tensor of ``numel`` elements on wire's device; its dtype is
            the output dtype (``dtype`` is then ignored) and its shape is kept.
        dtype: output dtype when ``out`` is not given (float32, float16 or bfloat16).

    Returns:
        ``out`` if given, else a new 1-D tensor of ``numel`` elements.

    Example::

        >>> decode(encode(torch.arange(8.0), block_size=4), 8, block_size=4).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    if isinstance(wire, torch.Tensor) and _use_triton(wire, block_size if isinstance(block_size, int) else 0):
        return decode_triton(wire, numel, block_size, out, dtype)
    return decode_reference(wire, numel, block_size, out, dtype)
