"""The fingerprint of what a cached dataset serves: a short digest of what can be seen cheaply of
the dataset and its transforms, plus a version the user sets.

Seen: the user's ``version``; the dataset's class (module and qualified name, and its source where
``inspect`` finds it) and length; each of its ``transform``, ``target_transform`` and
``transforms`` attributes: qualified name, source where available (the line of a lambda, the body
of a function, the class of a transform object), a function's defaults and closure values, and an
object's repr (its fields, when the repr is ``object``'s). Memory addresses (`` at 0x...``) are
cut from every repr, a set's items sorted, and the digest is a SHA-256 of that text: it is the
same in every process, rank and DataLoader worker, whatever the start method or
``PYTHONHASHSEED``.

Not seen: files the dataset reads, globals a transform reads, what a repr leaves out
(torchvision's ``Lambda`` hides its function), and the order of sets nested in other values (it
follows ``hash()``, which differs between processes; such a value makes the fingerprint differ
between processes, so each recomputes). Set ``version`` when those change.

Example::

    fp = dataset_fingerprint(ds, version="v2")
    fp.digest      # '3f0c9a1e2b7d4c55'
    fp.summary     # "version='v2', my_data.Images (5000 samples), transform=my_data.augment"
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from typing import Any, NamedTuple

__all__ = ["Fingerprint", "dataset_fingerprint"]

_TRANSFORM_ATTRIBUTES = ("transform", "target_transform", "transforms")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DEPTH = 3  # closures and partials are followed this deep


class Fingerprint(NamedTuple):
    """``digest``: 16 hex digits, the same for the same dataset, transforms and version;
    ``summary``: one line naming what went in (without the sources), for log messages."""

    digest: str
    summary: str


def dataset_fingerprint(dataset: Any, version: str = "") -> Fingerprint:
    """The fingerprint of ``dataset`` (its class, length and transforms) and ``version``.

    Example::

        dataset_fingerprint(torchvision.datasets.MNIST(root, transform=to_tensor)).digest
    """
    if not isinstance(version, str):
        raise TypeError(f"version must be a str, got {type(version).__name__} {version!r}")
    length = len(dataset)
    seen = [f"version={version!r}", _source_of(type(dataset)), f"len={length}"]
    summary = [f"version={version!r}"] if version else []
    summary.append(f"{_qualified_name(type(dataset))} ({length} samples)")
    for attribute in _TRANSFORM_ATTRIBUTES:
        transform = getattr(dataset, attribute, None)
        if transform is not None:
            seen.append(f"{attribute}={_describe(transform, _DEPTH)}")
            summary.append(f"{attribute}={_qualified_name(transform)}")
    digest = hashlib.sha256("\n".join(seen).encode("utf-8", "backslashreplace")).hexdigest()[:16]
    return Fingerprint(digest, ", ".join(summary))


def _qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class, or of an object's class. A script run as
    ``__main__`` is ``__mp_main__`` in spawned workers: both read ``__main__``."""
    target = obj if inspect.isroutine(obj) or inspect.isclass(obj) else type(obj)
    module = getattr(target, "__module__", None) or "?"
    module = "__main__" if module == "__mp_main__" else module
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', '?'))}"


def _source_of(target: Any) -> str:
    """The qualified name and, where ``inspect`` finds it, the source of a function or class."""
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):  # built in, or defined where no source file is
        source = ""
    return f"{_qualified_name(target)}\n{source}"


def _describe(obj: Any, depth: int) -> str:
    """What can be seen cheaply of a transform (see the module docstring)."""
    if isinstance(obj, functools.partial):
        inner = _describe(obj.func, depth - 1) if depth > 0 else _qualified_name(obj.func)
        return f"partial({inner}, args={_repr(obj.args)}, keywords={_repr(sorted(obj.keywords.items()))})"
    if inspect.isfunction(obj):
        closure = [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
        captured = [_describe(value, depth - 1) if depth > 0 and callable(value) else _repr(value) for value in closure]
        return (f"{_source_of(obj)}\ndefaults={_repr(obj.__defaults__)} "
                f"kwdefaults={_repr(sorted((obj.__kwdefaults__ or {}).items()))} closure={captured}")
    if inspect.isroutine(obj) or inspect.isclass(obj):
        return _source_of(obj)
    if type(obj).__repr__ is object.__repr__ and hasattr(obj, "__dict__"):  # a repr that shows nothing
        fields = [f"{k}={_describe(v, depth - 1) if depth > 0 and callable(v) else _repr(v)}"
                  for k, v in sorted(vars(obj).items())]
        return f"{_source_of(type(obj))}\nfields={fields}"
    return f"{_source_of(type(obj))}\nrepr={_repr(obj)}"


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True


def _repr(value: Any) -> str:
    """``repr(value)`` without memory addresses; a set's items sorted (their order follows
    ``hash()``, which differs between processes for strings)."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(_repr(v) for v in value)})"
    return _ADDRESS.sub("", repr(value))
