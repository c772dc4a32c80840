"""examples/hf_trainer.py end to end: Hugging Face's Trainer on 2 ranks, plain (torchrun, Gloo) and
with bagua's bytegrad as torch DDP's communication hook over striped connections (two torchrun
"machines" of one rank each on the 'bagua' backend, 4 connection sets), the same seeds and data order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.harness import free_port, run_command

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it
pytestmark = pytest.mark.xdist_group("hf_trainer")  # both runs once, on one worker

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 40
TINY = ["--steps", str(STEPS), "--layers", "2", "--width", "64", "--heads", "2", "--context", "64", "--batch-size", "8",
        "--max-files", "150", "--val-docs", "64", "--lr", "3e-3", "--warmup-steps", "10"]  # fmt: skip
# ln(256) = 5.55 nats is a uniform guess over bytes (the untrained model's ~5.37); 40 tiny steps
# reach ~3.0: at least this much lower, in evaluation and in training
LEARNED_BY = 1.5
SAME_EVAL = 0.005  # the hook's final evaluation loss within 0.5% (relative) of the plain Trainer's
# bytegrad: 1 byte a value (+ each 1024-value block's min and max) over bagua's compressed ring,
# against fp32's 4 bytes a value: ~0.25 (0.252 measured, the one-time layout checks included)
BYTES_VS_FP32 = (0.22, 0.30)
STRIPED = ["--streams", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("hf_trainer")
    results = {}
    for hook in ("none", "bytegrad"):  # one after the other: 2 ranks each on a small machine
        example = [str(EXAMPLE), "--hook", hook, *TINY, "--out-dir", str(tmp / "out"), "--cache-dir", str(tmp / "cache")]
        if hook == "none":
            cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", *example]
        else:  # two machines of one rank (LOCAL_WORLD_SIZE=1), so the 'bagua' backend stripes between them
            node = " ".join([str(TORCHRUN), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=hf", *example, *STRIPED])
            # the tiny model's buckets are below 1 MiB: pieces of 4 KiB at least
            cmd = ["sh", "-c", f"export BAGUA_NET_MIN_CHUNKSIZE=4096; {node} & first=$!; {node}; second=$?; "
                               f"wait $first; exit $(( $? | second ))"]
        proc = run_command(cmd, timeout=140, cwd=ROOT)
        finals = [line for line in proc.stdout.splitlines() if line.startswith("final: ")]
        assert len(finals) == 1, f"expected one final line (rank 0 only):\n{(proc.stdout + proc.stderr)[-5000:]}"
        results[hook] = json.loads((tmp / "out" / f"hf_trainer_{hook}.json").read_text())
        results[hook]["final_line"] = finals[0]
    return results


@pytest.mark.timeout(300)
def test_both_runs_train_the_same_steps_on_the_same_data(runs):
    for hook, r in runs.items():
        assert r["world_size"] == 2 and r["steps"] == STEPS and len(r["train_losses"]) == STEPS, hook
        assert len(r["step_times"]) == STEPS and all(t > 0 for t in r["step_times"]), hook
    # the same seeded weights and the same first batches: the first step's loss (before any
    # averaging) is the same number in both runs
    first = [r["train_losses"][0] for r in runs.values()]
    assert first[0] == pytest.approx(first[1], rel=1e-6), first
    assert runs["none"]["eval_loss_start"] == pytest.approx(runs["bytegrad"]["eval_loss_start"], rel=1e-6)


@pytest.mark.timeout(300)
def test_both_learn_and_the_hook_matches_the_plain_trainer(runs):
    for hook, r in runs.items():
        assert r["eval_loss"] < r["eval_loss_start"] - LEARNED_BY, (hook, r["eval_loss_start"], r["eval_loss"])
        assert r["final_train_loss"] < r["train_losses"][0] - LEARNED_BY, (hook, r["train_losses"])
    plain, hooked = runs["none"]["eval_loss"], runs["bytegrad"]["eval_loss"]
    assert abs(hooked - plain) / plain < SAME_EVAL, (plain, hooked)


@pytest.mark.timeout(300)
def test_the_hook_averaged_every_step_in_a_quarter_of_the_bytes(runs):
    hooked = runs["bytegrad"]
    assert hooked["hook_steps"] == STEPS  # torch DDP called it for every step's last bucket
    assert hooked["bagua_bytes_sent"] > 0
    ratio = hooked["bagua_bytes_sent"] / hooked["fp32_ring_bytes"]
    assert BYTES_VS_FP32[0] < ratio < BYTES_VS_FP32[1], (ratio, hooked["bagua_bytes_sent"], hooked["fp32_ring_bytes"])
    assert "of fp32 ring allreduce" in hooked["final_line"]
    # the plain Trainer never started bagua
    assert runs["none"]["bagua_bytes_sent"] is None and runs["none"]["hook_steps"] is None


@pytest.mark.timeout(300)
def test_the_hooked_run_went_over_striped_connections(runs):
    # every step's compressed ring (its segments) and the wrapper's first broadcast went in pieces
    assert runs["bytegrad"]["striped_calls"] >= STEPS
    assert runs["none"]["striped_calls"] == 0  # Gloo: bagua's backend never made
