"""The algorithm state a checkpoint holds (``ddp.algorithm_state_dict()``): the wrapper's step
count, the algorithm's own state, the configuration autotuning chose, and which algorithm (and
version of its state) wrote them, so that loading it under another algorithm is defined.

Written by the same algorithm (the same name and ``state_version``), everything is restored.
Written by another one (a run resumed after switching algorithms, say decentralized to bytegrad):

- the step count carries over (communication intervals and schedules go on from it);
- the old algorithm's own state (decentralized's peer schedule, async's counters) and the
  configuration autotuning chose for it are dropped, with one warning naming both algorithms;
  the new algorithm keeps its own state, as at wrap time;
- when the new algorithm keeps replicas identical (gradient_allreduce, bytegrad, qadam) and the
  ranks may hold different weights (the writer's replicas differed: decentralized,
  low_precision_decentralized, async after its warm-up, whose checkpoints hold every rank's own
  replica), every rank takes rank 0's weights, buffers and optimizer state, as wrapping does.
  Rank 0's rather than the average: wrapping and a load at another world size take rank 0's
  too, so loading before or after wrapping gives the same weights, and rank 0's weights and its
  optimizer state (momentum, Adam moments) are a pair that belongs together, which an average of
  the weights with one rank's moments is not.

State written before checkpoints recorded the algorithm is restored when its keys are those this
algorithm's state has, and otherwise dropped as another algorithm's.

Example::

    torch.save({"model": ddp.module.state_dict(), "bagua": ddp.algorithm_state_dict()}, path)
    ...
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm="bytegrad")   # was decentralized
    ddp.module.load_state_dict(ckpt["model"])
    ddp.load_algorithm_state_dict(ckpt["bagua"])   # one warning; every rank holds rank 0's weights
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import comm
from ..algorithms.base import algorithm_name

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel

logger = logging.getLogger(__name__)

_REQUIRED = {"step", "algorithm"}
_OPTIONAL = {"written_by", "autotune"}
_WRITER_FIELDS = {"algorithm": str, "state_version": int, "replicas_identical": bool}


def _writer(ddp: "DistributedDataParallel") -> dict[str, Any]:
    """What a checkpoint records about who wrote its algorithm state: the algorithm's name, the
    version of its state layout, and whether the ranks' replicas are identical now."""
    return {"algorithm": algorithm_name(ddp.algorithm), "state_version": ddp.impl.state_version,
            "replicas_identical": bool(ddp.impl.replicas_identical(ddp))}


def state_dict(ddp: "DistributedDataParallel") -> dict[str, Any]:
    """``ddp.algorithm_state_dict()``: the step count, the algorithm's own state, its writer,
    and the configuration autotuning chose, once it has."""
    state = {"step": ddp.step, "algorithm": ddp.impl.state_dict(), "written_by": _writer(ddp)}
    if ddp.autotune_result is not None:
        state["autotune"] = dict(ddp.autotune_result.config)
    return state


def load_state_dict(ddp: "DistributedDataParallel", state: Any) -> None:
    """``ddp.load_algorithm_state_dict(state)``, on every rank: see the module docstring."""
    theirs = _checked(state)
    mine = _writer(ddp)
    ddp.step = int(state["step"])
    if _restorable(ddp, state, theirs, mine):
        ddp.impl.load_state_dict(state["algorithm"])
        if "autotune" in state and ddp._tuner is not None:
            ddp._tuner.adopt(ddp, state["autotune"])
    else:
        written = (f"{theirs['algorithm']} (state version {theirs['state_version']})" if theirs is not None
                   else "an algorithm it does not name (saved before checkpoints recorded it)")
        dropped = sorted(state["algorithm"]) + (["autotune"] if "autotune" in state else [])
        logger.warning(
            "the checkpoint's algorithm state was written by %s; this wrapper runs %s (state version %d): "
            "the step count (%d) carries over, %s, and %s keeps its own state",
            written, mine["algorithm"], mine["state_version"], ddp.step,
            f"the rest is dropped ({', '.join(dropped)})" if dropped else "there is nothing else to carry",
            mine["algorithm"])
        ddp.impl.load_state_dict(ddp.impl.state_dict())  # its own state, through its load path
    if _replicas_may_differ(ddp, theirs):
        ddp._sync_from_first_rank()
        ddp.impl.on_weights_loaded(ddp)


def _checked(state: Any) -> Optional[dict]:
    """The writer ``state`` records (None for state saved before writers were recorded), after
    checking that ``state`` is what ``algorithm_state_dict()`` returns."""
    keys = set(state) if isinstance(state, dict) else None
    if keys is None or not _REQUIRED <= keys <= _REQUIRED | _OPTIONAL or not isinstance(state["algorithm"], dict):
        raise ValueError(
            f"expected what DistributedDataParallel.algorithm_state_dict() returns (keys 'step', 'algorithm' "
            f"(a dict), maybe 'written_by' and 'autotune'), got "
            f"{sorted(state, key=str) if isinstance(state, dict) else type(state).__name__}"
        )
    theirs = state.get("written_by")
    if theirs is None:
        return None
    if not isinstance(theirs, dict) or set(theirs) != set(_WRITER_FIELDS) or not all(
            type(theirs[k]) is t for k, t in _WRITER_FIELDS.items()):
        raise ValueError(
            f"the algorithm state's 'written_by' must be {{'algorithm': str, 'state_version': int, "
            f"'replicas_identical': bool}} (as algorithm_state_dict() writes it), got {theirs!r}"
        )
    return theirs


def _restorable(ddp: "DistributedDataParallel", state: dict, theirs: Optional[dict], mine: dict) -> bool:
    """Whether ``state``'s own algorithm state is this algorithm's to load."""
    if theirs is None:  # unrecorded: this algorithm's if it has the keys this algorithm's state has
        return set(state["algorithm"]) == set(ddp.impl.state_dict())
    return (theirs["algorithm"], theirs["state_version"]) == (mine["algorithm"], mine["state_version"])


def _replicas_may_differ(ddp: "DistributedDataParallel", theirs: Optional[dict]) -> bool:
    """Whether this algorithm keeps replicas identical (on every rank) while the ranks may have
    loaded different ones (on any rank): one small allreduce, so every rank decides alike."""
    flags = torch.tensor([int(not ddp.impl.replicas_identical(ddp)),
                          int(theirs is None or not theirs["replicas_identical"])])
    comm.allreduce(flags, op=comm.ReduceOp.MAX, group=ddp.comm_group)
    apart, may_differ = flags.tolist()
    return not apart and bool(may_differ)
