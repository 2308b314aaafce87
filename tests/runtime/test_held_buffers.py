"""A buffer allocated at a capacity bound (``Alloc(..., held=True)``: tiles whose size only the
run knows, STeP arXiv 2511.07776 §5.2 dynamic tiling) counts against the core's SRAM what it
holds at most, not its capacity: the simulated peak is the run's memory, the same program
serves a run that holds more (up to the bound), and a run that holds more than the core has
overflows when it does."""

from __future__ import annotations

import dataclasses

import pytest
from runtime_testkit import CORE, mesh_chip

from lowering.isa import (
    Alloc,
    Channel,
    Compute,
    Load,
    Program,
    ProgramSet,
    Recv,
    Region,
    Send,
    TensorDecl,
)
from runtime import simulate
from runtime.errors import SimulationError

ROWS, COLS, BOUND = 64, 32, 64


def _programs(rows: int, held: bool) -> ProgramSet:
    """Core 0 loads ``rows`` rows and sends them; core 1 receives them into a buffer
    allocated at ``BOUND`` rows and doubles them into another."""
    cap = (BOUND * COLS,)
    send = Program(
        0,
        (
            Alloc("x", cap, "fp32", held),
            Load("x", "a", Region((0, 0), (rows, COLS))),
            Send("c", "x"),
        ),
    )
    recv = Program(
        1,
        (
            Alloc("y", cap, "fp32", held),
            Alloc("z", cap, "fp32", held),
            Alloc("w", (16,), "fp32"),
            Recv("c", "y"),
            Compute("add", ("z",), ("y", "y"), (), "fp32"),
        ),
    )
    return ProgramSet(
        (send, recv), (Channel("c", 0, (1,)),), (TensorDecl("a", (ROWS, COLS), "fp32"),)
    )


def _peaks(rows: int, held: bool, sram: int = CORE.sram_bytes) -> list[int]:
    chip = mesh_chip(1, 2, core=dataclasses.replace(CORE, sram_bytes=sram))
    res = simulate(_programs(rows, held), chip)
    return [c.sram_peak_bytes for c in res.stats.cores]


def test_a_held_buffer_counts_what_it_held() -> None:
    for rows in (1, 5, 64):
        assert _peaks(rows, True) == [rows * COLS * 4, 2 * rows * COLS * 4 + 16 * 4]
    # allocated at its capacity without held: the bound counts, whatever the run holds
    cap = BOUND * COLS * 4
    assert _peaks(5, False) == [cap, 2 * cap + 16 * 4]


def test_a_held_buffer_overflows_when_the_run_holds_more_than_the_core_has() -> None:
    sram = 2 * 10 * COLS * 4 + 16 * 4  # room for two 10-row tiles on core 1
    assert _peaks(10, True, sram)[1] == sram
    with pytest.raises(SimulationError, match="now holds"):
        _peaks(11, True, sram)
