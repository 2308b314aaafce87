"""MoE regions of consecutive experts (``moe_lane_assign="consecutive"``, STeP arXiv 2511.07776
§5.3) on a layer whose router computes its top-k ids on chip and stores them (so the graph's
integer tiles carry no values: :func:`torch2step.spatial.control.control_data`).

A region's units loop over its chunks with one program built from the first chunk; the
selector each row goes back to its expert by must be computed in registers from the selector
the region's EagerMerge sends, not be the first chunk's literal (which routed every row of a
lane to one expert and deadlocked the timing report).  The report completes, every selector
Map of a region sends from a register, and the functional run still equals the module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torch2step
from lowering.isa import SendValue
from models import get_layer
from torch2step.spatial.control import control_data
from torch2step.spatial.plan import build_plan
from torch2step.spatial.simulate import simulate_plan


def _instrs(body: Any) -> Iterator[Any]:
    """Every instruction of a program body, nested ``If`` / ``Loop`` bodies included."""
    for ins in body:
        yield ins
        for field in ("then", "orelse", "body"):
            inner = getattr(ins, field, None)
            if isinstance(inner, tuple):
                yield from _instrs(inner)


@pytest.fixture(scope="module")
def spec() -> Any:
    return get_layer("qwen3-moe", tiny=True, batch=8)


@pytest.mark.parametrize("static_tile", [None, 4])
@pytest.mark.parametrize("lanes", [2, 4])
def test_consecutive_lanes_report_completes_and_run_equals_module(
    spec: Any, lanes: int, static_tile: int | None
) -> None:
    opts: dict[str, Any] = {"moe_lanes": lanes, "moe_lane_assign": "consecutive"}
    if static_tile is not None:
        opts["moe_static_tile"] = static_tile
    prog = torch2step.compile(spec.module, spec.example_inputs, **opts)
    report = prog.report(*spec.example_inputs)
    assert report.latency_cycles > 0
    got = prog.run(*spec.example_inputs)
    torch.testing.assert_close(got, spec.module(*spec.example_inputs), atol=1e-5, rtol=1e-5)


def test_region_selectors_are_computed_from_registers(spec: Any) -> None:
    prog = torch2step.compile(
        spec.module, spec.example_inputs, moe_lanes=2, moe_lane_assign="consecutive"
    )
    lw, res, _, _ = prog._execute(spec.example_inputs, None, timing_only=True, standins=True)
    assert not control_data(lw.program)  # the router stores its top-k ids
    plan = build_plan(lw.program, prog.chip, res)
    sends = [
        ins
        for p in plan.programs.programs
        for ins in _instrs(p.body)
        if isinstance(ins, SendValue)
        and not ins.stop
        and ins.channel.endswith(("_l0_sel", "_l1_sel"))
    ]
    assert sends, "each region sends its rows' selectors"
    assert all(isinstance(s.value, str) for s in sends), "a selector sent as the run's literal"
    # and the lanes' Partitions back to the experts send each expert exactly its rows
    back = [ch.name for ch in plan.programs.channels if "_back." in ch.name]
    watch: dict[str, Any] = {ch: [] for ch in back}
    simulate_plan(plan, watch=watch)
    assert {ch: len(watch[ch]) for ch in back} == {ch: plan.messages[ch] for ch in back}
