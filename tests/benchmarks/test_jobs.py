"""benchmarks/jobs.py, the one way the drivers start their rank jobs: the commands it builds run (torchrun
with ``-m``), a job starts from the repository root whatever the caller's directory, and ``run_job``
returns rank 0's JSON, or None with the reason for a failed, silent, hung or garbled job."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from benchmarks.jobs import ROOT, RankFailedError, emulated, loopback, run, run_job, worker

TAG = "@@jobs-test@@ "
LOG = logging.getLogger("test_jobs")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_job_starts_from_the_repository_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = run(python("import os; print(os.getcwd())"), 30, echo=False)
    assert job.outputs[0].strip() == str(ROOT)


def test_run_job_echoes_the_output_and_returns_rank_0s_json(capsys):
    job = run_job(python(f"print('step 1'); print({TAG!r} + '{{\"ratio\": 3.5}}')"), 30, TAG, LOG)
    assert job == {"ratio": 3.5}
    out = capsys.readouterr().out
    assert "  | step 1" in out and TAG not in out.split("\n", 1)[1]  # the JSON line is kept, not echoed


@pytest.mark.parametrize("code, reason", [
    ("import sys; sys.exit(3)", "job failed (exit 3, no results)"),
    ("print('done')", "job failed (exit 0, no results)"),
    (f"print({TAG!r} + '{{not json')", "is not JSON"),
])
def test_run_job_names_why_a_job_gave_nothing(code, reason, caplog):
    with caplog.at_level(logging.WARNING, logger="test_jobs"):
        assert run_job(python(code), 30, TAG, LOG) is None
    assert reason in caplog.text


def test_a_hung_job_is_stopped_at_its_deadline(caplog):
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="test_jobs"):
        assert run_job(python("import time; time.sleep(60)"), 1, TAG, LOG) is None
    assert time.monotonic() - started < 20 and "job timed out after 1 s" in caplog.text


def test_run_raises_with_the_tail_of_the_output():
    with pytest.raises(RankFailedError) as info:
        run(python("print('last words'); raise SystemExit(5)"), 30, echo=False)
    assert info.value.returncode == 5 and "last words" in info.value.output


def test_the_commands_name_the_worker_module_after_their_launcher():
    command = worker("benchmarks.step.ddp", "--worker", "--reps", 2)
    assert command == [sys.executable, "-m", "benchmarks.step.ddp", "--worker", "--reps", "2"]
    assert loopback(2, command, "--max-restarts", "1") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "-m", "benchmarks.step.ddp", "--worker", "--reps", "2"]
    assert emulated(command, "--ranks", "2") == [
        sys.executable, "-m", "benchmarks.network.netns", "--ranks", "2", "--", *command]
    with pytest.raises(ValueError, match="this interpreter's"):
        loopback(2, ["python3", "-m", "x"])


def test_a_loopback_job_runs_the_module_as_every_rank():
    """torchrun takes the worker's ``-m module`` after its own flags: both ranks run it."""
    job = run(loopback(2, [sys.executable, "-m", "json.tool", "--help"]), 120, echo=False)
    assert job.returncodes == [0] and job.outputs[0].count("usage:") == 2, job.outputs[0][-2000:]
