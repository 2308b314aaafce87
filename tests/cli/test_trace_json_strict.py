"""trace.json is strict JSON, and --trace-window / --trace-units shape it as they say: spans
clipped to the window, only tracks with events named, counters' values in force at the
window's start, one name per track of a layer split into configurations."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from runtime.trace import trace_problems, write_trace_json
from torch2step.cli import _window, main


def _strict(text: str) -> Any:
    """``json.loads`` as JSON.parse reads it: NaN, Infinity and -Infinity are errors."""

    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def moe() -> Any:
    from torch2step.named import report_layer

    return report_layer("qwen3-moe", 8, tiny=True, routing_trace="router", trace=True)


def _value_at(counters: list[dict[str, Any]], name: str, t: float) -> float:
    """The value of counter ``name`` in force at ``t`` (its last sample at or before it)."""
    samples = sorted((e["ts"], e["args"]["busy"]) for e in counters if e["name"] == name)
    return [v for ts, v in samples if ts <= t][-1]


def test_open_window_writes_strict_json_with_the_clock(moe: Any, tmp_path: Path) -> None:
    prog = moe.program
    path = prog.write_trace(tmp_path / "open.json", window=(1000.0, math.inf))
    doc = _strict(path.read_text())  # Infinity in otherData made this fail
    assert doc["otherData"]["window_cycles"] == [1000, None]
    assert doc["otherData"]["clock_ghz"] == prog.chip.clock_ghz
    assert doc["otherData"]["time_unit"] == "1 trace microsecond = 1 cycle"
    assert "displayTimeUnit" not in doc  # "ns" showed a cycle (1 trace microsecond) as 1,000 ns
    assert trace_problems(doc) == []


def test_a_nan_is_refused_not_written(tmp_path: Path) -> None:
    ev = {"name": "compute utilisation", "ph": "C", "ts": 0, "pid": 5, "args": {"busy": math.nan}}
    with pytest.raises(ValueError, match="NaN or an infinity"):
        write_trace_json(tmp_path / "nan.json", [ev], {})
    with pytest.raises(ValueError, match="NaN or an infinity"):
        write_trace_json(tmp_path / "inf.json", [], {"window": [0, math.inf]})


@pytest.mark.parametrize("text", ["nan:5", "0:nan", "inf:", "5:5", "9:4", "-1:4", "4", "a:b"])
def test_bad_windows_are_refused(text: str) -> None:
    from torch2step.errors import InputError

    with pytest.raises(InputError, match="--trace-window"):
        _window(text)


def test_window_bounds() -> None:
    assert _window("1000:") == (1000.0, math.inf)
    assert _window("0:inf") == (0.0, math.inf)
    assert _window(":50") == (0.0, 50.0)


@pytest.mark.parametrize("n", ["0", "-1"])
def test_trace_units_below_one_are_refused(
    n: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["report", "--layer", "qwen3-moe", "--tiny", "--batch", "8", "-q"]
    argv += ["--out", str(tmp_path / "run"), "--trace-units", n]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"--trace-units {n}: keep the core tracks of N >= 1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_window_clips_spans_names_only_tracks_left_and_keeps_counters() -> None:
    events = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "cores"}},
        {"name": "process_name", "ph": "M", "pid": 2, "tid": 0, "args": {"name": "links"}},
        {"name": "process_name", "ph": "M", "pid": 5, "tid": 0, "args": {"name": "util"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "core 0"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "core 1"}},
        {"name": "thread_name", "ph": "M", "pid": 2, "tid": 3, "args": {"name": "link 3"}},
        {"name": "k", "ph": "X", "ts": 0, "dur": 150, "pid": 1, "tid": 1},  # over the start
        {"name": "k", "ph": "X", "ts": 10, "dur": 5, "pid": 1, "tid": 0},  # before: dropped
        {"name": "k", "ph": "X", "ts": 100, "dur": 20, "pid": 1, "tid": 0},  # ends at start
        {"name": "t", "ph": "X", "ts": 170, "dur": 20.5, "pid": 2, "tid": 3},  # over the end
        {"name": "u", "ph": "C", "ts": 0, "pid": 5, "tid": 0, "args": {"busy": 0.5}},
        {"name": "u", "ph": "C", "ts": 100, "pid": 5, "tid": 0, "args": {"busy": 0.7}},
        {"name": "u", "ph": "C", "ts": 150, "pid": 5, "tid": 0, "args": {"busy": 0.9}},
        {"name": "u", "ph": "C", "ts": 180, "pid": 5, "tid": 0, "args": {"busy": 0.1}},
    ]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "w.json"
        stats = write_trace_json(path, events, {}, window=(120.0, 180.0), cycles=300)
        doc = _strict(path.read_text())
    out = doc["traceEvents"]
    assert trace_problems(doc) == [] and stats["events"] == len(out)
    spans = [(e["tid"], e["ts"], e["dur"], e.get("args")) for e in out if e["ph"] == "X"]
    assert spans == [(1, 120, 30, {"span": [0, 150]}), (3, 170, 10, {"span": [170, 190.5]})]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in out if e["name"] == "thread_name"}
    assert names == {(1, 1): "core 1", (2, 3): "link 3"}  # core 0 has no span left
    assert {e["pid"] for e in out if e["name"] == "process_name"} == {1, 2, 5}
    counters = sorted((e["ts"], e["args"]["busy"]) for e in out if e["ph"] == "C")
    assert counters == [(120, 0.7), (150, 0.9)]  # 0.7 was in force at the window's start
    # a window past the run's end: no counter value is made up there
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "late.json"
        write_trace_json(path, events, {}, window=(400.0, 500.0), cycles=300)
        assert _strict(path.read_text())["traceEvents"] == []


def test_a_windowed_run_is_clipped_and_names_only_its_tracks(moe: Any, tmp_path: Path) -> None:
    prog = moe.program
    cycles = moe.report.latency_cycles
    lo, hi = cycles // 2, cycles // 2 + 300
    full = _strict(prog.write_trace(tmp_path / "full.json").read_text())["traceEvents"]
    doc = _strict(prog.write_trace(tmp_path / "w.json", window=(lo, hi)).read_text())
    assert trace_problems(doc) == []
    out = doc["traceEvents"]
    spans = [e for e in out if e["ph"] == "X"]
    assert spans and all(lo <= e["ts"] and e["ts"] + e["dur"] <= hi for e in spans)
    # every span of the full trace that overlaps the window is there, clipped to it
    want = Counter(
        (e["pid"], e["tid"], e["name"], max(e["ts"], lo), min(e["ts"] + e["dur"], hi))
        for e in full
        if e["ph"] == "X" and e["ts"] < hi and e["ts"] + e["dur"] > lo
    )
    got = Counter((e["pid"], e["tid"], e["name"], e["ts"], e["ts"] + e["dur"]) for e in spans)
    assert got == want
    tracks = {(e["pid"], e["tid"]) for e in spans}
    named = [(e["pid"], e["tid"]) for e in out if e["name"] == "thread_name"]
    assert sorted(named) == sorted(tracks)  # core 0 was named though it had no span left
    procs = [e["pid"] for e in out if e["name"] == "process_name"]
    assert sorted(procs) == sorted({e["pid"] for e in out if e["ph"] != "M"})
    counters = [e for e in out if e["ph"] == "C"]
    all_counters = [e for e in full if e["ph"] == "C"]
    for name in ("compute utilisation", "hbm utilisation", "noc utilisation"):
        at_lo = [e["args"]["busy"] for e in counters if e["name"] == name and e["ts"] == lo]
        assert at_lo == [_value_at(all_counters, name, lo)], name


def test_a_window_past_the_run_is_warned_about(moe: Any, tmp_path: Path) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch2step")
    logger.addHandler(handler)
    try:
        cycles = moe.report.latency_cycles
        path = moe.program.write_trace(tmp_path / "late.json", window=(cycles + 10, cycles + 99))
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any(f"{cycles:,} cycles long" in m for m in warned), warned
    assert not [e for e in _strict(path.read_text())["traceEvents"] if e["ph"] == "X"]


@pytest.fixture(scope="module")
def split() -> Any:
    from torch2step.named import report_layer

    run = report_layer("llama-decoder", 4, tiny=True, sets=["noc.rows=6", "noc.cols=6"], trace=True)
    assert run.report.dynamic["configurations"] > 1
    return run


def test_a_split_layer_names_each_track_once(split: Any, tmp_path: Path) -> None:
    doc = _strict(split.program.write_trace(tmp_path / "t.json").read_text())
    assert trace_problems(doc) == []
    meta = Counter((e["name"], e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "M")
    assert max(meta.values()) == 1  # was: a process_name per pid per configuration
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"]
    k = split.report.dynamic["configurations"]
    # a core names its unit in each configuration that used it
    assert any(all(f"{i}: " in n for i in range(1, k + 1)) and " | " in n for n in names)


def test_split_trace_units_keeps_the_busiest_units_in_their_configuration(
    split: Any, tmp_path: Path
) -> None:
    prog = split.program
    n = 3
    doc = _strict(prog.write_trace(tmp_path / "u.json", units=n).read_text())
    assert trace_problems(doc) == [] and doc["otherData"]["units_kept"] == n
    parts = prog._split_parts
    ranked = sorted(
        ((r.busy, k, r.name, r.cores) for k, (*_, last) in enumerate(parts) for r in last.units),
        key=lambda x: (-x[0], x[1], x[2]),
    )[:n]
    kept = {(k, c) for _, k, _, cores in ranked for c in cores}
    ranges = [(start, start + last.cycles) for start, _, last in parts]
    core_spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert core_spans
    for e in core_spans:
        k = next(i for i, (a, b) in enumerate(ranges) if a <= e["ts"] < b)
        assert (k, e["tid"]) in kept, e  # only a kept unit's spans, in its configuration
    assert {e["tid"] for e in core_spans} == {c for _, c in kept}
    named = {e["tid"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 1}
    assert named == {c for _, c in kept}
