"""Shared plumbing of the block codecs (``minmax_uint8``, ``sign1``): the wire layout, argument
checks, header access, the reference's chunking, the non-finite error and the Triton dispatch.

A block codec cuts a flat tensor into blocks of ``block_size`` elements (the last one possibly
shorter) and writes a 1-D ``torch.uint8`` wire: ``header_floats`` float32 values per block, then
the codes of all elements in element order, ``elements_per_byte`` elements per byte (1 for 8-bit
codes, 8 for sign bits)::

    [ header of block 0 | header of block 1 | ... ]      4 * header_floats * nb bytes
    [ codes, element order ]                               ceil(numel / elements_per_byte) bytes

A block whose header holds a non-finite value is the codec's marker of non-finite input.
Each codec module holds its math (a Triton kernel and a torch reference) and a :class:`BlockWire`.

Private to ``bagua.kernels``. Example::

    WIRE = BlockWire("Sign1", header_floats=1, elements_per_byte=8)
    WIRE.wire_numel(1000, 256)      # 4 * 4 + 125
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional

import torch

from .._install import install_hint
from . import _triton
from ._triton import require_triton

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_TRITON_BLOCK = 1 << 16  # one program holds a whole block in registers
REF_CHUNK_ELEMS = 1 << 20  # the reference works on 4 MiB of float32 at a time (mostly in cache)
_warned_no_triton: set[str] = set()


def check_numel(numel: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


def check_float_tensor(t: torch.Tensor, what: str) -> None:
    """A contiguous float32, float16 or bfloat16 tensor, else a clear error naming ``what``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    problem = (f"must have dtype float32, float16 or bfloat16, got {t.dtype}; convert it first (e.g. tensor.float())"
               if t.dtype not in SUPPORTED_DTYPES else
               f"must be contiguous, got strides {tuple(t.stride())}; call .contiguous() first"
               if not t.is_contiguous() else None)
    if problem is not None:
        raise ValueError(f"{what} {problem}")


def _aligned(region: torch.Tensor) -> bool:
    return region.storage_offset() % 4 == 0 and region.data_ptr() % 4 == 0


