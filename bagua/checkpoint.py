"""Checkpoints that resume exactly: model, optimizers, LR schedulers, the wrapper's step and
algorithm state, the sampler's progress, and every rank's RNG states.

Every rank calls ``save_checkpoint`` (it gathers the ranks' RNG states). Rank 0 writes one
file; when the algorithm's replicas legitimately differ (decentralized, low-precision
decentralized, async after its warm-up) or its state does (onebit_grad's error-feedback residuals)
every other rank first writes its own replica (weights, optimizer and algorithm state) to
``<path>.rank<r>``, and rank 0 writes ``<path>`` last, so a
complete set is exactly a readable ``<path>``. Writes are atomic (a temporary file in the same
directory, fsync, rename): a crash leaves the previous checkpoint intact. ``load_checkpoint``
reads the files on every rank (a filesystem every rank sees): each rank takes its own replica
when the world size is the one saved, rank 0's otherwise.

Loading runs no code from the file: it unpickles with ``torch.load(weights_only=True)``, allowing
tensors, containers, numbers and strings (torch's own list) plus the NumPy array of NumPy's RNG
state, which is all a checkpoint of bagua's holds. Anything else (say, an object of your own
class in ``extra``) is refused with an :class:`UntrustedCheckpointError` naming it, unless the
caller passes ``trust_pickled=True``: full unpickling, for files whose writer you trust.

Example::

    path = bagua.checkpoint.latest_checkpoint("ckpt")
    step = bagua.checkpoint.load_checkpoint(path, model=ddp, optimizers=[opt], sampler=sampler) if path else 0
    for step in range(step + 1, total + 1):
        ...train one step...
        if step % 100 == 0:
            bagua.checkpoint.save_checkpoint(f"ckpt/step-{step}.pt", step=step, model=ddp,
                                             optimizers=[opt], sampler=sampler)
"""

from __future__ import annotations

import glob
import logging
import os
import pickle
import random
import re
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from . import comm
from .parallel import DistributedDataParallel
from .parallel.wrapping import open_wrapper

__all__ = ["CheckpointError", "UntrustedCheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT = "bagua-checkpoint/1"
PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: unreadable, truncated, or not what the call needs."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint holding types that only full unpickling (``trust_pickled=True``) would rebuild."""


# What a weights-only load needs beyond torch's defaults for bagua's own checkpoints: NumPy
# arrays, of uint32 (NumPy's RNG state) and uint8 (a sampler's np.packbits mask of the samples
# consumed before a world-size change), pickled through numpy's _reconstruct (spelled
# numpy.core.multiarray in files written under NumPy 1.x, numpy._core.multiarray under 2.x)
# with a dtype whose state is set on its class (numpy.dtypes.UInt32DType, UInt8DType).
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_SAFE_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), type(np.dtype(np.uint8)), _RECONSTRUCT,
                 (_RECONSTRUCT, "numpy.core.multiarray._reconstruct")]


