"""The tradeoff study's plumbing (benchmarks/tradeoff.py, tradeoff_fit.py, tradeoff_report.py): the
fit recovers known constants from synthetic step times and predicts held-out settings, the report's
targets and slopes, resuming and merging runs, and one real worker job on 2 ranks."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from bagua.advise import Constants, Link, predict
from tests.harness import run_command

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tradeoff  # noqa: E402
import tradeoff_fit  # noqa: E402
import tradeoff_report  # noqa: E402

MB13 = 12_966_912
TRUE = Constants(latency_factor=1.5, efficiency=0.8, backward_share=0.55, compressed_efficiency=0.7,
                 exchange_efficiency=0.6)
COMPUTE = {"torch-ddp": 0.30, "torch-ddp-fp16": 0.32, "gradient_allreduce": 0.31, "bytegrad": 0.40,
           "decentralized": 0.29, "low_precision_decentralized": 0.36, "async": 0.12, "qadam": 0.42, "onebit_grad": 0.38}


def synthetic_results(size: str = "full") -> dict:
    """A results file whose every step time is the model's, with ``TRUE`` constants."""
    settings = {}
    for s in tradeoff.SETTINGS:
        rate = float(s.rate.replace("gbit", "e9").replace("mbit", "e6"))
        variants = {}
        for name in tradeoff.VARIANTS:
            algo = tradeoff_fit.ADVISE_NAME.get(name, name)
            compute = COMPUTE[algo] * (2 if s.ranks == 8 else 1)  # twice the processes on 2 idle cores
            step = predict(algo, [MB13], s.ranks, Link(rate, (s.delay_ms or 0) / 1e3), compute, TRUE).step_s
            variants[name] = {"epoch_s": step * s.reps * s.block, "buckets": [MB13], **tradeoff.messages_per_step(name, [MB13], s.ranks)}
        job = {"world": s.ranks, "reps": s.reps, "block": s.block, "params": MB13 // 4, "variants": variants, "diverged": {},
               "model_flags": ["--layers", "4"], "tokens_per_batch": [260], "warmup": 1, "tcp_cc": "cubic", "elapsed_s": 1.0}
        settings[s.key] = {"setting": asdict(s), "rate_bit": rate, "date": "2026-11-26 12:00", "job": job}
    return {"size": size, "settings": settings, "machine": {"description": "a 2-CPU test", "cpus": 2, "load_start": 0.0}}


def test_the_fit_recovers_known_constants_and_predicts_the_held_out_settings():
    fit = tradeoff_fit.fit_results(synthetic_results())
    assert fit["constants"]["message_s"] == 0.0  # not identifiable on one world size: part of compute
    for key in ("latency_factor", "efficiency", "backward_share", "compressed_efficiency", "exchange_efficiency"):
        assert fit["constants"][key] == pytest.approx(getattr(TRUE, key), rel=0.02), key
    for algo, seconds in COMPUTE.items():
        assert fit["compute_s"][algo] == pytest.approx(seconds, rel=0.02), algo
    held = {(r["variant"], r["setting"]) for r in fit["held_out"]}
    assert ("torch-ddp", "bw-300mbit") in held and ("bytegrad", "x8-100mbit") in held
    assert ("async", "x8-100mbit") in held  # the 8-rank compute scale comes from the machine's facts
    assert fit["compute_scale"] == {"4": 1.0, "8": 2.0}
    assert fit["worst_held_out"] < 0.01
    # the same nominal link measured twice (bridged, and through the delay line at 0 ms): identical here
    pair, = fit["repeatability"]
    assert {pair["a"], pair["b"]} == {"bw-1gbit", "lat-0ms"}
    assert pair["mean"]["max_abs"] < 1e-9 and set(pair["mean"]["diffs"]) == set(fit["compute_s"])


def test_compute_scales_with_ranks_per_core_and_the_load_already_there():
    results = {"machine": {"description": "a 2-CPU x86_64 machine, Linux 6, Python 3, load average 5.1 at the start"}}
    assert tradeoff_fit.machine_facts(results) == {"cpus": 2.0, "load_start": 5.1}
    assert tradeoff_fit.compute_scale(results, 8, 4) == pytest.approx((8 + 5.1) / (4 + 5.1))
    assert tradeoff_fit.compute_scale(results, 8, 4, background=0.0) == 2.0
    assert tradeoff_fit.compute_scale({"machine": {}}, 8, 4) == 1.0  # unknown machine: as measured


