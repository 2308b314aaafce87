"""``WaitAny``: the choice of whichever channel's next message arrived first, made by the
simulator in simulated time (STeP arXiv 2511.07776 §3.2.3 EagerMerge, §5.3: "Every data- or
timing-dependent choice of a STeP operator ... is made by the simulator as the run
proceeds").  On a 2x2 mesh cores 1 and 2 (both one hop from core 3) send a value after
``r1`` / ``r2`` local matmuls; core 3 waits for either, forwards the chosen index to core 0 at
once, then receives both values in the chosen order.  The arrivals are measured alone (one
sender, a plain receive), the forwarding latency too, so the decision's index and cycle are
known in closed form: index of the earlier arrival (ties: the lower index), at that cycle."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_testkit import mesh_chip

from lowering.isa import (
    Alloc,
    Channel,
    Compute,
    Cond,
    If,
    Instr,
    Load,
    Loop,
    Program,
    ProgramSet,
    RecvValue,
    Region,
    SendValue,
    Store,
    TensorDecl,
    WaitAny,
    WriteValue,
)
from lowering.printer import format_instr
from lowering.reference import run_reference
from lowering.validate import program_problems
from runtime import simulate
from runtime.errors import DeadlockError

CHIP = mesh_chip(2, 2)
INIT = np.zeros(1, dtype=np.int32)


def _sender(core: int, chan: str, value: int, rounds: int) -> Program:
    body: tuple[Instr, ...] = (
        Alloc("m", (64, 64)),
        Compute("zeros", ("m",), (), (("shape", "64x64"),)),
    )
    if rounds:
        body += (Loop(rounds, (Compute("matmul", ("m",), ("m", "m")),)),)
    return Program(core, (*body, SendValue(chan, value)))


def _receiver() -> Program:
    both = (RecvValue("a", "x"), RecvValue("b", "y"))
    return Program(
        3,
        (
            WaitAny(("a", "b"), "k"),
            SendValue("o", "k"),
            If(Cond("k", "==", 0), both, both[::-1]),
        ),
    )


def _recorder() -> Program:
    """Core 0 stores the index it receives."""
    return Program(
        0,
        (
            RecvValue("o", "k"),
            Alloc("r", (1,), "int32"),
            Load("r", "init", Region((0,), (1,))),
            WriteValue("r", 0, "k"),
            Store("r", "out", Region((0,), (1,))),
        ),
    )


def _race(r1: int, r2: int) -> ProgramSet:
    return ProgramSet(
        (_recorder(), _sender(1, "a", 11, r1), _sender(2, "b", 22, r2), _receiver()),
        (Channel("a", 1, (3,)), Channel("b", 2, (3,)), Channel("o", 3, (0,))),
        (TensorDecl("init", (1,), "int32"), TensorDecl("out", (1,), "int32")),
    )


def _arrival(core: int, chan: str, rounds: int) -> int:
    """The cycle the value of ``chan`` reaches core 3 when it is the only message."""
    ps = ProgramSet(
        (_sender(core, chan, 1, rounds), Program(3, (RecvValue(chan, "v"),))),
        (Channel(chan, core, (3,)),),
    )
    return simulate(ps, CHIP, mode="functional").stats.cores[3].finish


def _latency() -> int:
    """Cycles from core 3's SendValue at cycle 0 to the end of core 0's recording."""
    ps = ProgramSet(
        (Program(3, (SendValue("o", 0),)), _recorder()),
        (Channel("o", 3, (0,)),),
        (TensorDecl("init", (1,), "int32"), TensorDecl("out", (1,), "int32")),
    )
    return simulate(ps, CHIP, mode="functional", inputs={"init": INIT}).stats.cores[0].finish


@pytest.mark.parametrize(("r1", "r2"), [(6, 2), (2, 6), (3, 3), (0, 4)])
def test_the_first_arrival_is_chosen_at_its_cycle(r1: int, r2: int) -> None:
    ta, tb = _arrival(1, "a", r1), _arrival(2, "b", r2)
    want = 0 if ta <= tb else 1
    res = simulate(_race(r1, r2), CHIP, mode="functional", inputs={"init": INIT})
    assert res.tensors["out"].tolist() == [want]
    # core 0 gets the index a forwarding latency after the decision, at the earlier arrival
    decided = res.stats.cores[0].finish - _latency()
    assert decided == min(ta, tb)
    # then both values are received (a tie: the forwarding SendValue's cycle comes first)
    assert res.stats.cores[3].finish == max(ta, tb, decided + 1)
    if r1 == r2:  # symmetric senders: a tie, broken by the lower index
        assert ta == tb and want == 0


def test_the_decision_follows_timing_alone() -> None:
    """The same programs decide differently when only the senders' speed differs."""
    out = [
        simulate(_race(r1, r2), CHIP, mode="functional", inputs={"init": INIT}).tensors["out"][0]
        for r1, r2 in ((1, 5), (5, 1))
    ]
    assert out == [0, 1]


def test_timing_mode_decides_as_functional_mode() -> None:
    fun = simulate(_race(2, 6), CHIP, mode="functional", inputs={"init": INIT})
    tim = simulate(_race(2, 6), CHIP, inputs={"init": INIT})
    assert [c.finish for c in tim.stats.cores] == [c.finish for c in fun.stats.cores]


def test_reference_replay_and_validator_accept_it() -> None:
    """The untimed interpreters take a channel holding a message (their schedule's order):
    the reference stores an index of a message it then receives, the replay runs to the end,
    the validator finds no problem, and the printer names the channels."""
    ps = _race(6, 2)
    assert not program_problems(ps, CHIP)[0]
    assert run_reference(ps, {"init": INIT})["out"].tolist()[0] in (0, 1)
    from runtime.engine import Simulator

    bare = ProgramSet((Program(0, (RecvValue("o", "k"),)), *ps.programs[1:]), ps.channels)
    sim = Simulator(bare, CHIP, mode="timing")
    rp = sim.replay()
    rp.resume()
    rp.close()
    assert format_instr(WaitAny(("a", "b"), "k")) == "wait_any k <- first of a, b"


def test_a_wait_with_nothing_sent_is_a_deadlock() -> None:
    ps = ProgramSet(
        (Program(3, (WaitAny(("a",), "k"), RecvValue("a", "x"))), Program(1, ())),
        (Channel("a", 1, (3,)),),
    )
    with pytest.raises(DeadlockError, match="any of channels"):
        simulate(ps, CHIP)


def test_the_mpi_backend_chooses_a_channel_holding_a_message() -> None:
    """The MPI backend's interpreter (one rank, in this process) takes a channel whose message
    came (wall-clock order) and receives both values after it."""
    from runtime.mpi.launch import mpi_available

    if mpi_available() is not None:
        pytest.skip("the mpi extra is not installed")
    from runtime.mpi import run_mpi

    r = run_mpi(_race(6, 2), CHIP, {"init": INIT}, timeout=30)
    assert r.tensors["out"].tolist()[0] in (0, 1)
