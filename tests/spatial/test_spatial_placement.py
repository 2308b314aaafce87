"""Placement of STeP units on cores: one unit per operator, wires, fused memory units, walks,
and the error when the chip is too small."""

from __future__ import annotations

import pytest
from spatial_graphs import map_chain, moe, tiled_matmul

from hwmodel import load_chip, with_mesh_shape
from torch2step.errors import LoweringError, ScheduleError
from torch2step.spatial import (
    DEFAULT_WIRES,
    WALKS,
    format_placement,
    place,
    simulate_graph,
    walk_cores,
)
from torch2step.step import Streamify

CHIP = load_chip("step-sda")
SHAPE_OPS = {"Flatten", "Promote", "Zip", "Reshape"}


@pytest.fixture(scope="module")
def small_moe() -> tuple:
    return moe(6, 512, 128, 4, 2)


def test_one_unit_per_operator_and_wires(small_moe: tuple) -> None:
    prog, run = small_moe
    p = place(prog, CHIP)
    kinds = [op.op_name for op in prog.nodes]
    wires = sum(k in SHAPE_OPS for k in kinds)
    assert wires and {k for _, k in p.wires} == SHAPE_OPS
    assert len(p.units) == len(kinds) - wires
    assert all(len(u.ops) == 1 and len(u.cores) == 1 for u in p.units)
    cores = [u.core for u in p.units]
    assert len(set(cores)) == len(cores)
    with pytest.raises(KeyError, match="it is a wire"):
        p.unit(next(n for n, _ in p.wires))


def test_wires_can_be_units(small_moe: tuple) -> None:
    """``wires=()``: every shape operator is a unit of its own, forwarding in one cycle; the
    traffic is unchanged and the extra hops only add latency."""
    prog, run = small_moe
    wired = simulate_graph(prog, CHIP, run)
    units = simulate_graph(prog, CHIP, run, wires=())
    assert len(units.units) == len(prog.nodes)
    assert {u.kind for u in units.units} >= SHAPE_OPS
    assert units.hbm_bytes == wired.hbm_bytes == run.offchip_bytes
    assert units.cycles > wired.cycles
    with pytest.raises(LoweringError, match="cannot be wires"):
        place(prog, CHIP, wires=("Map",))
    assert DEFAULT_WIRES == SHAPE_OPS


def test_streamify_runs_on_its_bufferize_unit() -> None:
    prog, run = tiled_matmul(128, 128, 128, 64)
    p = place(prog, CHIP)
    strm = next(op.name for op in prog.nodes if isinstance(op, Streamify))
    unit = p.unit(strm)
    assert unit.kinds == ("Bufferize", "Streamify") and unit.name == "buf_a"
    res = simulate_graph(prog, CHIP, run)
    assert res.hbm_bytes == run.offchip_bytes
    assert res.flops == run.total_flops


def test_consecutive_units_are_mesh_neighbours() -> None:
    """Units are laid along a Hilbert walk in chain order: a chain of operators sits on a path
    of neighbouring cores."""
    prog, _ = map_chain(2, ["relu"] * 6)
    p = place(prog, CHIP)
    cols = CHIP.noc.cols
    chain = ["ld", *(f"m{k}" for k in range(6)), "st"]
    for a, b in zip(chain, chain[1:]):
        (ra, ca), (rb, cb) = divmod(p.core(a), cols), divmod(p.core(b), cols)
        assert abs(ra - rb) + abs(ca - cb) == 1


@pytest.mark.parametrize("walk", WALKS)
def test_walks_visit_every_core_once(walk: str) -> None:
    chip = with_mesh_shape(CHIP, 5, 7)
    order = walk_cores(chip, walk)
    assert sorted(order) == list(range(35))
    if walk != "linear":
        for a, b in zip(order, order[1:]):
            (ra, ca), (rb, cb) = divmod(a, 7), divmod(b, 7)
            assert abs(ra - rb) + abs(ca - cb) == 1
    with pytest.raises(ScheduleError, match="unknown walk"):
        walk_cores(chip, "spiral")


def test_too_many_units_for_the_chip_is_a_schedule_error() -> None:
    prog, run = map_chain(2, ["relu"] * 4)  # 6 units
    tiny = with_mesh_shape(CHIP, 2, 2)
    with pytest.raises(ScheduleError) as info:
        simulate_graph(prog, tiny, run)
    msg = str(info.value)
    assert "'map_chain' needs 6 cores for its 6 units" in msg
    assert "4 Map, 1 LinearOffChipLoad, 1 LinearOffChipStore" in msg
    assert f"chip '{tiny.name}' has 4 cores" in msg
    assert "with_mesh_shape" in msg and "fewer operators" in msg
    ok = with_mesh_shape(CHIP, 2, 3)
    assert simulate_graph(prog, ok, run).cores_used == 6


def test_unit_with_large_buffers_takes_extra_memory_units() -> None:
    """A Bufferize holding two 512 KiB row blocks needs more than one core's 512 KiB with
    double buffering; it takes ``ceil(bytes / sram)`` cores and its buffers fit."""
    prog, run = tiled_matmul(256, 2048, 128, 128)
    res = simulate_graph(prog, CHIP, run)
    unit = res.placement.unit("buf_a")
    need = -(-res.unit("buf_a").sram_bytes // CHIP.core.sram_bytes)
    assert need > 1 and len(unit.cores) == need
    assert res.cores_used == len(res.units) - 1 + need
    text = format_placement(res.placement, CHIP)
    assert f"(+{need - 1} memory units" in text
    assert "Bufferize %buf_a, Streamify %strm_a" in text
