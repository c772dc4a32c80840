"""MinMax-UInt8 kernels: Triton (on CPU through TRITON_INTERPRET=1, see tests/conftest.py) against
the torch reference, bit for bit; plus the reference's own contract and argument checks."""

import pytest
import torch

from bagua.kernels import _codec
from bagua.kernels import minmax_uint8 as mm
from ._device import KERNEL_DEVICE, needs_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _data(numel, dtype, seed=0, device="cpu"):
    """Random normal data with a scale/offset per block size and a constant first block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 3.0 + 1.0
    if numel > 300:
        x[:256] = 0.75  # a constant block (for block sizes 256), exact after a round trip
        x[-40:] += 50.0  # an offset tail
    return x.to(dtype).to(device)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [256, 1024])
@pytest.mark.parametrize("numel", [1, 7, 1023, 1024, 1025, 5000])
def test_triton_matches_reference_bit_for_bit(numel, block_size, dtype):
    x = _data(numel, dtype, seed=numel)
    ref = mm.encode_reference(x, block_size)
    got = mm.encode_triton(x.to(KERNEL_DEVICE), block_size)
    assert got.dtype == torch.uint8 and got.shape == (mm.wire_numel(numel, block_size),)
    assert torch.equal(got.cpu(), ref), f"{int((got.cpu() != ref).sum())} wire bytes differ"

    for out_dtype in {torch.float32, dtype}:
        y_ref = mm.decode_reference(ref, numel, block_size, dtype=out_dtype)
        y_got = mm.decode_triton(ref.to(KERNEL_DEVICE), numel, block_size, dtype=out_dtype)
        assert y_got.dtype == out_dtype and y_got.shape == (numel,)
        assert torch.equal(y_got.cpu(), y_ref)


@needs_triton
def test_triton_decode_into_out_and_unaligned_wire():
    x = _data(1500, torch.float32, seed=3)
    ref = mm.encode_reference(x, 256)
    # a wire that starts at an odd byte offset (a row of a [world, wire_len] buffer)
    buf = torch.zeros(ref.numel() + 1, dtype=torch.uint8, device=KERNEL_DEVICE)
    mm.encode_triton(x.to(KERNEL_DEVICE), 256, out=buf[1:])
    assert torch.equal(buf[1:].cpu(), ref)
    out = torch.empty(30, 50, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    assert mm.decode_triton(buf[1:], 1500, 256, out=out) is out
    assert torch.equal(out.view(-1).cpu(), mm.decode_reference(ref, 1500, 256, dtype=torch.bfloat16))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: inf - inf
@needs_triton
def test_nonfinite_marker_identical_in_both_paths():
    x = torch.randn(3000)
    x[10] = float("nan")
    x[2500] = float("inf")
    ref = mm.encode_reference(x, 1024, check_finite=False)
    got = mm.encode_triton(x.to(KERNEL_DEVICE), 1024, check_finite=False).cpu()
    assert torch.equal(got, ref)
    header = ref[:24].view(torch.float32).view(3, 2)
    assert torch.isnan(header[0]).all() and torch.isfinite(header[1]).all() and torch.isnan(header[2]).all()
    assert (ref[24 : 24 + 1024] == 0).all()
    y = mm.decode_reference(ref, 3000, 1024)
    assert torch.isnan(y[:1024]).all() and torch.isnan(y[2048:]).all()
    assert torch.isfinite(y[1024:2048]).all()


def test_range_overflow_raises():
    x = torch.tensor([-3.0e38, 3.0e38, 0.0])
    with pytest.raises(ValueError, match="overflows float32"):
        mm.encode(x)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: inf - inf
@needs_triton
def test_range_overflow_raises_triton():
    x = torch.tensor([-3.0e38, 3.0e38, 0.0], device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="overflows float32"):
        mm.encode_triton(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 5000])
def test_reference_layout_and_error_bound(numel, dtype):
    B = 256
    x = _data(numel, dtype, seed=numel + 1)
    wire = mm.encode(x, B)
    nb = -(-numel // B)
    assert wire.numel() == mm.wire_numel(numel, B) == 8 * nb + numel
    header = wire[: 8 * nb].view(torch.float32).view(nb, 2)
    xf = x.float()
    for b in range(nb):
        block = xf[b * B : (b + 1) * B]
        assert header[b, 0] == block.min() and header[b, 1] == block.max()
    y = mm.decode(wire, numel, B)
    mn = header[:, 0].repeat_interleave(B)[:numel]
    mx = header[:, 1].repeat_interleave(B)[:numel]
    scale = (mx - mn) / 255
    eps = torch.finfo(torch.float32).eps
    tol = scale / 2 + 4 * eps * torch.maximum(mn.abs(), mx.abs())
    assert ((y - xf).abs() <= tol).all()
    assert torch.equal(y[mn == mx], xf[mn == mx])  # constant blocks are exact


def test_codes_are_round_half_up_of_the_scaled_offset():
    x = torch.tensor([0.0, 1.0, 2.0, 255.0, 127.5, 127.49])
    wire = mm.encode(x, 8)
    assert wire[8:].tolist() == [0, 1, 2, 255, 128, 127]
    assert mm.decode(wire, 6, 8).tolist()[:4] == [0.0, 1.0, 2.0, 255.0]


def test_chunked_reference_matches_one_shot(monkeypatch):
    x = _data(10_000, torch.float16, seed=9)
    whole = mm.encode(x, 256)
    y16, y32 = mm.decode(whole, 10_000, 256, dtype=torch.float16), mm.decode(whole, 10_000, 256)
    monkeypatch.setattr(_codec, "REF_CHUNK_ELEMS", 512)  # many chunks and a tail
    assert torch.equal(mm.encode(x, 256), whole)
    assert torch.equal(mm.decode(whole, 10_000, 256, dtype=torch.float16), y16)
    assert torch.equal(mm.decode(whole, 10_000, 256), y32)


def test_empty_and_out_arguments():
    assert mm.encode(torch.empty(0)).numel() == 0
    assert mm.decode(torch.empty(0, dtype=torch.uint8), 0).numel() == 0
    x = torch.randn(4, 300)
    out = torch.empty(mm.wire_numel(1200, 256), dtype=torch.uint8)
    assert mm.encode(x, 256, out=out) is out
    assert torch.equal(out, mm.encode(x.view(-1), 256))
    y = torch.empty(4, 300, dtype=torch.float16)
    assert mm.decode(out, 1200, 256, out=y) is y
    longer = torch.cat([out, torch.zeros(5, dtype=torch.uint8)])  # trailing bytes are ignored
    assert torch.equal(mm.decode(longer, 1200, 256, dtype=torch.float16), y.view(-1))
