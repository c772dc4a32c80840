"""benchmarks/scale/check.py: its checks fail where they should (synthetic records), and a real
16-rank job (8 machines x 2 ranks on loopback) of a subset of the algorithms passes them."""

from __future__ import annotations

import json

import pytest

from benchmarks.scale import check as scale_check

pytestmark = pytest.mark.xdist_group("scale_check")  # 16 processes: alone on a worker


def _record(world: int = 4, local: int = 2) -> dict:
    curve = [2.30, 2.25, 2.20]
    machines = world // local
    ranks = []
    for rank in range(world):
        machine = rank // local
        flat_half = range(world // 2, world) if rank < world // 2 else range(world // 2)
        hier_half = range(machines // 2, machines) if machine < machines // 2 else range(machines // 2)
        ranks.append({"init_s": 1.0, "wrap_s": 0.01, "rss_init_mb": 300, "rss_end_mb": 320,
                      "pairs": {"flat": list(flat_half), "hier": list(hier_half)}})
    return {"world": world, "local_size": local, "steps": 3, "elapsed_s": 5.0, "ranks": ranks, "variants": {
        "torch-ddp": {"losses": curve, "replicas_identical": True},
        "gradient_allreduce": {"losses": curve, "replicas_identical": True},
        "bytegrad": {"losses": [2.30, 2.26, 2.21], "replicas_identical": True},
        "decentralized-shift_one": {"losses": [2.30, 2.28, 2.27], "replicas_identical": False},
    }}


def _failed(record: dict) -> list[str]:
    return [what for what, ok, _ in scale_check.check(record) if not ok]


def test_a_correct_record_passes_every_check():
    checks = scale_check.check(_record())
    assert checks and all(ok for _, ok, _ in checks)
    assert any("shift_one (hier)" in what for what, _, _ in checks)


def test_each_check_catches_its_fault():
    record = _record()
    record["variants"]["gradient_allreduce"]["losses"] = [2.30, 2.25, 2.2001]  # 4.5e-5 off torch DDP
    assert _failed(record) == ["gradient_allreduce: loss curve = torch DDP's"]
    record = _record()
    record["variants"]["bytegrad"]["replicas_identical"] = False
    assert _failed(record) == ["bytegrad: replicas identical"]
    record = _record()
    record["variants"]["decentralized-shift_one"]["losses"] = [2.30, float("nan"), 2.1]
    assert _failed(record) == ["decentralized-shift_one: trains"]
    record = _record()
    record["ranks"][1]["pairs"]["flat"] = [2, 2]  # met one rank of the other half twice
    assert _failed(record) == ["shift_one (flat): every one of 4 ranks met the other half"]


def test_layouts_parse_and_bad_ones_are_named():
    assert scale_check.parse_layout("8x2") == (8, 2)
    for bad in ("8", "0x2", "ax2"):
        with pytest.raises(Exception, match="layout"):
            scale_check.parse_layout(bad)


@pytest.mark.timeout(300)
def test_sixteen_ranks_on_eight_machines(tmp_path, capsys):
    out = tmp_path / "scale.json"
    rc = scale_check.main(["--layouts", "8x2", "--steps", "3", "--out", str(out), "--variants", "gradient_allreduce",
                           "gradient_allreduce-hier", "bytegrad-hier", "decentralized-shift_one", "qadam"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    saved = json.loads(out.read_text())
    [record] = saved["records"]
    assert record["world"] == 16 and record["local_size"] == 2 and saved["key"]["all_passed"]
    assert "shift_one (hier): every one of 8 machines met the other half" in printed
    assert "gradient_allreduce-hier: loss curve = torch DDP's" in printed
