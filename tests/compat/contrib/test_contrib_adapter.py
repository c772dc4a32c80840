"""What the ported contrib tests do not reach: the original's signatures and errors as translated."""

from __future__ import annotations

import pytest
import redis
import torch

import bagua.parallel
from bagua.data import stores
from bagua.torch_api.contrib import (
    CacheLoader,
    CachedDataset,
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
    fuse_optimizer,
)
from bagua.torch_api.contrib.fuse.optimizer import fuse_step, is_fused_optimizer
from bagua.torch_api.contrib.sync_batchnorm import SyncBatchNorm
from bagua.torch_api.contrib.utils.redis_store import RedisStore, start_redis_server_cli
from bagua.torch_api.env import find_free_network_port


def _linear_and_sgd():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_fuse_optimizer_errors_and_count_are_the_originals():
    model, opt = _linear_and_sgd()
    with pytest.raises(ValueError, match="needs a fused optimizer, got a plain SGD"):
        fuse_step(opt)
    assert fuse_optimizer(opt) is opt and is_fused_optimizer(opt) and opt._bagua_fused_count == 0
    with pytest.raises(RuntimeError, match="trying to fuse an optimizer twice"):
        fuse_optimizer(opt)
    for step in range(3):
        model(torch.ones(1, 3)).sum().backward()
        fuse_step(opt) if step != 1 else opt.step()
    assert opt._bagua_fused_count == 2  # weight and bias as one tensor, in each of the 2 fuse_steps


def test_samplers_take_the_original_positional_arguments():
    dataset = torch.utils.data.TensorDataset(torch.arange(11))
    complexity = lambda sample: int(sample[0]) % 4  # noqa: E731
    samplers = [LoadBalancingDistributedSampler(dataset, complexity, 2, rank, True, 7, False, 0.5) for rank in (0, 1)]
    for rank, sampler in enumerate(samplers):
        sampler.set_epoch(3)
        chunks, order = sampler.shuffle_chunks()
        assert [chunks[i][rank] for i in order] == list(sampler)
        assert all(len(chunk) == 2 for chunk in chunks) and len(order) == len(sampler) == 6
    assert sorted(set(samplers[0]) | set(samplers[1])) == list(range(11))

    def pairs(indices):
        return [indices[i:i + 2] for i in range(0, len(indices), 2)]

    batches = LoadBalancingDistributedBatchSampler(samplers[1], pairs, True)
    assert batches.drop_last and batches.generate_batches()[1] == list(batches) == pairs(list(samplers[1]))


@pytest.fixture
def two_servers():
    ports = [find_free_network_port(), find_free_network_port()]
    for port in ports:
        start_redis_server_cli(port, 10_000_000, "--maxmemory-policy allkeys-random")
    yield [{"host": "127.0.0.1", "port": str(port)} for port in ports]  # ports as strings, as in the original's docs
    for port in ports:
        redis.Redis(port=port, retry=None).shutdown(nosave=True)


def test_redis_store_without_cluster_mode_uses_the_host_of_this_node(two_servers, monkeypatch):
    assert redis.Redis(port=int(two_servers[0]["port"])).config_get("maxmemory-policy") == {
        "maxmemory-policy": "allkeys-random"}
    monkeypatch.setenv("GROUP_RANK", "3")  # node 3 of a job: 3 % 2 -> the second host
    store = RedisStore(hosts=two_servers, cluster_mode=False)
    store.set("k", b"v")
    assert store.hosts == [f"127.0.0.1:{two_servers[1]['port']}"] and store.status()
    assert redis.Redis(port=int(two_servers[1]["port"])).get("k") == b"v"
    sharded = RedisStore(hosts=two_servers)
    assert isinstance(sharded, stores.Store) and len(sharded.hosts) == 2
    store.close()
    sharded.close()


def test_cache_loader_defaults_to_a_local_redis_server():
    loader = CacheLoader(dataset_name="squares", capacity_per_node=10_000_000)
    assert loader.backend == "redis" and isinstance(loader.store, RedisStore)
    assert loader.get(12, lambda k: k * k) == 144
    assert loader.get(12, lambda k: -1) == 144 and loader.num_keys() == 1
    loader.store.shutdown()
    assert not loader.store.status()


def test_cached_dataset_takes_the_native_lmdb_backend_too(tmp_path):
    cached = CachedDataset([10, 20, 30], backend="lmdb", dataset_name="ds", path=str(tmp_path / "lmdb"))
    assert [cached[i] for i in range(3)] == [10, 20, 30] and cached.cache_loader.num_keys() == 3
    cached.close()


def test_the_opt_in_to_unpickle_any_value_reaches_the_cache(tmp_path):
    from bagua.data.serialization import UntrustedValueError
    from tests.payloads import RunsCodeWhenUnpickled

    marker = tmp_path / "marker"
    samples = [RunsCodeWhenUnpickled(marker)]
    refusing = CachedDataset(samples, backend="lmdb", dataset_name="a", path=str(tmp_path / "lmdb"))
    with pytest.raises(UntrustedValueError, match="trust_pickled_values=True"):
        refusing[0]
    refusing.close()
    cached = CachedDataset(samples, backend="lmdb", dataset_name="b", path=str(tmp_path / "lmdb"),
                           trust_pickled_values=True)
    cached[0]
    cached.flush()
    assert cached[0] == str(marker) and marker.exists()  # read back from the store: fully unpickled
    cached.close()
    marker.unlink()
    loader = CacheLoader(backend="lmdb", dataset_name="c", path=str(tmp_path / "lmdb"), trust_pickled_values=True)
    loader.get(0, lambda k: samples[0])
    loader.flush()
    assert loader.get(0, lambda k: None) == str(marker) and marker.exists()
    loader.close()


def test_sync_batchnorm_is_the_native_one():
    assert SyncBatchNorm is bagua.parallel.SyncBatchNorm
    converted = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
    assert type(converted[0]) is SyncBatchNorm
