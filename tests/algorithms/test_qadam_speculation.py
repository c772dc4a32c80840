"""qadam's momentum averaged during backward, speculatively: where the speculation hits, where it
misses, and that every loop ends with the bits of averaging in ``step()`` (``overlap=False``).

One spawned job (2 ranks, Gloo) runs each loop both ways. Warm-up is 2 steps, then 4 steps whose
momentum is averaged; a miss pauses speculation for 1 step and the step ending the pause probes
(a few values per gradient, no allreduce); a failed probe pauses 2 steps (``MAX_PAUSE`` grows it
up to 64). So a loop that always changes its gradients misses at its 1st step after warm-up and
fails its probe at the 3rd; one that stops at its 2nd speculates again at its 4th.
"""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
import torch.nn.functional as F

import bagua
from bagua.algorithms.qadam_speculation import TRIAL_EVERY, TRIAL_SETTLE_STEPS, TRIAL_STEPS, OverlapTrial, _same_bits
from tests.harness import run_ranks

# Under xdist (`--dist loadgroup`) one worker runs the module: its module-scoped jobs run once, not once per worker.
pytestmark = pytest.mark.xdist_group("qadam_speculation")

WARMUP, STEPS = 2, 6
AFTER_WARMUP = STEPS - WARMUP
# the autotuner rebuilds the buckets at step boundaries, after warm-up too
TUNING = bagua.AutotuneConfig(max_trials=4, steps_per_trial=1, warmup_steps=1, space={"bucket_size_bytes": (64, 256)})
# the tuner switches speculation off (and on) after warm-up: a step is then averaged either way
OVERLAP_TUNING = bagua.AutotuneConfig(max_trials=2, steps_per_trial=1, warmup_steps=2, space={"overlap": (False, True)})


class _Net(torch.nn.Module):
    """A small MLP, optionally with a second head that a forward uses when asked (``extra``)."""

    def __init__(self, extra_head: bool):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)
        self.extra = torch.nn.Linear(16, 3) if extra_head else None

    def forward(self, x, extra: bool = False):
        h = self.body(x)
        return self.head(h) + self.extra(h) if extra else self.head(h)


def _clip(max_norm):
    return lambda ctx: torch.nn.utils.clip_grad_norm_(ctx["model"].parameters(), max_norm)


def _edit_through_data(ctx):
    for p in ctx["model"].parameters():
        p.grad.data.mul_(0.5)  # bumps a counter of its own, none that p.grad shows


def _clip_binding_once(ctx):
    if ctx["step"] == WARMUP:  # the 1st step after warm-up only: the probe at the 3rd holds
        _clip(1e-3)(ctx)


def _another_backward_without_sync(ctx):
    ddp, (x, y) = ctx["ddp"], ctx["batch"]
    with ddp.no_sync():
        F.cross_entropy(ddp(x * 2), y).backward()


def _slow_speculation_on_rank_0(ctx):
    if ctx["rank"] == 0 and ctx["ddp"].impl.speculation.active:  # this step speculated
        time.sleep(0.05)


def _user_allreduce(ctx):
    loss = torch.tensor([float(ctx["step"])])
    torch.distributed.all_reduce(loss)  # while the speculation's last bucket still crosses the link


# what the loop does between backward and step, after warm-up
BETWEEN = {
    "plain": None,
    "clip_binding": _clip(1e-3),
    "clip_never_binding": _clip(1e6),  # multiplies every gradient by 1.0: no bit changes, a hit
    "clip_binding_once": _clip_binding_once,
    "grad_data_edit": _edit_through_data,
    "zero_grad": lambda ctx: ctx["opt"].zero_grad(set_to_none=False),
    "further_backward_under_no_sync": _another_backward_without_sync,
    "user_allreduce": _user_allreduce,
}


