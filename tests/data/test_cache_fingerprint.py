"""A cache that knows what filled it: the fingerprint of the dataset, its transforms and version
(bagua.data.fingerprint), a changed transform served new values, the same code reusing the
cache, and the fingerprint the same in every process (other hash seeds, spawned workers)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bagua.data import CachedDataset
from bagua.data.fingerprint import dataset_fingerprint
from tests.data._fingerprint_samples import FingerprintsInWorker, numbers_with

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read_all(transform: str, backend, **kwargs):
    name, kw = backend
    src = numbers_with(transform)
    ds = CachedDataset(src, backend=name, dataset_name="train", **kw, **kwargs)
    values = ds.__getitems__(list(range(10))) + [ds[i] for i in range(10, 20)]
    ds.close()
    return values, src.calls


@pytest.mark.parametrize("old, new", [("x1", "x10"), ("shift1", "shift2"), ("square", "cube")])
def test_a_changed_transform_serves_new_values_and_says_so_once(backend, caplog, old, new):
    expected = {name: [numbers_with(name).transform(i) for i in range(20)] for name in (old, new)}
    assert _read_all(old, backend) == (expected[old], 20)
    with caplog.at_level(logging.INFO, logger="bagua.data"):
        assert _read_all(new, backend) == (expected[new], 20)  # every sample recomputed
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "another dataset, transform or version" in lines[0], lines
    assert _read_all(new, backend)[1] == 0
    assert _read_all(old, backend) == (expected[old], 20)  # overwritten in place: one value per sample


def test_a_new_version_starts_afresh(backend):
    assert _read_all("x1", backend, version="data-v1")[1] == 20
    assert _read_all("x1", backend, version="data-v1")[1] == 0
    assert _read_all("x1", backend, version="data-v2")[1] == 20


_RUN = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
    import torch
    from bagua.data import CachedDataset

    class Squares(torch.utils.data.Dataset):  # defined in the script: __main__.Squares
        def __init__(self, n, transform):
            self.n, self.transform, self.calls = n, transform, 0
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            self.calls += 1
            return self.transform(i * i)

    def tagged():
        tags = {"train", "eval", "test", "val", "dev"}  # a closure value whose repr follows the hash seed
        return lambda x: (x, sorted(tags)[0])

    src = Squares(30, transform=tagged())
    ds = CachedDataset(src, path=sys.argv[1], dataset_name="squares")
    assert [ds[i] for i in range(30)] == [(i * i, "dev") for i in range(30)]
    ds.close()
    print("RESULT", json.dumps({"calls": src.calls, "digest": ds.fingerprint.digest}))
""")


def test_the_same_code_run_again_reuses_the_cache_on_every_rank(tmp_path):
    """New interpreters with other hash seeds, as ranks 0 and 1 and a rerun of rank 0."""
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    runs = []
    for rank, seed in ((0, "1"), (1, "2"), (0, "3")):
        env = {**os.environ, "PYTHONPATH": REPO, "PYTHONHASHSEED": seed, "RANK": str(rank)}
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.split("RESULT ", 1)[1])
        runs.append((result, [line for line in done.stdout.splitlines() if line.startswith("bagua")]))
    (first, logged0), (rank1, logged1), (again, logged2) = runs
    assert first["calls"] == 30 and rank1["calls"] == 0 and again["calls"] == 0  # computed once in all
    assert first["digest"] == rank1["digest"] == again["digest"]
    assert logged0 == [] and logged1 == []  # a fresh cache says nothing; rank 1 never does
    assert len(logged2) == 1 and "reusing the cache in LmdbStore(path=" in logged2[0], logged2
    assert str(tmp_path / "cache") in logged2[0] and "31 entries" not in logged2[0] and "30 entries" in logged2[0]
    assert "version='<new>'" in logged2[0] and "store.clear()" in logged2[0]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_the_fingerprint_is_the_same_in_dataloader_workers(start_method):
    transforms = ["x10", "shift2", "cube"]
    here = [dataset_fingerprint(numbers_with(t), version="v1").digest for t in transforms]
    loader = torch.utils.data.DataLoader(FingerprintsInWorker(transforms), batch_size=1, num_workers=2,
                                         collate_fn=list, multiprocessing_context=start_method, timeout=60)
    assert [d for batch in loader for d in batch] == [here] * 2  # one item from each worker


def test_what_the_fingerprint_sees():
    fp = {name: dataset_fingerprint(numbers_with(name)) for name in ("x1", "x10", "shift1", "shift2", "square", "cube")}
    assert len({f.digest for f in fp.values()}) == 6
    assert dataset_fingerprint(numbers_with("x1")) == fp["x1"]
    assert dataset_fingerprint(numbers_with("x1"), version="2").digest != fp["x1"].digest
    summary = dataset_fingerprint(numbers_with("shift1"), version="2").summary
    assert summary == ("version='2', tests.data._fingerprint_samples.Numbers (20 samples), "
                       "transform=tests.data._fingerprint_samples.Shift")
    with pytest.raises(TypeError, match="version must be a str, got int 2"):
        dataset_fingerprint(numbers_with("x1"), version=2)


def _module_with(tmp_path, name: str, body: str):
    """A module ``name`` written to ``tmp_path`` and imported: the same names, another source."""
    import importlib.util

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_edited_source_another_length_or_target_transform_is_another_fingerprint(tmp_path):
    """What the fingerprint reads, changed one at a time where nothing else tells them apart: the
    body of a function of the same name and module, the dataset's length, its target_transform."""
    from tests.data._fingerprint_samples import Numbers

    edits = [_module_with(tmp_path / d, "augment", f"""
        def augment(i):
            return i {op} 1
        """) for d, op in (("a", "+"), ("b", "-"))]
    first, second = (Numbers(20, m.augment) for m in edits)
    assert dataset_fingerprint(first).summary == dataset_fingerprint(second).summary  # same names
    assert dataset_fingerprint(first).digest != dataset_fingerprint(second).digest  # other source

    assert dataset_fingerprint(Numbers(20, abs)).digest != dataset_fingerprint(Numbers(21, abs)).digest

    def with_target(target_transform):
        ds = Numbers(20, abs)
        ds.target_transform = target_transform
        return dataset_fingerprint(ds).digest

    assert len({with_target(None), with_target(numbers_with("x1").transform),
                with_target(numbers_with("shift2").transform)}) == 3
