"""Sign1 codec: one sign bit per element and one float32 scale per block, its root mean square.

The same math three ways, as :mod:`bagua.kernels.minmax_uint8`: Triton kernels
(``encode_triton`` / ``decode_triton``), a plain-torch reference (``encode_reference`` /
``decode_reference``, the production path on CPU) and the dispatching ``encode`` / ``decode``.

Wire layout for ``numel`` elements and block size ``B`` (a power of two >= 8; ``nb = ceil(numel /
B)`` blocks), a 1-D ``torch.uint8`` tensor of ``4 * nb + ceil(numel / 8)`` bytes::

    [ scale_0, scale_1, ..., scale_{nb-1} ]     nb float32 (4*nb bytes)
    [ byte_0, byte_1, ... ]                      bit j of byte k: element 8k + j is >= 0 (1) or < 0 (0)

The default block is 256 elements: the scales add 1/8 bit per value (1.125 bits, 28x fewer bytes
than float32). Smaller blocks follow the gradients' magnitudes more closely, which matters to an
optimizer that normalizes per coordinate (Adam): on ``examples/train_lm.py`` (with a mean |x|
scale) blocks of 1024 gave a 3.7% higher validation loss than blocks of 256 after 200 steps,
blocks of 64 0.3% lower.

A block of ``L`` elements (``B``, or fewer for the last one)::

    scale = sqrt(S / L)   S = the sum of x * x over the block padded with zeros to B elements, added
                              as a fixed pairwise tree (a[i] + a[i + B/2], then again on the halves ...)
    x'    = +scale if x >= 0 else -scale

Why the root mean square: the decoded block keeps the block's L2 norm (sum x'^2 = sum x^2), so an
optimizer that normalizes by a running mean of squared gradients (Adam's second moment) sees the
block's true mean square; it is also 1-bit Adam's scale (||x||_2 / sqrt(L)). The scale of least
squared error, the mean of |x| (which keeps the L1 norm instead), is smaller by a factor
E|x| / sqrt(E[x^2]) (0.8 for normal values, less for heavy tails): Adam then divides by too small
a second moment and takes larger steps. On ``examples/train_lm.py`` (AdamW, 200 steps, 50 of them
exact) the RMS scale ended 1.9% above 8-bit bytegrad's validation loss, the mean |x| 4.2%. With
error feedback both keep the residuals bounded (a simulated persistent single spike in a block of
256: RMS 15, mean |x| 128). An all-zero block decodes to exact zeros. The fixed tree makes the
scale a function of the block alone: the same bits on the GPU, in the interpreter and in the
reference, wherever the block lies in a tensor.

A block holding NaN or +-Inf, or whose sum of squares overflows float32 (values beyond ~1e19), is
marked by a NaN scale and zero bits (it decodes to NaN); ``encode`` then raises ``ValueError``
unless ``check_finite=False``.

``tail_lengths`` encodes a stream of whole blocks whose last blocks are padded (what
``bagua.comm.compressed`` sends: each tensor's short last block padded to B): block ``nb - t + i``
of a stream with ``t = len(tail_lengths)`` holds ``tail_lengths[i]`` real elements, and its scale is
theirs alone. The padding still gets sign bits, which nobody reads.

Example::

    >>> import torch
    >>> from bagua.kernels import sign1
    >>> x = torch.tensor([1.0, -5.0, 5.0, -7.0])
    >>> wire = sign1.encode(x, block_size=8)             # 4 + 1 bytes
    >>> sign1.decode(wire, 4, block_size=8).tolist()
    [5.0, -5.0, 5.0, -5.0]
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _codec
from ._codec import SUPPORTED_DTYPES, ref_chunks, ref_scratch  # noqa: F401 (SUPPORTED_DTYPES: in __all__)
from ._triton import HAS_TRITON, device_guard, launches, store_rne, tl, triton  # noqa: F401 (HAS_TRITON: in __all__)

__all__ = list(_codec.PUBLIC_NAMES)

DEFAULT_BLOCK_SIZE = 256
# Blocks per program of the Triton decode kernel: one 256-element block is too little work for a
# program (H200, 64M elements: 42% of copy bandwidth one block to a program, 88% four). The encode
# kernel keeps one block to a program: its per-row reduction tree over [4, 256] compiled to a
# kernel five times slower.
ROWS_PER_PROGRAM = 4
WIRE = _codec.BlockWire("Sign1", header_floats=1, elements_per_byte=8, rows_per_program=ROWS_PER_PROGRAM)

# decoding table: byte -> its eight elements' signs, +-1.0, bit 0 first
_SIGNS = torch.tensor([[1.0 if (byte >> j) & 1 else -1.0 for j in range(8)] for byte in range(256)])


def wire_numel(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Length in bytes of the wire tensor for ``numel`` input elements.

    Returns:
        ``4 * ceil(numel / block_size) + ceil(numel / 8)``.

    Example::

        >>> wire_numel(5000, 1024)
        645
        >>> wire_numel(5000)                  # the default block: 256
        705
    """
    return WIRE.wire_numel(numel, block_size)


