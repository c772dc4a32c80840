"""``MinMaxUInt8`` with the interface of the original's ``tests.internal.compressor`` (``compress``
-> ``(minmax, codes)``, ``decompress(minmax, codes)``), quantizing as bagua's codec does.

Deliberate difference: the original's reference quantized a whole tensor on one grid anchored
at zero (levels ``round(x * scale)``, ``scale = 255 / (max - min + 1e-7)``), as its CUDA kernel
did; bagua's ``MinMaxUInt8`` quantizes blocks of 1024 elements on a grid from each block's min
(exact for constant blocks). An 8-bit code may then differ by one level (on the ported
low-precision test, weights by up to 1.5e-5 after 10 steps, over its 1e-5 tolerance), so the
reference simulates the algorithm with the codec bagua runs; with it, bagua's ranks match the
reference bit for bit. ``minmax`` holds the (min, max) of every block.

Example::

    minmax, codes = MinMaxUInt8().compress(x)
    y = MinMaxUInt8().decompress(minmax, codes)
"""

import torch

from bagua.comm.compression import MinMaxUInt8 as BaguaMinMaxUInt8
from bagua.comm.compression import Payload


class MinMaxUInt8:
    def __init__(self):
        self.codec = BaguaMinMaxUInt8()

    def compress(self, tensor: torch.Tensor):
        """``(float32 (min, max) of each block, uint8 codes shaped like tensor)``."""
        wire = self.codec.encode(tensor).data  # the blocks' (min, max) pairs, then one code per element
        header = wire.numel() - tensor.numel()
        return wire[:header].view(torch.float32).clone(), wire[header:].view(tensor.shape).clone()

    def decompress(self, minmax: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
        """The float32 values that ``compress`` encoded as ``(minmax, compressed)``."""
        wire = torch.cat([minmax.contiguous().view(torch.uint8), compressed.reshape(-1)])
        return self.codec.decode(Payload(wire, compressed.shape, torch.float32))
