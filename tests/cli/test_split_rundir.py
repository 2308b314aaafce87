"""A layer split into sequential configurations reports them as one run: its utilisation
timeline (summary.json, utilisation.png) covers every configuration one after another, not
only the first, and the padding note of its dynamic Linear rows is kept."""

from __future__ import annotations

import json
from pathlib import Path

from torch2step.cli import main


def test_a_split_layers_timeline_covers_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "split"
    argv = ["report", "--layer", "llama-decoder", "--batch", "4", "--tiny", "-q"]
    assert main([*argv, "--set", "noc.rows=6", "--set", "noc.cols=6", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["dynamic"]["configurations"] > 1
    t = s["timeline"]
    assert t["edges"][0] == 0 and t["edges"][-1] == s["latency_cycles"]
    assert t["edges"] == sorted(t["edges"]) and len(t["edges"]) == len(t["compute"]) + 1
    assert any(n.startswith("Linear rows are a dynamic size") for n in s["notes"])
