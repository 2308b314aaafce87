"""``torch2step report`` shows the simulated cycles advancing on stderr at INFO, and nothing
with ``-q``; the printed report is the same either way.  On a terminal the progress is a bar;
into a file or pipe it is plain log lines (no carriage returns to garble the log)."""

from __future__ import annotations

import sys

import pytest

import runtime.engine as engine
import torch2step.named as named
from torch2step.cli import main

ARGS = ["report", "--layer", "llama-gqa", "--batch", "2", "--tiny"]


@pytest.fixture
def often(monkeypatch) -> None:
    monkeypatch.setattr(engine, "PROGRESS_EVENTS", 1)
    monkeypatch.setattr(engine, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(named, "LOG_EVERY_S", 0.0)


def test_report_logs_simulation_progress_lines_into_a_pipe(often, capsys) -> None:
    assert main(ARGS) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if "simulating:" in ln]
    assert lines and all("cycles" in ln and "events so far" in ln for ln in lines)
    assert "\r" not in err
    assert main([*ARGS, "-q"]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert "events" not in quiet_err
    assert quiet_out == out


def test_report_draws_a_progress_bar_on_a_terminal(often, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(ARGS) == 0
    _, err = capsys.readouterr()
    assert "simulating" in err and "cycles" in err and "events" in err
    assert "events so far" not in err
