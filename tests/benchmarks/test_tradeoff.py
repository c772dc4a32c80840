"""The tradeoff study's plumbing (benchmarks/tradeoff/: sweep.py, fit.py, report.py): the
fit recovers known constants from synthetic step times (noise-free and noisy) and predicts held-out
settings, its worst held-out error flags a step the model cannot explain, the report's targets and
slopes, the figures' data, resuming and merging runs, and one real worker job on 2 ranks."""

from __future__ import annotations

import json
import math
import random
import re
import sys
from dataclasses import asdict

import pytest

from bagua.advise import Constants, Link, communication_pace, predict
from tests.harness import run_command

from benchmarks.records import FIGURES, RESULTS
from benchmarks.tradeoff import fit as tradeoff_fit
from benchmarks.tradeoff import report as tradeoff_report
from benchmarks.tradeoff import sweep as tradeoff_sweep

MB13 = 12_966_912
TRUE = Constants(latency_factor=1.5, efficiency=0.8, compressed_efficiency=0.7, exchange_efficiency=0.6)
COMPUTE = {"torch-ddp": 0.30, "torch-ddp-fp16": 0.32, "gradient_allreduce": 0.31, "bytegrad": 0.40,
           "decentralized": 0.29, "low_precision_decentralized": 0.36, "async": 0.12, "qadam": 0.42, "onebit_grad": 0.38}


def synthetic_results(size: str = "full") -> dict:
    """A results file whose every step time is the model's, with ``TRUE`` constants (communication at
    the ranks' share of the 2 cores while they compute)."""
    settings = {}
    for s in tradeoff_sweep.SETTINGS:
        rate = float(s.rate.replace("gbit", "e9").replace("mbit", "e6"))
        variants = {}
        for name in tradeoff_sweep.VARIANTS:
            algo = tradeoff_fit.ADVISE_NAME.get(name, name)
            compute = COMPUTE[algo] * (2 if s.ranks == 8 else 1)  # twice the processes on 2 idle cores
            step = predict(algo, [MB13], s.ranks, Link(rate, (s.delay_ms or 0) / 1e3), compute, TRUE,
                           pace=communication_pace(s.ranks, 2)).step_s
            variants[name] = {"epoch_s": step * s.reps * s.block, "buckets": [MB13], **tradeoff_sweep.messages_per_step(name, [MB13], s.ranks)}
        job = {"world": s.ranks, "reps": s.reps, "block": s.block, "params": MB13 // 4, "variants": variants, "diverged": {},
               "model_flags": ["--layers", "4"], "tokens_per_batch": [260], "warmup": 1, "tcp_cc": "cubic", "elapsed_s": 1.0}
        settings[s.key] = {"setting": asdict(s), "rate_bit": rate, "date": "2026-11-26 12:00", "job": job}
    return {"size": size, "settings": settings, "machine": {"description": "a 2-CPU test", "cpus": 2, "load_start": 0.0}}


def test_the_fit_recovers_known_constants_and_predicts_the_held_out_settings():
    fit = tradeoff_fit.fit_results(synthetic_results())
    assert fit["constants"]["message_s"] == 0.0  # not identifiable on one world size: part of compute
    for key in ("latency_factor", "efficiency", "compressed_efficiency", "exchange_efficiency"):
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


NOISE = 0.03  # sigma of the log of each step time: the within-job standard error the sweep reports is 1-3%
#: what a right fit stays within on 99 of 100 seeds of NOISE (measured once, rounded up; seed 0 is well inside):
#: each fitted constant's relative error
WITHIN = {"latency_factor": 0.09, "efficiency": 0.035, "compressed_efficiency": 0.05, "exchange_efficiency": 0.06,
          "compute": 0.11}
#: and the worst held-out error against the noisy step times (54 points: the noise alone reaches ~9%)
HELD_OUT_BOUND = 0.13


def noisy(results: dict, sigma: float = NOISE, seed: int = 0) -> dict:
    """``results`` with every step time times a lognormal factor (median 1, ``sigma`` the sd of its log)."""
    rng = random.Random(seed)
    for record in results["settings"].values():
        for row in record["job"]["variants"].values():
            row["epoch_s"] *= math.exp(rng.gauss(0.0, sigma))
    return results


