"""Every python block of README.md and docs/*.md, run as written and checked.

Each block runs in a real job (``tests.harness.run_ranks``): 2 Gloo ranks where it needs ranks, 1
process where it does not. The names a block leaves to the reader (a model, a loader, a dataset...)
come from its recipe's namespace, built in the rank; what the block leaves behind is read there and
checked here. ``test_every_python_block_is_run`` fails when a block appears that no test runs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

import bagua
from tests.docs.snippets import ROOT, all_blocks, find
from tests.harness import run_ranks
from tests.parallel.models import flat_params, make_model, rank_batches


# --- what the blocks leave to the reader ----------------------------------------------------------
class Samples(torch.utils.data.Dataset):
    """``n`` learnable samples (12 features, a label) that count how often each was computed; the
    sample's index rides along as feature 0."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 12, generator=g)
        self.x[:, 0] = torch.arange(n)
        self.computed = [0] * n

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.computed[i] += 1
        return self.x[i], int(self.x[i, 1:4].argmax())


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _model_and_sgd(rank: int, workdir: str) -> dict:
    model = make_model()
    return {"torch": torch, "bagua": bagua, "model": model, "opt": _sgd(model)}


def _model_and_loader(steps: int) -> Callable[[int, str], dict]:
    def namespace(rank: int, workdir: str) -> dict:
        model = make_model()
        return {"torch": torch, "bagua": bagua, "model": model, "opt": _sgd(model), "MyModel": make_model,
                "loader": rank_batches(rank, steps)}
    return namespace


def _identical_weights(results: list[dict]) -> None:
    assert torch.equal(results[0]["weights"], results[1]["weights"]), "the replicas must end identical"


def _weights_of(name: str) -> Callable[[int, dict], dict]:
    return lambda rank, ns: {"weights": flat_params(ns[name])}


# --- the recipes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """How to run one block: the namespace it is given (built in each rank, where it may also
    prepare the process: environment, a torch group), what to read from it afterwards (in the
    rank), and the check over every rank's reading (here)."""

    namespace: Callable[[int, str], dict]
    check: Callable[[list[dict]], None]
    after: Callable[[int, dict], dict] = lambda rank, ns: {}
    ranks: int = 2
    init: bool = True  # the harness calls bagua.init_process_group() (False: the block does, or needs no group)
    local_world_size: Optional[int] = None
    before: tuple[str, ...] = ()  # blocks run first in the same namespace (a definition the block uses)
    timeout: float = 90.0


def _swaps_namespace(rank: int, workdir: str) -> dict:
    os.environ["BAGUA_CACHE_DIR"] = os.path.join(workdir, "cache")  # both ranks share the cache, as on one machine
    ds = Samples()
    return {"ds": ds, "lengths": [1 + i % 5 for i in range(len(ds))], "model": make_model()}


def _swaps_after(rank: int, ns: dict) -> dict:
    ns["ds"].cache_loader.flush()  # the samples it buffers (20 at a time) are written
    bagua.comm.barrier()  # both ranks' samples are stored
    return {"weights": flat_params(ns["model"]), "cached": ns["ds"].cache_loader.num_keys()}


def _swaps_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["cached"] == len(Samples()), "every sample of the epoch is in the cache"


def _options_after(rank: int, ns: dict) -> dict:
    algorithm = ns["ddp"].algorithm
    return {"algorithm": type(algorithm).__name__, "mode": algorithm.peer_selection_mode}


def _options_check(results: list[dict]) -> None:
    assert (results[0]["algorithm"], results[0]["mode"]) == ("DecentralizedAlgorithm", "shift_one")


def _batchnorm_namespace(rank: int, workdir: str) -> dict:
    def with_batchnorm():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    return {"torch": torch, "bagua": bagua, "MyModel": with_batchnorm}