def _loop(rank: int, overlap, between=None, *, scaler: str = "", accumulate: bool = False,
          fused: bool = False, unused: bool = False, rebucket: bool = False, hierarchical: bool = False,
          nan: str = "", autotune=False, bits: int = 8, step_not_taken: bool = False, steps: int = STEPS,
          variance: str = "tracked") -> dict:
    """``nan``: at the 2nd step after warm-up rank 1's loss (``"loss"``: every gradient) or its
    first layer's weight gradient (``"first_layer"``: the last bucket only) is NaN. With bits=1
    and a tracked variance, that step's momentum goes 8-bit (``refreshes_variance``)."""
    model = _Net(extra_head=unused)  # used by every rank in warm-up, then by rank 0 alone
    opt = bagua.optim.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=WARMUP, weight_decay=0.01,
                                     variance=variance)
    if fused:
        opt = bagua.optim.fuse_optimizer(opt)
    algorithm = bagua.algorithms.QAdamAlgorithm(opt, overlap=overlap, hierarchical=hierarchical, bits=bits)
    ddp = bagua.DistributedDataParallel(model, [opt], algorithm, find_unused_parameters=unused, bucket_size_bytes=1024,
                                        autotune=_tuning(autotune, overlap))
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    g = torch.Generator().manual_seed(rank)
    extra_grads, error, moved = [], None, None
    for step in range(steps):
        x = torch.randn(8, 12, generator=g)
        y = x[:, :3].argmax(dim=1)
        opt.zero_grad()
        if rebucket and step == WARMUP + 1:
            ddp.rebucket(4096)
            ddp.configure(segment_elems=1 << 16)
        extra = unused and (step < WARMUP or rank == 0)
        parts = 2 if accumulate else 1  # accumulation without no_sync: each backward synced
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            loss = F.cross_entropy(ddp(xs, extra), ys) / parts
            poisoned = step == WARMUP + 1 and rank == 1
            if (scaler == "overflow" or nan == "loss") and poisoned:
                loss = loss * float("inf" if scaler else "nan")
            hook = (model.body[0].weight.register_hook(lambda grad: grad * float("nan"))
                    if nan == "first_layer" and poisoned else None)
            (grad_scaler.scale(loss) if grad_scaler else loss).backward()
            if hook is not None:
                hook.remove()
        if step >= WARMUP:
            if scaler == "unscale_":
                grad_scaler.unscale_(opt)
            if between is not None:
                between(dict(model=model, opt=opt, ddp=ddp, batch=(x, y), step=step, rank=rank))
        extra_grads.append(unused and model.extra.weight.grad is None)
        if step_not_taken and step == WARMUP + 1:
            continue  # a backward whose step the loop does not take: the next forward goes on
        before = {name: p.detach().clone() for name, p in model.named_parameters()} if nan else None
        try:
            if grad_scaler is not None:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.fuse_step() if fused else opt.step()
        except ValueError as raised:  # a NaN on one rank: every rank raises, and keeps what the step left
            assert nan and "NaN or Inf" in str(raised), raised
            error = str(raised)
            moved = sorted(name for name, p in model.named_parameters() if not torch.equal(p, before[name]))
            break
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    momentum = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()]).clone()
    stats = ddp.impl.speculation.stats
    tuned = [entry["config"].get("overlap") for entry in ddp.autotune_log]
    offers_overlap = "overlap" in ddp.tunables()
    copied = [mb.grad_copies is not None for mb in ddp.impl._momentum.values()]  # the gradients' bits copied
    residuals = ddp.impl.state_dict()  # bits=1: this rank's error-feedback residuals per parameter
    trial = ddp.impl.overlap_trial
    ddp.close()
    return dict(params=params, momentum=momentum, stats=stats, extra_grad_none=extra_grads, steps=step + 1,
                error=error, moved=moved,
                residuals=residuals, tuned_overlap=tuned, offers_overlap=offers_overlap, copied=copied,
                trial=None if trial is None else (trial.choice, trial.times))


def _tuning(autotune, overlap: bool):
    """``autotune``: False, True (bucket sizes) or ``"overlap"`` (which a wrapper built with
    overlap=False does not offer: it runs untuned)."""
    if autotune == "overlap":
        return OVERLAP_TUNING if overlap else None
    return TUNING if autotune else None