def test_the_fit_of_noisy_step_times_recovers_the_constants_and_predicts_the_held_out_settings():
    """Noise as a measurement's: the constants within what 99 seeds in 100 give, each held-out step
    predicted within 10% of the noise-free one (what the noise leaves of the fit's error), and the
    fit's own quality measure (against the noisy steps) within its bound."""
    truth = {(o["variant"], o["setting"]): o["step_s"] for o in tradeoff_fit.observations(synthetic_results())}
    fit = tradeoff_fit.fit_results(noisy(synthetic_results()))
    for key in ("latency_factor", "efficiency", "compressed_efficiency", "exchange_efficiency"):
        assert fit["constants"][key] == pytest.approx(getattr(TRUE, key), rel=WITHIN[key]), key
    for algo, seconds in COMPUTE.items():
        assert fit["compute_s"][algo] == pytest.approx(seconds, rel=WITHIN["compute"]), algo
    assert len(fit["held_out"]) == 54  # 6 settings x 9 variants, none fitted
    for row in fit["held_out"]:
        assert row["predicted_s"] == pytest.approx(truth[(row["variant"], row["setting"])], rel=0.10), row
    assert fit["worst_held_out"] < HELD_OUT_BOUND


@pytest.mark.parametrize("setting, variant", [("bw-30mbit", "bytegrad"), ("lat-20ms", "ddp")])
def test_a_step_the_model_cannot_explain_is_the_fits_worst_held_out(setting, variant):
    """One step time twice what the model makes of it, in a held-out setting or in a fitted one
    (where the fit bends towards it): the worst held-out error exceeds what noise gives, and it is
    that variant's."""
    results = noisy(synthetic_results())
    results["settings"][setting]["job"]["variants"][variant]["epoch_s"] *= 2
    fit = tradeoff_fit.fit_results(results)
    worst = max(fit["held_out"], key=lambda r: abs(r["error"]))
    assert fit["worst_held_out"] > HELD_OUT_BOUND and worst["variant"] == tradeoff_fit.ADVISE_NAME.get(variant, variant)


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
        tradeoff_sweep.EPOCH_STEPS * predict("torch-ddp", [MB13], 4, Link(10e6), COMPUTE["torch-ddp"], TRUE).step_s)
    slopes = tradeoff_report.latency_slopes(results)
    # latency adds delays x factor x ms per step where nothing hides it: DDP's 12 hops, a round trip each on Gloo
    assert slopes["ddp"] == pytest.approx(tradeoff_sweep.EPOCH_STEPS * 2 * 12 * 1.5e-3, rel=0.05)
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


def _drawn(ax, color: str, style: str) -> tuple[list[float], list[float]]:
    """The x and y of the one line on ``ax`` in ``color`` and line ``style`` ("None": dots alone)."""
    from matplotlib.colors import same_color

    line, = [ln for ln in ax.get_lines() if same_color(ln.get_color(), color) and ln.get_linestyle() == style]
    return list(line.get_xdata()), list(line.get_ydata())


