"""What every block codec module (minmax_uint8, sign1) shares: non-finite input (an error naming
the block, or a marker that decodes to NaN), dispatch by device, argument checks, the Triton path's clear errors (no CUDA and no interpreter; no Triton at all), importing
without Triton, and (marked gpu) the CUDA kernels against the references."""

import os
import subprocess
import sys

import pytest
import torch

from bagua.kernels import _codec, _triton
from bagua.kernels import minmax_uint8, sign1

from ._device import encoder

MODULES = [minmax_uint8, sign1]
NAMES = lambda m: m.__name__.rsplit(".", 1)[1]  # noqa: E731
NEEDS_INSTALL = r"pip install 'bagua-torch\[gpu\]' \(in a clone: pip install -e '\.\[gpu\]'\)"
mm, s1 = minmax_uint8, sign1


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
        (lambda: s1.encode(torch.randn(16), block_size=4), "power of two >= 8"),
        (lambda: s1.encode(torch.randn(16), block_size=24), "power of two >= 8"),
        (lambda: s1.encode(torch.randn(20), 8, tail_lengths=[3]), "stream of whole blocks"),
        (lambda: s1.encode(torch.randn(16), 8, tail_lengths=[0]), "1 to block_size = 8"),
        (lambda: s1.encode(torch.randn(16), 8, tail_lengths=[9]), "max 9"),
        (lambda: s1.encode(torch.randn(16), 8, tail_lengths=[1, 2, 3]), "3 lengths for 16"),
        (lambda: s1.decode(torch.empty(5, dtype=torch.uint8), 16, 8), "too short"),
    ],
)
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: inf - inf
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", MODULES, ids=NAMES)
def test_nonfinite_input_raises_naming_the_block_or_is_marked(codec, path, bad):
    encode, device = encoder(codec, path)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3000))
    x[2100] = bad
    where = r"block 2 \(elements \[2048, 3000\)\).*element 2100"
    with pytest.raises(ValueError, match=f"{codec.WIRE.codec} encode.*{where}.*gradient clipping"):
        encode(x.to(device), 1024)
    wire = encode(x.to(device), 1024, check_finite=False).cpu()
    assert torch.equal(wire, codec.encode_reference(x, 1024, check_finite=False))
    y = codec.decode(wire, 3000, 1024)
    assert torch.isnan(y[2048:]).all() and torch.isfinite(y[:2048]).all()


@pytest.mark.parametrize("codec", MODULES, ids=NAMES)
def test_cpu_tensors_go_to_the_reference(codec, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(_codec, "require_block_triton", boom)  # the Triton path's first call
    x = torch.randn(2000)
    assert torch.equal(codec.decode(codec.encode(x), 2000), codec.decode_reference(codec.encode_reference(x), 2000))


@pytest.mark.parametrize("codec", MODULES, ids=NAMES)
def test_the_triton_path_says_what_it_needs(codec, monkeypatch):
    if _triton.HAS_TRITON and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="CUDA tensors"):
            codec.encode_triton(torch.randn(10))
    monkeypatch.setattr(_triton, "triton", None)
    monkeypatch.setattr(_triton, "TRITON_IMPORT_ERROR", ImportError("No module named 'triton'"))
    with pytest.raises(RuntimeError, match=NEEDS_INSTALL):
        codec.encode_triton(torch.randn(16))
    with pytest.raises(RuntimeError, match=NEEDS_INSTALL):
        codec.decode_triton(torch.zeros(codec.wire_numel(16), dtype=torch.uint8), 16)


def test_the_modules_import_and_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from bagua.kernels import minmax_uint8 as mm, sign1\n"
        "assert not mm.HAS_TRITON and not sign1.HAS_TRITON\n"
        "x = torch.randn(3000)\n"
        "assert (mm.decode(mm.encode(x), 3000) - x).abs().max() < 0.05\n"
        "assert torch.equal(sign1.decode(sign1.encode(x), 3000) > 0, x >= 0)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("codec", MODULES, ids=NAMES)
def test_cuda_kernels_match_reference(codec, dtype):
    n = (1 << 22) + 12345
    x = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 3.0 + 1.0).to(dtype).cuda()
    wire = codec.encode(x)  # dispatches to Triton
    ref = codec.encode_reference(x.cpu())
    assert torch.equal(wire.cpu(), ref)
    y = codec.decode(wire, n, dtype=dtype)
    assert y.is_cuda and torch.equal(y.cpu(), codec.decode_reference(ref, n, dtype=dtype))
    x[12345] = float("nan")
    with pytest.raises(ValueError, match=f"block {12345 // codec.DEFAULT_BLOCK_SIZE} "):
        codec.encode(x)


@pytest.mark.parametrize("numel, block, rows", [(0, 256, 4), (5, 256, 4), (256, 256, 4), (3 * 256, 256, 4),
                                                (10 * 256 + 5, 256, 4), (64 * 32, 32, 4), (9 * 32 + 1, 32, 1)])
def test_row_launches_cover_every_block_once_and_mask_only_the_tail(numel, block, rows):
    covered = []
    for grid, first, masked, r in _triton.row_launches(numel, block, rows):
        assert grid > 0 and first % block == 0 and r in (1, rows) and (not masked or (grid, r) == (1, 1))
        covered += [(first // block + i, masked) for i in range(grid * r)]
    blocks = -(-numel // block)
    assert [b for b, _ in covered] == list(range(blocks))
    assert [b for b, masked in covered if masked] == ([blocks - 1] if numel % block else [])
