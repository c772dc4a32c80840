"""Data loading: load-balanced distributed samplers.

Example::

    import bagua, torch
    bagua.init_process_group()
    sampler = bagua.data.LoadBalancingDistributedSampler(dataset, complexities=lengths)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)
"""

from .load_balancing_sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
