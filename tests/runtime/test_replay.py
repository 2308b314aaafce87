"""The untimed replay (runtime.replay) deadlocks where the timed simulation does: the same
wait-for graph, the same channels to deepen, and the timed run after it is unaffected."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_testkit import mesh_chip

from lowering.isa import (
    Alloc,
    Barrier,
    Channel,
    Compute,
    Cond,
    If,
    Loop,
    Program,
    ProgramSet,
    ReadValue,
    Recv,
    RecvValue,
    Send,
    SendValue,
    WaitAny,
    WriteValue,
)
from runtime import DeadlockError, Simulator
from runtime.ops_select import watch_key
from runtime.replay import ReplayUnsupported


def _pair(depth: int, sends: int) -> ProgramSet:
    """Two cores that each send ``sends`` messages before receiving the other's."""

    def prog(core: int, out: str, inp: str) -> Program:
        return Program(
            core,
            (
                Alloc("m", (8,)),
                Alloc("r", (8,)),
                Loop(sends, (Send(out, "m"),)),
                Loop(sends, (Recv(inp, "r"), Compute("copy", ("r",), ("r",)))),
            ),
        )

    chans = (Channel("ab", 0, (1,), depth=depth), Channel("ba", 1, (0,), depth=depth))
    return ProgramSet((prog(0, "ab", "ba"), prog(1, "ba", "ab")), chans)


@pytest.mark.parametrize("sends", [2, 5])
def test_replay_deadlocks_where_the_timed_run_does(sends: int) -> None:
    """Depth-1 FIFOs: both the replay and the timed run stop with each core waiting for FIFO
    space at the other; deepening both channels lets either finish."""
    chip = mesh_chip(1, 2)
    timed = Simulator(_pair(1, sends), chip)
    replay = timed.replay()
    with pytest.raises(DeadlockError, match="untimed replay"):
        replay.run()
    with pytest.raises(DeadlockError):
        timed.run()
    assert replay.waits() == timed.waits() == {0: (1, "ab"), 1: (0, "ba")}
    for sim in (replay, timed):
        for name in ("ab", "ba"):
            sim.deepen(name, sends)
        sim.resume()
        assert all(c.done for c in sim.comp.active)
        assert sim.channel_depth("ab") == sends


def test_replay_leaves_the_timed_run_alone() -> None:
    """The replay borrows the simulator's compiled programs and gives them back as compiled:
    deepening before ``run`` applies to the run, and the result equals that of programs
    declared with the deeper FIFOs."""
    chip = mesh_chip(1, 2)
    sim = Simulator(_pair(1, 3), chip)
    replay = sim.replay()
    with pytest.raises(DeadlockError):
        replay.run()
    for name in ("ab", "ba"):
        replay.deepen(name, 3)
    replay.resume()
    replay.close()
    for name in ("ab", "ba"):
        sim.deepen(name, 3)
    got = sim.run()
    want = Simulator(_pair(3, 3), chip).run()
    assert got.cycles == want.cycles > 0
    assert got.stats.to_dict() == want.stats.to_dict()


def test_replay_follows_control_values_and_barriers() -> None:
    """A count sent as a control value steers the receiver's loop; a barrier holds both cores;
    with a too-shallow FIFO the sender waits on the receiver in both models."""

    def ps(depth: int) -> ProgramSet:
        sender = Program(
            0,
            (
                Alloc("m", (4,)),
                SendValue("n", 3),
                Loop(3, (Send("d", "m"),)),
                Barrier("all"),
            ),
        )
        receiver = Program(
            1,
            (
                Alloc("r", (4,)),
                RecvValue("n", "k"),
                Barrier("all"),
                Loop("k", (Recv("d", "r"), Compute("copy", ("r",), ("r",)))),
            ),
        )
        chans = (Channel("n", 0, (1,)), Channel("d", 0, (1,), depth=depth))
        return ProgramSet((sender, receiver), chans, barriers=(("all", (0, 1)),))

    chip = mesh_chip(1, 2)
    for depth, stuck in ((2, True), (3, False)):
        sim = Simulator(ps(depth), chip)
        replay = sim.replay()
        if stuck:
            with pytest.raises(DeadlockError):
                replay.run()
            with pytest.raises(DeadlockError):
                sim.run()
            assert replay.waits() == sim.waits() == {0: (1, "d"), 1: (None, None)}
        else:
            replay.run()
            assert sim.run().cycles > 0