class BlockWire:
    """The wire layout of one block codec (see the module docstring) and what depends on it alone.

    Args:
        codec: the codec's name in messages (``"MinMaxUInt8"``).
        header_floats: float32 header values per block.
        elements_per_byte: elements per code byte (1 or 8); block sizes are multiples of it.
    """

    def __init__(self, codec: str, header_floats: int, elements_per_byte: int):
        self.codec, self.header_floats, self.elements_per_byte = codec, header_floats, elements_per_byte

    # --- sizes -------------------------------------------------------------------------------
    def check_block_size(self, block_size: int) -> None:
        least = self.elements_per_byte
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size < least
            or block_size & (block_size - 1)
        ):
            raise ValueError(f"block_size must be a power of two >= {least} (e.g. 1024), got {block_size!r}")

    @staticmethod
    def num_blocks(numel: int, block_size: int) -> int:
        return (numel + block_size - 1) // block_size

    def code_numel(self, numel: int) -> int:
        """Bytes of codes for ``numel`` elements."""
        return -(-numel // self.elements_per_byte)

    def header_bytes(self, nb: int) -> int:
        return 4 * self.header_floats * nb

    def wire_numel(self, numel: int, block_size: int) -> int:
        """Length in bytes of the wire of ``numel`` elements: the header, then the codes."""
        check_numel(numel)
        self.check_block_size(block_size)
        return self.header_bytes(self.num_blocks(numel, block_size)) + self.code_numel(numel)

    # --- header and codes --------------------------------------------------------------------
    def read_header(self, wire: torch.Tensor, nb: int) -> torch.Tensor:
        """The float32 header values: a view of wire, or a copy when wire is not 4-byte aligned
        (e.g. one row of a [world, wire_len] receive buffer with an odd wire_len)."""
        region = wire[: self.header_bytes(nb)]
        return region.view(torch.float32) if _aligned(region) else region.clone().view(torch.float32)

    def header_for_write(self, wire: torch.Tensor, nb: int) -> torch.Tensor:
        """Where to write the header: a view of wire, or a scratch buffer for :meth:`flush_header`."""
        region = wire[: self.header_bytes(nb)]
        if _aligned(region):
            return region.view(torch.float32)
        return torch.empty(self.header_floats * nb, dtype=torch.float32, device=wire.device)

    def flush_header(self, wire: torch.Tensor, header: torch.Tensor, nb: int) -> None:
        region = wire[: self.header_bytes(nb)]
        if header.data_ptr() != region.data_ptr():
            region.copy_(header.view(torch.uint8))

    def codes(self, wire: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
        start = self.header_bytes(self.num_blocks(numel, block_size))
        return wire[start : start + self.code_numel(numel)]

    # --- argument checks ---------------------------------------------------------------------
    def _check_wire(self, wire: torch.Tensor, need: int, what: str, exact: bool) -> None:
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
                f"block_size (the header of every block, then the codes); was it encoded with another block_size?"
            )

    def check_encode_args(self, x: torch.Tensor, block_size: int, out: Optional[torch.Tensor]) -> None:
        check_float_tensor(x, "x")
        self.check_block_size(block_size)
        if out is not None:
            self._check_wire(out, self.wire_numel(x.numel(), block_size), "out", exact=True)
            if out.device != x.device:
                raise ValueError(f"out must be on the device of x ({x.device}), got {out.device}")

    def check_decode_args(
        self, wire: torch.Tensor, numel: int, block_size: int, out: Optional[torch.Tensor], dtype: torch.dtype
    ) -> None:
        check_numel(numel)
        self.check_block_size(block_size)
        self._check_wire(wire, self.wire_numel(numel, block_size), "wire", exact=False)
        if out is None:
            if dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
            return
        check_float_tensor(out, "out")
        if out.numel() != numel:
            raise ValueError(f"out must have numel = {numel} elements, got {out.numel()}")
        if out.device != wire.device:
            raise ValueError(f"out must be on the device of wire ({wire.device}), got {out.device}")

    # --- non-finite input --------------------------------------------------------------------
    def raise_if_nonfinite(
        self, x_flat: torch.Tensor, wire: torch.Tensor, block_size: int, overflow: Callable[[torch.Tensor], str]
    ) -> None:
        """Checks the header values (cheap); raises ValueError naming the first marked block.
        ``overflow(block)`` says what overflowed in a block of finite values."""
        numel = x_flat.numel()
        nb = self.num_blocks(numel, block_size)
        if nb == 0:
            return
        header = self.read_header(wire, nb)
        if bool(torch.isfinite(header).all()):
            return
        bad = ~torch.isfinite(header.view(nb, self.header_floats)).all(dim=1)
        n_bad = int(bad.sum())
        b = int(bad.nonzero()[0, 0])
        start, stop = b * block_size, min((b + 1) * block_size, numel)
        block = x_flat[start:stop]
        nonfinite = (~torch.isfinite(block)).nonzero()
        if nonfinite.numel() > 0:
            i = start + int(nonfinite[0, 0])
            what = f"NaN or Inf values (e.g. element {i} = {float(x_flat[i])})"
        else:
            what = overflow(block)
        raise ValueError(
            f"{self.codec} encode: input of {numel} elements has non-finite data in {n_bad} of {nb} "
            f"blocks of {block_size}; the first is block {b} (elements [{start}, {stop})) with {what}. "
            f"Refusing to encode garbage. This usually means training diverged: check the loss, lower "
            f"the learning rate, use a loss scaler (torch.amp.GradScaler) or gradient clipping, or skip "
            f"this step."
        )

    # --- one implementation, validated -------------------------------------------------------
    def encode_with(
        self, raw: Callable[..., None], overflow: Callable[[torch.Tensor], str], x: torch.Tensor, block_size: int,
        out: Optional[torch.Tensor], check_finite: bool, *extra: object,
    ) -> torch.Tensor:
        """Validate, allocate, run the encode implementation ``raw(x_flat, wire, block_size, *extra)``,
        check finiteness."""
        self.check_encode_args(x, block_size, out)
        wire = out if out is not None else torch.empty(
            self.wire_numel(x.numel(), block_size), dtype=torch.uint8, device=x.device)
        x_flat = x.view(-1)
        raw(x_flat, wire, block_size, *extra)
        if check_finite:
            self.raise_if_nonfinite(x_flat, wire, block_size, overflow)
        return wire

    def decode_with(
        self, raw: Callable[..., None], wire: torch.Tensor, numel: int, block_size: int,
        out: Optional[torch.Tensor], dtype: torch.dtype,
    ) -> torch.Tensor:
        """Validate, allocate, run the decode implementation ``raw(wire, numel, block_size, out_flat)``."""
        self.check_decode_args(wire, numel, block_size, out, dtype)
        result = out if out is not None else torch.empty(numel, dtype=dtype, device=wire.device)
        raw(wire, numel, block_size, result.view(-1))
        return result


# --------------------------------------------------------------------------------------------
# the torch references: cache-sized chunks of whole blocks
# --------------------------------------------------------------------------------------------


def ref_chunks(numel: int, block_size: int) -> Iterator[tuple[int, int, int]]:
    """Yields (first element, rows, row length) covering numel: chunks of full blocks, then the tail."""
    nfull = numel // block_size
    step = max(1, REF_CHUNK_ELEMS // block_size)
    for r0 in range(0, nfull, step):
        rows = min(step, nfull - r0)
        yield r0 * block_size, rows, block_size
    if numel > nfull * block_size:
        yield nfull * block_size, 1, numel - nfull * block_size


def ref_scratch(numel: int, block_size: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer that holds any chunk of :func:`ref_chunks` (at least one block)."""
    size = min(max(numel, block_size), max(block_size, (REF_CHUNK_ELEMS // block_size) * block_size))
    return torch.empty(size, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# the Triton side
# --------------------------------------------------------------------------------------------


def require_block_triton(t: object, block_size: object, fn: str) -> None:
    """What a codec's kernels need beyond its encode/decode argument checks (which run next)."""
    require_triton(t, fn)
    if isinstance(block_size, int) and block_size > MAX_TRITON_BLOCK:
        raise ValueError(
            f"block_size must be <= {MAX_TRITON_BLOCK} for the Triton kernels (one program holds a "
            f"block), got {block_size}"
        )


def num_warps(block_size: int) -> int:
    return max(1, min(8, block_size // 256))


def aligned8(codes: torch.Tensor, block_bytes: int) -> bool:
    """Every program's first code byte is 8-byte aligned (Triton itself only detects 16)."""
    return codes.data_ptr() % 8 == 0 and block_bytes % 8 == 0


def use_triton(t: torch.Tensor, block_size: object, codec: str) -> bool:
    """Whether ``t`` goes to the Triton kernels of ``codec``: a CUDA tensor, Triton installed (a
    warning, once per codec, where it is not) and a block a program can hold."""
    if not t.is_cuda:
        return False
    if _triton.triton is None:
        if codec not in _warned_no_triton:
            _warned_no_triton.add(codec)
            logger.warning(
                "Triton is not importable (%s): %s on CUDA tensors falls back to the slower torch "
                "reference; install the gpu extra (%s) for the kernels",
                _triton.TRITON_IMPORT_ERROR, codec, install_hint("gpu"),
            )
        return False
    return isinstance(block_size, int) and block_size <= MAX_TRITON_BLOCK