LOOPS = {
    **{name: dict(between=between) for name, between in BETWEEN.items()},
    "accumulation_without_no_sync": dict(accumulate=True),
    "grad_scaler_unscale_": dict(scaler="unscale_"),
    "grad_scaler_still_scaled": dict(scaler="scaled"),
    "grad_scaler_skips_a_step": dict(scaler="overflow"),
    "fused": dict(fused=True),
    "unused_on_one_rank": dict(unused=True),
    "rebucketed_mid_run": dict(rebucket=True),
    "autotuned": dict(autotune=True),
    "autotuned_overlap": dict(autotune="overlap"),
    "nan_on_one_rank_raises": dict(nan="loss"),
    "nan_in_the_last_bucket_raises": dict(nan="first_layer"),
    "step_not_taken_once": dict(step_not_taken=True),
}


def _job(rank: int) -> dict:
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("bagua.algorithms.qadam_speculation")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    out = {name: {overlap: _loop(rank, overlap, **kw) for overlap in (True, False)} for name, kw in LOOPS.items()}
    out["debug_log"] = records
    # overlap="auto" through its first trial and 2 steps past it, rank 0 slow on speculating steps
    steps = WARMUP + TRIAL_SETTLE_STEPS + TRIAL_STEPS + 2
    out["auto"] = {way: _loop(rank, way, _slow_speculation_on_rank_0, steps=steps) for way in ("auto", False)}
    return out


def _hierarchical_job(rank: int, bits: int) -> dict:
    return {overlap: _loop(rank, overlap, hierarchical=True, bits=bits) for overlap in (True, False)}


# bits=1: a speculation runs on a provisional copy of the error-feedback residuals; a miss (the
# loops that change the gradients after backward, the skipped and the raising steps) must leave
# them as the last step that averaged did, or the step averaging again would count twice
ONE_BIT_LOOPS = {name: LOOPS[name] for name in (
    "plain", "clip_binding", "clip_never_binding", "clip_binding_once", "further_backward_under_no_sync",
    "grad_scaler_unscale_", "grad_scaler_skips_a_step", "fused", "rebucketed_mid_run", "autotuned",
    "nan_on_one_rank_raises", "nan_in_the_last_bucket_raises")}
# the NaN on a 1-bit step (the frozen variance's steps are all 1-bit after warm-up)
ONE_BIT_LOOPS["nan_on_a_one_bit_step_raises"] = dict(nan="loss", variance="frozen")


def _one_bit_job(rank: int) -> dict:
    return {name: {overlap: _loop(rank, overlap, bits=1, **kw) for overlap in (True, False)}
            for name, kw in ONE_BIT_LOOPS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_job, 2, timeout=240)


def _assert_both_ways_alike(results: list[dict], loops) -> None:
    """Each loop's overlapped run has the bits of its run averaging in step(), residuals included
    (bits=1), on every rank; the ranks' weights are identical."""
    for name in loops:
        for r in results:
            ours, theirs = r[name][True], r[name][False]
            assert ours["steps"] == theirs["steps"], name
            for key in ("params", "momentum"):  # bit for bit, NaN included
                assert torch.equal(ours[key].view(torch.int32), theirs[key].view(torch.int32)), (name, key)
            assert _same_residuals(ours["residuals"], theirs["residuals"]), name
        assert torch.equal(results[0][name][True]["params"], results[1][name][True]["params"]), name


def _same_residuals(ours: dict, theirs: dict) -> bool:
    return ours.keys() == theirs.keys() and all(
        ours[side].keys() == theirs[side].keys() and all(torch.equal(ours[side][k], theirs[side][k]) for k in ours[side])
        for side in ("worker", "server") if side in ours)


def test_every_loop_has_the_bits_of_averaging_in_step_on_every_rank(results):
    _assert_both_ways_alike(results, LOOPS)


