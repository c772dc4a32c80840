"""Autotuning inside the training loop: the search, its agreement across ranks, and that it never
changes a result."""

from __future__ import annotations

import csv
import os
import time

import pytest
import torch

import bagua
from tests.harness import run_ranks, run_ranks_expect_errors
from tests.parallel.models import flat_params, make_model, rank_batches

STEPS = 16
SIZES = (64, 256, 1 << 20)  # bytes: a bucket per tensor, a few, one
SMALLEST = 128  # the bucket size the tests wrap with: the default configuration
QUICK = dict(max_trials=6, steps_per_trial=1, warmup_steps=1, space={"bucket_size_bytes": SIZES})


def _train(rank: int, algorithm: str, autotune, by_hand=None, slow=None) -> dict:
    """Train STEPS steps. ``by_hand``: {step: settings} applied with ``configure`` instead of tuning;
    ``slow``: {bucket size: seconds} a step sleeps on rank 1 while that size is in use."""
    model = make_model(seed=rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm, bucket_size_bytes=SMALLEST, autotune=autotune)
    in_use = []
    for step, (x, y) in enumerate(rank_batches(rank, STEPS)):
        if by_hand and step in by_hand:
            ddp.configure(**by_hand[step])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        in_use.append(ddp.bucket_size_bytes)  # what this step ran with
        if slow and rank == 1:
            time.sleep(slow.get(ddp.bucket_size_bytes, 0.0))
    return {"weights": flat_params(model), "log": ddp.autotune_log, "result": ddp.autotune_result, "in_use": in_use}


def test_tuning_changes_no_weight_and_every_rank_changes_at_the_same_step():
    tuned = run_ranks(_train, 2, "gradient_allreduce", bagua.AutotuneConfig(**QUICK))
    log = tuned[0]["log"]
    assert len(log) >= 3 and tuned[0]["result"] is not None
    assert tuned[1]["log"] == log  # the same trials, configurations, steps and scores on every rank
    assert tuned[0]["in_use"] == tuned[1]["in_use"]
    assert len(set(tuned[0]["in_use"])) >= 3  # it really tried several sizes
    # the same sequence of configurations applied by hand: bit-identical weights
    by_hand = {entry["step"]: entry["config"] for entry in log}
    by_hand[tuned[0]["result"].applied_at_step - 1] = tuned[0]["result"].config
    manual = run_ranks(_train, 2, "gradient_allreduce", False, by_hand)
    untuned = run_ranks(_train, 2, "gradient_allreduce", False)
    for rank in range(2):
        assert manual[rank]["in_use"] == tuned[rank]["in_use"]
        assert torch.equal(tuned[rank]["weights"], manual[rank]["weights"])
        assert torch.equal(tuned[rank]["weights"], untuned[rank]["weights"])  # 2 ranks: sums are exact
    assert torch.equal(tuned[0]["weights"], tuned[1]["weights"])


@pytest.mark.parametrize("world_size,space", [
    (2, {"bucket_size_bytes": SIZES, "segment_elems": (1 << 16, 1 << 22)}),
    (3, {"bucket_size_bytes": SIZES}),
    (2, {"segment_elems": (1 << 16, 1 << 18, 1 << 22)}),
], ids=["buckets-and-segments", "three-ranks", "segments"])
def test_tuning_bytegrad_changes_no_weight_at_any_world_size(world_size, space):
    """bytegrad's 8-bit blocks follow each tensor and its reduction sums the ranks in order, so
    bucket and segment sizes leave every bit, on any number of ranks."""
    config = bagua.AutotuneConfig(max_trials=6, steps_per_trial=1, warmup_steps=1, space=space)
    tuned = run_ranks(_train, world_size, "bytegrad", config)
    untuned = run_ranks(_train, world_size, "bytegrad", False)
    assert len({str(e["config"]) for e in tuned[0]["log"]}) >= 3
    for rank in range(world_size):
        assert torch.equal(tuned[rank]["weights"], untuned[rank]["weights"])


def _hierarchical(rank: int, switch: bool) -> dict:
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt])
    space = ddp.tunables()
    for step, (x, y) in enumerate(rank_batches(rank, 6)):
        if switch and step in (2, 4):
            ddp.configure(hierarchical=step == 2)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"space": sorted(space), "weights": flat_params(model), "flat": ddp.impl.node_groups is None}


def test_hierarchical_is_tunable_for_exact_gradients_on_several_nodes_of_several_ranks():
    switched = run_ranks(_hierarchical, 4, True, local_world_size=2)
    plain = run_ranks(_hierarchical, 4, False, local_world_size=2)
    assert switched[0]["space"] == ["bucket_size_bytes", "hierarchical"] and switched[0]["flat"]
    for rank in range(4):
        assert torch.equal(switched[rank]["weights"], switched[0]["weights"])  # identical on every rank
        # the same sums grouped by node: equal up to float rounding (4 ranks)
        torch.testing.assert_close(switched[rank]["weights"], plain[rank]["weights"], rtol=1e-6, atol=1e-7)
    assert run_ranks(_hierarchical, 2, False, local_world_size=2)[0]["space"] == ["bucket_size_bytes"]  # one node


