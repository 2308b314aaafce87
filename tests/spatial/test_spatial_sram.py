"""A unit's simulated on-chip bytes against its cores' SRAM (:mod:`torch2step.spatial.sram`):
a unit that needs more than one core's SRAM spans more cores and the report says so; when the
chip cannot give it those cores the error names the unit, its bytes and the core capacity."""

from __future__ import annotations

import pytest

from hwmodel import load_chip, with_overrides
from torch2step.errors import ScheduleError
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.spatial import simulate_graph
from torch2step.spatial.result import UnitRecord
from torch2step.spatial.sram import check_sram, sram_spans
from torch2step.step import run

E, K, H, I, T = 4, 2, 64, 64, 16  # noqa: E741


def _unit(name: str, sram: int, fifo: int, cores: tuple[int, ...] = (0,)) -> UnitRecord:
    return UnitRecord(name, (name,), ("Bufferize",), cores, 0, 0, 0, 0, 0, 0, 0, sram, fifo, 0, 0)


def test_units_over_one_core_span_cores_and_say_so() -> None:
    chip = with_overrides(load_chip("step-sda"), ["core.sram_bytes=1000"])
    units = (_unit("a", 900, 0), _unit("b", 600, 1900, (1,)), _unit("c", 2500, 0, (2, 3, 4)))
    spans = sram_spans(units, chip)
    assert [(s.unit, s.need, s.placed) for s in spans] == [("b", 3, 1), ("c", 3, 3)]
    notes = check_sram(units, chip)
    assert "unit %b (Bufferize) holds 2,500 bytes" in notes[0]
    assert "spans 3 cores (placed on 1, 2 more for its FIFOs)" in notes[0]


def test_too_few_cores_is_an_error_naming_unit_bytes_and_capacity() -> None:
    chip = with_overrides(load_chip("step-sda"), ["core.sram_bytes=1000", "noc.rows=2",
                                                  "noc.cols=2"])
    units = (_unit("x", 100, 0), _unit("big", 1000, 3000, (1,)))
    with pytest.raises(ScheduleError, match=r"unit %big \(Bufferize\) needs 4,000 bytes .* "
                       r"has 1,000 bytes of SRAM"):
        check_sram(units, chip)


def test_simulated_moe_on_small_sram_reports_spanning_units() -> None:
    """Every expert's weight-tile staging (64 x 64 fp32 x 2 = 32 KB) exceeds a 16 KB core:
    placement gives those units two cores and the report lists them; the printed on-chip
    memory is the simulated peak (buffers + FIFOs of every unit)."""
    chip = with_overrides(load_chip("step-sda"), ["core.sram_bytes=16384"])
    kw = {"num_experts": E, "top_k": K, "hidden": H, "intermediate": I}
    prog = moe_graph(**kw, tokens=T)
    res = run(prog, tensors=moe_inputs(**kw, tokens=T))
    sim = simulate_graph(prog, chip, res)
    assert sim.memory_notes
    assert any("spans" in n and "16,384 bytes of SRAM" in n for n in sim.memory_notes)
    assert "memory: unit %" in sim.summary()
    assert sim.peak_onchip_bytes == sum(u.sram_bytes + u.fifo_bytes for u in sim.units)
    assert all(len(u.cores) >= -(-u.sram_bytes // 16384) for u in sim.units)