def test_the_speculation_hits_where_the_step_sees_what_backward_left(results):
    for r in results:
        for name in ("plain", "clip_never_binding", "accumulation_without_no_sync", "fused", "unused_on_one_rank",
                     "rebucketed_mid_run", "autotuned", "user_allreduce"):
            stats = r[name][True]["stats"]
            assert (stats.hits, stats.misses, stats.paused) == (AFTER_WARMUP, 0, 0), (name, stats)
        assert r["plain"][False]["stats"].hits == 0  # overlap=False never speculates
        stats = r["step_not_taken_once"][True]["stats"]  # the next backward speculates afresh
        assert (stats.hits, stats.misses, stats.paused) == (AFTER_WARMUP - 1, 0, 0), stats


def test_the_speculation_keeps_the_gradients_backward_made_instead_of_copying_them(results):
    for r in results:  # after zero_grad() (set to None) the wrapper copies each fresh gradient into its view
        assert not any(r["plain"][True]["copied"]), r["plain"][True]["copied"]
        # a second backward accumulates into the views: nothing fresh to keep, the bits are copied
        assert any(r["accumulation_without_no_sync"][True]["copied"])


def test_the_autotuner_switches_speculation_off_and_on_with_the_same_bits(results):
    for r in results:  # the bits: test_every_loop_has_the_bits_of_averaging_in_step_on_every_rank
        tuned = r["autotuned_overlap"][True]
        assert tuned["tuned_overlap"][:2] == [True, False], tuned["tuned_overlap"]  # both measured
        assert tuned["stats"].hits >= 1 and tuned["stats"].misses == 0, tuned["stats"]
    assert results[0]["autotuned_overlap"][True]["tuned_overlap"] == results[1]["autotuned_overlap"][True]["tuned_overlap"]


def test_overlap_auto_times_both_ways_and_every_rank_keeps_the_faster_with_the_same_bits(results):
    for r in results:
        ours, exact = r["auto"]["auto"], r["auto"][False]
        assert torch.equal(ours["params"].view(torch.int32), exact["params"].view(torch.int32))
        assert torch.equal(ours["momentum"].view(torch.int32), exact["momentum"].view(torch.int32))
        choice, (speculating, not_speculating) = ours["trial"]
        # rank 0 sleeps 50 ms in each speculating step: the ranks' average says not to speculate
        assert not choice and speculating > not_speculating + 0.02, ours["trial"]
        # the settling steps and the trial's speculating half hit; nothing after the verdict
        assert ours["stats"].hits == TRIAL_SETTLE_STEPS + TRIAL_STEPS // 2 and ours["stats"].misses == 0, ours["stats"]
        assert exact["trial"] is None
    assert results[0]["auto"]["auto"]["trial"] == results[1]["auto"]["auto"]["trial"]


