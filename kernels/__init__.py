"""Triton kernels of bagua, each beside a plain-torch reference of the same math.

Installed as ``bagua.kernels``. Every kernel module dispatches by device: the Triton kernel for
CUDA tensors, the torch reference for CPU tensors. Triton is optional (the ``gpu`` extra): the
modules import without it and their CPU paths keep working.

Modules:
    minmax_uint8: the MinMax-UInt8 codec (per-block float32 min/max header, 8-bit codes).
    sign1: the Sign1 codec (per-block float32 mean |x| header, one sign bit per element).
    adam, sgd, lion: single-pass optimizer updates (Adam/AdamW, SGD with momentum, Lion) over
        flat buffers, used by ``bagua.optim.fuse_optimizer`` on CUDA.
"""
