"""Full-size reports of every shipped layer at batch 64 on ``step-sda`` (``slow``: about 10–20 s
each; ``python -m pytest -m slow tests/api/test_fullsize_reports.py``).

The small layers of the default run cannot reach the sizes where some limits bite (a merge over
Qwen3-30B-A3B's 128 experts, a decoder's two configurations sharing one compiled program), so
these run what ``torch2step report --layer L --batch 64`` runs and check the report against its
physical bounds: the run finishes (no deadlock), it is never faster than its roofline bound (the
larger of the HBM time of its off-chip bytes and the compute time at the chip's peak FLOPs), and
it is timed in bf16, the dtype the layers are served in; a layer with experts (alone or in a
decoder layer) is routed by its model's packaged trace.
"""

from __future__ import annotations

import pytest

from models import LAYERS
from torch2step.named import report_layer


@pytest.mark.slow
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fullsize_report_within_physical_bounds(layer: str) -> None:
    rep = report_layer(layer, 64).report
    assert rep.latency_cycles > 0
    assert rep.hbm_bytes > 0
    assert rep.roofline_cycles <= rep.latency_cycles, (
        f"{layer}: {rep.latency_cycles:,} cycles beat the roofline bound {rep.roofline_cycles:,}"
    )
    assert 0.0 < rep.roofline_fraction <= 1.0
    assert rep.dtype == "bf16"
    prefix = LAYERS[layer].routing_prefix
    if prefix is not None:  # MoE layers and MoE decoder layers: the packaged trace routes
        assert f"routing: trace {prefix}_b64 (first 64 of 64 tokens)" in rep.notes, rep.notes
        assert sum(rep.dynamic["tokens_per_expert"]) % 64 == 0  # top-k of each token
