import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch

from bagua.data import CachedDataset, CacheLoader, stores
from bagua.data.serialization import SerializationError, UntrustedValueError, dumps
from tests.data.samples import BadSampleDataset, LoggingDataset, SampleDataset, make_sample, same
from tests.harness import run_ranks
from tests.payloads import RunsCodeWhenUnpickled

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_same_values_and_types_over_epochs(backend):
    name, kw = backend
    src = SampleDataset(50)
    ds = CachedDataset(src, backend=name, dataset_name="train", writer_buffer_size=7, **kw)
    assert len(ds) == 50 and isinstance(ds.cache_loader, CacheLoader)
    for epoch in range(3):
        for i in range(50):
            assert same(ds[i], make_sample(i)), (epoch, i)
        if epoch == 0:
            assert src.computed == 50
    assert src.computed == 50  # epochs 2 and 3 came from the cache
    assert same(ds[-1], make_sample(49))
    batch = ds.__getitems__([3, 1, 3, 49])
    assert all(same(s, make_sample(i)) for s, i in zip(batch, [3, 1, 3, 49]))
    ds.close()


def test_getitems_computes_only_misses_and_each_once(tmp_path):
    src = SampleDataset(40)
    ds = CachedDataset(src, path=str(tmp_path / "c"), writer_buffer_size=100)
    for i in range(0, 40, 4):
        ds[i]
    before = src.computed
    out = ds.__getitems__([5, 5, 8, 9, 12, 5])
    assert [same(s, make_sample(i)) for s, i in zip(out, [5, 5, 8, 9, 12, 5])] == [True] * 6
    assert src.computed - before == 2  # 5 and 9; 8 and 12 were cached, 5 only once
    assert out[0] is not out[1] and out[0][0] is not out[1][0]  # repeats are separate copies
    with pytest.raises(IndexError):
        ds[40]
    ds.close()


def test_several_datasets_in_one_store(backend):
    name, kw = backend
    a = CachedDataset(SampleDataset(20), backend=name, dataset_name="a", **kw)
    b = CachedDataset(BigOffset(30), backend=name, dataset_name="b", **kw)
    for i in range(20):
        assert same(a[i], make_sample(i))
    for i in range(30):
        assert same(b[i], make_sample(i + 1000))
    a.flush(), b.flush()
    assert a.cache_loader.num_keys() == 50 == b.cache_loader.num_keys()  # one store, counted together
    for i in range(20):  # still apart after both are cached
        assert same(a[i], make_sample(i)) and same(b[i], make_sample(i + 1000))
    a.close(), b.close()


class BigOffset(SampleDataset):
    def __getitem__(self, i):
        return make_sample(i + 1000)


def test_dataset_names_never_collide(tmp_path):
    path = str(tmp_path / "c")
    pairs = [("a", "b/c"), ("a/b", "c"), ("", "1"), ("1", ""), ("x", 1), ("x", "1")]
    loaders = [CacheLoader(dataset_name=n, path=path) for n, _ in pairs]
    for (n, k), loader in zip(pairs, loaders):
        assert loader.get(k, lambda key, n=n: f"{n}|{key!r}") == f"{n}|{k!r}"
    assert len({loader.key(k) for (_, k), loader in zip(pairs, loaders)}) == len(pairs)
    for (n, k), loader in zip(pairs, loaders):
        assert loader.get(k, lambda key: pytest.fail("should be cached")) == f"{n}|{k!r}"
    assert loaders[0].num_keys() == len(pairs)
    for loader in loaders:
        loader.close()


