"""The registry of the performance page: its areas, what each results file does not record about
itself, the results files no figure reads, the claims held in prose only, every figure (by area,
``areas/``), and the README's headline.

Example::

    from benchmarks.performance.registry import FIGURES, RECORDED
    next(f for f in FIGURES if f.name == "cache_lmdb_epoch2").claim
    RECORDED["tradeoff.json"].section      # 'Bandwidth x latency' (its history in RESULTS.md)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .areas import accuracy, data, elastic, machines, network, optimizer, torch_ddp, wrapper
from .figure import Figure

CPU_BOX = ("the 2-vCPU shared KVM guest (AMD EPYC), torch 2.13.0+cpu on Gloo "
           "(RESULTS.md, \"Machine\")")



@dataclass(frozen=True)
class Area:
    """A section of the page."""

    key: str
    title: str
    intro: str


@dataclass(frozen=True)
class Recorded:
    """What a results file does not record about itself. ``section``: its history in RESULTS.md;
    ``module``: the benchmark that wrote it (its recorded ``argv`` is that module's); ``command``,
    ``date``: used where the file records none (a file that names no machine ran on ``CPU_BOX``);
    ``plot``: under benchmarks/figures/."""

    section: str
    module: Optional[str] = None
    command: Optional[str] = None
    date: Optional[str] = None
    plot: Optional[str] = None



AREAS = [
    Area("network", "Algorithms at network speeds",
         "How fast each algorithm trains at a link speed: **the grid below is the figure to quote** (one sweep, "
         "every algorithm, every rank its own machine behind an emulated link). The targets after it were set on "
         "other workloads and are measured on those."),
    Area("accuracy", "Time to accuracy",
         "Speed that costs accuracy is not speed: each algorithm's steps and time to torch DDP's final validation "
         "loss, and its loss at DDP's last step ([convergence.md](convergence.md) has the method and every table)."),
    Area("wrapper", "The wrapper's step",
         "What `bagua.DistributedDataParallel` adds to a training step against torch DDP, where the link is "
         "not the bottleneck."),
    Area("machines", "Several ranks a machine",
         "Machines of several ranks each (`LOCAL_WORLD_SIZE`), emulated: hierarchical algorithms against flat, "
         "the cost model on shapes it never saw, and correctness at 16 and 32 ranks."),
    Area("torch", "Plain torch DDP with bagua's hooks and connections",
         "No bagua wrapper: torch's `DistributedDataParallel` (or the Hugging Face `Trainer`) with `bagua.comm_hooks` "
         "or the `\"bagua\"` torch backend ([striped_connections.md](striped_connections.md))."),
    Area("data", "Data: cached dataset and sampler", "`bagua.data`'s cache and load-balanced sampling."),
    Area("optimizer", "Fused optimizer", "`bagua.optim.fuse_step` on CPU."),
    Area("elastic", "Elastic training", "Agents leaving and joining a running job."),
    Area("communication", "Communication core", "`bagua.comm`'s collectives against torch's."),
    Area("lightning", "Lightning", "`BaguaStrategy` against Lightning's DDP strategy."),
    Area("autotune", "Autotuning", "The autotuner against the exhaustive grid."),
    Area("gpu", "GPU",
         "No GPU figure is kept in a results file: `make gpu-check` writes `gpu_check.json` on a lent machine, "
         "and the H100 and H200 runs of earlier sessions are recorded in RESULTS.md only."),
]

RECORDED = {
    "tradeoff.json": Recorded("Bandwidth x latency", command="python -m benchmarks.tradeoff.sweep", plot="tradeoff.png"),
    "tradeoff_model.json": Recorded("Bandwidth x latency", command="python -m benchmarks.tradeoff.sweep --report",
                                    date="fitted to tradeoff.json's sweep"),
    "ddp_hooks.json": Recorded("Data-parallel algorithms", module="benchmarks.step.ddp"),
    "ddp_striped_backend.json": Recorded("Striped collectives", module="benchmarks.step.ddp"),
    "ddp.md": Recorded("Data-parallel algorithms",
                       command=".venv/bin/python -m benchmarks.step.ddp --out .bench/ddp-final2.json"),
    "wrapper_overhead.json": Recorded(
        "Readiness per bucket", command="python -m benchmarks.step.wrapper_overhead --rounds 7 --steps 400 --floor "
                                        "--out benchmarks/results/wrapper_overhead.json"),
    "wrapper_overhead_every_step.json": Recorded(
        "Readiness per bucket", command="python -m benchmarks.step.wrapper_overhead --rounds 5 --steps 400 --floor "
                                        "--block 1 --out benchmarks/results/wrapper_overhead_every_step.json"),
    "time_to_accuracy.json": Recorded("Speed without losing accuracy",
                                      command="python -m benchmarks.accuracy.time_to_accuracy",
                                      plot="time_to_accuracy.png"),
    "time_to_accuracy_constant.json": Recorded(
        "Speed without losing accuracy", plot="time_to_accuracy_constant.png",
        command="python -m benchmarks.accuracy.time_to_accuracy --measure constant --variants torch-ddp bytegrad "
                "qadam qadam1 onebit_grad"),
    "machines.json": Recorded("Many ranks, several a machine", command="python -m benchmarks.tradeoff.machines",
                              plot="machines.png"),
    "machines_heldout.json": Recorded("Many ranks, several a machine",
                                      command="python -m benchmarks.tradeoff.machines --held-out",
                                      plot="machines_heldout.png"),
    "machines_fresh_repeat.json": Recorded("Many ranks, several a machine"),  # its command is not recorded
    "machines_fresh.json": Recorded("Many ranks, several a machine",
                                    command="python -m benchmarks.tradeoff.machines --fresh", plot="machines_fresh.png"),
    "machines_comm_bound.json": Recorded("Many ranks, several a machine",
                                         command="python -m benchmarks.tradeoff.machines --size comm-bound"),
    "scale_check.json": Recorded("Many ranks, several a machine", module="benchmarks.scale.check"),
    "elastic_machines.json": Recorded("Many ranks, several a machine"),
    "hf_trainer.json": Recorded("Data-parallel algorithms", module="benchmarks.step.hf_trainer"),
    "cache.md": Recorded("Cached dataset"),
    "sampler.md": Recorded("Load-balanced sampler"),
    "fused_optimizer.md": Recorded("Fused optimizer"),
}

#: results files no figure is taken from, and why (a test fails on a results file in neither place)
NOT_SHOWN = {
    "tradeoff_quick.json": "the quick sweep (a 0.44M model), superseded by tradeoff.json",
    "tradeoff_model_quick.json": "the quick sweep's fit, superseded by tradeoff_model.json",
    "time_to_accuracy_quick.json": "the 60-step first look, superseded by time_to_accuracy.json",
}

#: claims whose figures live in RESULTS.md's prose only (no results file holds them): (area, claim, section)
PROSE_ONLY = [
    ("wrapper", "gradient_allreduce's step against torch DDP after the wrapper's rework (issue 11) and with "
                "`broadcast_buffers`; later runs of the loopback target above", "The wrapper and the algorithms in everyday loops"),
    ("wrapper", "compiled wrappers (`torch.compile`), split at the buckets or one graph", "torch.compile and overlap"),
    ("network", "qadam with `bits=1` at 100 Mbit/s, and qadam with gradient clipping (issue 28)",
     "The 8-bit path at the wire's limit"),
    ("accuracy", "onebit_grad's and qadam `bits=1`'s validation loss in `examples/train_lm.py` runs (issue 28); "
                 "the load-balanced sampler's tokens/s in LM training (issue 26)", "1-bit gradients"),
    ("data", "decoding cached samples with the restricted unpickler (issue 24)", "Cached dataset"),
    ("elastic", "restart success over kill -9 trials, recovery time and checkpoint cost (issue 14)",
     "Elastic restarts and checkpoints"),
    ("communication", "uncompressed allreduce against raw torch, MinMaxUInt8 allreduce at 100 Mbit/s (issue 2)",
     "Communication core"),
    ("communication", "striped collectives (`streams=K`) under per-flow caps (issue 16)", "Striped collectives"),
    ("lightning", "`BaguaStrategy` epoch time on loopback and at 100 Mbit/s (issue 13)", "Lightning strategy"),
    ("autotune", "autotuned step against the grid's best, steps to tune (issue 17)", "Autotuning"),
    ("gpu", "codec and fused-optimizer kernels' share of copy bandwidth, Sign1 kernels, the wrapper on one GPU, "
            "`make gpu-check`'s time (issues 2, 3, 6, 28, 29)", "GPU check"),
    ("gpu", "issue 43's re-measure of the wrapper on one GPU: not measured, no GPU was lent to that session",
     "Readiness per bucket"),
]

#: every figure, each area's in the order its module registers them
FIGURES: list[Figure] = [*wrapper.FIGURES, *network.FIGURES, *accuracy.FIGURES, *machines.FIGURES,
                         *torch_ddp.FIGURES, *data.FIGURES, *optimizer.FIGURES, *elastic.FIGURES]

#: the README's headline table: (figure, what it says), in order; ``{NAME}`` in a label is figure NAME
HEADLINE = [
    ("wrapper_host_ratio_148", "bagua's extra host time per training step, against torch DDP's"),
    ("speed_bytegrad_bw-100mbit", "bytegrad against torch DDP, 100 Mbit/s"),
    ("speed_bytegrad_bw-10mbit", "bytegrad against torch DDP, 10 Mbit/s"),
    ("speed_onebit_grad_bw-10mbit", "onebit_grad against torch DDP, 10 Mbit/s"),
    ("tta_fastest_speedup_100mbit", "time to torch DDP's validation loss, 100 Mbit/s, the fastest ({tta_fastest_100mbit})"),
    ("machines_hier_comm_bound", "hierarchical bytegrad against flat, 4 machines x 2 ranks, 100 Mbit/s"),
    ("striped_per_flow", "plain torch DDP on striped connections, each connection capped"),
    ("hf_trainer_8bit", "Hugging Face `Trainer` with bagua's 8-bit hook, 100 Mbit/s"),
    ("cache_lmdb_epoch2", "a second epoch from the LMDB cache, against no cache"),
]
HEADLINE_PLOT = "tradeoff.png"