def save_checkpoint(
    path: PathLike,
    *,
    step: int,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    lr_schedulers: Sequence[Any] = (),
    sampler: Any = None,
    extra: Any = None,
    keep_last: Optional[int] = None,
) -> None:
    """Write a checkpoint of training after ``step`` steps (every rank calls it).

    Args:
        model: a ``bagua.DistributedDataParallel`` or the module it wraps (its step and
            algorithm state are saved too either way), or a bare module; the weights are saved
            with the module's own keys.
        optimizers: saved with their ``state_dict()`` (fused optimizers too).
        lr_schedulers: saved with their ``state_dict()``.
        sampler: anything with ``state_dict()`` and ``load_state_dict()`` (bagua's samplers: the
            epoch's progress; torch's ``DistributedSampler`` has none: use
            ``bagua.data.ElasticDistributedSampler``).
        extra: anything ``torch.save`` can write, returned by ``load_checkpoint(..., extra=...)``
            (objects of other types than tensors, containers, numbers, strings and NumPy arrays
            load only with ``trust_pickled=True``).
        keep_last: if given, the other checkpoints in the same directory are removed but the
            newest ``keep_last`` (by step, this one included), once this one is complete.

    Example::

        save_checkpoint(f"ckpt/step-{step}.pt", step=step, model=ddp, optimizers=[opt], keep_last=3)
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"save_checkpoint: keep_last must be an int >= 1 or None, got {keep_last!r}")
    _check_resumable("save_checkpoint", sampler)
    path = Path(path)
    wrapper, module = _unwrap(model)
    rank, world = _rank_and_world()
    differs = wrapper is not None and (not wrapper.impl.replicas_identical(wrapper) or wrapper.impl.state_per_rank)
    mine = (_rng_state(), differs)
    gathered = comm.allgather_object(mine) if world > 1 else [mine]
    rng = [state for state, _ in gathered]
    separate = any(d for _, d in gathered)  # one decision for all ranks, in the same message
    if separate and rank != 0:
        _atomic_save({"format": FORMAT, "rank": rank, **_replica(module, optimizers, wrapper)}, _rank_path(path, rank))
    if world > 1:
        comm.barrier()  # every rank's file is in place before the one that makes the set complete
    if rank == 0:
        _atomic_save({
            "format": FORMAT, "step": step, "world_size": world, "replica_files": world if separate else 0,
            **_replica(module, optimizers, wrapper), "lr_schedulers": [s.state_dict() for s in lr_schedulers],
            "sampler": sampler.state_dict() if sampler is not None else None, "rng": rng, "extra": extra,
        }, path)
        if keep_last is not None:
            _remove_all_but_newest(path.parent, keep_last)
    if world > 1:
        comm.barrier()  # nobody goes on (or reads it) before the checkpoint exists


def _check_resumable(what: str, sampler: Any) -> None:
    """A TypeError unless ``sampler`` is None or can save and restore its progress."""
    if sampler is None or all(callable(getattr(sampler, m, None)) for m in ("state_dict", "load_state_dict")):
        return
    name = f"{type(sampler).__module__}.{type(sampler).__qualname__}"
    raise TypeError(
        f"{what}: sampler={name} has no state_dict()/load_state_dict(), so it cannot resume mid-epoch (torch's "
        f"DistributedSampler cannot); use bagua.data.ElasticDistributedSampler (DistributedSampler's arguments "
        f"and order, resumable) or a bagua.data.LoadBalancingDistributedSampler"
    )


def load_checkpoint(
    path: PathLike,
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    lr_schedulers: Sequence[Any] = (),
    sampler: Any = None,
    extra: Optional[dict] = None,
    strict: bool = True,
    trust_pickled: bool = False,
) -> int:
    """Restore what ``save_checkpoint`` wrote into the given objects; return its step (every
    rank calls it). ``extra``, if a dict, receives the saved extra under ``"extra"``; ``strict``
    is ``module.load_state_dict``'s.

    ``trust_pickled=True`` unpickles the files fully, which runs whatever code their writer put
    in them: only for files you trust, holding types beyond tensors, containers, numbers,
    strings and NumPy arrays (an :class:`UntrustedCheckpointError` names them otherwise).

    Loaded into a bare module before wrapping, the algorithm state is not restored (there is
    no wrapper yet): load after wrapping to resume a schedule or warm-up exactly. At another
    world size each rank takes rank 0's replica and RNG states are left as they are.

    Example::

        step = load_checkpoint(latest_checkpoint("ckpt"), model=ddp, optimizers=[opt])
        step = load_checkpoint(path, model=ddp, optimizers=[opt], trust_pickled=True)  # a file you trust
    """
    _check_resumable("load_checkpoint", sampler)
    path = Path(path)
    wrapper, module = _unwrap(model)
    rank, world = _rank_and_world()
    main = _read(path, trust_pickled=trust_pickled)
    same_world = main["world_size"] == world
    replica = main
    if main["replica_files"] and same_world and rank != 0:
        replica = _read(_rank_path(path, rank), trust_pickled=trust_pickled)
    if len(replica["optimizers"]) != len(optimizers) or len(main["lr_schedulers"]) != len(lr_schedulers):
        raise CheckpointError(
            f"{path} holds {len(replica['optimizers'])} optimizer(s) and {len(main['lr_schedulers'])} LR "
            f"scheduler(s); pass the same number (got {len(optimizers)} and {len(lr_schedulers)})"
        )
    module.load_state_dict(replica["model"], strict=strict)
    for opt, state in zip(optimizers, replica["optimizers"]):
        opt.load_state_dict(state)
    for scheduler, state in zip(lr_schedulers, main["lr_schedulers"]):
        scheduler.load_state_dict(state)
    if replica["algorithm"] is not None:
        if wrapper is not None:
            wrapper.load_algorithm_state_dict(replica["algorithm"])
        else:
            logger.warning("%s: loaded into a bare module, the algorithm state is not restored "
                           "(load after wrapping to resume it exactly)", path)
    if sampler is not None and main["sampler"] is not None:
        sampler.load_state_dict(main["sampler"])
    if same_world:
        _set_rng_state(main["rng"][rank])
    else:
        logger.warning("%s was saved at world size %d, loaded at %d: RNG states not restored",
                       path, main["world_size"], world)
    if isinstance(extra, dict):
        extra["extra"] = main["extra"]
    return int(main["step"])


def latest_checkpoint(directory: PathLike, *, trust_pickled: bool = False) -> Optional[str]:
    """The path of the newest complete checkpoint in ``directory`` (by saved step), or None.
    Unreadable or incomplete files are skipped with a warning; a file holding types that only
    ``trust_pickled=True`` unpickles raises :class:`UntrustedCheckpointError` (skipping it would
    resume an older one).

    Example::

        path = latest_checkpoint("ckpt")       # e.g. "ckpt/step-300.pt"
    """
    found = _complete_checkpoints(Path(directory), warn=True, trust_pickled=trust_pickled)
    return str(found[-1][1]) if found else None


def _complete_checkpoints(directory: Path, warn: bool, trust_pickled: bool = False,
                          skip_untrusted: bool = False) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as (step, path), oldest first. A file refused for
    its types raises, or with ``skip_untrusted`` is left out with a warning."""
    if not directory.is_dir():
        return []
    found = []
    for candidate in sorted(directory.iterdir()):
        if not candidate.is_file() or _RANK_FILE.search(candidate.name) or candidate.name.startswith("."):
            continue
        try:
            main = _read(candidate, probe=True, trust_pickled=trust_pickled)
            for r in range(1, main["replica_files"]):
                _read(_rank_path(candidate, r), probe=True, trust_pickled=trust_pickled)
        except UntrustedCheckpointError as error:
            if not skip_untrusted:
                raise
            logger.warning("left alone: %s", error)
            continue
        except CheckpointError as error:
            if warn:
                logger.warning("skipping %s", error)
            continue
        found.append((int(main["step"]), candidate))
    return sorted(found, key=lambda item: item[0])


