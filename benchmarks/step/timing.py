"""Interleaved step timing: torch DDP and every bagua algorithm on one model, in one job.

Every rank builds one copy of the same model per variant (the caller builds model and optimizer)
and times training steps (``zero_grad; loss; backward; step``) of the variants interleaved: each
repetition runs a block of ``block`` steps of every variant, the order rotated from one repetition
to the next (A B C ..., then B C ... A) so that drifts in machine load hit them alike. Used by
``ddp.py`` (an MLP) and ``tradeoff/sweep.py`` (the language model of ``examples/train_lm.py``).

====================  ========================================================================
ddp                   ``torch.nn.parallel.DistributedDataParallel`` (bucket_cap_mb=25, default)
ddp-10MB              the same with bucket_cap_mb=10
ddp-fp16              torch DDP + ``default_hooks.fp16_compress_hook``
ddp-bytegrad-hook     torch DDP + ``bagua.comm_hooks.register(model, "bytegrad")`` (no bagua wrapper)
ddp-onebit-hook       torch DDP + ``bagua.comm_hooks.register(model, "onebit_grad", warmup_steps=warmup)``
<algorithm>-hier      the same with ``hierarchical=True`` (gradient_allreduce, bytegrad, decentralized,
                      low_precision_decentralized)
ddp-striped           torch DDP on a ``new_group(backend="bagua")`` group: its buckets cut over
                      ``STRIPED_STREAMS`` Gloo connection sets between machines (no bagua wrapper)
<algorithm>           ``bagua.DistributedDataParallel(..., algorithm=<algorithm>)``; qadam takes its
                      ``QAdamOptimizer``, async averages every ``async_interval_ms`` from step 0
<name>-10MB           the same with ``bucket_size_bytes=10 MiB`` (default: 25 MiB, as torch DDP)
<name>-bn[-nobuf]     the caller's model with BatchNorm (-nobuf: ``broadcast_buffers=False``)
onebit_grad           bagua, 1-bit (sign1) gradient allreduce with error feedback, ``warmup_steps=warmup``
local                 no wrapper, no communication: the step's compute alone
qadam-nooverlap       qadam with ``overlap=False`` (its momentum averaged in ``step()``); qadam itself
                      is the default ``overlap="auto"``, ``qadam-overlap`` ``overlap=True``
qadam1[-nooverlap]    qadam with ``bits=1`` (1-bit momentum with error feedback)
====================  ========================================================================

async: its background thread is resumed (``algo.resume(ddp)``) before each of its blocks and
stopped with ``algo.abort(ddp)`` (which also averages the weights once) after it, outside the
timed region, so it never runs during the other variants' blocks. Its step time is the time of
the training loop, which never waits for the averaging; that is what async buys.

Example::

    variants = [Variant(name, make_model(), make_opt(name), loss) for name in ("ddp", "bytegrad")]
    rows, diverged = time_interleaved(variants, batches, warmup=1, reps=3, block=2, log=print)
    rows["bytegrad"]["step_s"]          # median step time, max over ranks
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

from benchmarks.records import quantile

MIB = 1 << 20
TORCH_BUCKET_MB = {"ddp-10MB": 10}  # torch DDP variants with another bucket_cap_mb than 25
STRIPED_STREAMS = 8  # ddp-striped's connection sets (bagua's own striped runs use 8 too)


class Variant:
    """One model copy wrapped one way; ``step(batch)`` runs one training step.

    Args:
        name: the variant (see the module docstring).
        model: this variant's copy of the model, on its device.
        optimizer: its optimizer (a ``QAdamOptimizer`` for qadam); a fused one
            (``bagua.optim.fuse_optimizer``) keeps its gradients as views and steps with ``fuse_step``.
        loss: ``loss(model, batch) -> scalar tensor``: the forward pass and the loss.
        async_interval_ms: async's ``sync_interval_ms``.
        device: "cpu" or "cuda".
        init_sync: broadcast rank 0's weights at wrap time (both wrappers' default); False where
            every rank built identical ones (a slow link then does not pay a broadcast per variant).
        warmup: onebit_grad's exact warm-up steps (the caller's untimed steps).
        clip_norm: ``clip_grad_norm_`` the gradients to this before each step (None: no clipping).
    """

    def __init__(self, name: str, model, optimizer, loss: Callable, async_interval_ms: int = 500,
                 device: str = "cpu", init_sync: bool = True, warmup: int = 1, clip_norm: Optional[float] = None):
        import torch
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        import bagua

        self.name = name
        self.is_torch = name.startswith("ddp")
        self.is_hook = name.endswith("-hook")  # torch DDP with a bagua.comm_hooks hook: bagua counts its bytes
        self.is_local = name == "local"
        self.algo = None
        self.opt = optimizer
        self.loss = loss
        self.clip_norm = clip_norm
        self.fused = bagua.optim.is_fused_optimizer(optimizer)
        broadcast_buffers = not name.endswith("-nobuf")
        if self.is_local:
            self.model = model
        elif self.is_torch:
            kw = {"device_ids": [torch.cuda.current_device()]} if device == "cuda" else {}
            if name == "ddp-striped":
                import torch.distributed as dist

                kw["process_group"] = dist.new_group(
                    backend=bagua.comm.STRIPED_BACKEND, pg_options=bagua.comm.StripeOptions(streams=STRIPED_STREAMS))
            self.model = TorchDDP(model, bucket_cap_mb=TORCH_BUCKET_MB.get(name, 25),
                                  forward_sync_buffers=broadcast_buffers, init_sync=init_sync, **kw)
            if name == "ddp-fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
            elif self.is_hook:
                algorithm = {"ddp-bytegrad-hook": "bytegrad", "ddp-onebit-hook": "onebit_grad"}[name]
                options = {"warmup_steps": warmup} if algorithm == "onebit_grad" else {}
                import bagua.comm_hooks

                bagua.comm_hooks.register(self.model, algorithm, **options)
        else:
            base = name.split("-")[0]
            if base in ("qadam", "qadam1"):
                overlap = False if "-nooverlap" in name else True if "-overlap" in name else "auto"
                algo = bagua.algorithms.QAdamAlgorithm(optimizer, overlap=overlap,
                                                       bits=1 if base == "qadam1" else 8)
            elif base == "async":
                algo = bagua.algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=async_interval_ms, warmup_steps=0)
            elif base == "onebit_grad":  # its exact warm-up: the untimed steps
                algo = bagua.algorithms.OneBitGradAlgorithm(warmup_steps=warmup)
            else:
                # "-hier": exact within each machine, the algorithm among the machines' leaders
                algo = bagua.algorithms.Algorithm.init(base, **({"hierarchical": True} if name.endswith("-hier") else {}))
            self.algo = algo
            size = 10 * MIB if name.endswith("-10MB") else bagua.parallel.ddp.DEFAULT_BUCKET_SIZE_BYTES
            self.model = bagua.DistributedDataParallel(model, [optimizer], algorithm=algo, bucket_size_bytes=size,
                                                       broadcast_buffers=broadcast_buffers, init_sync=init_sync)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.last_step_bytes: list[int] = []
        self._async_running = False

    def step(self, batch) -> None:
        self.opt.zero_grad(set_to_none=not self.fused)  # a fused optimizer's gradients stay views
        loss = self.loss(self.model, batch)
        if not self.is_torch and not self.is_local:
            self.last_step_bytes.append(self.model.bytes_sent_last_step)
        loss.backward()
        if self.clip_norm is not None:
            import torch

            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.opt.fuse_step() if self.fused else self.opt.step()

    def overlap_trial(self) -> Optional[tuple]:
        """qadam with ``overlap="auto"``: its trial's ``(choice, (speculating s, not s))``, ``times``
        None until its first trial ends; None for every other variant."""
        trial = getattr(getattr(self.model, "impl", None), "overlap_trial", None)
        return None if trial is None else (trial.choice, trial.times)

    def begin_block(self) -> None:
        if self.name == "async" and not self._async_running and self.model.step > 0:
            self.algo.resume(self.model)
        self._async_running = self.name == "async"

    def end_block(self) -> None:
        if self.name == "async" and self._async_running:
            self.algo.abort(self.model)  # every rank; also averages the weights once
            self._async_running = False

    def close(self) -> None:
        """Stop the wrapper; call it on every rank before the process group is destroyed.

        A torch DDP wrapper is dropped here: its C++ reducer holds a reference to the Gloo group,
        and when that is the last one (the group already destroyed) the reducer's destructor joins
        Gloo's worker threads with the GIL held, while a worker that is freeing a finished op's
        tensors waits for the GIL: the finished job never exits (tests/benchmarks/test_tradeoff.py
        hung so, about 1 run in 15 on a loaded 2-core machine). Dropped while the group is up, the
        last reference goes with ``destroy_process_group``, which joins without the GIL.
        """
        self.end_block()
        if self.is_torch:
            self.model = None
        elif not self.is_local:
            self.model.close()


def time_interleaved(variants: Sequence[Variant], batches: Sequence, warmup: int, reps: int, block: int,
                     log: Callable[[str], None], tx_bytes: Optional[Callable[[], int]] = None,
                     ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Warm every variant up (``warmup`` untimed steps, which also pass qadam's warm-up, and for
    qadam's ``overlap="auto"`` the steps of its first trial), then time
    ``reps`` rotated repetitions of ``block`` steps each. Every variant reads ``batches`` in the
    same order (cycled). Call on every rank.

    Returns ``(rows, diverged)``: per variant that trained to the end, the median, p25 and p75
    step time, the "epoch" (the sum of its timed blocks), bagua's bytes sent per step and the
    interface's (``tx_bytes``: this rank's tx counter, or None), each the max over ranks, plus
    rank 0's block times; and the variants dropped for NaN/Inf with why.
    """
    import torch
    import torch.distributed as dist

    import bagua

    cursor = {v.name: 0 for v in variants}
    diverged: dict[str, str] = {}

    def guarded_steps(v: Variant, k: int, times: Optional[list[float]]) -> bool:
        """Run k steps; False if the variant diverged. bagua's compressed allreduce raises the same
        ValueError on every rank when any input holds NaN/Inf, so all ranks drop it together."""
        try:
            for _ in range(k):
                batch = batches[cursor[v.name] % len(batches)]
                cursor[v.name] += 1
                ts = time.perf_counter()
                v.step(batch)
                if times is not None:
                    times.append(time.perf_counter() - ts)
        except ValueError as e:
            if "NaN or Inf" not in str(e):
                raise
            diverged[v.name] = f"NaN/Inf at its step {getattr(v.model, 'step', '?')}: {str(e).splitlines()[0][:160]}"
            log(f"{v.name} DIVERGED: {diverged[v.name]}")
            return False
        return True

    for v in variants:
        v.begin_block()
        guarded_steps(v, warmup, None)
        trial = v.overlap_trial()
        while v.name not in diverged and trial is not None and trial[1] is None:
            guarded_steps(v, 1, None)  # qadam overlap="auto": time the steady state, after its trial
            trial = v.overlap_trial()
        if trial is not None and v.name not in diverged:
            choice, (on, off) = trial
            log(f"{v.name}: overlap=auto speculates: {choice} (steps {1e3 * on:.0f} ms speculating, {1e3 * off:.0f} ms not)")
        if v.name not in diverged:
            v.end_block()
        dist.barrier()
    log(f"warm-up done: {warmup} step(s) per variant")

    n = len(variants)
    step_t: dict[str, list[float]] = {v.name: [] for v in variants}
    block_t: dict[str, list[float]] = {v.name: [] for v in variants}
    sent: dict[str, list[float]] = {v.name: [] for v in variants}
    wire: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(reps):
        for j in range(n):
            v = variants[(r + j) % n]
            if v.name in diverged:
                continue
            v.begin_block()
            dist.barrier()
            b0 = bagua.comm.bytes_sent()
            w0 = tx_bytes() if tx_bytes else 0
            t0 = time.perf_counter()
            if not guarded_steps(v, block, step_t[v.name]):
                dist.barrier()
                continue
            block_t[v.name].append(time.perf_counter() - t0)
            sent[v.name].append((bagua.comm.bytes_sent() - b0) / block)
            if tx_bytes:
                dist.barrier()  # tiny: lets the block's last segments leave the qdisc
                wire[v.name].append((tx_bytes() - w0) / block)
            v.end_block()
        log(f"repetition {r + 1}/{reps}")

    # per rank: median, p25, p75 step; epoch (sum of blocks); bytes; then max over ranks
    local: list[float] = []
    alive = [v for v in variants if v.name not in diverged and block_t[v.name]]
    for v in alive:
        s = step_t[v.name]
        local += [statistics.median(s), quantile(s, 0.25), quantile(s, 0.75), sum(block_t[v.name]),
                  statistics.median(sent[v.name]),
                  statistics.median(wire[v.name]) if wire[v.name] else -1.0,
                  statistics.median(v.last_step_bytes[warmup:]) if v.last_step_bytes[warmup:] else -1.0]
    K = 7
    agg = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(agg, op=dist.ReduceOp.MAX)
    agg = agg.tolist()
    world = dist.get_world_size()
    rows: dict[str, Any] = {}
    for i, v in enumerate(alive):
        med, p25, p75, epoch, b, w, last = agg[K * i: K * i + K]
        rows[v.name] = {
            "step_s": med, "p25_s": p25, "p75_s": p75, "epoch_s": epoch,
            "bagua_sent_per_step": None if v.is_torch and not v.is_hook else b,
            "bytes_sent_last_step": None if v.is_torch or v.is_local or last < 0 else last,
            "ring_formula_per_step": (2 * (world - 1) / world * v.grad_bytes * (0.5 if v.name == "ddp-fp16" else 1.0))
            if v.is_torch and not v.is_hook else None,
            "wire_per_step": w if w >= 0 else None,
            "blocks_s": block_t[v.name],
            "grad_bytes": v.grad_bytes,
        }
        if v.overlap_trial() is not None:
            rows[v.name]["overlap_trial"] = v.overlap_trial()
    return rows, diverged
