"""Deadlocks are reported (never a hang) and bad programs fail with messages that say what to do."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_testkit import mesh_chip

from lowering.isa import (
    Alloc,
    Barrier,
    Channel,
    Compute,
    Load,
    LoadValue,
    Program,
    ProgramSet,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Store,
    TensorDecl,
)
from runtime import DeadlockError, SimulationError, simulate


def test_receive_cycle_deadlocks():
    # Each core forwards what it receives, so each waits for the other's message.
    progs = (
        Program(0, (Alloc("x", (8,)), Recv("to0", "x"), Send("to1", "x"))),
        Program(1, (Alloc("y", (8,)), Recv("to1", "y"), Send("to0", "y"))),
    )
    ps = ProgramSet(progs, (Channel("to1", 0, (1,)), Channel("to0", 1, (0,))), name="ring")
    with pytest.raises(DeadlockError) as err:
        simulate(ps, mesh_chip(1, 2))
    msg = str(err.value)
    assert "2 core(s) are blocked" in msg
    assert (
        "core 0 (r0c0) at `send to1 <- x` waits for buffer 'x' from a receive on channel 'to0'"
        in msg
    )
    assert (
        "core 1 (r0c1) at `send to0 <- y` waits for buffer 'y' from a receive on channel 'to1'"
        in msg
    )


def test_full_fifos_deadlock():
    # Depth-1 FIFOs: both cores send twice before receiving; the second sends never find space.
    def prog(core: int, out: str, inp: str) -> Program:
        return Program(
            core,
            (
                Alloc("m", (8,)),
                Alloc("r", (8,)),
                Send(out, "m"),
                Send(out, "m"),
                Recv(inp, "r"),
                Recv(inp, "r"),
            ),
        )

    chans = (Channel("ab", 0, (1,), depth=1), Channel("ba", 1, (0,), depth=1))
    ps = ProgramSet((prog(0, "ab", "ba"), prog(1, "ba", "ab")), chans)
    with pytest.raises(DeadlockError) as err:
        simulate(ps, mesh_chip(1, 2))
    msg = str(err.value)
    assert (
        "core 0 (r0c0) at `send ab <- m` waits for space in the FIFO of channel 'ab' to core 1"
        in msg
    )
    assert (
        "core 1 (r0c1) at `send ba <- m` waits for space in the FIFO of channel 'ba' to core 0"
        in msg
    )
    # with depth 2 the same programs run
    ps2 = ProgramSet(
        ps.programs, (Channel("ab", 0, (1,), depth=2), Channel("ba", 1, (0,), depth=2))
    )
    assert simulate(ps2, mesh_chip(1, 2)).cycles > 0


def test_control_value_and_barrier_deadlock():
    progs = (
        Program(0, (RecvValue("v", "r"), SendValue("v2", 1))),
        Program(1, (Barrier("g"),)),
        Program(2, (RecvValue("v2", "r"),)),
    )
    ps = ProgramSet(
        progs, (Channel("v", 2, (0,)), Channel("v2", 0, (2,))), barriers=(("g", (1, 2)),)
    )
    with pytest.raises(DeadlockError) as err:
        simulate(ps, mesh_chip(1, 3))
    msg = str(err.value)
    assert (
        "core 0 (r0c0) at `recv_value r <- v` waits for a control value from a receive on channel 'v'"
        in msg
    )
    assert "core 1 (r0c1) at `barrier g` waits at barrier 'g' for cores [2]" in msg
    assert "core 2" in msg


def test_messages_never_received_are_an_error():
    ps = ProgramSet(
        (Program(0, (Alloc("m", (8,)), Send("c", "m"))), Program(1, ())),
        (Channel("c", 0, (1,)),),
    )
    with pytest.raises(SimulationError, match="1 message.* never received by core 1"):
        simulate(ps, mesh_chip(1, 2))


@pytest.mark.parametrize(
    "body,match",
    [
        ((Send("c", "m"),), "channel 'c' is sent by core 1, not core 0"),
        ((Recv("nope", "m"),), "channel 'nope' is not declared"),
        ((Alloc("m", (8,)), Load("m", "T")), "tensor 'T' is not declared"),
        ((Compute("fft", ("m",), ()),), "unknown kernel 'fft'"),
        ((Barrier("g"),), "barrier group 'g' is not declared"),
    ],
)
def test_invalid_programs_are_rejected_before_running(body, match):
    ps = ProgramSet((Program(0, body), Program(1, ())), (Channel("c", 1, (0,)),))
    with pytest.raises(SimulationError, match=match):
        simulate(ps, mesh_chip(1, 2))


def test_run_time_errors_name_core_and_instruction():
    x = TensorDecl("x", (4, 4))
    cases = [
        ((Alloc("b", (4,)), Load("b", "x")), "do not fit buffer 'b'"),
        ((Alloc("b", (4, 4), "fp32"), Load("b", "x")), "allocate the buffer as bf16"),
        ((Load("b", "x"),), "used before Alloc"),
        ((Alloc("b", (1 << 20,)),), r"SRAM overflow: buffer 'b' \(2097152 bytes\)"),
        (
            (Alloc("b", (2, 2)), Load("b", "x", Region(("r", 0), (2, 2)))),
            "register 'r' is read before it is set",
        ),
        (
            (Alloc("b", (4, 4)), Load("b", "x"), Store("b", "x", Region((0, 0), (2, 2)))),
            "store a matching region",
        ),
    ]
    for body, match in cases:
        ps = ProgramSet((Program(0, body),), tensors=(x,))
        with pytest.raises(SimulationError, match=match) as err:
            simulate(ps, mesh_chip(1, 1))
        assert str(err.value).startswith("core 0 at cycle")


def test_missing_inputs_are_named():
    ps = ProgramSet(
        (Program(0, (Alloc("b", (4,)), Load("b", "x"), LoadValue("n", "lens", (0,)))),),
        tensors=(TensorDecl("x", (4,)), TensorDecl("lens", (2,), "int32")),
    )
    with pytest.raises(
        SimulationError, match=r"missing inputs for tensors the programs read: \['lens', 'x'\]"
    ):
        simulate(ps, mesh_chip(1, 1), mode="functional")
    with pytest.raises(
        SimulationError, match=r"missing inputs for integer tensors read by LoadValue: \['lens'\]"
    ):
        simulate(ps, mesh_chip(1, 1))
    with pytest.raises(SimulationError, match="not declared tensors"):
        simulate(ps, mesh_chip(1, 1), inputs={"y": np.zeros(3), "lens": np.zeros(2)})
    assert simulate(ps, mesh_chip(1, 1), inputs={"lens": np.array([3, 4])}).cycles > 0


def test_max_cycles_stops_a_long_run():
    ps = ProgramSet((Program(0, (Alloc("a", (64, 64)), Compute("matmul", ("a",), ("a", "a")))),))
    with pytest.raises(SimulationError, match="max_cycles=10"):
        simulate(ps, mesh_chip(1, 1), max_cycles=10)