def test_the_fit_predicts_the_collectives_the_job_recorded():
    """A job of older code recorded its own pattern (qadam's momentum after backward, behind an
    agreement check): the model predicts that, not today's pattern."""
    results = synthetic_results()
    row = results["settings"]["bw-10mbit"]["job"]["variants"]["qadam"]
    row["messages"] = [{"what": "agreement check", "nbytes": 432, "hops": 3, "overlap": "none"},
                       {"what": "compressed momentum allreduce", "nbytes": 4900581.0, "hops": 2, "overlap": "none"}]
    obs = next(o for o in tradeoff_fit.observations(results) if o["setting"] == "bw-10mbit" and o["variant"] == "qadam")
    assert [c.what for c in obs["pattern"]] == ["agreement check", "compressed momentum allreduce"]
    old = tradeoff_fit.predicted(obs, COMPUTE, TRUE)
    assert old > predict("qadam", [MB13], 4, Link(10e6), COMPUTE["qadam"], TRUE).step_s  # nothing hidden


def test_the_papers_setting_is_anchored_on_ddps_epoch():
    paper = tradeoff_fit.predict_paper(Constants(latency_factor=2.0))
    ddp = paper["epochs"]["100gbit 0ms"]["torch-ddp"]
    assert ddp["A"] == pytest.approx(125, rel=1e-6) and ddp["B"] == pytest.approx(125, rel=1e-6)
    assert paper["epochs"]["100gbit 0ms"]["async"]["B"] == pytest.approx(61, rel=1e-6)  # B's compute
    assert 0 < paper["cases"]["B"]["compute_s"] < paper["cases"]["A"]["compute_s"]
    slopes = paper["latency_slopes"]["torch-ddp"]
    assert slopes["C"] > slopes["B"]  # each message costing the fitted latencies (more than one)


def test_the_report_measures_the_targets_and_slopes():
    results = synthetic_results()
    epochs = tradeoff_report.epochs(results)
    assert epochs["bw-10mbit"]["ddp"] == pytest.approx(
        tradeoff.EPOCH_STEPS * predict("torch-ddp", [MB13], 4, Link(10e6), COMPUTE["torch-ddp"], TRUE).step_s)
    slopes = tradeoff_report.latency_slopes(results)
    # latency adds hops x factor x ms per step where nothing hides it: DDP's 12 hops
    assert slopes["ddp"] == pytest.approx(tradeoff.EPOCH_STEPS * 12 * 1.5e-3, rel=0.05)
    assert slopes["async"] == pytest.approx(0.0, abs=1e-9)
    found = {t["what"]: t for t in tradeoff_report.targets(results)}
    ddp_slope = found["DDP log-log slope, 100 -> 10 Mbit/s"]["value"]
    expected = (epochs["bw-10mbit"]["ddp"] / epochs["bw-100mbit"]["ddp"])
    assert ddp_slope == pytest.approx(-__import__("math").log10(expected))
    assert found["async: its 10 Mbit/s / its 1 Gbit/s"]["met"] is True
    section = tradeoff_report.results_section(results, None, "tradeoff.png")
    assert "| torch DDP fp32 |" in section and "Measured order: ddp" in section


def test_sections_are_replaced_between_their_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nprose\n")
    tradeoff_report.replace_section(doc, "first")
    tradeoff_report.replace_section(doc, "second\nversion")
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose\n") and text.count(tradeoff_report.BEGIN) == 1
    assert "second\nversion" in text and "first" not in text


