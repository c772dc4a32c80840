"""Keeping torchrun's attempts apart in the agent's store: one fresh key prefix per attempt.

torchrun's workers share the agent's TCPStore, unprefixed, across restarts, and torch names
its groups the same way in every attempt, so a restarted worker can read an address that a
dead worker of an earlier attempt published for the same group: Gloo then fails with
"connectFullMesh ... Connection refused", or hangs. Each attempt must see its own keys.

The attempt cannot be named from the environment: ``TORCHELASTIC_RESTART_COUNT`` is counted
per agent, and with several agents (``--nnodes 1:4``) they disagree (a failure raises it on
the agent whose worker failed, a membership change raises it nowhere). So the ranks agree
on a *generation* through the store itself:

- rank 0 opens a new generation ``g`` (an atomic counter), announces it as the current one,
  waits until the other ``world_size - 1`` ranks have joined ``g``, and marks ``g`` ready;
- every other rank joins the announced generation and waits for it to be ready. It may see
  a dead attempt's announcement first: if that generation was ready, its join count goes
  past ``world_size - 1`` and the rank knows it is stale; if it never became ready, the rank
  is still waiting when rank 0 announces the new one, and moves on to it.

Every rank of one attempt thus ends with the same ``g``, different from every earlier one.

Example::

    store = torchrun_attempt_store("10.0.0.1", 29500, world_size=8, rank=3, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=3, world_size=8)
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Optional

import torch.distributed as dist

__all__ = ["torchrun_attempt_store"]

_POLL_S = 0.01


def torchrun_attempt_store(
    addr: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta
) -> Optional[dist.Store]:
    """Under torchrun (agent store in use), the agent's store seen through this attempt's own
    prefix; None otherwise. Every rank of the attempt must call it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    agent_store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    base = f"bagua/{os.environ.get('TORCHELASTIC_RUN_ID', '-')}/{world_size}/"
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = _open_generation(agent_store, base, world_size, deadline)
    else:
        generation = _join_generation(agent_store, base, world_size, deadline)
    return dist.PrefixStore(f"{base}{generation}/", agent_store)


def _open_generation(store: dist.Store, base: str, world_size: int, deadline: float) -> int:
    generation = store.add(base + "generation", 1)
    store.set(base + "current", str(generation))
    joined = f"{base}{generation}/joined"
    while store.add(joined, 0) < world_size - 1:
        _wait(deadline, f"rank 0 waited for the other {world_size - 1} rank(s) of this torchrun attempt "
                        f"to join generation {generation}")
    store.set(f"{base}{generation}/ready", "1")
    return generation


def _join_generation(store: dist.Store, base: str, world_size: int, deadline: float) -> int:
    joined_generation: Optional[int] = None
    stale: set[int] = set()
    while True:
        if store.check([base + "current"]):
            current = int(store.get(base + "current"))
            if current != joined_generation and current not in stale:
                if store.add(f"{base}{current}/joined", 1) > world_size - 1:
                    stale.add(current)  # that generation was complete: a dead attempt's
                else:
                    joined_generation = current
            if joined_generation == current and store.check([f"{base}{current}/ready"]):
                return current
        _wait(deadline, "a rank waited for rank 0 of this torchrun attempt to open its generation")


def _wait(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(
            f"bagua.init_process_group timed out: {what}; a rank of this attempt did not start or "
            f"reach init_process_group (see the other ranks' logs)"
        )
    time.sleep(_POLL_S)
