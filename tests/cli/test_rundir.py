"""`torch2step report --tiny ... --out DIR` writes a complete run directory."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest

from runtime.trace import trace_problems
from torch2step.cli import main
from torch2step.rundir import OPERATOR_COLUMNS, UNIT_COLUMNS


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "qwen"
    argv = ["report", "--layer", "qwen3-moe", "--tiny", "--batch", "8", "--out", str(out), "-q"]
    assert main(argv) == 0
    return out


def test_every_file_is_written(run_dir: Path) -> None:
    names = {p.name for p in run_dir.iterdir()}
    assert names >= {
        "summary.json",
        "units.csv",
        "operators.csv",
        "trace.json",
        "roofline.png",
        "utilisation.png",
        "breakdown.png",
        "report.md",
    }


def test_summary_keys(run_dir: Path) -> None:
    s = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "latency_cycles",
        "latency_s",
        "hbm_bytes",
        "peak_onchip_bytes",
        "flops",
        "roofline_cycles",
        "chip_spec",
        "options",
        "versions",
        "dtype",
        "cores_used",
        "cores_available",
        "hbm_peak_bytes_per_s",
        "hbm_bandwidth_fraction",
        "sram_capacity_bytes",
    ):
        assert key in s, key
    assert s["chip_spec"]["name"] == "step-sda" and s["chip_spec"]["num_cores"] == 1040
    assert s["versions"]["torch"] and s["versions"]["torch2step"]
    # the tiny layer has 8 experts: no packaged trace fits, and the report says so
    assert s["options"]["routing"] == "router"
    assert any("the model's router (no packaged trace fits" in n for n in s["notes"])
    assert 0 < s["cores_used"] <= s["cores_available"]
    assert 0 < s["hbm_bandwidth_fraction"] <= 1


def test_csv_columns(run_dir: Path) -> None:
    with (run_dir / "units.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == UNIT_COLUMNS
    s = json.loads((run_dir / "summary.json").read_text())
    assert len(rows) == len(s["units"])
    assert sum(int(r["busy_cycles"]) for r in rows) == s["breakdown"]["busy"]
    assert sum(int(r["flops"]) for r in rows) == s["flops"]
    with (run_dir / "operators.csv").open() as f:
        ops = list(csv.DictReader(f))
    assert tuple(ops[0]) == OPERATOR_COLUMNS
    assert sum(int(r["busy_cycles"]) for r in ops if r["group"] == "step") == s["breakdown"]["busy"]


def test_trace_is_valid_trace_event_format(run_dir: Path) -> None:
    doc = json.loads((run_dir / "trace.json").read_text())
    assert trace_problems(doc) == []
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    procs = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"cores", "hbm channels", "utilisation"} <= procs
    counters = [e for e in events if e["ph"] == "C"]
    kinds = {e["name"] for e in counters}
    assert kinds == {"compute utilisation", "hbm utilisation", "noc utilisation"}
    assert all(0.0 <= e["args"]["busy"] <= 1.0 + 1e-9 for e in counters)
    assert max(e["args"]["busy"] for e in counters if e["name"].startswith("hbm")) > 0
    # every track with a span is named
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in spans} <= named


def test_trace_problems_finds_bad_events() -> None:
    bad = {
        "traceEvents": [
            {"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 1},
            {"name": "c", "ph": "C", "ts": -1, "pid": 1, "args": {"v": "x"}},
            {"ph": "Q"},
        ]
    }
    problems = trace_problems(bad)
    assert len(problems) == 4, problems


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("name", ["roofline.png", "utilisation.png", "breakdown.png"])
def test_pngs_are_images(run_dir: Path, name: str) -> None:
    w, h = _png_size(run_dir / name)
    assert w >= 300 and h >= 200
    assert (run_dir / name).stat().st_size > 10_000


def test_report_md_links_everything(run_dir: Path) -> None:
    md = (run_dir / "report.md").read_text()
    for name in ("roofline.png", "utilisation.png", "breakdown.png", "trace.json", "perfetto"):
        assert name in md
    assert "cores used" in md and "element type" in md


def test_breakdown_by_the_users_operators(run_dir: Path) -> None:
    s = json.loads((run_dir / "summary.json").read_text())
    ops = s["by_operator"]
    # the router's Linear and TopK, and each expert's branch of the MoE operator
    assert any("(Linear)" in k for k in ops) and any("(TopKRouting)" in k for k in ops)
    assert sum("(MoEExperts) e" in k for k in ops) >= 2
    assert sum(r["flops"] for r in ops.values()) == s["flops"]
    md = (run_dir / "report.md").read_text()
    assert "by operator" in md and "(MoEExperts) e" in md


def test_trace_window_and_units_limit_the_file(tmp_path: Path) -> None:
    from torch2step.named import report_layer

    run = report_layer("qwen3-moe", 8, tiny=True, routing_trace="router", trace=True)
    full = run.program.write_trace(tmp_path / "full.json")
    n_full = run.program.trace_stats["events"]
    small = run.program.write_trace(tmp_path / "small.json", window=(200, 600), units=5)
    stats = run.program.trace_stats
    doc = json.loads(small.read_text())
    assert trace_problems(doc) == [] and json.loads(full.read_text())["traceEvents"]
    assert stats["events"] == len(doc["traceEvents"]) < n_full
    assert stats["bytes"] == small.stat().st_size < full.stat().st_size
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert all(e["ts"] < 600 and e["ts"] + e["dur"] >= 200 for e in spans)
    assert len({e["tid"] for e in spans if e["pid"] == 1}) <= 5 * 2