def _train(model, opt, rank: int, steps: int) -> None:
    """``steps`` plain training steps on this rank's batches, after a snippet set the model up."""
    for x, y in rank_batches(rank, steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _batchnorm_after(rank: int, ns: dict) -> dict:
    model, opt = ns["model"], ns["opt"]
    _train(model, opt, rank, 2)
    norm = model.module[1]
    return {"kind": type(norm).__name__, "running_mean": norm.running_mean.clone(), "weights": flat_params(model)}


def _batchnorm_check(results: list[dict]) -> None:
    assert results[0]["kind"] == "SyncBatchNorm"
    assert torch.equal(results[0]["running_mean"], results[1]["running_mean"]), "statistics over both ranks' batches"
    _identical_weights(results)


def _switch_namespace(rank: int, workdir: str) -> dict:
    ns = _model_and_sgd(rank, workdir)
    batches = iter(rank_batches(rank, 6))

    def train(ddp, steps):
        for _ in range(steps):
            x, y = next(batches)
            ns["opt"].zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            ns["opt"].step()
    return dict(ns, train=train)


def _switch_after(rank: int, ns: dict) -> dict:
    return {"step": ns["step"], "wrapper_step": ns["ddp"].step, "weights": flat_params(ns["model"])}


def _switch_check(results: list[dict]) -> None:
    _identical_weights(results)  # bytegrad started from rank 0's replica and kept them identical
    assert results[0]["step"] == 3 and results[0]["wrapper_step"] == 6, "the step count carries over"
    assert any("decentralized" in m and "bytegrad" in m for m in results[0]["log"]), results[0]["log"]


def _torch_ddp_twin(rank: int, ns: dict) -> dict:
    """The block's loop once more under torch's own DistributedDataParallel, from the same start."""
    import contextlib as cl

    twin = make_model()
    opt = _sgd(twin)
    ddp = torch.nn.parallel.DistributedDataParallel(twin, bucket_cap_mb=25)
    for i, (x, y) in enumerate(rank_batches(rank, 6)):
        last_of_two = i % 2 == 1
        with cl.nullcontext() if last_of_two else ddp.no_sync():
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if last_of_two:
            opt.step()
            opt.zero_grad()
    return {"weights": flat_params(ns["model"]), "torch_ddp": flat_params(twin)}


def _swap_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert torch.equal(results[0]["weights"], results[0]["torch_ddp"]), "bit-equal to torch DDP"


def _hook_namespace(rank: int, workdir: str) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist

    dist.init_process_group("gloo")  # a plain torch job: the hook joins it on its first call
    return {"model": make_model(), "torch": torch, "bagua": bagua, "pl": pl}


def _hook_after(rank: int, ns: dict) -> dict:
    model = ns["model"]
    opt = _sgd(model)
    _train(model, opt, rank, 3)
    return {"weights": flat_params(model.module), "steps": ns["hook_state"].steps,
            "callbacks": [type(c).__name__ for c in ns["trainer"].callbacks]}


def _hook_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["steps"] == 3 and "CommHook" in results[0]["callbacks"]


def _collectives_check(results: list[dict]) -> None:
    assert torch.equal(results[0]["everything"], torch.tensor([0.5] * 2000))
    assert torch.equal(results[1]["everything"], results[0]["everything"])


def _striping_check(results: list[dict]) -> None:
    for r in results:
        assert r["streams"] == 4 and torch.equal(r["t"], torch.full((4 << 20,), 2.0))


def _cache_namespace(rank: int, workdir: str) -> dict:
    seen = []
    return {"slow_ds": Samples(16), "cache_dir": os.path.join(workdir, "lmdb"), "seen": seen,
            "train_step": lambda x, y: seen.append(x[:, 0].long().tolist())}


def _cache_after(rank: int, ns: dict) -> dict:
    return {"computed": ns["slow_ds"].computed, "seen": ns["seen"]}


def _cache_check(results: list[dict]) -> None:
    [r] = results
    assert r["computed"] == [1] * 16, "every sample computed once, in epoch 0"
    epochs = [sorted(sum(r["seen"][:2], [])), sorted(sum(r["seen"][2:], []))]
    assert epochs == [list(range(16))] * 2, "both epochs see every sample"


def _redis_namespace(rank: int, workdir: str) -> dict:
    os.environ["BAGUA_CACHE_DIR"] = os.path.join(workdir, "cache")  # the local server's socket lives here
    return {"bagua": bagua, "slow_ds": Samples(8)}


def _redis_after(rank: int, ns: dict) -> dict:
    store = type(ns["ds"].cache_loader.store).__name__
    bagua.data.stores.stop_local_server()
    return {"store": store, "expected": str([Samples(8)[i][1] for i in range(4)])}


def _redis_check(results: list[dict]) -> None:
    [r] = results
    assert r["store"] == "RedisStore" and r["stdout"].strip() == r["expected"]


def _sampler_namespace(rank: int, workdir: str) -> dict:
    g = torch.Generator().manual_seed(3)
    docs = []
    for i in range(40):
        doc = torch.randint(1, 100, (int(torch.randint(4, 64, (1,), generator=g)),), generator=g)
        doc[0] = i  # the document's index, its first token
        docs.append(doc)
    ns: dict = {"bagua": bagua, "docs": docs, "batches_seen": []}

    def pad(batch):
        return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=-1)

    def train_step(batch):  # reads the block's loop variable, `epoch`, from the namespace it runs in
        ns["batches_seen"].append((ns["epoch"], batch[:, 0].tolist(), int((batch >= 0).sum(1).max()), len(batch)))
    ns.update(pad=pad, train_step=train_step)
    return ns


