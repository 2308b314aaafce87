"""Programs shared by the MPI backend tests: the deadlocking programs of the simulator's tests
(tests/runtime/test_deadlock_errors.py) and one that fails on a non-root rank."""

from __future__ import annotations

import numpy as np

import hwmodel
from hwmodel.chip import Chip
from lowering.isa import (
    Alloc,
    Barrier,
    Channel,
    Load,
    LoadValue,
    Program,
    ProgramSet,
    Recv,
    RecvValue,
    Send,
    SendValue,
    TensorDecl,
)


def line_chip(n: int) -> Chip:
    """A 1 x n mesh (the simulator tests' ``mesh_chip(1, n)``)."""
    return hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), 1, n)


def receive_cycle() -> ProgramSet:
    """Each core forwards what it receives, so each waits for the other's message."""
    progs = (
        Program(0, (Alloc("x", (8,)), Recv("to0", "x"), Send("to1", "x"))),
        Program(1, (Alloc("y", (8,)), Recv("to1", "y"), Send("to0", "y"))),
    )
    return ProgramSet(progs, (Channel("to1", 0, (1,)), Channel("to0", 1, (0,))), name="ring")


def full_fifos() -> ProgramSet:
    """Depth-1 FIFOs: both cores send twice before receiving."""

    def prog(core: int, out: str, inp: str) -> Program:
        body = (Alloc("m", (8,)), Alloc("r", (8,)), Send(out, "m"), Send(out, "m"))
        return Program(core, (*body, Recv(inp, "r"), Recv(inp, "r")))

    chans = (Channel("ab", 0, (1,), depth=1), Channel("ba", 1, (0,), depth=1))
    return ProgramSet((prog(0, "ab", "ba"), prog(1, "ba", "ab")), chans, name="fifos")


def value_and_barrier() -> ProgramSet:
    """A control-value cycle and a barrier member that never arrives."""
    progs = (
        Program(0, (RecvValue("v", "r"), SendValue("v2", 1))),
        Program(1, (Barrier("g"),)),
        Program(2, (RecvValue("v2", "r"),)),
    )
    chans = (Channel("v", 2, (0,)), Channel("v2", 0, (2,)))
    return ProgramSet(progs, chans, barriers=(("g", (1, 2)),), name="value_barrier")


DEADLOCKS = {
    "receive_cycle": (receive_cycle, 2),
    "full_fifos": (full_fifos, 2),
    "value_and_barrier": (value_and_barrier, 3),
}


def fails_on_last_core(n: int = 4) -> tuple[ProgramSet, dict[str, np.ndarray]]:
    """Core ``n - 1`` loads a 4x4 tile into an 8-element buffer; the others just finish."""
    body = (Alloc("m", (8,)), Load("m", "T"))
    progs = tuple(Program(c, body if c == n - 1 else ()) for c in range(n))
    ps = ProgramSet(progs, tensors=(TensorDecl("T", (4, 4), "fp32"),), name="too_small")
    return ps, {"T": np.zeros((4, 4), np.float32)}


def hbm_ordering() -> tuple[ProgramSet, dict[str, np.ndarray]]:
    """Stores ordered by a message: core 0 accumulates ``X`` into ``Y`` and copies ``J`` to the
    integer tensor ``I``, then sends a token; core 1 reads ``I[1]`` (a loop count), reads ``Y``
    back, doubles it and accumulates it into ``Y`` that many times."""
    from lowering.isa import Compute, Loop, Store

    core0 = (
        Alloc("x", (4, 4), "fp32"),
        Load("x", "X"),
        Store("x", "Y", accumulate=True),
        Alloc("j", (2,), "int32"),
        Load("j", "J"),
        Store("j", "I"),
        SendValue("tok", 1),
    )
    core1 = (
        RecvValue("tok", "t"),
        LoadValue("n", "I", (1,)),
        Alloc("y", (4, 4), "fp32"),
        Load("y", "Y"),
        Compute("add", ("y",), ("y", "y"), dtype="fp32"),
        Loop("n", (Store("y", "Y", accumulate=True),)),
    )
    tensors = (
        TensorDecl("X", (4, 4), "fp32"),
        TensorDecl("Y", (4, 4), "fp32"),
        TensorDecl("J", (2,), "int32"),
        TensorDecl("I", (2,), "int32"),
    )
    ps = ProgramSet(
        (Program(0, core0), Program(1, core1)),
        (Channel("tok", 0, (1,)),),
        tensors,
        name="hbm_ordering",
    )
    rng = np.random.default_rng(5)
    inputs = {
        "X": rng.standard_normal((4, 4)).astype(np.float32),
        "Y": rng.standard_normal((4, 4)).astype(np.float32),
        "J": np.array([7, 3], np.int32),
    }
    return ps, inputs
