"""``WriteValue``: a register written into an element of an integer buffer, so a unit can send a
control value it computes in registers as data (a decode request's ``[row_base, n, stride]``
cursor, STeP arXiv 2511.07776 §5.1).  The values travel with the message in timing mode too
(integer data carries values in both modes), and the reference interpreter, the simulator in
both modes and the printer agree on it."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_testkit import mesh_chip

from lowering.isa import (
    Affine,
    Alloc,
    Channel,
    Load,
    Program,
    ProgramSet,
    ReadValue,
    Recv,
    Region,
    Send,
    Set,
    Store,
    TensorDecl,
    WriteValue,
)
from lowering.printer import format_instr
from lowering.reference import run_reference
from lowering.validate import program_problems
from runtime import simulate
from runtime.errors import SimulationError

INIT = np.arange(16, dtype=np.int64) + 40


def _programs(index: int = 2) -> ProgramSet:
    """Core 0 writes ``[r, r + 5, 7]`` (``r = 3``) over an int64 buffer it loaded, sends it, then overwrites element 0 (after the send: the message keeps 3); core 1 reads
    element 1 back, adds 1, and both values and the buffer are stored; it loads as many
    elements (8) into a buffer held at 16."""
    send = Program(
        0,
        (
            Alloc("x", (3,), "int64"),
            Set("r", 3),
            Load("x", "init", Region((0,), (3,))),
            WriteValue("x", 0, "r"),
            WriteValue("x", 1, Affine(5, (("r", 1),))),
            WriteValue("x", index, 7),
            Send("c", "x"),
            WriteValue("x", 0, 99),
        ),
    )
    recv = Program(
        1,
        (
            Alloc("y", (3,), "int64"),
            Alloc("z", (1,), "int64"),
            Alloc("w", (16,), "int64", True),
            Recv("c", "y"),
            ReadValue("n", "y", 1),
            Store("y", "out", Region((0,), (3,))),
            Load("z", "init", Region((3,), (1,))),
            WriteValue("z", 0, Affine(1, (("n", 1),))),
            Store("z", "out", Region((3,), (1,))),
            Load("w", "init", Region((0,), (Affine(0, (("n", 1),)),))),
        ),
    )
    return ProgramSet(
        (send, recv),
        (Channel("c", 0, (1,)),),
        (TensorDecl("init", (16,), "int64"), TensorDecl("out", (4,), "int64")),
    )


def test_written_values_travel_in_both_modes_and_match_the_reference() -> None:
    ps = _programs()
    assert not program_problems(ps, mesh_chip(1, 2))[0]
    want = [3, 8, 7, 9]
    ref = run_reference(ps, {"init": INIT})
    assert ref["out"].tolist() == want
    res = simulate(ps, mesh_chip(1, 2), mode="functional", inputs={"init": INIT})
    assert res.tensors["out"].tolist() == want


def test_a_write_outside_the_buffer_fails() -> None:
    with pytest.raises(SimulationError, match="outside buffer"):
        simulate(_programs(index=3), mesh_chip(1, 2), mode="functional", inputs={"init": INIT})


def test_write_value_prints_and_validates_its_registers() -> None:
    assert format_instr(WriteValue("x", 1, Affine(5, (("r", 1),)))) == "write_value x[1] <- r+5"
    bad = ProgramSet(
        (Program(0, (Alloc("x", (1,), "int64"), WriteValue("x", 0, "nope"))),),
    )
    assert any("'nope'" in p for p in program_problems(bad, mesh_chip(1, 1))[0])
    undeclared = ProgramSet((Program(0, (WriteValue("x", 0, 1),)),))
    assert any("not allocated" in p for p in program_problems(undeclared, mesh_chip(1, 1))[0])


def test_timing_mode_carries_the_written_values() -> None:
    """In timing mode too the written values travel: the receiver reads element 1 (8) and
    loads 8 elements into its held buffer, which its on-chip peak counts."""
    res = simulate(_programs(), mesh_chip(1, 2), inputs={"init": INIT})
    assert res.stats.cores[1].sram_peak_bytes == 8 * (3 + 1 + 8)


def test_the_mpi_backend_writes_the_values_too() -> None:
    """The MPI backend's interpreter (one rank, in this process) stores what the simulator
    does."""
    from runtime.mpi.launch import mpi_available

    if mpi_available() is not None:
        pytest.skip("the mpi extra is not installed")
    from runtime.mpi import run_mpi

    r = run_mpi(_programs(), mesh_chip(1, 2), {"init": INIT}, timeout=30)
    assert r.tensors["out"].tolist() == [3, 8, 7, 9]
