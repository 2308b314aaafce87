"""Choices made for the user are said in the report, never made silently."""

from __future__ import annotations

import numpy as np

from models import traces
from torch2step.named import report_layer


def test_tiny_scales_a_kv_trace_and_keeps_its_shape() -> None:
    run = report_layer("llama-gqa", 16, tiny=True)
    real = traces.kv_lengths("b16/med")
    lens = np.array(run.report.dynamic["kv_lengths"])
    assert lens.max() == 64 and len(set(lens.tolist())) > 1  # ragged, not clamped to 64
    assert np.array_equal(lens, np.maximum(1, np.rint(real * 64.0 / real.max())))
    assert any("scaled by 64/" in n for n in run.report.notes)
    assert "note: KV lengths: trace b16/med scaled" in str(run.report)


def test_auto_routing_says_which_trace_or_why_the_router() -> None:
    run = report_layer("qwen3-moe", 4, tiny=True)
    assert run.report.options["routing"] == "router"
    assert "no packaged trace fits" in str(run.report)
    explicit = report_layer("qwen3-moe", 4, tiny=True, routing_trace="router")
    assert "routing: the model's router (--routing-trace router)" in explicit.report.notes


def test_auto_routing_checks_the_batch_trace_of_a_tiny_layer() -> None:
    # batch 64 has a packaged trace of the full-size model (top-8 of 128): the tiny layer
    # (top-2 of 8) cannot take it, so the router routes and the report says why
    run = report_layer("qwen3-moe", 64, tiny=True)
    assert run.report.options["routing"] == "router"
    note = next(n for n in run.report.notes if n.startswith("routing:"))
    assert "qwen_b64 routes top-8" in note and "this layer has top-2 of 8" in note