def _dies_mid_trial(rank: int):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = bagua.DistributedDataParallel(model, [opt], autotune=bagua.AutotuneConfig(**QUICK))
    for step, (x, y) in enumerate(rank_batches(rank, STEPS)):
        if rank == 1 and step == 4:
            raise RuntimeError("rank 1 stops here on purpose")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def test_a_rank_that_dies_mid_trial_ends_in_the_usual_timeout_error():
    errors = run_ranks_expect_errors(_dies_mid_trial, 2, comm_timeout_s=5.0, timeout=60)
    assert "on purpose" in errors[1]
    assert "bagua.comm.allreduce" in errors[0], errors[0]


def test_the_fastest_configuration_wins_the_slowest_rank_sets_the_score_and_slow_trials_are_cut():
    slow = {SMALLEST: 0.02, 64: 0.25, 256: 0.0, 1 << 20: 0.05}  # rank 1 alone sleeps: its steps set the pace
    config = bagua.AutotuneConfig(max_trials=8, steps_per_trial=3, warmup_steps=1, space={"bucket_size_bytes": SIZES})
    out = run_ranks(_train, 2, "gradient_allreduce", config, None, slow)
    result, log = out[0]["result"], out[0]["log"]
    assert result.config == {"bucket_size_bytes": 256}
    assert len(log) == 4  # the default (128 bytes) and the three sizes, each once: the space is exhausted
    scores = {e["config"]["bucket_size_bytes"]: e for e in log}
    assert scores[64]["outcome"] == "cut" and scores[64]["step_time_s"] >= 0.25  # rank 1's sleep counts
    assert scores[1 << 20]["step_time_s"] >= 0.05  # cut as well (over 3x the best), or complete
    assert result.step_time_s < 0.02 <= result.default_step_time_s == scores[SMALLEST]["step_time_s"]
    assert result.speedup > 1
    # tuning ended within the budget: warm-up, then one settling and three timed steps per trial
    assert result.applied_at_step <= 1 + 4 * 4 + 1
    assert out[0]["in_use"][result.applied_at_step:] == [256] * (STEPS - result.applied_at_step)


def _csv_and_line(rank: int, path: str) -> dict:
    import logging

    os.environ["BAGUA_AUTOTUNE_LOG"] = path
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("bagua.parallel.autotune").addHandler(handler)
    logging.getLogger("bagua.parallel.autotune").setLevel(logging.INFO)
    out = _train(rank, "gradient_allreduce", bagua.AutotuneConfig(**QUICK))
    out["lines"] = [r.getMessage() for r in records]
    return out


def test_every_trial_goes_to_the_csv_log_and_rank0_logs_one_line(tmp_path):
    path = str(tmp_path / "trials.csv")
    out = run_ranks(_csv_and_line, 2, path)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["trial"]) for r in rows] == [e["trial"] for e in out[0]["log"]]
    assert rows[0]["bucket_size_bytes"] == str(SMALLEST) and float(rows[0]["step_time_s"]) > 0
    assert len(out[0]["lines"]) == 1 and out[1]["lines"] == []
    assert out[0]["lines"][0].startswith("bagua autotune: bucket_size_bytes=") and "ms/step" in out[0]["lines"][0]


def _initial(rank: int) -> dict:
    import sys

    sys.modules["optuna"] = None  # a configuration found before needs no search, so no optuna
    config = bagua.AutotuneConfig(initial={"bucket_size_bytes": 1 << 20})
    return _train(rank, "gradient_allreduce", config)


def test_a_saved_result_is_applied_at_wrap_time_without_searching():
    for out in run_ranks(_initial, 2):
        assert out["in_use"] == [1 << 20] * STEPS and out["log"] == []
        assert out["result"].config == {"bucket_size_bytes": 1 << 20}


def _resume(rank: int) -> dict:
    tuned = _train(rank, "gradient_allreduce", bagua.AutotuneConfig(**QUICK))
    model = make_model(seed=rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ddp = bagua.DistributedDataParallel(model, [opt], bucket_size_bytes=SMALLEST, autotune=True)
    ddp.load_algorithm_state_dict({"step": 0, "algorithm": {}, "autotune": tuned["result"].config})
    for x, y in rank_batches(rank, 8):  # more than the default warm-up: a search would have begun
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"tuned": tuned["result"].config, "resumed": ddp.autotune_result.config, "log": ddp.autotune_log,
            "in_use": ddp.bucket_size_bytes, "saved": ddp.algorithm_state_dict()["autotune"]}


def test_a_checkpoint_carries_the_tuned_configuration_and_a_resumed_run_does_not_search_again():
    for out in run_ranks(_resume, 2):
        assert out["resumed"] == out["tuned"] == out["saved"] and out["log"] == []
        assert out["in_use"] == out["tuned"]["bucket_size_bytes"]


