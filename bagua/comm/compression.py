"""Compression codecs with one interface: ``encode(tensor) -> Payload``, ``decode(payload) -> tensor``.

A :class:`Payload` holds exactly the bytes that cross the wire (``data``, a 1-D contiguous tensor
of ``codec.wire_dtype`` and ``codec.wire_numel(numel)`` elements) plus the shape and dtype of the
encoded tensor. Shape and dtype are known to the receiver by protocol, so a receiver that got
raw wire bytes rebuilds the payload and decodes it::

    >>> import torch
    >>> from bagua.comm.compression import Payload, get_codec
    >>> codec = get_codec("minmax_uint8")
    >>> grad = torch.randn(32, 100)
    >>> sent = codec.encode(grad).data                    # what a send/allgather transmits
    >>> received = sent.clone()
    >>> back = codec.decode(Payload(received, torch.Size([32, 100]), torch.float32))
    >>> back.shape, bool((back - grad).abs().max() < 0.05)
    (torch.Size([32, 100]), True)

Codecs: ``fp16`` and ``bf16`` (casts, 2 bytes per element), ``minmax_uint8`` (per-block
float32 min/max and an 8-bit code per element, ~1 byte per element; see
:mod:`bagua.kernels.minmax_uint8`) and ``sign1`` (per-block float32 root mean square and a sign bit per
element, ~1/8 byte per element; see :mod:`bagua.kernels.sign1`; meant for error feedback, which
``bagua.comm.compressed_allreduce(..., error_feedback=...)`` does). Every codec refuses NaN/Inf by
default (ValueError), since a compressed non-finite value is garbage; ``encode(t,
check_finite=False)`` lets them through (as NaN/Inf, or for the block codecs as a block that
decodes to NaN) for callers that check later.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Optional, Union

import torch

from bagua.kernels import minmax_uint8 as _mm
from bagua.kernels import sign1 as _s1

__all__ = ["Payload", "Codec", "FP16", "BF16", "MinMaxUInt8", "Sign1", "get_codec", "CODEC_NAMES"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True, eq=False)
class Payload:
    """An encoded tensor: ``data`` is exactly what crosses the wire.

    Attributes:
        data: 1-D contiguous tensor of ``codec.wire_dtype`` and ``codec.wire_numel(numel)`` elements.
        shape: shape of the encoded tensor (a tuple is converted to ``torch.Size``).
        dtype: dtype of the encoded tensor; decode returns this dtype.

    Example::

        >>> p = Payload(torch.zeros(6, dtype=torch.float16), (2, 3), torch.float32)
        >>> p.shape, p.numel
        (torch.Size([2, 3]), 6)
    """

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise TypeError(f"Payload.data must be a torch.Tensor, got {type(self.data).__name__}")
        if self.data.dim() != 1 or not self.data.is_contiguous():
            raise ValueError(
                f"Payload.data must be a 1-D contiguous tensor, got shape {tuple(self.data.shape)} and "
                f"strides {tuple(self.data.stride())}; use data.reshape(-1).contiguous()"
            )
        try:
            shape = torch.Size(self.shape)
        except (TypeError, ValueError) as err:
            raise TypeError(f"Payload.shape must be a sequence of ints, got {self.shape!r}") from err
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"Payload.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        """Number of elements of the encoded tensor."""
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return self.data.numel() * self.data.element_size()


class Codec(abc.ABC):
    """A tensor codec: ``encode(tensor) -> Payload`` and ``decode(payload) -> tensor``.

    Subclasses set ``name`` (the registry name) and ``wire_dtype`` (dtype of ``Payload.data``) and
    implement :meth:`wire_numel`, :meth:`encode` and :meth:`decode`. Codecs are immutable and
    compare equal when their parameters are equal.
    """

    name: ClassVar[str]
    wire_dtype: ClassVar[torch.dtype]
    #: elements encoded together (a per-block header): a tensor encoded piece by piece on
    #: multiples of it from its start decodes exactly as if encoded whole
    block_size: int = 1

    @abc.abstractmethod
    def wire_numel(self, numel: int) -> int:
        """Length of ``payload.data`` (in ``wire_dtype`` elements) for ``numel`` input elements."""

    def code_numel(self, numel: int) -> int:
        """The wire elements of ``numel`` elements' codes: every codec's payload is its header
        (``wire_numel(n) - code_numel(n)`` elements) followed by the codes in element order."""
        return numel

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor, *, check_finite: bool = True,
               tail_lengths: Optional[torch.Tensor] = None) -> Payload:
        """Encodes a float tensor of any shape; raises ValueError on NaN/Inf unless check_finite=False.

        ``tail_lengths``: the tensor is a stream of whole blocks whose last ``len(tail_lengths)``
        blocks hold only that many real elements each, each padded to a whole block by repeating
        its last real element (``bagua.comm.compressed`` encodes a chunk of many tensors so). A
        codec whose block header that padding changes (``sign1``: the mean square) leaves it out;
        the others (min/max, casts) need not look at it."""

    @abc.abstractmethod
    def decode(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns a tensor of ``payload.shape`` and ``payload.dtype``, written into ``out`` if given
        (``out`` must have ``payload.shape``; its float dtype may differ and wins)."""

    # shared checks -------------------------------------------------------------------------

    def _check_input(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.name} encode needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{self.name} encode needs a floating-point tensor (float32, float16, bfloat16 or "
                f"float64), got {tensor.dtype}; send integer tensors uncompressed"
            )

    def _check_payload(self, payload: Payload, out: torch.Tensor | None) -> None:
        if not isinstance(payload, Payload):
            raise TypeError(f"{self.name} decode needs a Payload, got {type(payload).__name__}")
        if payload.data.dtype != self.wire_dtype:
            raise ValueError(f"{self.name} payload data must have dtype {self.wire_dtype}, got {payload.data.dtype}")
        need = self.wire_numel(payload.numel)
        if payload.data.numel() != need:
            raise ValueError(
                f"{self.name} payload for shape {tuple(payload.shape)} must have {need} wire elements, "
                f"got {payload.data.numel()}; was it encoded by another codec or for another shape?"
            )
        if payload.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{self.name} payload dtype must be floating point, got {payload.dtype}")
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if out.shape != payload.shape:
                raise ValueError(f"out must have shape {tuple(payload.shape)}, got {tuple(out.shape)}")
            if out.dtype not in _FLOAT_DTYPES:
                raise ValueError(f"out must be a floating-point tensor, got {out.dtype}")
            if out.device != payload.data.device:
                raise ValueError(f"out must be on {payload.data.device} (where the payload is), got {out.device}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class _CastCodec(Codec):
    """Encode = cast to ``wire_dtype``; decode = cast back."""

    def wire_numel(self, numel: int) -> int:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        return numel

    def encode(self, tensor: torch.Tensor, *, check_finite: bool = True,
               tail_lengths: Optional[torch.Tensor] = None) -> Payload:
        self._check_input(tensor)
        # always a fresh buffer: the payload never aliases the caller's tensor
        data = torch.empty(tensor.numel(), dtype=self.wire_dtype, device=tensor.device)
        data.view(tensor.shape).copy_(tensor)
        if check_finite and not bool(torch.isfinite(data).all()):
            self._raise_nonfinite(tensor, data)
        return Payload(data, tensor.shape, tensor.dtype)

    def decode(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check_payload(payload, out)
        src = payload.data.view(payload.shape)
        if out is not None:
            return out.copy_(src)
        return src.to(payload.dtype, copy=True)

    def _raise_nonfinite(self, tensor: torch.Tensor, data: torch.Tensor) -> None:
        flat_in = tensor.reshape(-1)
        bad_in = ~torch.isfinite(flat_in)
        if bool(bad_in.any()):
            i = int(bad_in.nonzero()[0, 0])
            what = f"{int(bad_in.sum())} NaN/Inf input values (first at flat index {i}: {float(flat_in[i])})"
            hint = "check for a diverging loss (lower the learning rate, clip gradients, or use a loss scaler)"
        else:
            bad = ~torch.isfinite(data)
            i = int(bad.nonzero()[0, 0])
            finfo = torch.finfo(self.wire_dtype)
            what = (
                f"{int(bad.sum())} values outside the {self.wire_dtype} range +-{finfo.max:g} "
                f"(first at flat index {i}: {float(flat_in[i])})"
            )
            hint = "scale the tensor down (e.g. average instead of sum, or a loss scaler), or use the bf16 codec"
        raise ValueError(
            f"{self.name} encode of a tensor of shape {tuple(tensor.shape)}: {what}; the encoding would "
            f"be Inf/NaN. {hint[0].upper()}{hint[1:]}."
        )


class FP16(_CastCodec):
    """Cast to float16: 2 bytes per element, ~3 significant digits, range +-65504.

    Encoding a value beyond the float16 range, or NaN/Inf, raises ValueError.

    Example::

        >>> codec = FP16()
        >>> p = codec.encode(torch.tensor([1.0, 2.5, -3.0]))
        >>> p.data.dtype, codec.decode(p).tolist()
        (torch.float16, [1.0, 2.5, -3.0])
    """

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


class BF16(_CastCodec):
    """Cast to bfloat16: 2 bytes per element, ~2-3 significant digits, the float32 range.

    Encoding NaN/Inf raises ValueError.

    Example::

        >>> codec = BF16()
        >>> p = codec.encode(torch.tensor([1.0, 2.5, -3.0]))
        >>> p.data.dtype, codec.decode(p).tolist()
        (torch.bfloat16, [1.0, 2.5, -3.0])
    """

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16


class _BlockCodec(Codec):
    """A codec of ``bagua.kernels`` (``_kernels``: a module with ``encode``, ``decode``,
    ``wire_numel`` and its ``WIRE``) over blocks of ``block_size`` elements; float64 travels as
    float32. Immutable."""

    wire_dtype: ClassVar[torch.dtype] = torch.uint8
    _kernels: ClassVar[ModuleType]
    #: the block header depends on which elements are real (see ``Codec.encode``)
    _needs_tail_lengths: ClassVar[bool] = False

    def __init__(self, block_size: Optional[int] = None) -> None:
        block_size = self._kernels.DEFAULT_BLOCK_SIZE if block_size is None else block_size
        self._kernels.WIRE.check_block_size(block_size)
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"

    def __setattr__(self, key: str, value: object) -> None:
        if key in self.__dict__:
            raise AttributeError(f"{type(self).__name__} is immutable; build a new codec instead")
        super().__setattr__(key, value)

    def wire_numel(self, numel: int) -> int:
        return self._kernels.wire_numel(numel, self.block_size)

    def code_numel(self, numel: int) -> int:
        return self._kernels.WIRE.code_numel(numel)

    def encode(self, tensor: torch.Tensor, *, check_finite: bool = True,
               tail_lengths: Optional[torch.Tensor] = None) -> Payload:
        self._check_input(tensor)
        kernels = self._kernels
        src = tensor if tensor.dtype in kernels.SUPPORTED_DTYPES else tensor.float()
        options = {"tail_lengths": tail_lengths} if self._needs_tail_lengths else {}
        data = kernels.encode(src.contiguous(), self.block_size, check_finite=check_finite, **options)
        return Payload(data, tensor.shape, tensor.dtype)

    def decode(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check_payload(payload, out)
        kernels, n = self._kernels, payload.numel
        if out is not None and out.is_contiguous() and out.dtype in kernels.SUPPORTED_DTYPES:
            kernels.decode(payload.data, n, self.block_size, out=out)
            return out
        dtype = payload.dtype if payload.dtype in kernels.SUPPORTED_DTYPES else torch.float32
        flat = kernels.decode(payload.data, n, self.block_size, dtype=dtype)
        if out is not None:
            return out.copy_(flat.view(payload.shape))
        return flat.view(payload.shape).to(payload.dtype)


class MinMaxUInt8(_BlockCodec):
    """Per-block float32 (min, max) and an 8-bit code per element: ~1 byte per element.

    ``wire_numel(n) = 8 * ceil(n / block_size) + n`` bytes. One encode/decode errs by at most half
    a quantization step, ``(max - min) / 255 / 2`` of the element's block; a constant block is
    exact. Triton kernels on CUDA, a vectorized torch path on CPU (:mod:`bagua.kernels.minmax_uint8`).
    NaN/Inf input raises ValueError naming the first bad block.

    Args:
        block_size: elements per (min, max) block, a positive power of two (default 1024).

    Example::

        >>> codec = MinMaxUInt8(block_size=256)
        >>> x = torch.randn(1000)
        >>> p = codec.encode(x)
        >>> p.data.numel()                          # 8 * 4 + 1000 bytes instead of 4000
        1032
        >>> bool((codec.decode(p) - x).abs().max() < 0.02)
        True
    """

    name: ClassVar[str] = "minmax_uint8"
    _kernels = _mm  # padding a block with copies of its last element changes neither min nor max


class Sign1(_BlockCodec):
    """Per-block float32 scale (the block's root mean square) and one sign bit per element: ~1/8
    byte per element, 28x fewer bytes than fp32 at the default block of 256 (``wire_numel(n) = 4 *
    ceil(n / block_size) + ceil(n / 8)``).

    Each element decodes to +-scale of its block: the block's L2 norm is kept (so Adam's second
    moment sees the true mean square; see :mod:`bagua.kernels.sign1` for why not the mean |x|),
    but one encode is far from the input (a block of N(0, 1) values errs by ~0.6 per element,
    relative to its norm). Use it with error feedback, which sends what a
    step's rounding left out in the next steps (``bagua.comm.compressed_allreduce(...,
    error_feedback=ErrorFeedback())``). Triton kernels on CUDA, a torch path on CPU
    (:mod:`bagua.kernels.sign1`). NaN/Inf input raises ValueError naming the first bad block.

    Args:
        block_size: elements per scale, a power of two >= 8 (default 256: the scales add 12.5%;
            smaller blocks follow the values' magnitudes more closely, see :mod:`bagua.kernels.sign1`).

    Example::

        >>> codec = Sign1(block_size=8)
        >>> p = codec.encode(torch.tensor([1.0, -5.0, 5.0, -7.0]))
        >>> p.data.numel(), codec.decode(p).tolist()           # 4 bytes of scale, 1 of signs
        (5, [5.0, -5.0, 5.0, -5.0])
    """

    name: ClassVar[str] = "sign1"
    _kernels = _s1
    _needs_tail_lengths = True


_CODECS: dict[str, type[Codec]] = {cls.name: cls for cls in (FP16, BF16, MinMaxUInt8, Sign1)}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)
"""The codec names ``get_codec`` and the collectives' ``compression=`` take: ``("fp16", "bf16", "minmax_uint8", "sign1")``."""


def get_codec(name_or_codec: Union[str, Codec]) -> Codec:
    """Returns a codec by name (case-insensitive, default parameters) or the given Codec itself.

    Args:
        name_or_codec: one of :data:`CODEC_NAMES` (``"fp16"``, ``"bf16"``, ``"minmax_uint8"``,
            ``"sign1"``) or a
            :class:`Codec` instance (e.g. ``MinMaxUInt8(block_size=256)``).

    Returns:
        A :class:`Codec`.

    Raises:
        ValueError: unknown name. TypeError: neither a string nor a Codec.

    Example::

        >>> get_codec("MinMax_UInt8")
        MinMaxUInt8(block_size=1024)
    """
    if isinstance(name_or_codec, Codec):
        return name_or_codec
    if isinstance(name_or_codec, str):
        cls = _CODECS.get(name_or_codec.strip().lower())
        if cls is None:
            raise ValueError(f"unknown codec {name_or_codec!r}; known codecs: {', '.join(CODEC_NAMES)}")
        return cls()
    raise TypeError(
        f"codec must be a name ({', '.join(CODEC_NAMES)}) or a bagua.comm.compression.Codec, "
        f"got {type(name_or_codec).__name__}"
    )