def test_cache_loader_get_or_compute(tmp_path):
    loader = CacheLoader(backend="lmdb", dataset_name="sq", path=str(tmp_path / "c"))
    assert isinstance(loader.store, stores.LmdbStore)
    calls = []
    square = lambda k: calls.append(k) or k * k  # noqa: E731
    assert loader.get(12, square) == 144 and loader.get(12, square) == 144
    assert loader.get_many([12, 3, 4], square) == [144, 9, 16]
    assert calls == [12, 3, 4] and loader.num_keys() == 3
    with pytest.raises(ValueError, match="writer_buffer_size"):
        CacheLoader(writer_buffer_size=0, path=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="backend must be one of"):
        CacheLoader(backend="sqlite")
    loader.close()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers(tmp_path, start_method):
    log = tmp_path / "computed.log"
    ds = CachedDataset(LoggingDataset(96, str(log)), path=str(tmp_path / "c"), dataset_name="w")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list,
                                         multiprocessing_context=start_method, timeout=60)
    for epoch in range(2):
        seen = [s for batch in loader for s in batch]
        assert len(seen) == 96 and all(same(s, make_sample(i)) for i, s in enumerate(seen))
        if epoch == 0:
            # the workers flushed their buffers (20 per write) when they exited
            assert ds.cache_loader.num_keys() == 96
    lines = log.read_text().split()
    assert len(lines) == 2 * 96  # computed once each, all in epoch 1, by the workers
    assert str(os.getpid()) not in lines[::2]
    ds.close()


@pytest.mark.parametrize("start_method,server", [("fork", "tcp"), ("spawn", "local")])
def test_dataloader_workers_redis(start_method, server, redis_servers, cache_dir, tmp_path):
    kw = {"hosts": [redis_servers.start()]} if server == "tcp" else {}  # local: RedisStore starts one
    ds = CachedDataset(LoggingDataset(64, str(tmp_path / "log")), backend="redis", **kw)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list,
                                         multiprocessing_context=start_method, timeout=60)
    for epoch in range(2):
        seen = [s for batch in loader for s in batch]
        assert all(same(s, make_sample(i)) for i, s in enumerate(seen))
        assert ds.cache_loader.num_keys() == 64  # workers flushed at exit; the server still runs
    assert len((tmp_path / "log").read_text().split()) == 2 * 64
    ds.close()


def test_fork_while_another_thread_reads(tmp_path):
    """DataLoader forks workers while a thread of the parent keeps reading the same LMDB."""
    import threading

    ds = CachedDataset(SampleDataset(64), path=str(tmp_path / "c"), dataset_name="t", writer_buffer_size=1)
    for i in range(64):
        ds[i]
    stop, errors, reads = threading.Event(), [], [0]

    def reader():
        try:
            while not stop.is_set():
                for i in range(64):
                    assert same(ds[i], make_sample(i))
                    reads[0] += 1
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list,
                                             multiprocessing_context="fork", timeout=60)
        for epoch in range(3):
            seen = [s for batch in loader for s in batch]
            assert all(same(s, make_sample(i)) for i, s in enumerate(seen))
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert reads[0] > 0 and ds.dataset.computed == 64
    ds.close()


def _write_concurrently(rank, backend, kw, log_path):
    ds = CachedDataset(LoggingDataset(200, log_path), backend=backend, dataset_name="shared",
                       writer_buffer_size=1, **kw)
    order = range(200) if rank == 0 else range(199, -1, -1)
    for epoch in range(2):
        for i in order:
            assert same(ds[i], make_sample(i)), (rank, epoch, i)
    n = ds.cache_loader.num_keys()
    ds.close()
    return n


def test_two_processes_write_the_same_cache_at_once(backend, tmp_path):
    name, kw = backend
    counts = run_ranks(_write_concurrently, 2, name, kw, str(tmp_path / "log"), init=False, timeout=120)
    assert counts[1] == 200 or counts[0] == 200
    # the same dataset class (another class would be another fingerprint: its samples recomputed)
    ds = CachedDataset(LoggingDataset(200, str(tmp_path / "reader.log")), backend=name, dataset_name="shared", **kw)
    assert ds.cache_loader.num_keys() == 200
    assert all(same(ds[i], make_sample(i)) for i in range(200)) and ds.dataset.computed == 0
    computed = len((tmp_path / "log").read_text().splitlines())
    assert 200 <= computed < 400  # together they computed each sample about once
    ds.close()


@pytest.mark.parametrize("batched", [False, True])
def test_unserializable_sample_names_index_and_type(tmp_path, batched):
    ds = CachedDataset(BadSampleDataset(8), path=str(tmp_path / "c"), dataset_name="bad")
    with pytest.raises(SerializationError, match=r"index 3 of dataset 'bad'.*builtins\.tuple"):
        ds.__getitems__([1, 2, 3]) if batched else ds[3]
    assert same(ds[2], make_sample(2))  # others unaffected
    ds.close()


