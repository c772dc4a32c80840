"""examples/train_lm.py: the stdlib corpus and its split, and a tiny language model trained end
to end on 2 ranks (torchrun, and Lightning's launcher with --lightning)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.harness import run_command

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from stdlib_corpus import StdlibDocuments, block_spans, corpus_files, in_validation, pad_batch  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_lm.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
TINY = ["--steps", "60", "--layers", "2", "--width", "64", "--heads", "2", "--context", "64", "--batch-size", "8",
        "--eval-every", "30", "--max-files", "150", "--val-docs", "64", "--lr", "3e-3", "--warmup-steps", "10",
        "--no-progress"]  # fmt: skip
# ln(256) = 5.55 nats is a uniform guess over bytes; after 60 tiny steps the model has learned at
# least the bytes' frequencies and common pairs (unigram entropy of this corpus: ~4.2 nats)
LEARNED = 3.6
FINAL = re.compile(r"final: validation loss (\d+\.\d+)")


def test_split_is_a_stable_hash_of_the_path_the_same_in_every_process():
    files = corpus_files()
    assert len(files) > 500 and files == sorted(files)
    val = [f for f in files if in_validation(f)]
    assert 0.02 < len(val) / len(files) < 0.08
    # another interpreter, another hash seed: the same split
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); "
            "from stdlib_corpus import corpus_files, in_validation; "
            "print(','.join(f for f in corpus_files() if in_validation(f)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})  # fmt: skip
    assert out.stdout.strip().split(",") == val
    # the first 8 bytes of the path's sha256, little-endian, mod 10,000: 1177 and 100 (validation below 500)
    assert (in_validation("os.py"), in_validation("abc.py")) == (False, True)


def test_documents_are_blocks_cut_at_the_context_and_splits_are_disjoint():
    data = b"import os\n\n\ndef f():\n    return 1\n\n    \nclass A:\n    x = 1\n\n    def g(self):\n        pass\n"
    spans = block_spans(data, context=1000, min_bytes=2)
    assert [data[a:b].split(b"\n")[0] for a, b in spans] == [b"import os", b"def f():", b"class A:", b"    def g(self):"]
    assert all(b - a <= 9 for a, b in block_spans(data, context=8, min_bytes=2))
    # a context shorter than min_bytes cuts the long blocks; the short ones stay out
    assert [data[a:b] for a, b in block_spans(data, context=4, min_bytes=13)] == [b"def f", b"class", b"    d"]
    train, val = StdlibDocuments("train", context=64, max_files=60), StdlibDocuments("val", context=64, max_files=60)
    assert not set(train.files) & set(val.files)
    assert train.lengths.max() == 65 and train.lengths.min() >= 32
    doc = train[3]
    assert doc.dtype == torch.uint8 and len(doc) == train.lengths[3]


def test_batches_pad_to_the_longest_and_mask_the_padding():
    batch = pad_batch([torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4], dtype=torch.uint8)])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]


def _run(cmd: list[str], tmp_path: Path) -> tuple[float, str]:
    cmd = cmd + TINY + ["--out-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]
    proc = run_command(cmd, timeout=240, cwd=ROOT)
    output = proc.stdout + proc.stderr
    found = FINAL.findall(proc.stdout)
    assert len(found) == 1, output[-5000:]
    return float(found[0]), output


def test_two_ranks_learn_the_language(tmp_path):
    loss, output = _run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(EXAMPLE), "--algorithm", "bytegrad"], tmp_path)
    assert loss < LEARNED, output[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "run" / "lm_curve_bytegrad.csv")))
    assert [int(r["step"]) for r in rows] == [0, 30, 60]
    assert float(rows[0]["val_loss"]) > 5.0 > float(rows[-1]["val_loss"])
    sent = [float(mb) for mb in re.findall(r"tokens/s  padding \d+\.\d%  sent (\d+\.\d\d) MB/step", output)]
    assert len(sent) == 2 and min(sent) > 0, output[-3000:]  # each evaluation's line: bytegrad averaged
    assert "replicas differed" not in output, output[-3000:]


def test_runs_into_one_directory_are_kept_plotted_together_and_compared(tmp_path):
    import argparse

    import train_lm

    log: list[str] = []
    for algorithm, val in (("torch-ddp", 2.0), ("bytegrad", 1.9), ("bytegrad", 1.8)):
        args = argparse.Namespace(out_dir=str(tmp_path), algorithm=algorithm, plot=True)
        runs = train_lm.write_outputs(args, {"curve": [(0, 0.0, 0, float("nan"), 5.0), (10, 3.5, 640, 2.4, val)]},
                                      log.append)
    assert sorted(runs) == ["bytegrad", "torch-ddp"] and (tmp_path / "lm_loss.png").stat().st_size > 0
    assert any("replacing the earlier bytegrad run's curve" in line for line in log)  # said, not silent
    assert float(runs["bytegrad"][-1]["val_loss"]) == 1.8  # the second bytegrad run's
    assert train_lm.compared("bytegrad", runs) == [
        "vs torch-ddp: val loss 2.0000 after 3.5 s (this run: 1.8000 after 3.5 s)"]


def test_two_ranks_learn_through_lightning(tmp_path):
    loss, output = _run([sys.executable, str(EXAMPLE), "--lightning", "--devices", "2"], tmp_path)
    assert loss < LEARNED, output[-3000:]
    assert "world size 2, algorithm gradient_allreduce, Lightning" in output
