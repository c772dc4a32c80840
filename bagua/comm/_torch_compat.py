"""torch.distributed names that moved between the torch versions we support (>= 2.11).

Example::

    all_gather_flat(output, input, group=pg.group)
"""

import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (*_into_tensor / *_tensor -> *_single).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
