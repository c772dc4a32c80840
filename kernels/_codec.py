"""Shared plumbing of the block codecs (``minmax_uint8``, ``sign1``): the wire layout, argument
checks, header access, the reference's chunking, the non-finite error and the Triton dispatch.

A block codec cuts a flat tensor into blocks of ``block_size`` elements (the last one possibly
shorter) and writes a 1-D ``torch.uint8`` wire: ``header_floats`` float32 values per block, then
the codes of all elements in element order, ``elements_per_byte`` elements per byte (1 for 8-bit
codes, 8 for sign bits)::

    [ header of block 0 | header of block 1 | ... ]      4 * header_floats * nb bytes
    [ codes, element order ]                               ceil(numel / elements_per_byte) bytes

A block whose header holds a non-finite value is the codec's marker of non-finite input.
Each codec module holds its math (a Triton kernel and a torch reference), a :class:`BlockWire`
and the public functions :func:`public_functions` makes of them.

Private to ``bagua.kernels``. Example::

    WIRE = BlockWire("Sign1", header_floats=1, elements_per_byte=8)
    WIRE.wire_numel(1000, 256)      # 4 * 4 + 125
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from .._install import install_hint
from . import _triton
from ._triton import device_guard, require_triton, row_launches

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: what every codec module exports
PUBLIC_NAMES = ("DEFAULT_BLOCK_SIZE", "SUPPORTED_DTYPES", "HAS_TRITON", "wire_numel", "encode", "decode",
                "encode_reference", "decode_reference", "encode_triton", "decode_triton")
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
        rows_per_program: whole blocks per program of the Triton decode kernel (its ``ROWS``),
            for blocks too small to keep a GPU busy one to a program; 1: a kernel without ``ROWS``.
    """

    def __init__(self, codec: str, header_floats: int, elements_per_byte: int, rows_per_program: int = 1):
        self.codec, self.header_floats, self.elements_per_byte = codec, header_floats, elements_per_byte
        self.rows_per_program = rows_per_program

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
        """Validate, allocate, run the encode implementation ``raw(x_flat, header, codes,
        block_size, *extra)`` (``header``: float32 values to write), check finiteness."""
        self.check_encode_args(x, block_size, out)
        numel = x.numel()
        wire = out if out is not None else torch.empty(
            self.wire_numel(numel, block_size), dtype=torch.uint8, device=x.device)
        x_flat, nb = x.view(-1), self.num_blocks(numel, block_size)
        if nb:
            header = self.header_for_write(wire, nb)
            raw(x_flat, header, self.codes(wire, numel, block_size), block_size, *extra)
            self.flush_header(wire, header, nb)
        if check_finite:
            self.raise_if_nonfinite(x_flat, wire, block_size, overflow)
        return wire

    def decode_with(
        self, raw: Callable[..., None], wire: torch.Tensor, numel: int, block_size: int,
        out: Optional[torch.Tensor], dtype: torch.dtype,
    ) -> torch.Tensor:
        """Validate, allocate, run the decode implementation ``raw(header, codes, numel,
        block_size, out_flat)``."""
        self.check_decode_args(wire, numel, block_size, out, dtype)
        result = out if out is not None else torch.empty(numel, dtype=dtype, device=wire.device)
        nb = self.num_blocks(numel, block_size)
        if nb:
            raw(self.read_header(wire, nb), self.codes(wire, numel, block_size), numel, block_size, result.view(-1))
        return result

    def launch_decode(self, kernel, header: torch.Tensor, codes: torch.Tensor, numel: int, block_size: int,
                      out_flat: torch.Tensor) -> None:
        """Run a decode kernel ``kernel(header_ptr, codes_ptr, out_ptr, numel, BLOCK, MASKED,
        CODES_ALIGN8[, ROWS])``, one program per block (``ROWS`` blocks where ``rows_per_program``
        is over 1): the full blocks unmasked, then the tail masked."""
        with device_guard(out_flat):
            for grid, e0, masked, rows in row_launches(numel, block_size, self.rows_per_program):
                b0, c = e0 // block_size, codes[e0 // self.elements_per_byte :]
                kernel[(grid,)](
                    header[self.header_floats * b0 :], c, out_flat[e0:], numel - e0, BLOCK=block_size, MASKED=masked,
                    CODES_ALIGN8=aligned8(c, block_size // self.elements_per_byte),
                    num_warps=num_warps(rows * block_size), enable_fp_fusion=False,
                    **({"ROWS": rows} if self.rows_per_program > 1 else {}),
                )  # fmt: skip


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


# --------------------------------------------------------------------------------------------
# a codec module's public functions
# --------------------------------------------------------------------------------------------

TailLengths = Optional[Union[Sequence[int], torch.Tensor]]


def check_tail_lengths(tail_lengths: TailLengths, numel: int, block_size: int) -> Optional[torch.Tensor]:
    """``tail_lengths`` (see ``public_functions``) checked, as an int32 CPU tensor (None when not given)."""
    if tail_lengths is None:
        return None
    lengths = torch.as_tensor(tail_lengths, dtype=torch.int64).reshape(-1).cpu()
    nb = BlockWire.num_blocks(numel, block_size)
    if numel % block_size or lengths.numel() > nb or (lengths.numel() and not (
            bool((lengths >= 1).all()) and bool((lengths <= block_size).all()))):
        raise ValueError(
            f"tail_lengths are the real lengths (1 to block_size = {block_size}) of the last blocks of a "
            f"stream of whole blocks; got {lengths.numel()} lengths for {numel} elements "
            f"(min {int(lengths.min()) if lengths.numel() else '-'}, max {int(lengths.max()) if lengths.numel() else '-'})"
        )
    return lengths.to(torch.int32)


def public_functions(
    wire: BlockWire, default_block: int, reference: tuple[Callable, Callable], kernels: tuple[Callable, object],
    overflow: Callable[[torch.Tensor], str], uses_tail_lengths: bool,
) -> tuple[Callable, ...]:
    """``encode``, ``decode`` (dispatching), ``encode_reference``, ``decode_reference``,
    ``encode_triton`` and ``decode_triton`` of a block codec, from its implementations:
    ``reference`` is ``(encode_raw, decode_raw)`` (see ``BlockWire.encode_with`` and
    ``decode_with``), ``kernels`` ``(encode_raw, decode_kernel)`` (see ``BlockWire.launch_decode``).
    ``uses_tail_lengths``: the encoders get the padded tails' real lengths (``tails``, last), else
    a padding by repeats changes no block header: checked, unused.
    """
    codec = wire.codec

    def _decode_triton_raw(header, codes, numel, block_size, out_flat) -> None:
        wire.launch_decode(kernels[1], header, codes, numel, block_size, out_flat)

    def _encode(raw: Callable, x, block_size, out, check_finite, tail_lengths) -> torch.Tensor:
        tails = check_tail_lengths(tail_lengths, x.numel(), block_size) if isinstance(x, torch.Tensor) else None
        extra = (tails,) if uses_tail_lengths else ()
        return wire.encode_with(raw, overflow, x, block_size, out, check_finite, *extra)

    def encode_reference(x: torch.Tensor, block_size: int = default_block, out: Optional[torch.Tensor] = None, *,
                         check_finite: bool = True, tail_lengths: TailLengths = None) -> torch.Tensor:
        return _encode(reference[0], x, block_size, out, check_finite, tail_lengths)

    def decode_reference(wire_: torch.Tensor, numel: int, block_size: int = default_block,
                         out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return wire.decode_with(reference[1], wire_, numel, block_size, out, dtype)

    def encode_triton(x: torch.Tensor, block_size: int = default_block, out: Optional[torch.Tensor] = None, *,
                      check_finite: bool = True, tail_lengths: TailLengths = None) -> torch.Tensor:
        require_block_triton(x, block_size, "encode_triton")
        return _encode(kernels[0], x, block_size, out, check_finite, tail_lengths)

    def decode_triton(wire_: torch.Tensor, numel: int, block_size: int = default_block,
                      out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        require_block_triton(wire_, block_size, "decode_triton")
        return wire.decode_with(_decode_triton_raw, wire_, numel, block_size, out, dtype)

    def encode(x: torch.Tensor, block_size: int = default_block, out: Optional[torch.Tensor] = None, *,
               check_finite: bool = True, tail_lengths: TailLengths = None) -> torch.Tensor:
        triton_path = isinstance(x, torch.Tensor) and use_triton(x, block_size, codec)
        return (encode_triton if triton_path else encode_reference)(
            x, block_size, out, check_finite=check_finite, tail_lengths=tail_lengths)

    def decode(wire_: torch.Tensor, numel: int, block_size: int = default_block,
               out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        triton_path = isinstance(wire_, torch.Tensor) and use_triton(wire_, block_size, codec)
        return (decode_triton if triton_path else decode_reference)(wire_, numel, block_size, out, dtype)

    functions = (encode, decode, encode_reference, decode_reference, encode_triton, decode_triton)
    for function in functions:
        function.__doc__ = _DOCS[function.__name__].format(codec=codec, default=default_block)
    return functions


_ENCODE_ARGS = """
    Args:
        x: contiguous float32/float16/bfloat16 tensor of any shape, treated as flat.
        block_size: elements per block (default {default}).
        out: optional preallocated 1-D contiguous uint8 tensor of ``wire_numel(x.numel(), block_size)``
            bytes on x's device.
        check_finite: raise on NaN/Inf (default). With False a non-finite block is only marked (a
            NaN header), so it decodes to NaN: a marker that survives the wire, for callers that
            check later (after a collective, so that all ranks fail alike); on CUDA it also skips
            the check's host sync.
        tail_lengths: x is a stream of whole blocks whose last ``len(tail_lengths)`` blocks hold
            that many real elements each, each padded to a whole block by repeating its last one.

    Returns:
        The 1-D uint8 wire tensor (``out`` if given): the blocks' headers, then the codes.

    Raises:
        ValueError: bad arguments, or (with check_finite) x holds NaN/Inf, naming the first bad block.
"""
_DECODE_ARGS = """
    Args:
        wire: 1-D contiguous uint8 tensor of at least ``wire_numel(numel, block_size)`` bytes.
        numel: number of encoded elements.
        block_size: the block size used to encode.
        out: optional contiguous float tensor of ``numel`` elements on wire's device; its dtype is
            the output dtype (``dtype`` is then ignored) and its shape is kept.
        dtype: output dtype when ``out`` is not given (float32, float16 or bfloat16).

    Returns:
        ``out`` if given, else a new 1-D tensor of ``numel`` elements.
"""
_DOCS = {
    "encode": "Encodes a float tensor into {codec} wire bytes (Triton on CUDA, the torch reference on CPU).\n"
              + _ENCODE_ARGS + "\n    Example::\n\n        wire = encode(torch.randn(5000))\n",
    "decode": "Decodes {codec} wire bytes (Triton on CUDA, the torch reference on CPU).\n"
              + _DECODE_ARGS + "\n    Example::\n\n        y = decode(encode(x), x.numel())\n",
    "encode_reference": "Plain-torch {codec} encode (any device): the same bytes as the Triton kernel. "
                        "As ``encode``.\n\n    Example::\n\n        wire = encode_reference(torch.ones(10))\n",
    "decode_reference": "Plain-torch {codec} decode (any device): the same values as the Triton kernel. "
                        "As ``decode``.\n\n    Example::\n\n        y = decode_reference(wire, 10)\n",
    "encode_triton": "Triton {codec} encode, one program per block: CUDA tensors (or CPU under "
                     "TRITON_INTERPRET=1); RuntimeError without Triton. As ``encode``.\n\n"
                     "    Example::\n\n        wire = encode_triton(torch.randn(4096, device='cuda'))\n",
    "decode_triton": "Triton {codec} decode, one program per block: CUDA tensors (or CPU under "
                     "TRITON_INTERPRET=1); RuntimeError without Triton. As ``decode``.\n\n"
                     "    Example::\n\n        y = decode_triton(wire, 4096)\n",
}
