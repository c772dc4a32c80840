"""``python -m bagua.advise``: its ranked output, its errors, and measuring the link under a real
2-rank torchrun job."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bagua import advise
from tests.harness import run_command

ADVISE = [sys.executable, "-m", "bagua.advise"]


def _rows(text: str) -> list[tuple[int, str, float]]:
    """The ranked rows: (rank, how to select the algorithm, predicted step ms)."""
    selects = sorted(advise.SELECT.values(), key=len, reverse=True)
    rows = []
    for line in text.splitlines():
        found = re.match(r"^(\d+)\s+(.*)$", line)
        select = found and next((s for s in selects if found.group(2).startswith(s)), None)
        if select:
            rows.append((int(found.group(1)), select, float(found.group(2)[len(select):].split()[0])))
    return rows


PAPER = ["--bandwidth", "1gbit", "--latency-ms", "2", "--params", "340M", "--world-size", "128",
         "--ranks-per-machine", "8", "--compute-ms", "500"]


def test_the_papers_question_ranked_by_time_to_ddps_loss():
    out = run_command([*ADVISE, *PAPER], timeout=60).stdout
    assert "340M parameters (fp32), 128 ranks, 8 per machine, 1000 Mbit/s, 2 ms one way, nccl" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == list(range(1, len(advise.ALGORITHMS) + 1))
    assert {r[1] for r in rows} == set(advise.SELECT.values())  # each row says how to select it
    by_select = {select: name for name, select in advise.SELECT.items()}
    multipliers = advise.steps_multipliers()
    names = [by_select[r[1]] for r in rows]
    k = sum(multipliers[name] is not None for name in names)  # those that reached DDP's loss come first
    assert k >= 2 and all(multipliers[name] is not None for name in names[:k])
    times = [r[2] * multipliers[name] for r, name in zip(rows[:k], names[:k])]
    assert times == sorted(times)  # by predicted time to DDP's loss
    assert [r[2] for r in rows[k:]] == sorted(r[2] for r in rows[k:])  # the others by step time
    recommended = re.search(r"^Recommended: (.*) \(predicted", out, re.M)
    assert recommended and recommended.group(1) == rows[0][1], out
    assert "steps x: steps to torch DDP's final validation loss" in out and "hops: messages in sequence" in out
    assert advise.WORKLOAD in out and "no --compute-ms" not in out


def test_a_users_own_steps_multiplier_reranks(capsys):
    advise.main(PAPER)
    before = _rows(capsys.readouterr().out)
    advise.main([*PAPER, "--steps-multiplier", "async=1.0", "--steps-multiplier", "qadam1=1.0"])
    out = capsys.readouterr().out
    after = _rows(out)
    assert after[0][1] == advise.SELECT["async"]  # the fastest step, now taken to need no more steps
    assert before[0][1] != after[0][1]
    assert re.search(r"1\.00\*", out)  # a user's own multiplier is marked


@pytest.mark.parametrize("bad", ["qadam", "qadam=0", "qadam=x", "nosuch=1.1", "qadam=inf"])
def test_bad_steps_multipliers_are_named(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        advise.main([*PAPER, "--steps-multiplier", bad])
    assert exit_info.value.code == 2
    assert "--steps-multiplier takes ALGORITHM=X with X > 0" in capsys.readouterr().err


def test_json_output_matches_the_library(capsys):
    assert advise.main(["--bandwidth", "100mbit", "--latency-ms", "0", "--params", "3.2M", "--world-size", "4",
                        "--backend", "gloo", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    expected = advise.predict_all(3.2e6, 4, advise.Link(100e6, 0.0), backend="gloo")
    assert [p["algorithm"] for p in got["predictions"]] == [p.algorithm for p in expected]
    assert got["predictions"][-1]["step_s"] == pytest.approx(expected[-1].step_s)


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "fast", "--latency-ms", "2", "--params", "1M", "--world-size", "4"],
     "bandwidth must be a positive rate in bits such as 1gbit"),
    (["--bandwidth", "1gbit", "--latency-ms", "-1", "--params", "1M", "--world-size", "4"],
     "argument --latency-ms: must be a number >= 0, got '-1'"),
    (["--bandwidth", "1gbit", "--latency-ms", "2", "--params", "lots", "--world-size", "4"],
     "params must be a positive count such as 340M"),
    (["--bandwidth", "1gbit", "--params", "1M", "--world-size", "4"], "give both --bandwidth and --latency-ms, or neither"),
    (["--bandwidth", "1gbit", "--latency-ms", "2", "--params", "1M"], "--world-size is needed with a stated link"),
    (["--bandwidth", "1gbit", "--latency-ms", "2", "--params", "1M", "--world-size", "12", "--ranks-per-machine", "8"],
     "--world-size (12) must be a multiple of --ranks-per-machine (8)"),
    (["--params", "1M"], "no link given: pass --bandwidth and --latency-ms"),
])
def test_bad_input_is_named(argv, message, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not under torchrun
    with pytest.raises(SystemExit) as exit_info:
        advise.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_command_line_exits_2_on_bad_input():
    res = subprocess.run([*ADVISE, "--params", "1M", "--bandwidth", "1gbit"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "give both --bandwidth and --latency-ms" in res.stderr


def test_parsers():
    assert advise.parse_bandwidth("1gbit") == 1e9 and advise.parse_bandwidth("10Gbit/s") == 10e9
    assert advise.parse_bandwidth("300mbit") == 300e6 and advise.parse_bandwidth("1e9") == 1e9
    assert advise.parse_count("340M") == 340e6 and advise.parse_count("1.5B") == 1.5e9
    for bad in ("0mbit", "1 gigabit", "nan", "-5"):
        with pytest.raises(ValueError, match="bandwidth must be"):
            advise.parse_bandwidth(bad)


def test_under_torchrun_it_measures_the_link_first():
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "bagua.advise", "--params", "3.2M", "--probe-mb", "4"], timeout=120).stdout
    found = re.search(r"measured: (\d+) Mbit/s and ([\d.]+) ms one way \(what each message in sequence costs, over "
                      r"its one-way latencies\), from exact allreduces of "
                      r"4\.096 KB and 4 MB on 2 ranks \(gloo", out)
    assert found, out
    assert int(found.group(1)) > 0
    assert "3.2M parameters (fp32), 2 ranks, 1 per machine" in out
    assert len(_rows(out)) == len(advise.ALGORITHMS)  # printed once, by rank 0


def test_fitted_constants_are_read_from_the_fits_json(tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"constants": {"message_s": 0.0, "latency_factor": 3.0, "efficiency": 0.5,
                                              "backward_share": 0.6}, "compute_s": {"bytegrad": 0.1}}))
    argv = ["--bandwidth", "100mbit", "--latency-ms", "1", "--params", "3.2M", "--world-size", "4", "--backend", "gloo",
            "--json"]
    advise.main(argv)
    ideal = {p["algorithm"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}
    advise.main([*argv, "--constants", str(path)])
    fitted = {p["algorithm"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}
    assert fitted["torch-ddp"]["transfer_s"] == pytest.approx(2 * ideal["torch-ddp"]["transfer_s"])
    assert fitted["torch-ddp"]["latency_s"] == pytest.approx(3 * ideal["torch-ddp"]["latency_s"])
