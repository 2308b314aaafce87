"""The command line's log handler writes to whatever ``sys.stderr`` is when a record is
emitted: after a command ran with one stream (a test's capture, a redirect that has since been
closed), a later record goes to the current stream, not to the closed one (which printed
"--- Logging error ---" and a traceback instead)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from torch2step.cli import _setup_logging


def test_records_go_to_the_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    _setup_logging(0, False)
    first.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    logging.getLogger("torch2step").info("after the stream changed")
    assert now.getvalue().endswith("] after the stream changed\n")
    assert "Logging error" not in now.getvalue()