def test_overlap_trial_alternates_pairs_of_steps_and_keeps_the_faster_way():
    trial, now, ways = OverlapTrial(), 0.0, []
    for _ in range(TRIAL_SETTLE_STEPS + TRIAL_STEPS + 2):
        way = trial.wants()
        ways.append(way)
        now += 1.0 if way else 0.5  # not speculating is faster here
        medians = trial.step_ended(way, now)
        if medians is not None:
            assert medians == (1.0, 0.5)
            assert trial.decide(*medians) is False
    pairs = [True, True, False, False] * (TRIAL_STEPS // 4)
    assert ways == [True] * TRIAL_SETTLE_STEPS + pairs + [False, False]
    assert trial.times == (1.0, 0.5)
    # every TRIAL_EVERY steps the trial runs again, from speculating
    for _ in range(TRIAL_EVERY - len(ways)):
        trial.step_ended(trial.wants(), now)
    assert trial.wants() is False  # settling keeps the last choice
    assert trial.decide(0.4, 0.5) is True and trial.decide(math.inf, math.inf) is False  # no sample: in step()


def test_overlap_trial_counts_no_step_that_missed_or_paused():
    trial, now = OverlapTrial(), 0.0
    for _ in range(TRIAL_SETTLE_STEPS + TRIAL_STEPS):
        way = trial.wants()
        now += 1.0
        medians = trial.step_ended(None if way else False, now)  # every speculation missed
    assert medians == (math.inf, 1.0) and trial.decide(*medians) is False


def test_qadam_rejects_an_overlap_it_does_not_know():
    opt = bagua.optim.QAdamOptimizer(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="overlap must be True, False or 'auto'"):
        bagua.algorithms.QAdamAlgorithm(opt, overlap="sometimes")


def test_a_wrapper_built_with_overlap_false_offers_the_tuner_no_overlap(results):
    for r in results:  # such a loop may write where the check cannot see: it stays off
        assert r["plain"][True]["offers_overlap"] and not r["plain"][False]["offers_overlap"]


def test_the_layout_of_buckets_changes_no_bit(results):
    for r in results:
        for name in ("fused", "rebucketed_mid_run", "autotuned"):
            assert torch.equal(r[name][True]["params"], r["plain"][True]["params"]), name


def test_the_speculation_misses_and_pauses_where_the_gradients_changed_after_backward(results):
    for r in results:
        for name in ("clip_binding", "grad_data_edit", "zero_grad", "further_backward_under_no_sync",
                     "grad_scaler_unscale_", "grad_scaler_still_scaled", "grad_scaler_skips_a_step"):
            stats = r[name][True]["stats"]
            # missed at its 1st step after warm-up, paused 1, its probe failed, paused 2
            assert (stats.hits, stats.misses, stats.paused, stats.probes) == (0, 1, 2, 1), (name, stats)


def test_a_loop_that_stops_changing_its_gradients_speculates_again_after_its_probe(results):
    for r in results:
        stats = r["clip_binding_once"][True]["stats"]
        # missed at its 1st step after warm-up, paused 1, its probe held, hit at the 4th
        assert (stats.hits, stats.misses, stats.paused, stats.probes) == (1, 1, 1, 1), stats


def test_a_nan_on_one_rank_raises_at_the_same_step_everywhere_leaving_the_same_state(results):
    for r in results:  # the momenta as the step left them (updated locally, not averaged): equal above
        assert r["nan_on_one_rank_raises"][True]["steps"] == WARMUP + 2
        assert r["nan_on_one_rank_raises"][True]["stats"].hits == 2  # the NaN step too: its bits did not change


def test_a_nan_in_the_last_bucket_only_raises_with_no_parameter_moved(results):
    # the buckets before it arrived finite, and their momenta are written back, but the step
    # moves no parameter until every average is known finite: both ways, every rank
    for r in results:
        for name in ("nan_in_the_last_bucket_raises", "nan_on_one_rank_raises"):
            for overlap in (True, False):
                ran = r[name][overlap]
                assert ran["steps"] == WARMUP + 2 and ran["moved"] == [], (name, overlap, ran["moved"])
        assert "body.0.weight" in r["nan_in_the_last_bucket_raises"][True]["error"]  # the bucket is named


def test_a_parameter_unused_on_a_rank_keeps_no_gradient_there_either_way(results):
    r0, r1 = results
    # the extra head: used by every rank in warm-up, then by rank 0 alone; its gradient is None on rank 1
    for overlap in (True, False):
        assert r1["unused_on_one_rank"][overlap]["extra_grad_none"] == [False] * WARMUP + [True] * AFTER_WARMUP
        assert not any(r0["unused_on_one_rank"][overlap]["extra_grad_none"])


def test_each_step_logs_the_hit_rate_at_debug(results):
    log = results[0]["debug_log"]
    assert any(line.startswith("qadam speculation hit; hit rate 100%") for line in log), log[:3]
    assert any("missed" in line and "pausing 1 step(s), then probing" in line for line in log), log[:3]
    assert any(line.startswith("qadam speculation probe failed") and "pausing 2 step(s)" in line for line in log)
    assert any(line.startswith("qadam speculation probe held") for line in log)


@pytest.mark.parametrize("bits", [8, 1])
def test_hierarchical_on_two_simulated_nodes_has_the_bits_of_averaging_in_step(bits):
    results = run_ranks(_hierarchical_job, 4, bits, local_world_size=2, timeout=240)
    for r in results:
        assert torch.equal(r[True]["params"], r[False]["params"])
        assert r[True]["stats"].hits == AFTER_WARMUP
    assert all(torch.equal(r[True]["params"], results[0][True]["params"]) for r in results)


@pytest.fixture(scope="module")
def one_bit() -> list[dict]:
    return run_ranks(_one_bit_job, 2, timeout=240)


def test_one_bit_every_loop_has_the_bits_of_averaging_in_step_residuals_included(one_bit):
    _assert_both_ways_alike(one_bit, ONE_BIT_LOOPS)
    assert all(one_bit[0][name][True]["residuals"]["worker"] for name in ("plain", "clip_binding"))


def test_one_bit_speculation_misses_where_it_must_and_hits_elsewhere(one_bit):
    for r in one_bit:
        for name in ("clip_binding", "further_backward_under_no_sync", "grad_scaler_unscale_",
                     "grad_scaler_skips_a_step"):
            stats = r[name][True]["stats"]
            assert (stats.hits, stats.misses, stats.probes) == (0, 1, 1), (name, stats)  # the residuals were really restored
        for name in ("plain", "clip_never_binding", "fused", "rebucketed_mid_run", "autotuned"):
            assert r[name][True]["stats"].hits == AFTER_WARMUP, name
        for name in ("clip_binding", "plain"):  # residuals were kept (they are not all zero)
            assert any(t.abs().sum() > 0 for t in r[name][True]["residuals"]["worker"].values()), name


def test_one_bit_residuals_never_absorb_a_nonfinite_value(one_bit):
    for r in one_bit:
        run = r["grad_scaler_skips_a_step"][True]  # skipped on every rank: the residuals stay as they were
        assert run["steps"] == STEPS and torch.isfinite(run["params"]).all()
        assert run["residuals"]["worker"] and all(torch.isfinite(t).all() for side in ("worker", "server")
                                                  for t in run["residuals"][side].values())
        raised = r["nan_on_a_one_bit_step_raises"][True]  # every gradient NaN: every bucket's residuals restart at zero
        assert raised["steps"] == WARMUP + 2 and raised["residuals"]["worker"] == {}
        refresh = r["nan_on_one_rank_raises"][True]  # an 8-bit step, no residuals in it: they stay as they were
        assert refresh["steps"] == WARMUP + 2 and refresh["residuals"]["worker"]
        assert all(torch.isfinite(t).all() for t in refresh["residuals"]["worker"].values())


def test_one_bit_layout_of_buckets_and_fusing_change_no_bit(one_bit):
    for r in one_bit:
        for name in ("fused", "rebucketed_mid_run", "autotuned"):
            assert torch.equal(r[name][True]["params"], r["plain"][True]["params"]), name
            mine, plain = r[name][True]["residuals"]["worker"], r["plain"][True]["residuals"]["worker"]
            assert mine.keys() == plain.keys() and all(torch.equal(mine[k], plain[k]) for k in mine), name
    for name in ("fused", "rebucketed_mid_run", "autotuned"):  # a server residual lives on its reducer: the sum
        for key in one_bit[0]["plain"][True]["residuals"]["server"]:
            ours, plain = (sum(r[v][True]["residuals"]["server"][key] for r in one_bit) for v in (name, "plain"))
            assert torch.equal(ours, plain), (name, key)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_gradient_check_sees_every_bit(layout):
    """Contiguous CPU tensors are compared by the C library's memcmp, others as integers: either
    way -0.0 is not 0.0, a NaN equals the same NaN, and one flipped bit anywhere is a change."""
    base = torch.randn(33, 65, dtype=torch.float32)
    base[0, 0], base[5, 7] = 0.0, float("nan")

    def shaped(t):
        return t if layout == "contiguous" else t.t()  # a transposed view: not contiguous

    copy = base.clone()
    assert _same_bits(shaped(base), shaped(copy))
    assert _same_bits(None, None) and not _same_bits(shaped(base), None)
    copy[0, 0] = -0.0
    assert not _same_bits(shaped(base), shaped(copy))
    for index in ((0, 1), (32, 64), (16, 31)):
        copy = base.clone()
        copy.view(torch.int32)[index] ^= 1  # the lowest mantissa bit
        assert not _same_bits(shaped(base), shaped(copy)), index
    assert _same_bits(torch.empty(0), torch.empty(0))