def _overflow(block: torch.Tensor) -> str:
    return f"a sum of squares that overflows float32 (max |x| {float(block.float().abs().max())})"


# --------------------------------------------------------------------------------------------
# plain-torch reference (the production path for CPU tensors)
# --------------------------------------------------------------------------------------------


def _tree_sum_(a: torch.Tensor) -> torch.Tensor:
    """Sums each row of ``a`` [m, B] (B a power of two) as the kernel does, in place: a[:, i] +=
    a[:, i + B/2], then on the first half again ...; returns the [m, 1] sums (a view of a)."""
    width = a.shape[1]
    while width > 1:
        width //= 2
        a[:, :width].add_(a[:, width : 2 * width])
    return a[:, :1]


def _pack_(signs: torch.Tensor, out: torch.Tensor) -> None:
    """Packs ``signs`` (bool, a multiple of 8 elements) into ``out`` (uint8), bit j of byte k
    being element 8k + j."""
    groups = signs.view(-1, 8).view(torch.uint8)
    torch.bitwise_left_shift(groups[:, 7], 7, out=out)
    for j in range(7):
        out.bitwise_or_(groups[:, j] << j)


def _encode_rows(
    rows: torch.Tensor, lengths: Optional[torch.Tensor], block: int, scales: torch.Tensor, bits: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """Encodes each row of ``rows`` [m, L] (L = block, or one short row: a tensor's last block) into
    ``scales`` [m] and ``bits`` [ceil(m * L / 8)]; ``lengths`` [m]: the real elements of each row
    (None: all of them)."""
    m, length = rows.shape
    a = scratch[: m * block].view(m, block)
    a[:, length:].zero_()
    if rows.dtype == torch.float32:
        torch.mul(rows, rows, out=a[:, :length])
    else:
        a[:, :length].copy_(rows).square_()  # half inputs are upcast exactly, squared in float32
    if lengths is not None:
        a.masked_fill_(torch.arange(block, device=a.device)[None, :] >= lengths[:, None], 0.0)
        count = lengths.to(torch.float32)[:, None]
    else:
        count = torch.full((m, 1), float(length), device=a.device)
    # IEEE division and square root, as div_rn, sqrt_rn: torch's float32 sqrt on CPU (SLEEF, 0.5001
    # ulp) rounds ~0.5% of values the other way; float64's, rounded to float32, is exact for them
    scale = torch.sqrt((_tree_sum_(a) / count).double()).float()
    bad = ~torch.isfinite(scale)  # NaN or Inf in the block, or the sum overflowed
    signs = rows >= 0
    if bool(bad.any()):
        scale.masked_fill_(bad, float("nan"))
        signs.masked_fill_(bad, False)
    if length % 8:  # a tensor's last block: its last byte is filled up as the kernel fills it
        signs = torch.cat([signs.view(-1), signs.new_ones(8 - length % 8)])
    scales.copy_(scale.view(-1))
    _pack_(signs, bits)


def _encode_reference_raw(
    x_flat: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, block_size: int, tails: Optional[torch.Tensor]
) -> None:
    numel, nb = x_flat.numel(), scales.numel()
    first_tail = nb - (0 if tails is None else tails.numel())
    lengths = torch.full((nb,), block_size, dtype=torch.int32, device=x_flat.device)
    if first_tail < nb:
        lengths[first_tail:] = tails.to(x_flat.device)
    scratch = ref_scratch(numel, block_size, x_flat.device)
    for e0, rows, length in ref_chunks(numel, block_size):
        b0 = e0 // block_size
        _encode_rows(
            x_flat[e0 : e0 + rows * length].view(rows, length),
            lengths[b0 : b0 + rows] if b0 + rows > first_tail else None,  # rows with padded tails
            block_size, scales[b0 : b0 + rows], bits[e0 // 8 : -(-(e0 + rows * length) // 8)], scratch,
        )  # fmt: skip


def _decode_reference_raw(scales: torch.Tensor, bits: torch.Tensor, numel: int, block_size: int,
                          out_flat: torch.Tensor) -> None:
    table = _SIGNS.to(out_flat.device)
    scratch = ref_scratch(numel, block_size, out_flat.device)
    for e0, rows, length in ref_chunks(numel, block_size):
        b0, e1 = e0 // block_size, e0 + rows * length
        direct = out_flat.dtype == torch.float32 and length % 8 == 0
        y = out_flat[e0:e1] if direct else scratch[: -(-(e1 - e0) // 8) * 8]
        torch.index_select(table, 0, bits[e0 // 8 : -(-e1 // 8)].int(), out=y.view(-1, 8))  # +-1 per element
        y = y[: e1 - e0].view(rows, length)
        y.mul_(scales[b0 : b0 + rows, None])  # +-scale, exactly
        if not direct:
            out_flat[e0:e1].view(rows, length).copy_(y)  # to the output dtype: round to nearest even


# --------------------------------------------------------------------------------------------
# Triton kernels and launchers
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _sign1_encode_kernel(
        x_ptr, scale_ptr, bits_ptr, lengths_ptr, numel,
        BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, MASKED: tl.constexpr, LENGTHS: tl.constexpr,
    ):  # fmt: skip
        # One program per block: load it once; the scale from a fixed pairwise tree over x * x (the
        # reference's order, so both give the same bits), the signs packed 8 to a byte. Full blocks
        # run unmasked; a tensor's short last block masked (MASKED); a padded stream's tails with
        # their real lengths (LENGTHS).
        pid = tl.program_id(0)
        k = tl.arange(0, BLOCK)
        offs = pid.to(tl.int64) * BLOCK + k
        if MASKED:
            valid = offs < numel
            x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            count = (numel - pid.to(tl.int64) * BLOCK).to(tl.float32)  # (one program: the last block)
        else:
            x = tl.load(x_ptr + offs).to(tl.float32)
            count = tl.full((), BLOCK, tl.float32)
        a = x * x  # (launched without FMA contraction: rounded as the reference's)
        if LENGTHS:
            length = tl.load(lengths_ptr + pid)
            a = tl.where(k < length, a, 0.0)
            count = length.to(tl.float32)
        for i in tl.static_range(LOG2_BLOCK):  # a[j] + a[j + half], halving down to one value
            a = tl.sum(tl.reshape(a, (2, BLOCK >> (i + 1))), axis=0)
        scale = tl.math.sqrt_rn(tl.math.div_rn(tl.sum(a, axis=0), count))
        bad = scale - scale != 0.0  # NaN or Inf in the block, or the sum overflowed
        signs = tl.where(bad, 0, (x >= 0.0).to(tl.int32))
        shifts = tl.arange(0, 8)
        packed = tl.sum(tl.reshape(signs, (BLOCK // 8, 8)) << shifts[None, :], axis=1).to(tl.uint8)
        boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        if MASKED:
            tl.store(bits_ptr + boffs, packed, mask=boffs < (numel + 7) // 8)
        else:
            tl.store(bits_ptr + boffs, packed)
        tl.store(scale_ptr + pid, tl.where(bad, float("nan"), scale))

    @triton.jit
    def _sign1_decode_kernel(
        scale_ptr, bits_ptr, out_ptr, numel, BLOCK: tl.constexpr, MASKED: tl.constexpr, CODES_ALIGN8: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # ROWS blocks per program (a MASKED launch: one): x' = +-scale by each element's bit.
        blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK]
        boffs = blocks[:, None] * (BLOCK // 8) + tl.arange(0, BLOCK // 8)[None, :]
        bit_ptrs = bits_ptr + boffs
        if CODES_ALIGN8:
            bit_ptrs = tl.multiple_of(bit_ptrs, [1, 8])
        scale = tl.load(scale_ptr + blocks)
        if MASKED:
            packed = tl.load(bit_ptrs, mask=boffs < (numel + 7) // 8, other=0)
        else:
            packed = tl.load(bit_ptrs)
        bits = (packed.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
        y = tl.where(tl.reshape(bits, (ROWS, BLOCK)) != 0, scale[:, None], -scale[:, None])
        store_rne(out_ptr + offs, y, offs < numel, MASKED)
else:  # pragma: no cover - without Triton only the references run
    _sign1_encode_kernel = _sign1_decode_kernel = None


def _encode_triton_raw(
    x_flat: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, block_size: int, tails: Optional[torch.Tensor]
) -> None:
    numel, nb = x_flat.numel(), scales.numel()
    t = 0 if tails is None else tails.numel()
    # (grid, first block, MASKED, LENGTHS): the full blocks, then a short last block or the padded tails
    plan = [(grid, e0 // block_size, masked, False) for grid, e0, masked in launches(numel, block_size)]
    if t:
        plan = [(nb - t, 0, False, False), (t, nb - t, False, True)]
    lengths = tails.to(x_flat.device) if t else scales  # (not read without LENGTHS)
    with device_guard(x_flat):
        for grid, b0, masked, with_lengths in plan:
            if grid:
                _sign1_encode_kernel[(grid,)](
                    x_flat[b0 * block_size :], scales[b0:], bits[b0 * block_size // 8 :], lengths,
                    numel - b0 * block_size, BLOCK=block_size, LOG2_BLOCK=block_size.bit_length() - 1,
                    MASKED=masked, LENGTHS=with_lengths, num_warps=_codec.num_warps(block_size),
                    enable_fp_fusion=False,
                )  # fmt: skip


encode, decode, encode_reference, decode_reference, encode_triton, decode_triton = _codec.public_functions(
    WIRE, DEFAULT_BLOCK_SIZE, (_encode_reference_raw, _decode_reference_raw), (_encode_triton_raw, _sign1_decode_kernel),
    _overflow, uses_tail_lengths=True,
)
