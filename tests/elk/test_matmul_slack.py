"""A matrix product's slack — how far into its execution its preload may still arrive — is
timed as its execution is (:func:`elk.cost._matmul`): the last weight piece is needed when
the last product starts, so the slack never reaches the end of the execution, and a plan's
breakdown into preload, execute, overlapped, interconnect and idle adds up to its cycles."""

from __future__ import annotations

import pytest

import torch2step
from elk.cost import ChipCosts, item_for
from elk.ops import Operator
from hwmodel.presets import load_chip
from models.registry import get_layer


@pytest.mark.parametrize("chip", ["ipu-hbm", "mesh"])
@pytest.mark.parametrize(
    "dims", [(8, 4096, 4096), (32, 4096, 4096), (32, 4096, 1024), (64, 14336, 4096)]
)
def test_every_matmul_plan_needs_its_last_weight_piece_before_it_ends(chip, dims) -> None:
    costs = ChipCosts.from_chip(load_chip(chip))
    it = item_for(costs, Operator("o_proj", "matmul", dims))
    assert it.execs
    for o in it.execs:
        p = o.ref
        assert 0 <= p.slack < p.time, (p.tiles, p.slack, p.time)


@pytest.mark.parametrize("chip", ["ipu-hbm", "mesh"])
def test_breakdown_of_a_kernel_report_adds_up_to_its_plan(chip) -> None:
    spec = get_layer("llama-gqa", batch=32)
    prog = torch2step.compile(spec.module, spec.example_inputs, chip=chip)
    s = prog.schedule
    b = s.breakdown()
    assert sum(b.values()) == pytest.approx(s.cycles, rel=1e-6)
