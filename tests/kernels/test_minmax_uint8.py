"""MinMax-UInt8 kernels: Triton (on CPU through TRITON_INTERPRET=1, see tests/conftest.py) against
the torch reference, bit for bit; plus the reference's own contract and argument checks."""

import os
import subprocess
import sys

import pytest
import torch

from bagua.kernels import _codec, _triton
from bagua.kernels import minmax_uint8 as mm

HAS_CUDA = torch.cuda.is_available()
# Without CUDA the Triton kernels run on CPU tensors through the interpreter (set in conftest.py).
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not mm.HAS_TRITON or (not HAS_CUDA and not _triton.triton_interpreting()),
    reason="needs triton, with CUDA or TRITON_INTERPRET=1",
)
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
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raises_naming_the_block(path, bad):
    if path == "triton" and not (mm.HAS_TRITON and (HAS_CUDA or _triton.triton_interpreting())):
        pytest.skip("needs triton")
    x = torch.randn(3000)
    x[2100] = bad
    fn = mm.encode_reference if path == "reference" else mm.encode_triton
    device = "cpu" if path == "reference" else KERNEL_DEVICE
    with pytest.raises(ValueError, match=r"block 2 \(elements \[2048, 3000\)\).*element 2100") as info:
        fn(x.to(device), 1024)
    assert "gradient clipping" in str(info.value)


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


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mm.encode(torch.arange(10)), "dtype float32, float16 or bfloat16"),
        (lambda: mm.encode(torch.randn(8, 8).t()), "contiguous"),
        (lambda: mm.encode(torch.randn(10), block_size=1000), "power of two"),
        (lambda: mm.encode(torch.randn(10), block_size=0), "power of two"),
        (lambda: mm.encode(torch.randn(10), out=torch.empty(17, dtype=torch.uint8)), "18 bytes"),
        (lambda: mm.encode(torch.randn(10), out=torch.empty(18)), "torch.uint8"),
        (lambda: mm.decode(torch.empty(17, dtype=torch.uint8), 10), "too short"),
        (lambda: mm.decode(torch.empty(18), 10), "torch.uint8"),
        (lambda: mm.decode(torch.empty(18, dtype=torch.uint8), -1), "non-negative"),
        (lambda: mm.decode(torch.empty(18, dtype=torch.uint8), 10, out=torch.empty(9)), "numel = 10"),
        (lambda: mm.decode(torch.empty(18, dtype=torch.uint8), 10, dtype=torch.int32), "dtype must be"),
        (lambda: mm.wire_numel(10, 3), "power of two"),
    ],
)
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@needs_triton
def test_triton_path_needs_cuda_or_interpreter(monkeypatch):
    if HAS_CUDA:
        pytest.skip("only meaningful without CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        mm.encode_triton(torch.randn(10))


def test_cpu_dispatches_to_reference(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(mm, "encode_triton", boom)
    monkeypatch.setattr(mm, "decode_triton", boom)
    x = torch.randn(2000)
    assert torch.equal(mm.decode(mm.encode(x), 2000), mm.decode_reference(mm.encode_reference(x), 2000))


def test_missing_triton_gives_clear_error(monkeypatch):
    monkeypatch.setattr(_triton, "triton", None)
    monkeypatch.setattr(_triton, "TRITON_IMPORT_ERROR", ImportError("No module named 'triton'"))
    with pytest.raises(RuntimeError, match=r"pip install 'bagua-torch\[gpu\]' \(in a clone: pip install -e '\.\[gpu\]'\)"):
        mm.encode_triton(torch.randn(10))
    with pytest.raises(RuntimeError, match=r"pip install 'bagua-torch\[gpu\]' \(in a clone: pip install -e '\.\[gpu\]'\)"):
        mm.decode_triton(torch.zeros(18, dtype=torch.uint8), 10)


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from bagua.kernels import minmax_uint8 as mm\n"
        "assert not mm.HAS_TRITON\n"
        "x = torch.randn(3000)\n"
        "assert (mm.decode(mm.encode(x), 3000) - x).abs().max() < 0.05\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernels_match_reference(dtype):
    n = (1 << 22) + 12345
    x = _data(n, dtype, seed=7, device="cuda")
    wire = mm.encode(x)  # dispatches to Triton
    ref = mm.encode_reference(x.cpu())
    assert torch.equal(wire.cpu(), ref)
    y = mm.decode(wire, n, dtype=dtype)
    assert y.is_cuda
    assert torch.equal(y.cpu(), mm.decode_reference(ref, n, dtype=dtype))
    x[12345] = float("nan")
    with pytest.raises(ValueError, match="block 12"):
        mm.encode(x)