def _sampler_check(results: list[dict]) -> None:
    per_rank = [r["batches_seen"] for r in results]
    for epoch in (0, 1):
        counts = [sum(1 for b in seen if b[0] == epoch) for seen in per_rank]
        assert counts[0] == counts[1], f"epoch {epoch}: every rank the same number of batches"
        docs = {i for seen in per_rank for b in seen if b[0] == epoch for i in b[1]}
        assert docs == set(range(40)), f"epoch {epoch}: every document once"
    for _, _, longest, size in per_rank[0] + per_rank[1]:
        assert size * longest <= 256 or size == 1, "a batch's padded tokens stay within the budget"


def _resume_namespace(rank: int, workdir: str) -> dict:
    import multiprocessing

    multiprocessing.current_process().daemon = False  # the harness's ranks are daemons; the block starts DataLoader workers
    ds = torch.utils.data.TensorDataset(torch.arange(40), torch.arange(40) % 3)
    return {"bagua": bagua, "ds": ds}


def _resume_after(rank: int, ns: dict) -> dict:
    whole = list(bagua.data.ElasticDistributedSampler(ns["ds"], shuffle=True))  # this rank's epoch, uninterrupted
    rest = [i for x, y in ns["rest"] for i in x.tolist()]
    return {"whole": whole, "rest": rest, "position": ns["state"]["position"]}


def _resume_check(results: list[dict]) -> None:
    for r in results:
        assert r["position"] == 12, "the state counts the 3 batches the loop received, not the prefetched ones"
        assert r["rest"] == r["whole"][12:], "the resumed pass yields exactly the rest of the epoch"