def test_replay_writes_control_values_into_computed_buffers() -> None:
    """A count written (WriteValue) into an integer buffer a kernel has just written, sent as
    data and read on the other core (a decode request's cursor, STeP §5.1): the replay keeps
    the buffer's shape through the kernel, so it steers the receiver's loop as the timed run
    does, and both stop on the same full FIFO until it is deepened."""

    def ps(depth: int) -> ProgramSet:
        sender = Program(
            0,
            (
                Alloc("c", (3,), "int64"),
                Alloc("m", (4,)),
                Compute("copy", ("c",), ("c",)),
                WriteValue("c", 1, 3),
                Send("cnt", "c"),
                Loop(3, (Send("d", "m"),)),
                Barrier("all"),
            ),
        )
        receiver = Program(
            1,
            (
                Alloc("r", (3,), "int64"),
                Alloc("x", (4,)),
                Recv("cnt", "r"),
                ReadValue("k", "r", 1),
                Barrier("all"),
                Loop("k", (Recv("d", "x"), Compute("copy", ("x",), ("x",)))),
            ),
        )
        chans = (Channel("cnt", 0, (1,)), Channel("d", 0, (1,), depth=depth))
        return ProgramSet((sender, receiver), chans, barriers=(("all", (0, 1)),))

    chip = mesh_chip(1, 2)
    sim = Simulator(ps(2), chip)
    replay = sim.replay()
    with pytest.raises(DeadlockError):
        replay.run()
    with pytest.raises(DeadlockError):
        sim.run()
    assert replay.waits() == sim.waits() == {0: (1, "d"), 1: (None, None)}
    assert replay.comp.cores[1].regs["k"] == sim.comp.cores[1].regs["k"] == 3
    for run in (replay, sim):
        run.deepen("d", 3)
        run.resume()
        assert all(c.done for c in run.comp.active)


def test_functional_mode_has_no_replay() -> None:
    sim = Simulator(_pair(2, 2), mesh_chip(1, 2), mode="functional", inputs={})
    with pytest.raises(ReplayUnsupported):
        sim.replay()
    assert np.isfinite(sim.run().cycles)


def _merge_or_wait() -> ProgramSet:
    """Core 3 merges channels ``a`` (core 1 sends at once) and ``b`` (core 2 sends only after
    core 3's value on ``c``, which core 3 sends after the first input it takes): taking ``a``
    first completes, waiting for ``b`` first is a deadlock of cores 2 and 3."""
    a_first = (RecvValue("a", "x"), SendValue("c", 0), RecvValue("b", "y"))
    b_first = (RecvValue("b", "y"), SendValue("c", 0), RecvValue("a", "x"))
    return ProgramSet(
        (
            Program(1, (SendValue("a", 11),)),
            Program(2, (RecvValue("c", "z"), SendValue("b", 22))),
            Program(3, (WaitAny(("a", "b"), "k"), If(Cond("k", "==", 0), a_first, b_first))),
        ),
        (Channel("a", 1, (3,)), Channel("b", 2, (3,)), Channel("c", 3, (2,))),
    )


def test_replay_follows_a_recorded_wait_any_order() -> None:
    """A ``WaitAny`` in the replay takes the lowest ready input, or, given an order to follow
    (a timed run's recorded choices), the input recorded next, waiting for that input alone:
    the wait-for graph then names its producer, so a deadlock of that order is found."""
    chip = mesh_chip(2, 2)
    timed = Simulator(_merge_or_wait(), chip)
    timed.watch = {watch_key("k"): []}
    timed.run()
    assert timed.watch[watch_key("k")] == [0]
    replay = Simulator(_merge_or_wait(), chip).replay()
    replay.run()
    assert replay.chosen == {"k": [0]}
    replay.close()
    replay = Simulator(_merge_or_wait(), chip).replay()
    replay.order = {"k": [1]}
    with pytest.raises(DeadlockError, match="untimed replay"):
        replay.run()
    assert replay.chosen == {"k": []}
    assert replay.waits() == {2: (3, None), 3: (2, None)}
    replay.close()


def test_replay_follows_only_the_shapes_a_write_reads() -> None:
    """runtime.replay_rules.shape_readers: a kernel writing a buffer that reaches a WriteValue
    (here on another core, through a Send and a Recv) keeps its shape rule in the replay; the
    kernels whose outputs nothing writes into skip it, and the replay reads the same value."""
    sender = Program(
        0,
        (
            Alloc("c", (3,), "int64"),
            Alloc("m", (4,)),
            Compute("copy", ("c",), ("c",)),
            Compute("copy", ("m",), ("m",)),
            Send("cnt", "c"),
            Send("d", "m"),
        ),
    )
    receiver = Program(
        1,
        (
            Alloc("r", (3,), "int64"),
            Alloc("x", (4,)),
            Recv("cnt", "r"),
            WriteValue("r", 2, 7),
            ReadValue("k", "r", 2),
            Recv("d", "x"),
            Compute("copy", ("x",), ("x",)),
        ),
    )
    ps = ProgramSet((sender, receiver), (Channel("cnt", 0, (1,)), Channel("d", 0, (1,))))
    sim = Simulator(ps, mesh_chip(1, 2))
    replay = sim.replay()
    rules = {
        core: [
            (rule.__name__, tuple(b.name for b in op.outs))
            for rule, op in steps
            if op.src.__class__ is Compute
        ]
        for core, steps in replay.steps.items()
    }
    assert rules == {
        0: [("_compute", ("c",)), ("_compute_unread", ("m",))],
        1: [("_compute_unread", ("x",))],
    }
    replay.run()
    assert replay.comp.cores[1].regs["k"] == 7
    replay.close()
    sim.run()
    assert sim.comp.cores[1].regs["k"] == 7
