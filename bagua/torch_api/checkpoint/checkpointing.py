"""The original ``bagua.torch_api.checkpoint``: ``save_checkpoint(iteration, checkpoints_path,
model, optimizer, lr_scheduler)`` and ``load_checkpoint(checkpoints_path, model, ...) -> iteration``
over ``bagua.checkpoint``, in the original's layout: ``<path>/iter_0000100/mp_rank_00_model_states.pt``
and ``<path>/latest_checkpointed_iteration.txt`` naming the newest iteration.

What is saved is the native checkpoint (atomic writes, the algorithm's state, every rank's RNG
states, one replica per rank where the algorithm's replicas differ). Checkpoints written by the
original Bagua (a ``torch.save`` of ``{"iteration", "model", "optimizer", "lr_scheduler"}``) load
too. The MoE layer's expert files are not supported (the MoE layer is not). Both load without
running code from the file (see ``bagua.checkpoint``); ``trust_pickled=True`` unpickles fully, for
trusted files holding other types.

Example::

    from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint
    start = load_checkpoint("ckpt", model, optimizer)        # 0 without a checkpoint
    ...
    save_checkpoint(iteration, "ckpt", model, optimizer)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ... import checkpoint as native
from ... import comm

__all__ = ["load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"


def save_checkpoint(
    iteration: int,
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Any = None,
) -> None:
    """Save a checkpoint of ``iteration`` under ``checkpoints_path`` (every rank calls it)."""
    native.save_checkpoint(_model_file(checkpoints_path, iteration, release=False), step=iteration, model=model,
                           optimizers=_listed(optimizer), lr_schedulers=_listed(lr_scheduler))
    if not comm.is_initialized() or comm.get_rank() == 0:
        tracker = Path(checkpoints_path, TRACKER)
        temporary = tracker.with_name(f".{TRACKER}.tmp")
        temporary.write_text(str(iteration))
        os.replace(temporary, tracker)
    if comm.is_initialized():
        comm.barrier()


def load_checkpoint(
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Any = None,
    strict: bool = True,
    trust_pickled: bool = False,
) -> int:
    """Load the newest checkpoint under ``checkpoints_path``; its iteration (0, with a warning,
    when there is none). ``trust_pickled`` is ``bagua.checkpoint.load_checkpoint``'s.

    Raises:
        bagua.checkpoint.CheckpointError: the tracker file names no iteration, or the file is
            corrupt or incomplete.
        bagua.checkpoint.UntrustedCheckpointError: the file holds types that only
            ``trust_pickled=True`` unpickles.
    """
    tracker = Path(checkpoints_path, TRACKER)
    if not tracker.is_file():
        logger.warning("could not find checkpoint metadata file %s", tracker)
        return 0
    text = tracker.read_text().strip()
    release = text == "release"
    if not (release or text.isdigit()):
        raise native.CheckpointError(f"{tracker} must hold an iteration number or 'release', got {text!r}")
    iteration = 0 if release else int(text)
    path = _model_file(checkpoints_path, iteration, release)
    try:
        native.load_checkpoint(path, model=model, optimizers=_listed(optimizer),
                               lr_schedulers=_listed(lr_scheduler), strict=strict, trust_pickled=trust_pickled)
    except native.CheckpointError:
        saved = _original_format(path, trust_pickled)
        if saved is None:
            raise
        model.load_state_dict(saved["model"], strict=strict)
        if optimizer is not None:
            optimizer.load_state_dict(saved["optimizer"])
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if comm.is_initialized():
        comm.barrier()
    return iteration


def _model_file(checkpoints_path: str, iteration: int, release: bool) -> Path:
    directory = "release" if release else f"iter_{iteration:07d}"
    return Path(checkpoints_path, directory, "mp_rank_00_model_states.pt")


def _listed(item: Any) -> list:
    return [] if item is None else [item]


def _original_format(path: Path, trust_pickled: bool) -> Optional[dict]:
    """The checkpoint at ``path`` if the original Bagua wrote it, else None."""
    try:
        saved = native._load(path, trust_pickled=trust_pickled)
    except native.CheckpointError:  # unreadable or refused: the native error says why
        return None
    is_original = isinstance(saved, dict) and "format" not in saved and {"iteration", "model"} <= saved.keys()
    return saved if is_original else None
