"""``torch2step report`` shows the simulated cycles advancing on stderr at INFO, and nothing
with ``-q``; the printed report is the same either way."""

from __future__ import annotations

import runtime.engine as engine
from torch2step.cli import main


def test_report_shows_simulation_progress_at_info_only(monkeypatch, capsys) -> None:
    monkeypatch.setattr(engine, "PROGRESS_EVENTS", 1)
    monkeypatch.setattr(engine, "PROGRESS_SECONDS", 0.0)
    args = ["report", "--layer", "llama-gqa", "--batch", "2", "--tiny"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "simulating" in err and "cycles" in err and "events" in err
    assert main([*args, "-q"]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert "events" not in quiet_err
    assert quiet_out == out