def test_figures_from_the_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = synthetic_results("quick")
    fit = tradeoff_fit.fit_results(results)
    tradeoff_report.plot(results, fit, tmp_path / "t.png")
    tradeoff_report.plot_paper(fit, tmp_path / "p.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000 and (tmp_path / "p.png").stat().st_size > 10_000


def test_a_run_resumes_and_a_rerun_of_some_variants_merges():
    results = {"settings": {}}
    first, second = tradeoff.SETTINGS[:2]
    job = {"variants": {"ddp": {"epoch_s": 1.0}, "bytegrad": {"epoch_s": 0.5}}, "diverged": {"qadam": "NaN"}, "elapsed_s": 10.0}
    tradeoff.merge(results, first, job, 1e9)
    all_variants = list(tradeoff.VARIANTS)
    assert tradeoff.plan([first, second], results, ["ddp", "bytegrad"], named=False, only=False) == [second]
    assert tradeoff.plan([first, second], results, all_variants, named=False, only=False) == [first, second]
    tradeoff.merge(results, first, {"variants": {"qadam": {"epoch_s": 0.7}}, "diverged": {}, "elapsed_s": 5.0}, 1e9)
    merged = results["settings"][first.key]["job"]
    assert set(merged["variants"]) == {"ddp", "bytegrad", "qadam"} and merged["diverged"] == {}
    assert merged["elapsed_s"] == 15.0 and "date" in merged["variants"]["qadam"]


def test_worker_commands():
    bridged, delayed = tradeoff.SETTINGS[0], tradeoff.SETTINGS[8]
    assert "--delay" not in tradeoff.worker_command(bridged, "full", ["ddp"], "/tmp/c", 60)
    cmd = tradeoff.worker_command(delayed, "full", ["ddp", "qadam"], "/tmp/c", 60)
    assert cmd[cmd.index("--delay") + 1] == f"{delayed.delay_ms:g}" and cmd[-2:] == ["ddp", "qadam"]
    keys = [s.key for s in tradeoff.SETTINGS]
    assert keys[:5] == ["bw-1gbit", "bw-300mbit", "bw-100mbit", "bw-30mbit", "bw-10mbit"]
    assert keys[5:11] == [f"lat-{ms}ms" for ms in (0, 1, 2, 5, 10, 20)] and keys[11] == "x8-100mbit"


def test_a_real_worker_job_records_steps_buckets_and_messages(tmp_path):
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "benchmarks/tradeoff.py", "--worker", "--setting", "t", "--size", "quick", "--reps", "1",
                       "--block", "1", "--variants", "ddp", "low_precision_decentralized", "onebit_grad",
                       "--cache-dir", str(tmp_path)], timeout=120).stdout
    job = json.loads(re.search(r"@@tradeoff@@ (.*)", out).group(1))
    assert job["world"] == 2 and set(job["variants"]) == {"ddp", "low_precision_decentralized", "onebit_grad"}
    ddp, lpd = job["variants"]["ddp"], job["variants"]["low_precision_decentralized"]
    assert ddp["buckets"] == [job["params"] * 4] and ddp["step_s"] > 0
    # one ring exchange per bucket (the first bucket closes at 1 MiB, so this small LM has two)
    assert lpd["hops_per_step"] == len(lpd["buckets"]) and {m["what"] for m in lpd["messages"]} == {"ring exchange"}
    assert lpd["bagua_sent_per_step"] == pytest.approx(lpd["model_bytes_per_step"], rel=0.01)
    # onebit_grad's timed step is past its 1-step exact warm-up: 1.125 bits a value, as the model counts
    onebit = job["variants"]["onebit_grad"]
    assert {m["what"] for m in onebit["messages"]} == {"1-bit allreduce"} and onebit["step_s"] > 0
    assert onebit["bagua_sent_per_step"] == pytest.approx(onebit["model_bytes_per_step"], rel=0.02)
    assert onebit["bagua_sent_per_step"] < ddp["ring_formula_per_step"] / 20


def test_a_report_of_results_elsewhere_leaves_the_projects_files_alone(tmp_path, capsys):
    """An experiment's ``--results /tmp/x.json`` is reported, not written over RESULTS.md, the guide,
    the figures or the fit of the project's own sweep."""
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(synthetic_results()))
    watched = [tradeoff_report.RESULTS_MD, tradeoff_report.GUIDE, *(tradeoff_report.HERE / "figures").glob("tradeoff*.png"),
               *(tradeoff_report.HERE / "results").glob("tradeoff_model*.json")]
    before = {p: p.read_bytes() for p in watched}
    assert tradeoff_report.main(["--results", str(path)]) == 0
    assert {p: p.read_bytes() for p in watched} == before
    assert "is not the project's results file" in capsys.readouterr().out