def _remove_all_but_newest(directory: Path, keep: int) -> None:
    """Remove the complete checkpoints of ``directory`` but the newest ``keep``: the main file
    first (the set is then incomplete, never half-usable), then its replica files. Files it may
    not unpickle (see ``load_checkpoint``'s ``trust_pickled``) are left, with a warning."""
    found = _complete_checkpoints(directory, warn=False, skip_untrusted=True)
    for _, old in found[:max(0, len(found) - keep)]:
        old.unlink(missing_ok=True)
        for replica in directory.glob(f"{glob.escape(old.name)}.rank*"):
            if _RANK_FILE.search(replica.name):
                replica.unlink(missing_ok=True)


# --- what goes in -------------------------------------------------------------------------------
def _unwrap(model: torch.nn.Module) -> tuple[Optional[DistributedDataParallel], torch.nn.Module]:
    if isinstance(model, DistributedDataParallel):
        return model, model.module
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None, model.module
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a bagua.DistributedDataParallel, got {type(model).__name__}")
    return open_wrapper(model), model  # a wrapped module: its wrapper's state too


def _replica(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
             wrapper: Optional[DistributedDataParallel]) -> dict:
    return {
        "model": module.state_dict(),
        "optimizers": [opt.state_dict() for opt in optimizers],
        "algorithm": wrapper.algorithm_state_dict() if wrapper is not None else None,
    }


def _rank_and_world() -> tuple[int, int]:
    return (comm.get_rank(), comm.get_world_size()) if comm.is_initialized() else (0, 1)


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# --- files ------------------------------------------------------------------------------------------
_RANK_FILE = re.compile(r"\.rank\d+$")


def _rank_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.rank{rank}")


def _atomic_save(obj: dict, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def _read(path: Path, probe: bool = False, trust_pickled: bool = False) -> dict:
    """The checkpoint at ``path``; ``probe``: mapped, not read (cheap, for checking many files:
    a truncated zip fails at once, its directory being at the end)."""
    state = _load(path, probe, trust_pickled)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a bagua checkpoint (written by bagua.checkpoint.save_checkpoint)")
    return state


def _load(path: Path, probe: bool = False, trust_pickled: bool = False) -> Any:
    """``torch.load`` of ``path`` on the CPU: weights-only with bagua's few extra types, or full
    unpickling when the caller trusts the file (``trust_pickled``)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        if trust_pickled:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=probe)
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=probe)
    except pickle.UnpicklingError as error:
        refused = None if trust_pickled else _refused_types(path, error)
        if refused is not None:
            raise UntrustedCheckpointError(
                f"{path} holds {refused}, which bagua does not unpickle unless asked to: unpickling "
                f"can run any code the file's writer chose. If you trust whoever wrote it, pass "
                f"trust_pickled=True (to load_checkpoint, and to latest_checkpoint)"
            ) from None
        raise _unreadable(path, error) from None
    except Exception as error:
        raise _unreadable(path, error) from None


def _refused_types(path: Path, error: pickle.UnpicklingError) -> Optional[str]:
    """What a weights-only load of ``path`` refused (the globals it names, or torch's reason),
    or None when ``error`` is not such a refusal (a damaged file)."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # not a zip torch can list: let torch's message speak
        names = []
    if names:
        return "the type(s) " + ", ".join(names)
    reason = str(error).split("WeightsUnpickler error:", 1)
    return f"what torch's weights-only loader refuses ({reason[1].strip()})" if len(reason) == 2 else None


def _unreadable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable checkpoint ({type(error).__name__}: {error}); it may be truncated "
        f"by a crash during an older, non-atomic write: delete it or load another"
    )