@pytest.mark.parametrize("backend_name", ["lmdb", "redis"])
def test_corrupted_values_are_recomputed_overwritten_and_warned_once(backend_name, tmp_path, redis_servers, caplog):
    kw = {"path": str(tmp_path / "c")} if backend_name == "lmdb" else {"hosts": [redis_servers.start()]}
    src = SampleDataset(10)
    ds = CachedDataset(src, backend=backend_name, dataset_name="c", writer_buffer_size=1, **kw)
    for i in range(10):
        ds[i]
    store, key = ds.cache_loader.store, ds.cache_loader.key
    good = store.get(key(4))
    store.set(key(2), good[: len(good) // 2])  # truncated
    flipped = bytearray(good)
    flipped[-5] ^= 1
    store.set(key(4), bytes(flipped))  # one bit of the payload
    store.set(key(6), b"garbage")
    with caplog.at_level(logging.WARNING, logger="bagua.data"):
        assert same(ds[2], make_sample(2))
        out = ds.__getitems__([4, 5, 6])
    assert all(same(s, make_sample(i)) for s, i in zip(out, [4, 5, 6]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "index 2" in warnings[0] and "recomputing" in warnings[0], warnings
    assert src.computed == 13
    ds.flush()
    assert store.get(key(4)) == good  # overwritten with the recomputed value
    assert all(same(ds[i], make_sample(i)) for i in range(10)) and src.computed == 13
    ds.close()


def test_a_cached_value_naming_other_code_is_refused_unless_trusted(backend, tmp_path):
    name, kw = backend
    marker = tmp_path / "marker"
    ds = CachedDataset(SampleDataset(10), backend=name, dataset_name="h", **kw)
    hostile = ds.cache_loader._stamp + dumps(RunsCodeWhenUnpickled(marker), trust_pickled=True)  # stamped as ours
    ds.cache_loader.store.set(ds.cache_loader.key(3), hostile)  # by someone else
    refused = r"names tests\.payloads\.write_marker, .*CachedDataset\(\.\.\., trust_pickled_values=True\)"
    for read in (lambda: ds[3], lambda: ds.__getitems__([2, 3])):
        with pytest.raises(UntrustedValueError, match=refused):
            read()
    assert not marker.exists() and ds.dataset.computed == 0  # a refused value is not a miss to recompute
    ds.close()

    trusting = CachedDataset(SampleDataset(10), backend=name, dataset_name="h", trust_pickled_values=True, **kw)
    assert pickle.loads(pickle.dumps(trusting)).cache_loader.trust_pickled_values  # as DataLoader workers get it
    assert trusting[3] == str(marker) and marker.exists()
    trusting.close()


def test_a_sample_the_cache_would_refuse_to_read_fails_when_first_cached(tmp_path):
    ds = CachedDataset([RunsCodeWhenUnpickled(tmp_path / "marker")] * 4, path=str(tmp_path / "c"), dataset_name="w")
    with pytest.raises(UntrustedValueError, match=r"index 1 of dataset 'w' names tests\.payloads\.write_marker"):
        ds[1]
    ds.close()


_EXIT_CHILD = """
import sys
from bagua.data import CachedDataset
from tests.data.samples import SampleDataset
ds = CachedDataset(SampleDataset(50), path=sys.argv[1], dataset_name="exit", writer_buffer_size=1000)
for i in range(30):
    ds[i]
ds.__getitems__(list(range(30, 40)))
assert ds.cache_loader.store.num_keys() == 0  # still buffered
# no close(): the interpreter exits
"""


def test_buffered_writes_are_flushed_at_exit_and_on_close(tmp_path):
    path = str(tmp_path / "c")
    out = subprocess.run([sys.executable, "-c", _EXIT_CHILD, path], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    ds = CachedDataset(SampleDataset(50), path=path, dataset_name="exit", writer_buffer_size=1000)
    assert ds.cache_loader.store.num_keys() == 40
    assert all(same(ds[i], make_sample(i)) for i in range(40)) and ds.dataset.computed == 0
    for i in range(40, 50):
        ds[i]
    assert ds.cache_loader.store.num_keys() == 40
    ds.close()
    assert stores.LmdbStore(path=path).num_keys() == 50
