"""Sign1 kernels: Triton (on CPU through TRITON_INTERPRET=1, see tests/conftest.py) against the
torch reference, bit for bit (the scale is a fixed pairwise tree, so the math allows it); the
codec's contract (the root mean square per block, the L2 norm kept, zeros exact); edge cases."""

import numpy as np
import pytest
import torch

from bagua.kernels import sign1 as s1
from ._device import KERNEL_DEVICE, needs_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _data(numel, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 3.0
    x[::7] = 0.0  # zeros (and their sign: +)
    x[1::11] = -0.0
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [32, 256])
@pytest.mark.parametrize("numel", [1, 7, 9, 255, 256, 257, 700, 2600])  # 2600: grouped, left-over and tail programs
def test_triton_matches_reference_bit_for_bit(numel, block_size, dtype):
    x = _data(numel, dtype, seed=numel)
    ref = s1.encode_reference(x, block_size)
    got = s1.encode_triton(x.to(KERNEL_DEVICE), block_size)
    assert ref.numel() == s1.wire_numel(numel, block_size) == 4 * -(-numel // block_size) + -(-numel // 8)
    assert torch.equal(got.cpu(), ref), f"{int((got.cpu() != ref).sum())} wire bytes differ"
    for out_dtype in {torch.float32, dtype}:
        y_ref = s1.decode_reference(ref, numel, block_size, dtype=out_dtype)
        y_got = s1.decode_triton(ref.to(KERNEL_DEVICE), numel, block_size, dtype=out_dtype)
        assert y_got.dtype == out_dtype and torch.equal(y_got.cpu(), y_ref)


@needs_triton
def test_padded_tails_match_and_scale_only_their_real_elements():
    """A stream of whole blocks whose last ones are padded (as compressed.py sends a chunk of many
    tensors): each tail's scale is that of its real elements alone, in both paths."""
    block = 256
    parts = [_data(3 * block, seed=1), _data(100, seed=2), _data(block, seed=3), _data(7, seed=4)]
    tails = [100, block, 7]
    stream = torch.cat([parts[0]] + [torch.cat([p, p[-1:].expand(block - p.numel())]) for p in parts[1:]])
    ref = s1.encode_reference(stream, block, tail_lengths=tails)
    assert torch.equal(s1.encode_triton(stream.to(KERNEL_DEVICE), block, tail_lengths=tails).cpu(), ref)
    scales = ref[: 4 * 6].view(torch.float32)
    for i, part in enumerate(parts[1:]):
        alone = s1.encode_reference(part, block)[:4].view(torch.float32)
        assert torch.equal(scales[3 + i : 4 + i], alone)
    assert torch.equal(s1.encode_reference(stream, block, tail_lengths=[]), s1.encode_reference(stream, block))


@pytest.mark.parametrize("numel", [1, 13, 1000, 4096])
def test_scale_is_the_root_mean_square_and_keeps_the_l2_norm(numel):
    block = 256
    x = _data(numel, seed=5)
    y = s1.decode(s1.encode(x, block), numel, block)
    for b in range(0, numel, block):
        xb, yb = x[b : b + block], y[b : b + block]
        torch.testing.assert_close(yb.abs(), xb.square().mean().sqrt().expand_as(yb), rtol=1e-6, atol=0)
        torch.testing.assert_close(yb.square().sum(), xb.square().sum(), rtol=1e-5, atol=0)
        assert torch.equal(yb >= 0, xb >= 0)  # signs exact; zeros (+0 and -0) decode as +


def test_the_reference_scale_is_the_ieee_square_root_of_the_mean_square():
    """The kernel's sqrt_rn is IEEE; torch's float32 sqrt on CPU is not always (about 1 value in
    200 rounded the other way on an AVX-512 machine: the Triton path then differed in a scale's last
    bit). NumPy's float32 square root is IEEE: the reference must give its bits for every block."""
    block, blocks = 64, 4096
    x = _data(block * blocks, seed=6)
    scales = s1.encode_reference(x, block)[: 4 * blocks].view(torch.float32)
    sums = x.view(blocks, block).square().numpy()  # float32, summed in the codec's pairwise tree
    width = block
    while width > 1:
        width //= 2
        sums[:, :width] += sums[:, width : 2 * width]
    expected = np.sqrt(sums[:, 0] / np.float32(block))
    assert (scales.numpy() == expected).all(), f"{int((scales.numpy() != expected).sum())} scales differ"


def test_zeros_are_exact_and_a_constant_block_too():
    assert torch.equal(s1.decode(s1.encode(torch.zeros(300), 64), 300, 64), torch.zeros(300))
    x = torch.full((64,), -2.5)
    assert torch.equal(s1.decode(s1.encode(x, 64), 64, 64), x)


def test_wire_layout():
    x = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.5, -0.5, 0.5, -2.5, -4.0])  # mean squares 1 and 16
    wire = s1.encode(x, 8)  # two blocks: 8 elements, then 1
    assert wire.numel() == 4 * 2 + 2
    assert wire[:8].view(torch.float32).tolist() == [1.0, 4.0]
    assert wire[8:].tolist() == [0b01011001, 0b11111110]  # the last byte's padding bits: 1
    assert s1.decode(wire, 9, 8).tolist() == [1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -4.0]


def test_a_nonfinite_block_is_marked_by_a_nan_scale_and_zero_bits():
    x = torch.randn(600)
    x[300] = float("inf")
    wire = s1.encode(x, 256, check_finite=False)
    assert torch.isnan(wire[4:8].view(torch.float32)).all() and torch.isfinite(wire[:4].view(torch.float32)).all()
    assert (wire[4 * 3 + 32 : 4 * 3 + 64] == 0).all()


def test_a_sum_that_overflows_float32_raises():
    x = torch.full((16,), 2.0e19)  # squares of 4e38
    with pytest.raises(ValueError, match="sum of squares that overflows float32"):
        s1.encode(x, 8)


def test_empty_out_arguments_and_chunked_reference(monkeypatch):
    assert s1.encode(torch.empty(0)).numel() == 0 and s1.decode(torch.empty(0, dtype=torch.uint8), 0).numel() == 0
    x = _data(5000, torch.bfloat16, seed=9)
    whole = s1.encode(x, 256)
    out = torch.empty(s1.wire_numel(5000, 256), dtype=torch.uint8)
    assert s1.encode(x.view(50, 100), 256, out=out) is out and torch.equal(out, whole)
    y = torch.empty(50, 100, dtype=torch.float16)
    assert s1.decode(whole, 5000, 256, out=y) is y
    from bagua.kernels import _codec

    monkeypatch.setattr(_codec, "REF_CHUNK_ELEMS", 512)  # many chunks and a tail
    assert torch.equal(s1.encode(x, 256), whole)
    assert torch.equal(s1.decode(whole, 5000, 256, dtype=torch.float16), y.view(-1))
