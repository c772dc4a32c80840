"""A real text corpus that needs no download: the Python standard library's own source files.

Documents are the blocks of each ``.py`` file (a function, a method, a class header, a run of
statements: what lies between a blank line followed by a line indented 0 or 4 spaces and the
next), as bytes, truncated at ``context + 1`` bytes (a model with context ``c`` predicts ``c`` next bytes from them). They
differ in length, as sentences do, which is what the load-balanced sampler is for.

The train/validation split is by a stable hash of each file's path relative to the standard
library (SHA-256, not Python's salted ``hash``), so every process on every machine puts a file
on the same side; a file's blocks all go one way, so validation measures unseen files.

Example::

    >>> from stdlib_corpus import StdlibDocuments, pad_batch
    >>> train = StdlibDocuments("train", context=256)
    >>> x = pad_batch([train[0], train[1]])          # input_ids, attention_mask, labels
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB = 256  # bytes
_BLOCK_START = re.compile(rb"\n[ \t]*\n(?=(?: {4})?\S)")  # a blank line, then a line indented 0 or 4 spaces


def stdlib_root() -> Path:
    """Where this interpreter's standard library lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def in_validation(relative_path: str, val_percent: float = 5.0) -> bool:
    """Whether the file goes to the validation split: the same answer in every process."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 10_000 < val_percent * 100


def corpus_files(root: Path | None = None) -> list[str]:
    """The standard library's ``.py`` files (no site-packages), as sorted POSIX paths relative to ``root``."""
    root = root or stdlib_root()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and p.is_file())  # fmt: skip


def block_spans(data: bytes, context: int, min_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of each block of ``data`` at least ``min_bytes`` long, cut at ``context + 1``
    bytes (a context shorter than ``min_bytes`` still gets documents: the cut ones)."""
    cuts = [0] + [m.end() for m in _BLOCK_START.finditer(data)] + [len(data)]
    return [(a, min(b, a + context + 1)) for a, b in zip(cuts, cuts[1:]) if b - a >= min_bytes]


class StdlibDocuments(Dataset):
    """One split of the corpus: item ``i`` is document ``i`` as a uint8 tensor of its bytes.

    Reading a document opens its file; wrap this in ``bagua.data.CachedDataset`` to keep the
    documents in LMDB after the first read. ``lengths`` are the documents' lengths (for the
    sampler), known from the index without reading them again.

    Args:
        split: ``"train"`` or ``"val"``.
        context: the model's context; documents are cut at ``context + 1`` bytes.
        val_percent: the share of files in the validation split.
        min_bytes: shorter blocks are left out (measured before the cut at ``context + 1``).
        root: the corpus folder (default: this interpreter's standard library).
        max_files: use only this many files, evenly spread over the sorted list (a quick run).
    """

    def __init__(self, split: str, context: int = 256, val_percent: float = 5.0, min_bytes: int = 32,
                 root: Path | None = None, max_files: int | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if context < 1 or min_bytes < 2:
            raise ValueError(f"context must be >= 1 and min_bytes >= 2, got {context} and {min_bytes}")
        self.root, self.split, self.context = root or stdlib_root(), split, context
        self.files: list[str] = []
        spans: list[tuple[int, int, int]] = []
        paths = corpus_files(self.root)
        if max_files is not None and max_files < len(paths):
            paths = [paths[i] for i in np.linspace(0, len(paths) - 1, max_files).astype(int)]
        for path in paths:
            if in_validation(path, val_percent) != (split == "val"):
                continue
            found = block_spans((self.root / path).read_bytes(), context, min_bytes)
            if found:
                spans += [(len(self.files), a, b) for a, b in found]
                self.files.append(path)
        if not spans:
            raise ValueError(f"no documents of >= {min_bytes} bytes in the {split} split of {self.root}")
        self._index = np.array(spans, dtype=np.int64)  # file number, start, end
        self.lengths = (self._index[:, 2] - self._index[:, 1]).astype(np.int64)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> torch.Tensor:
        f, a, b = (int(v) for v in self._index[i])
        with open(self.root / self.files[f], "rb") as fh:
            fh.seek(a)
            data = fh.read(b - a)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def fingerprint(self) -> str:
        """What the documents are (the files, the cuts): a cache key that changes with them."""
        h = hashlib.sha256(repr((self.context, self.files)).encode())
        h.update(self._index.tobytes())
        return h.hexdigest()[:16]


def pad_batch(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Documents (uint8 byte tensors) padded to the longest: ``input_ids`` (0 where padded),
    ``attention_mask`` and ``labels`` (-100 where padded: no loss there)."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s)] = s.long()
        mask[row, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
