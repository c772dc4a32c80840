import logging
import os
import pickle
import subprocess
import sys

import pytest

from bagua.data import CachedDataset
from bagua.data.stores import LmdbStore, Store, StorePathError, create_store
from tests.data.samples import SampleDataset, make_sample, same

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_store_interface(tmp_path):
    store = LmdbStore(path=str(tmp_path / "c"))
    assert isinstance(store, Store)
    assert store.get("a") is None and store.num_keys() == 0
    store.set("a", b"1")
    store.mset({"b": b"2", "c": bytearray(b"3")})
    store.mset([("d", memoryview(b"4"))])
    store.set("a", b"one")  # overwrite
    assert store.get("a") == b"one"
    assert store.mget(["a", "b", "c", "d", "zz"]) == [b"one", b"2", b"3", b"4", None]
    assert store.num_keys() == 4
    long_a, long_b = "k" * 600 + "a", "k" * 600 + "b"  # beyond LMDB's 511-byte key limit
    store.mset({long_a: b"A", long_b: b"B"})
    assert store.mget([long_a, long_b]) == [b"A", b"B"]
    store.clear()
    assert store.num_keys() == 0 and store.get("a") is None
    store.close()
    store.close()  # idempotent
    assert store.get("b") is None  # usable again after close: reopens


def test_default_path_is_under_bagua_cache_dir(cache_dir):
    store = LmdbStore()
    assert store.path == os.path.realpath(cache_dir / "lmdb")
    assert os.path.exists(cache_dir / "lmdb" / "data.mdb")
    store.close()
    assert isinstance(create_store("lmdb"), LmdbStore)
    with pytest.raises(ValueError, match="backend must be one of"):
        create_store("memcached")


def test_two_stores_on_one_path_share_data_and_survive_pickling(tmp_path):
    a = LmdbStore(path=str(tmp_path / "c"))
    b = pickle.loads(pickle.dumps(LmdbStore(path=str(tmp_path / "c"))))
    a.set("x", b"1")
    assert b.get("x") == b"1"
    a.close()
    assert b.get("x") == b"1"  # closing one store leaves the other working
    b.close()


def test_path_under_a_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorePathError, match=str(blocker / "cache")) as e:
        LmdbStore(path=str(blocker / "cache"))
    assert "writable" in str(e.value)
    with pytest.raises(ValueError, match="capacity_bytes"):
        LmdbStore(path=str(tmp_path / "c"), capacity_bytes=0)


def test_path_without_write_permission_is_a_clear_error(tmp_path):
    ro = tmp_path / "readonly"
    ro.mkdir()
    target = str(ro / "cache")
    if os.geteuid() != 0:
        os.chmod(ro, 0o555)
        try:
            with pytest.raises(StorePathError) as e:
                LmdbStore(path=target)
        finally:
            os.chmod(ro, 0o755)
        text = str(e.value)
    else:  # root ignores permission bits: use a read-only mount in a private namespace
        code = (
            "import sys\nfrom bagua.data.stores import LmdbStore, StorePathError\n"
            "try:\n    LmdbStore(path=sys.argv[1])\nexcept StorePathError as e:\n    print(e)\n"
        )
        out = subprocess.run(
            ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro,size=64k tmpfs "$1" && exec "$2" -c "$3" "$4"',
             "sh", str(ro), sys.executable, code, target],
            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
        if out.returncode != 0 and "mount" in out.stderr and "python" not in out.stderr.lower():
            pytest.skip(f"root, and cannot mount a read-only tmpfs here: {out.stderr.strip()}")
        assert out.returncode == 0, out.stderr
        text = out.stdout
    assert target in text and "writable" in text, text


_FULL_DISK_CHILD = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
mnt = sys.argv[1]
import numpy as np
from bagua.data import CachedDataset
from bagua.data.stores import LmdbStore, StorePathError
from tests.data.samples import BigSampleDataset

# 1) The disk fills up while caching: one warning, every sample still correct.
ds = CachedDataset(BigSampleDataset(200), path=mnt + "/c1", writer_buffer_size=4)
for epoch in range(2):
    for i in range(200):
        assert (ds[i] == np.full(4096, i, dtype=np.float32)).all(), i
ds.flush()
print("CACHED", ds.cache_loader.num_keys(), flush=True)
# 2) A store created on the full disk: a clear error naming the path.
with open(mnt + "/fill", "wb") as f:
    try:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    except OSError:
        pass
try:
    LmdbStore(path=mnt + "/c2")
    print("NO ERROR")
except StorePathError as e:
    print("ERROR", e)
"""


def test_full_disk(tmp_path):
    """On a real 2 MiB tmpfs (in a private mount namespace): filling up mid-run degrades with
    one warning and correct samples; creating a store on the full disk is a clear error."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and unshare): {probe.stderr.strip()}")
    script = tmp_path / "child.py"
    script.write_text(_FULL_DISK_CHILD)
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=2m tmpfs "$1" && exec "$2" "$3" "$1"',
         "sh", str(mnt), sys.executable, str(script)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    cached = int(out.stdout.split("CACHED ")[1].split()[0])
    assert 0 < cached < 200, out.stdout  # some samples fit, not all
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING bagua.data")]
    assert len(warnings) == 1, out.stderr
    assert "c1" in warnings[0] and "disk is full" in warnings[0]
    error = out.stdout.split("ERROR ", 1)[1]
    assert str(mnt / "c2") in error and "full disk" in error, out.stdout


def test_capacity_reached_keeps_serving_and_warns_once(tmp_path, caplog):
    src = SampleDataset(300)
    ds = CachedDataset(src, path=str(tmp_path / "c"), capacity_bytes=160 << 10, writer_buffer_size=5)
    with caplog.at_level(logging.WARNING, logger="bagua.data"):
        for epoch in range(3):
            for i in range(300):
                assert same(ds[i], make_sample(i))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "capacity" in warnings[0].getMessage(), warnings
    cached = ds.cache_loader.num_keys()
    assert 0 < cached < 300
    assert src.computed == 300 + 2 * (300 - cached)  # later epochs compute only what did not fit
    ds.close()
