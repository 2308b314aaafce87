"""A run directory holds this run's files only: saving again without a trace removes the
earlier run's trace.json (and any plot this run does not make); summary.json and report.md say
what the trace was cut to; a report that recorded a trace, saved without its program, warns
that no trace.json is written."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import torch2step
from models import get_layer
from torch2step.cli import main


def test_saving_again_without_a_trace_removes_the_old_one(tmp_path: Path) -> None:
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(spec.module, spec.example_inputs, chip="step-sda")
    traced = prog.report(*spec.example_inputs, trace=True)
    d = traced.save(tmp_path / "run", trace=prog)
    assert (d / "trace.json").is_file()
    assert json.loads((d / "summary.json").read_text())["trace"]["file"] == "trace.json"
    plain = prog.report(*spec.example_inputs)  # no trace recorded
    plain.save(d)
    assert not (d / "trace.json").exists() and not (d / "utilisation.png").exists()
    assert json.loads((d / "summary.json").read_text())["trace"] is None
    assert "trace.json" not in (d / "report.md").read_text()
    with pytest.warns(UserWarning, match=r"save\(dir, trace=prog\)"):
        traced.save(tmp_path / "other")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.save(tmp_path / "third")  # nothing recorded: nothing to warn about


def test_a_cut_trace_is_said_in_the_summary_and_report(tmp_path: Path) -> None:
    out = tmp_path / "cut"
    argv = ["report", "--layer", "llama-gqa", "--tiny", "--batch", "4", "--out", str(out), "-q"]
    assert main([*argv, "--trace-window", "100:400", "--trace-units", "3"]) == 0
    trace = json.loads((out / "summary.json").read_text())["trace"]
    assert trace["window_cycles"] == [100, 400] and trace["units_kept"] == 3
    assert trace["bytes"] == (out / "trace.json").stat().st_size
    md = (out / "report.md").read_text()
    assert "cycles 100 to 400 only" in md and "the cores of the 3 busiest units only" in md