def _env(rank: int, value: str) -> dict:
    os.environ["BAGUA_AUTOTUNE"] = value
    return _train(rank, "gradient_allreduce", None)


def test_bagua_autotune_env_turns_it_on():
    out = run_ranks(_env, 2, "1")
    assert len(out[0]["log"]) >= 2  # the default budget is longer than this run: still tuning
    assert run_ranks(_env, 2, "0")[0]["log"] == []


def test_streams_join_the_search_where_there_are_stripes():
    init = {"streams": 2}
    config = bagua.AutotuneConfig(max_trials=8, steps_per_trial=1, warmup_steps=1,
                                  space={"streams": (1, 2), "bucket_size_bytes": (256,)})
    # each rank its own machine: stripes are made only for groups across machines
    tuned = run_ranks(_train, 2, "gradient_allreduce", config, init_kwargs=init, local_world_size=1)
    untuned = run_ranks(_train, 2, "gradient_allreduce", False, init_kwargs=init, local_world_size=1)
    assert {e["config"]["streams"] for e in tuned[0]["log"]} == {1, 2}
    assert len(tuned[0]["log"]) == 3 and tuned[0]["result"] is not None  # the default, then the space, exhausted
    assert torch.equal(tuned[0]["weights"], untuned[0]["weights"])


def _bad(rank: int, case: str):
    import sys

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "no_optuna":
        sys.modules["optuna"] = None
        bagua.DistributedDataParallel(model, [opt], autotune=bagua.AutotuneConfig(space={"bucket_size_bytes": SIZES}))
    elif case == "nothing_to_tune":
        bagua.DistributedDataParallel(model, [opt], "low_precision_decentralized", autotune=True)
    elif case == "env":
        os.environ["BAGUA_AUTOTUNE"] = "yes"
        bagua.DistributedDataParallel(model, [opt])
    elif case == "space":
        bagua.DistributedDataParallel(model, [opt], autotune=bagua.AutotuneConfig(space={"segment_elems": (1024,)}))
    elif case == "config":
        bagua.AutotuneConfig(steps_per_trial=0)


@pytest.mark.parametrize("case,message", [
    ("no_optuna", "pip install 'bagua-torch[autotune]' (in a clone: pip install -e '.[autotune]')"),
    ("nothing_to_tune", "autotune: nothing to tune for LowPrecisionDecentralizedAlgorithm"),
    ("env", "environment variable BAGUA_AUTOTUNE must be 0 or 1, got 'yes'"),
    ("space", "AutotuneConfig.space: ['segment_elems'] not tunable here; tunable: ['bucket_size_bytes']"),
    ("config", "AutotuneConfig.steps_per_trial must be an integer >= 1, got 0"),
])
def test_bad_input_is_a_clear_error(case, message):
    errors = run_ranks_expect_errors(_bad, 2, case, timeout=60)
    assert all(message in tb for tb in errors.values()), errors[0]


def _shown(rank: int, config, width: int) -> dict:
    """What rank ``rank`` prints on stderr while wrapping and training, logging left unconfigured."""
    import contextlib
    import io
    import logging

    assert not logging.getLogger().hasHandlers()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        ddp = bagua.DistributedDataParallel(model, [opt], autotune=config)
        for x, y in rank_batches(rank, 8):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    return {"stderr": stderr.getvalue(), "result": ddp.autotune_result}


@pytest.mark.parametrize("case", ["fits_in_one_bucket", "searched", "quiet"])
def test_rank0_shows_one_line_by_default_and_none_when_quiet(case):
    """Without any logging configuration: the tiny model (1 KB) fits in the smallest bucket size of
    the default space (1 MiB), so the search is skipped with one line; a 1.6 MB model is searched
    and its result shown; quiet shows nothing."""
    quick = dict(max_trials=2, steps_per_trial=1, warmup_steps=1)
    config, width = {
        "fits_in_one_bucket": (True, 16),
        "searched": (bagua.AutotuneConfig(**quick, space={"bucket_size_bytes": (1 << 20, 2 << 20)}), 25_000),
        "quiet": (bagua.AutotuneConfig(**quick, quiet=True), 16),
    }[case]
    rank0, rank1 = run_ranks(_shown, 2, config, width)
    assert rank1["stderr"] == ""
    lines = rank0["stderr"].splitlines()
    if case == "quiet":
        assert lines == []
    elif case == "searched":
        assert len(lines) == 1 and lines[0].startswith("bagua autotune: bucket_size_bytes=") and "2 trials" in lines[0]
    else:
        assert lines == ["bagua autotune: skipped: the whole model (1036 bytes) fits in the smallest bucket size "
                         "tried (1 MiB), so every configuration is the same; keeping bucket_size_bytes=25 MiB"]
        assert rank0["result"].config == {"bucket_size_bytes": 25 << 20} and rank0["result"].trials == 0
