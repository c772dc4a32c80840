"""Error-feedback compressed allreduce (sign1, 1-bit Adam's two-stage scheme) on real Gloo ranks.

The worker side sends c = x + e_old - e_new, the reducer r + s_old - s_new, so over T calls

    sum_t result_t + mean_r(e_T,r) + s_T == sum_t mean_r(x_t,r)            (float rounding aside)

where e are the ranks' worker residuals and s the server residuals (each element's on its owner,
zero elsewhere: their sum over ranks). Checked below, with the residuals bounded (they do not grow
with T), so the mean of what was sent converges to the mean of the inputs like 1/T.
"""

import pytest
import torch

import bagua
from bagua.comm.compressed import SEGMENT_ELEMS
from tests.harness import run_ranks, run_ranks_expect_errors

SIZES = [3000, 5, 70_000]  # three members: blocks restart at each, tails of 952, 5 and 368
STARTS = [0, 3000, 3005]
N = sum(SIZES)


def _input(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(N, generator=g) * (1 + rank) + 0.5 * rank


def _residual_sum(state) -> torch.Tensor:
    """This rank's worker residual / world + its server residuals (to be summed over ranks)."""
    import bagua

    return state.worker / bagua.get_world_size() + state.server


def _calls(rank: int, steps: int) -> dict:
    import bagua
    from bagua.comm import ErrorFeedback, compressed_allreduce

    out = {}
    for segment in (SEGMENT_ELEMS, "varying"):
        state, results = ErrorFeedback(), []
        for step in range(steps):
            t = _input(rank, step)
            size = SEGMENT_ELEMS if segment == SEGMENT_ELEMS else (4096, 1000, SEGMENT_ELEMS)[step % 3]
            compressed_allreduce(t, op="avg", codec="sign1", starts=STARTS, segment_elems=size, error_feedback=state)
            results.append(t)
            if step in (4, steps - 1):
                left = _residual_sum(state)
                bagua.comm.allreduce(left, op="sum")
                out[(segment, step)] = (torch.stack(results).sum(0), left, float(state.worker.norm()))
        out[segment] = results
    return out


def _mean_inputs(world_size: int, steps: int) -> torch.Tensor:
    """sum over the first ``steps`` calls of the ranks' mean input."""
    return torch.stack([torch.stack([_input(r, t) for r in range(world_size)]).mean(0) for t in range(steps)]).sum(0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sent_sums_to_the_inputs_up_to_bounded_residuals_identically_on_every_rank(world_size):
    steps = 24
    results = run_ranks(_calls, world_size, steps, timeout=180)
    errors = {}
    for step in (4, steps - 1):
        inputs = _mean_inputs(world_size, step + 1)
        sent, left, _ = results[0][(SEGMENT_ELEMS, step)]
        torch.testing.assert_close(sent + left, inputs, rtol=0, atol=2e-4 * (step + 1))
        errors[step] = ((sent - inputs) / (step + 1)).abs().max()
    # bounded: ~5x more steps, the residuals no larger, so the mean's error shrinks like 1/T
    early, late = results[0][(SEGMENT_ELEMS, 4)], results[0][(SEGMENT_ELEMS, steps - 1)]
    assert late[1].norm() < 2 * early[1].norm() and late[2] < 2 * early[2]
    assert errors[steps - 1] < errors[4] / 2.5
    for r in results:
        for a, b, c in zip(r[SEGMENT_ELEMS], results[0][SEGMENT_ELEMS], results[0]["varying"]):
            assert torch.equal(a, b)  # identical on every rank
            assert torch.equal(a, c)  # and whatever the segment size (the server residuals move with it)


def _resumed(rank: int) -> dict:
    from bagua.comm import ErrorFeedback, compressed_allreduce

    def run(state, steps, segment=SEGMENT_ELEMS):
        out = []
        for step in steps:
            t = _input(rank, step)
            compressed_allreduce(t, op="sum", codec="sign1", starts=STARTS, segment_elems=segment, error_feedback=state)
            out.append(t)
        return out

    whole = ErrorFeedback()
    straight = run(whole, range(5))
    first = ErrorFeedback()
    run(first, range(3))
    saved = first.state_dict()
    again = ErrorFeedback()
    again.load_state_dict(saved)
    resumed = run(again, range(3, 5), segment=4096)  # another layout: the server residuals move
    # a NaN on one rank: every rank gets the marked block, and every rank's residuals restart
    t = _input(rank, 5)
    if rank == 1:
        t[10] = float("nan")
    compressed_allreduce(t, op="sum", codec="sign1", starts=STARTS, error_feedback=again, nonfinite="propagate")
    return {"straight": straight[3:], "resumed": resumed, "bad": t, "reset": again.worker is None}


def test_residuals_resume_exactly_and_restart_after_a_nonfinite_result():
    results = run_ranks(_resumed, 2, timeout=120)
    for r in results:
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
        assert r["reset"]
        bad = ~torch.isfinite(r["bad"])
        block = bagua.comm.Sign1().block_size
        assert bad[:block].all() and not bad[block:].any()  # the first codec block only


def _provisional(rank: int) -> dict:
    """A call on a copy of the residuals (a speculation), dropped or kept, against calls on the
    state itself; the copy taken under a layout the server residuals were not kept under."""
    from bagua.comm import ErrorFeedback, compressed_allreduce

    def call(state, step, segment=SEGMENT_ELEMS):
        t = _input(rank, step)
        compressed_allreduce(t, op="avg", codec="sign1", starts=STARTS, segment_elems=segment, error_feedback=state)
        return t

    straight, trial, spare = ErrorFeedback(), ErrorFeedback(), ErrorFeedback()
    expected = [call(straight, step) for step in range(3)]
    got = [call(trial, step) for step in range(2)]
    spare.copy_from(trial)
    call(spare, 7, segment=4096)  # dropped: what the state holds stays as it was
    before = trial.state_dict()
    got.append(call(trial, 2))
    spare.copy_from(trial)
    kept = call(spare, 3, segment=4096)  # kept: the state takes what the call left
    trial.swap(spare)
    empty = ErrorFeedback()
    spare.copy_from(empty)
    return {"expected": expected + [call(straight, 3)], "got": got + [kept], "before": before,
            "trial": trial.state_dict(), "straight": straight.state_dict(), "emptied": spare.worker is None}


def test_a_provisional_copy_leaves_the_state_as_it_was_unless_kept():
    results = run_ranks(_provisional, 2, timeout=120)
    total = {}
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["got"], r["expected"]))
        assert r["before"]["worker"] is not None and r["emptied"]
        assert torch.equal(r["trial"]["worker"], r["straight"]["worker"])
        for name, state in (("trial", r["trial"]), ("straight", r["straight"])):
            total[name] = total.get(name, 0) + state["server"]  # the owners depend on the segment size
    assert torch.equal(total["trial"], total["straight"])


def _misuse(rank: int, case: str):
    from bagua.comm import ErrorFeedback, compressed_allreduce

    state = ErrorFeedback()
    if case == "op":
        compressed_allreduce(torch.ones(64), op="max", codec="sign1", error_feedback=state)
    compressed_allreduce(torch.ones(64), codec="sign1", error_feedback=state)
    compressed_allreduce(torch.ones(65), codec="sign1", error_feedback=state)


@pytest.mark.parametrize("case, message", [
    ("op", "error_feedback needs a bagua.comm.ErrorFeedback and op SUM or AVG"),
    ("size", "holds residuals of 64 elements, the tensor has 65: use one ErrorFeedback per buffer"),
])
def test_misuse_is_a_clear_error(case, message):
    errors = run_ranks_expect_errors(_misuse, 2, case, timeout=60)
    assert all(message in error for error in errors.values())
