"""Codecs of bagua.comm.compression: round-trip error bounds, wire sizes, NaN/Inf policy, registry."""

import pytest
import torch

from bagua.comm.compression import BF16, CODEC_NAMES, FP16, Codec, MinMaxUInt8, Payload, get_codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (7,), (3, 500), (2, 3, 1025)]
ALL_CODECS = [FP16(), BF16(), MinMaxUInt8(), MinMaxUInt8(block_size=256)]


def _randn(shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _minmax_tolerance(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per element: half a step of its block, plus float32 rounding of values that large."""
    xf = x.float().reshape(-1)
    n = xf.numel()
    nb = -(-n // block_size)
    padded = torch.cat([xf, xf[-1:].expand(nb * block_size - n)]).view(nb, block_size)
    mn = padded.amin(1).repeat_interleave(block_size)[:n]
    mx = padded.amax(1).repeat_interleave(block_size)[:n]
    eps = torch.finfo(torch.float32).eps
    return (mx - mn) / 255 / 2 + 1e-6 * (mx - mn) + 4 * eps * torch.maximum(mn.abs(), mx.abs())


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_preserves_shape_dtype_and_bounds_error(codec, dtype, shape):
    x = _randn(shape, dtype, seed=len(shape), scale=2.0)
    p = codec.encode(x)
    assert p.shape == x.shape and p.dtype == dtype
    assert p.data.dtype == codec.wire_dtype and p.data.dim() == 1 and p.data.is_contiguous()
    assert p.data.numel() == codec.wire_numel(x.numel())
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - x.float()).abs().reshape(-1)
    if isinstance(codec, MinMaxUInt8):
        tol = _minmax_tolerance(x, codec.block_size)
        if dtype != torch.float32:  # the decoded value is rounded once more to the output dtype
            tol = tol + y.float().abs().reshape(-1) * torch.finfo(dtype).eps
    else:  # one round to nearest into the wire dtype; exact when the input is already that coarse
        tol = x.float().abs().reshape(-1) * torch.finfo(codec.wire_dtype).eps / 2
    assert (err <= tol).all(), f"max excess {(err - tol).max().item()}"


@pytest.mark.parametrize("block_size", [256, 1024])
def test_minmax_large_offset_and_random_normal(block_size):
    codec = MinMaxUInt8(block_size)
    for x in (_randn(100_003, seed=1), _randn(100_003, seed=2, scale=0.01, offset=1e4)):
        y = codec.decode(codec.encode(x))
        assert ((y - x).abs() <= _minmax_tolerance(x, block_size)).all()
    # error is small relative to the data's spread: ~ (range / 255) / 2 at most
    x = _randn(100_000, seed=3)
    err = (codec.decode(codec.encode(x)) - x).abs()
    assert err.max() < (x.max() - x.min()) / 255 / 2 * 1.01
    assert err.mean() < err.max() / 1.5  # rounding errors spread out, not stuck at the bound


def test_minmax_constant_blocks_are_exact():
    codec = MinMaxUInt8(block_size=256)
    x = _randn(1000, seed=4)
    x[:256] = 3.14159
    x[512:768] = -2.0e-3
    y = codec.decode(codec.encode(x))
    assert torch.equal(y[:256], x[:256]) and torch.equal(y[512:768], x[512:768])
    z = torch.full((5, 7), 123.456, dtype=torch.float16)
    assert torch.equal(codec.decode(codec.encode(z)), z)


def test_wire_sizes():
    n = 1 << 20
    x = torch.randn(n)
    mm = MinMaxUInt8()
    assert mm.encode(x).nbytes == 8 * (n // 1024) + n == mm.wire_numel(n)
    assert x.numel() * 4 / mm.encode(x).nbytes > 3.96  # ~4x fewer bytes than fp32
    assert MinMaxUInt8(256).wire_numel(1000) == 8 * 4 + 1000
    assert MinMaxUInt8().wire_numel(0) == 0
    for codec in (FP16(), BF16()):
        p = codec.encode(x)
        assert p.nbytes == 2 * n and codec.wire_numel(n) == n


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_raises(codec, bad):
    x = torch.randn(4, 700)
    x[2, 11] = bad
    with pytest.raises(ValueError, match="NaN|Inf"):
        codec.encode(x)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_check_finite_false_lets_nonfinite_through_as_nan_or_inf(codec):
    x = torch.randn(3000)
    x[5] = float("nan")
    y = codec.decode(codec.encode(x, check_finite=False))
    assert torch.isnan(y[5])
    assert torch.isfinite(y[-100:]).all()


def test_fp16_overflow_raises_but_bf16_does_not():
    x = torch.tensor([1.0, 70000.0, 2.0])
    with pytest.raises(ValueError, match=r"float16 range.*flat index 1"):
        FP16().encode(x)
    assert BF16().decode(BF16().encode(x))[1] == 70144.0  # nearest bfloat16


def test_get_codec():
    assert isinstance(get_codec("fp16"), FP16)
    assert isinstance(get_codec("BF16"), BF16)
    assert get_codec("MinMax_UInt8") == MinMaxUInt8(1024)
    mine = MinMaxUInt8(block_size=256)
    assert get_codec(mine) is mine
    assert CODEC_NAMES == ("fp16", "bf16", "minmax_uint8", "sign1")
    with pytest.raises(ValueError, match="fp16, bf16, minmax_uint8"):
        get_codec("int4")
    with pytest.raises(TypeError, match="Codec"):
        get_codec(8)
    with pytest.raises(ValueError, match="power of two"):
        MinMaxUInt8(block_size=100)
    with pytest.raises(AttributeError):
        mine.block_size = 512
    assert repr(mine) == "MinMaxUInt8(block_size=256)" and mine != MinMaxUInt8()
    assert all(isinstance(get_codec(n), Codec) for n in CODEC_NAMES)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_receiver_rebuilds_payload_from_raw_bytes(codec):
    x = _randn((6, 333), torch.bfloat16, seed=5)
    sent = codec.encode(x)
    received = torch.empty(codec.wire_numel(x.numel()), dtype=codec.wire_dtype)
    received.copy_(sent.data)  # as filled by a recv/allgather
    y = codec.decode(Payload(received, (6, 333), torch.bfloat16))
    assert torch.equal(y, codec.decode(sent))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_decode_into_out(codec):
    x = _randn((40, 50), seed=6)
    p = codec.encode(x)
    expected = codec.decode(p)
    out = torch.empty(40, 50)
    assert codec.decode(p, out=out) is out
    assert torch.equal(out, expected)
    strided = torch.empty(50, 40).t()  # non-contiguous out of the right shape
    assert codec.decode(p, out=strided) is strided
    assert torch.equal(strided, expected)
    half = torch.empty(40, 50, dtype=torch.float16)  # out's dtype wins
    assert torch.equal(codec.decode(p, out=half), expected.half())
    with pytest.raises(ValueError, match="shape"):
        codec.decode(p, out=torch.empty(2000))


def test_decode_into_rows_of_a_buffer_from_an_odd_length_wire():
    # compressed allreduce decodes rows of a [world, wire_len] receive buffer: odd byte offsets
    codec = MinMaxUInt8(block_size=256)
    x = _randn((3, 301), seed=7)
    wire = torch.stack([codec.encode(row).data for row in x])
    out = torch.empty(3, 301)
    for j, data in enumerate(wire):
        codec.decode(Payload(data, torch.Size([301]), torch.float32), out=out[j])
    for j in range(3):
        assert ((out[j] - x[j]).abs() <= _minmax_tolerance(x[j], 256)).all()
    assert torch.equal(out[1], codec.decode(codec.encode(x[1])))


def test_payload_and_decode_validation():
    with pytest.raises(ValueError, match="1-D contiguous"):
        Payload(torch.zeros(2, 3, dtype=torch.uint8), (6,), torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        Payload(torch.zeros(6, dtype=torch.uint8), (6,), "float32")
    p = Payload(torch.zeros(10, dtype=torch.uint8), [10], torch.float32)
    assert p.shape == torch.Size([10]) and p.numel == 10
    with pytest.raises(ValueError, match="18 wire elements"):
        MinMaxUInt8().decode(p)
    with pytest.raises(ValueError, match="torch.float16"):
        FP16().decode(p)
    with pytest.raises(ValueError, match="floating-point"):
        FP16().encode(torch.arange(4))