def _twin_after(make_optimizer: Callable) -> Callable[[int, dict], dict]:
    """The block's fused optimizer against the same optimizer unfused, from the same start, on the same batches."""
    def after(rank: int, ns: dict) -> dict:
        twin = make_model()
        opt = make_optimizer(twin.parameters())
        for x, y in ns["loader"]:
            loss = torch.nn.functional.cross_entropy(twin(x), y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
        return {"weights": flat_params(ns["model"]), "unfused": flat_params(twin),
                "fused": bagua.optim.is_fused_optimizer(ns["opt"]), "steps": bagua.optim.fused_update_count(ns["opt"])}
    return after


def _fused_check(results: list[dict]) -> None:
    [r] = results
    assert r["fused"] and r["steps"] == 5
    torch.testing.assert_close(r["weights"], r["unfused"])  # torch's single-pass CPU kernel: equal within rounding


def _lion_check(results: list[dict]) -> None:
    [r] = results
    assert r["fused"] and r["steps"] == 5
    assert torch.equal(r["weights"], r["unfused"]), "Lion's flat step is its own step, element by element"


def _fused_wrapper_after(rank: int, ns: dict) -> dict:
    return {"weights": flat_params(ns["model"]), "steps": bagua.optim.fused_update_count(ns["opt"])}


def _fused_wrapper_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["steps"] == 4


def _qadam_after(rank: int, ns: dict) -> dict:
    return {"weights": flat_params(ns["model"]), "steps": ns["opt"].step_count, "bits": ns["model"].algorithm.bits}


def _qadam_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["steps"] == 8 and results[0]["bits"] == 1, "past warm-up, on 1-bit momentum"


def _lightning_namespace(rank: int, workdir: str) -> dict:
    import lightning.pytorch as pl

    os.environ["TORCHELASTIC_RUN_ID"] = "snippets"  # as under torchrun: Lightning takes the job's ranks

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = Samples(32)
    return {"model": Classifier(), "loader": torch.utils.data.DataLoader(ds, batch_size=4)}


def _lightning_after(rank: int, ns: dict) -> dict:
    trainer = ns["trainer"]
    return {"weights": flat_params(ns["model"]), "steps": trainer.global_step,
            "strategy": type(trainer.strategy).__name__}


def _lightning_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["strategy"] == "BaguaStrategy" and results[0]["steps"] == 4  # 32 samples, 2 ranks, batches of 4


def _autotune_after(rank: int, ns: dict) -> dict:
    result = ns["model"].autotune_result
    return {"weights": flat_params(ns["model"]), "config": result.config if result else None}


def _autotune_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["config"] and results[0]["config"] == results[1]["config"], "a configuration kept, the same on every rank"
    assert "AutotuneResult" in results[0]["stdout"]


def _bytes_after(rank: int, ns: dict) -> dict:
    return {"sent": ns["sent"], "params": sum(p.numel() for p in ns["model"].parameters())}


def _bytes_check(results: list[dict]) -> None:
    r = results[0]
    fp32 = 2 * (2 - 1) / 2 * 4 * r["params"]  # an exact ring allreduce on 2 ranks sends 2 (w-1)/w of the fp32 bytes
    assert 0 < r["sent"] < 0.3 * fp32, f"8-bit gradients: about a quarter of {fp32:.0f} bytes, got {r['sent']}"
    assert "on a 100 Mbit/s link" in r["stdout"]


def _migrating_namespace(rank: int, workdir: str) -> dict:
    model = make_model()
    return {"torch": torch, "model": model, "optimizer": _sgd(model), "original": model}


def _migrating_after(rank: int, ns: dict) -> dict:
    model, opt = ns["model"], ns["optimizer"]
    _train(model, opt, rank, 3)
    return {"weights": flat_params(model), "same_module": model is ns["original"],
            "algorithm": type(model.bagua_algorithm).__name__}


def _migrating_check(results: list[dict]) -> None:
    _identical_weights(results)
    assert results[0]["same_module"] and results[0]["algorithm"] == "GradientAllReduceAlgorithm"


def _plugin_after(rank: int, ns: dict) -> dict:
    return {"algorithm": type(ns["model"].algorithm).__name__, "every": ns["model"].algorithm.every}


def _plugin_check(results: list[dict]) -> None:
    assert (results[0]["algorithm"], results[0]["every"]) == ("PeriodicAverageAlgorithm", 4)


def _advise_check(results: list[dict]) -> None:
    from bagua.advise import ALGORITHMS

    lines = results[0]["stdout"].splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(ALGORITHMS), "one line per algorithm"


WRITING = "docs/writing_an_algorithm.md > Worked example: average the weights every k steps (local SGD)"
_just_bagua = lambda rank, workdir: {"torch": torch, "bagua": bagua}  # noqa: E731

RECIPES: dict[str, Recipe] = {
    "README.md > The one-line swaps": Recipe(_swaps_namespace, _swaps_check, _swaps_after, init=False),
    "docs/index.md > Bagua": Recipe(lambda rank, workdir: {}, _identical_weights, _weights_of("model"), init=False),
    "docs/distributed_training.md > The wrapper": Recipe(_model_and_loader(4), _identical_weights, _weights_of("model"),
                                                         init=False),
    "docs/distributed_training.md > Options": Recipe(_model_and_sgd, _options_check, _options_after),
    "docs/distributed_training.md > Batch norm across ranks": Recipe(_batchnorm_namespace, _batchnorm_check,
                                                                     _batchnorm_after),
    "docs/distributed_training.md > Checkpoints": Recipe(_switch_namespace, _switch_check, _switch_after),
    "docs/coming_from_torch_ddp.md > The swap": Recipe(_model_and_loader(6), _swap_check, _torch_ddp_twin, init=False),
    "docs/coming_from_torch_ddp.md > Keeping torch DDP: bagua as a communication hook": Recipe(
        _hook_namespace, _hook_check, _hook_after, init=False, timeout=120),
    "docs/communication.md > Collectives": Recipe(lambda rank, workdir: {}, _collectives_check,
                                                  lambda rank, ns: {"everything": ns["everything"]}, init=False),
    "docs/communication.md > Striping": Recipe(_just_bagua, _striping_check,
                                               lambda rank, ns: {"streams": ns["group"].streams, "t": ns["t"]},
                                               init=False, local_world_size=1),  # two machines of one rank each
    "docs/data.md > Caching a dataset": Recipe(_cache_namespace, _cache_check, _cache_after, ranks=1, init=False),
    "docs/data.md > Stores": Recipe(_redis_namespace, _redis_check, _redis_after, ranks=1, init=False),
    "docs/data.md > Load-balanced samplers": Recipe(_sampler_namespace, _sampler_check,
                                                    lambda rank, ns: {"batches_seen": ns["batches_seen"]}),
    "docs/data.md > Resuming mid-epoch": Recipe(_resume_namespace, _resume_check, _resume_after),
    "docs/optimizers.md > Fusing an optimizer": Recipe(_model_and_loader(5), _fused_check,
                                                       _twin_after(lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                                                       ranks=1, init=False),
    "docs/optimizers.md > With the wrapper": Recipe(_model_and_loader(4), _fused_wrapper_check, _fused_wrapper_after),
    "docs/optimizers.md > Lion": Recipe(_model_and_loader(5), _lion_check,
                                        _twin_after(lambda ps: bagua.optim.Lion(ps, lr=1e-4, weight_decay=0.1)),
                                        ranks=1, init=False),
    "docs/optimizers.md > QAdamOptimizer": Recipe(_model_and_loader(8), _qadam_check, _qadam_after),
    "docs/lightning.md > Lightning": Recipe(_lightning_namespace, _lightning_check, _lightning_after, timeout=120),
    "docs/choosing_an_algorithm.md > Ask the model for your setting": Recipe(lambda rank, workdir: {}, _advise_check,
                                                                             ranks=1, init=False),
    "docs/autotuning.md > Autotuning": Recipe(_model_and_loader(60), _autotune_check, _autotune_after, timeout=120),
    "docs/benchmarks.md > Bytes per step": Recipe(_model_and_loader(3), _bytes_check, _bytes_after),
    "docs/gpu.md > GPU": Recipe(_model_and_loader(4), _identical_weights, _weights_of("model"), init=False),
    "docs/migrating_from_bagua.md > Migrating from the original Bagua (0.9)": Recipe(
        _migrating_namespace, _migrating_check, _migrating_after, init=False),
    WRITING + " #1": Recipe(_model_and_sgd, _plugin_check, _plugin_after, before=(WRITING,)),
}

# Blocks another test runs as written, with checks of its own: "path::test".
RUN_ELSEWHERE = {
    WRITING: "tests/parallel/test_writing_an_algorithm.py::test_the_documented_algorithm_averages_every_k_steps",
    "docs/striped_connections.md > Striped connections (Bagua-Net) for any torch.distributed job":
        "tests/comm/test_striped_backend.py::test_the_guide_snippets_run_as_written",
    "docs/striped_connections.md > Striped connections (Bagua-Net) for any torch.distributed job #1":
        "tests/comm/test_striped_backend.py::test_the_guide_snippets_run_as_written",
    "docs/elastic.md > Checkpoints and restarts":
        "tests/docs/test_snippets.py::test_the_checkpoint_recipe_resumes_every_sample_once_and_never_reenters_a_finished_epoch",
}


# --- running a block ------------------------------------------------------------------------------
class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run(rank: int, key: str, workdir: str) -> dict:
    """In a rank: build the recipe's namespace, run the block as written, read what it left."""
    recipe = RECIPES[key]
    os.chdir(workdir)  # relative paths a block writes ("ckpt/...", Lightning's logs) land in the test's directory
    ns = recipe.namespace(rank, workdir)
    log = _Log()
    logging.getLogger("bagua").addHandler(log)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for earlier in recipe.before:
            exec(find(earlier).compile(), ns)
        exec(find(key).compile(), ns)
    logging.getLogger("bagua").removeHandler(log)
    result = recipe.after(rank, ns)
    return dict(result, stdout=out.getvalue(), log=log.messages + [str(w.message) for w in caught])


@pytest.mark.parametrize("key", sorted(RECIPES))
def test_the_block_runs_as_written(key, tmp_path):
    if "Lightning" in key or "communication hook" in key:
        pytest.importorskip("lightning")
    recipe = RECIPES[key]
    results = run_ranks(_run, recipe.ranks, key, str(tmp_path), init=recipe.init,
                        local_world_size=recipe.local_world_size, timeout=recipe.timeout)
    recipe.check(results)


def test_every_python_block_is_run():
    blocks = set(all_blocks())
    assert not set(RECIPES) & set(RUN_ELSEWHERE), "a block has one runner"
    unrun = sorted(blocks - set(RECIPES) - set(RUN_ELSEWHERE))
    assert not unrun, f"python blocks no test runs (give each a Recipe here, or name the test that runs it): {unrun}"
    gone = sorted((set(RECIPES) | set(RUN_ELSEWHERE)) - blocks)
    assert not gone, f"recipes for blocks that no longer exist (a heading changed?): {gone}"
    for key, where in RUN_ELSEWHERE.items():
        path, test = where.split("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {test}\(", source, re.M), f"{where} (running {key!r}) does not exist"
        assert Path(key.split(" > ")[0]).name in source, f"{path} does not read {key.split(' > ')[0]}"


# --- the checkpoint recipe of docs/elastic.md: a resume trains every sample once ---------------------
CHECKPOINTS = "docs/elastic.md > Checkpoints and restarts"
SAMPLES, BATCH, EPOCHS = 32, 4, 3  # 4 steps per epoch on each of 2 ranks


class _Interrupted(Exception):
    """The job dies before this step."""


def _attempt(code, checkpoint_every: int, stop_at) -> dict:
    """One run of the recipe, as a fresh job would start it; interrupted before step ``stop_at``."""
    x = torch.randn(SAMPLES, 12, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(SAMPLES)  # the sample's index rides along as a feature
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ns: dict[str, Any] = {"bagua": bagua, "ds": torch.utils.data.TensorDataset(x, x[:, 1:4].argmax(1)), "opt": opt,
                          "ddp": bagua.DistributedDataParallel(model, [opt]),
                          "sched": torch.optim.lr_scheduler.StepLR(opt, 10), "epochs": EPOCHS,
                          "checkpoint_every": checkpoint_every}
    seen, evaluated = [], []

    def train_step(x, y):
        if ns["step"] + 1 == stop_at:
            raise _Interrupted
        loss = torch.nn.functional.cross_entropy(ns["ddp"](x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ns["sched"].step()
        seen.append((ns["step"] + 1, ns["epoch"], x[:, 0].long().tolist()))

    ns.update(train_step=train_step, evaluate=evaluated.append)
    try:
        exec(code, ns)
    except _Interrupted:
        pass
    ns["ddp"].close()
    return {"seen": seen, "evaluated": evaluated}


def _checkpoints_and_restarts(rank: int, workdir: str) -> dict:
    code = find(CHECKPOINTS).compile()
    out = {}
    for case, checkpoint_every in (("end_of_epoch", 4), ("mid_epoch", 3)):
        os.chdir(os.path.join(workdir, case))  # the recipe's "ckpt" directory is relative
        out[case] = [_attempt(code, checkpoint_every, stop_at=5), _attempt(code, checkpoint_every, stop_at=None)]
    return out


def test_the_checkpoint_recipe_resumes_every_sample_once_and_never_reenters_a_finished_epoch(tmp_path):
    for case in ("end_of_epoch", "mid_epoch"):
        (tmp_path / case).mkdir()
    ranks = run_ranks(_checkpoints_and_restarts, 2, str(tmp_path))
    for case, saved_at, evaluated_after in (("end_of_epoch", 4, [1, 2]), ("mid_epoch", 3, [0, 1, 2])):
        per_epoch = {e: [] for e in range(EPOCHS)}
        for first, resumed in (r[case] for r in ranks):
            assert first["evaluated"] == [0]  # interrupted at the first step of epoch 1
            assert resumed["evaluated"] == evaluated_after, f"{case}: the resumed run's epochs"
            assert resumed["seen"][0][0] == saved_at + 1, "steps count on from the checkpoint"
            for step, epoch, indices in [s for s in first["seen"] if s[0] <= saved_at] + resumed["seen"]:
                per_epoch[epoch] += indices
        for epoch, indices in per_epoch.items():
            assert sorted(indices) == list(range(SAMPLES)), f"{case}: epoch {epoch} trains every sample once"
