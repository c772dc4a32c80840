"""Where the kernel tests run the Triton kernels: on the GPU, or on CPU through Triton's
interpreter (TRITON_INTERPRET=1, set in tests/conftest.py when there is no CUDA device)."""

import pytest
import torch

from bagua.kernels import _triton

HAS_CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
CAN_RUN_TRITON = _triton.HAS_TRITON and (HAS_CUDA or _triton.triton_interpreting())
needs_triton = pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs triton, with CUDA or TRITON_INTERPRET=1")


def encoder(codec, path: str):
    """(``codec``'s encode function, the device to give it) for ``path``, "reference" or
    "triton" (skipped where the kernels cannot run)."""
    if path == "triton" and not CAN_RUN_TRITON:
        pytest.skip("needs triton, with CUDA or TRITON_INTERPRET=1")
    return (codec.encode_reference, "cpu") if path == "reference" else (codec.encode_triton, KERNEL_DEVICE)