def test_figures_draw_the_results_and_the_fitted_model(tmp_path):
    """Each variant's measured epochs over each sweep, the fitted model through them (dotted), the
    paper's epochs and the model at its scale as the fit's table has them, on the intended scales."""
    import numpy as np

    results = synthetic_results("quick")
    fit = tradeoff_fit.fit_results(results)
    left, right = tradeoff_report.plot(results, fit, tmp_path / "t.png").axes
    assert (left.get_xscale(), left.get_yscale(), right.get_xscale(), right.get_yscale()) == ("log", "log", "linear", "linear")
    assert "bandwidth" in left.get_xlabel() and "latency" in right.get_xlabel()
    assert all(ax.get_ylabel() == f"epoch time, s ({tradeoff_sweep.EPOCH_STEPS} steps)" for ax in (left, right))
    epochs = tradeoff_report.epochs(results)
    bandwidth = sorted((r["rate_bit"] / 1e6, k) for k, r in results["settings"].items() if r["setting"]["sweep"] == "bandwidth")
    for ax, sweep, log in ((left, bandwidth, True), (right, tradeoff_report.latency_sweep(results), False)):
        for name in tradeoff_sweep.VARIANTS:
            x, y = _drawn(ax, tradeoff_report.COLORS[name], "-")
            assert x == [at for at, _ in sweep] and y == [epochs[k][name] for _, k in sweep], name
            assert tradeoff_report.LABELS[name] in [ln.get_label() for ln in ax.get_lines()]
            mx, my = (np.log(v) if log else np.array(v) for v in _drawn(ax, tradeoff_report.COLORS[name], ":"))
            model = np.interp(np.log(x) if log else x, mx, my)  # the data here are the model's: it passes through them
            assert list(np.exp(model) if log else model) == pytest.approx(y, rel=0.01), name
    assert (tmp_path / "t.png").stat().st_size > 0

    left, right = tradeoff_report.plot_paper(fit, tmp_path / "p.png").axes
    assert (left.get_xscale(), left.get_yscale(), right.get_xscale()) == ("log", "log", "linear")
    table, inverse = fit["paper"]["epochs"], {v: k for k, v in tradeoff_fit.ADVISE_NAME.items()}
    for algo in tradeoff_fit.PAPER["epoch_s"]["1gbit 0ms"]:
        color = tradeoff_report.COLORS[inverse.get(algo, algo)]
        assert _drawn(left, color, "None") == ([1, 100], [table["1gbit 0ms"][algo]["paper_s"], table["100gbit 0ms"][algo]["paper_s"]])
        assert _drawn(right, color, "None") == ([0, 5], [table["100gbit 0ms"][algo]["paper_s"], table["100gbit 5ms"][algo]["paper_s"]])
        for case, style in (("A", "-"), ("B", "--")):
            gbits, epoch = _drawn(left, color, style)
            assert [epoch[gbits.index(g)] for g in (1.0, 100.0)] == pytest.approx(
                [table["1gbit 0ms"][algo][case], table["100gbit 0ms"][algo][case]], rel=1e-9), (algo, case)
            ms, epoch = _drawn(right, color, style)
            assert [epoch[ms.index(m)] for m in (0.0, 5.0)] == pytest.approx(
                [table["100gbit 0ms"][algo][case], table["100gbit 5ms"][algo][case]], rel=1e-9), (algo, case)
    assert table["100gbit 0ms"]["torch-ddp"]["A"] == pytest.approx(125)  # the anchor the figure shows
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_run_resumes_and_a_rerun_of_some_variants_merges():
    results = {"settings": {}}
    first, second = tradeoff_sweep.SETTINGS[:2]
    job = {"variants": {"ddp": {"epoch_s": 1.0}, "bytegrad": {"epoch_s": 0.5}}, "diverged": {"qadam": "NaN"}, "elapsed_s": 10.0}
    tradeoff_sweep.merge(results, first, job, 1e9)
    all_variants = list(tradeoff_sweep.VARIANTS)
    assert tradeoff_sweep.plan([first, second], results, ["ddp", "bytegrad"], named=False, only=False) == [second]
    assert tradeoff_sweep.plan([first, second], results, all_variants, named=False, only=False) == [first, second]
    tradeoff_sweep.merge(results, first, {"variants": {"qadam": {"epoch_s": 0.7}}, "diverged": {}, "elapsed_s": 5.0}, 1e9)
    merged = results["settings"][first.key]["job"]
    assert set(merged["variants"]) == {"ddp", "bytegrad", "qadam"} and merged["diverged"] == {}
    assert merged["elapsed_s"] == 15.0 and "date" in merged["variants"]["qadam"]


def test_worker_commands():
    bridged, delayed = tradeoff_sweep.SETTINGS[0], tradeoff_sweep.SETTINGS[8]
    assert "--delay" not in tradeoff_sweep.worker_command(bridged, "full", ["ddp"], "/tmp/c", 60)
    cmd = tradeoff_sweep.worker_command(delayed, "full", ["ddp", "qadam"], "/tmp/c", 60)
    assert cmd[cmd.index("--delay") + 1] == f"{delayed.delay_ms:g}" and cmd[-2:] == ["ddp", "qadam"]
    keys = [s.key for s in tradeoff_sweep.SETTINGS]
    assert keys[:5] == ["bw-1gbit", "bw-300mbit", "bw-100mbit", "bw-30mbit", "bw-10mbit"]
    assert keys[5:11] == [f"lat-{ms}ms" for ms in (0, 1, 2, 5, 10, 20)] and keys[11] == "x8-100mbit"


def test_a_real_worker_job_records_steps_buckets_and_messages(tmp_path):
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "benchmarks.tradeoff.sweep", "--worker", "--setting", "t", "--size", "quick", "--reps", "1",
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
    watched = [tradeoff_report.RESULTS_MD, tradeoff_report.GUIDE, *FIGURES.glob("tradeoff*.png"),
               *RESULTS.glob("tradeoff_model*.json")]
    before = {p: p.read_bytes() for p in watched}
    assert tradeoff_report.main(["--results", str(path)]) == 0
    assert {p: p.read_bytes() for p in watched} == before
    assert "is not the project's results file" in capsys.readouterr().out
