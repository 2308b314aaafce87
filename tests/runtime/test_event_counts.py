"""What the simulator counts as events, and resuming a deadlocked run with deeper FIFOs."""

from __future__ import annotations

import pytest
from runtime_testkit import a2a_chip, hbm, mesh_chip

from lowering.isa import (
    Affine,
    Alloc,
    Channel,
    Load,
    Loop,
    Program,
    ProgramSet,
    Recv,
    Region,
    Send,
    Set,
    TensorDecl,
)
from runtime import DeadlockError, Simulator


def _stream(cores: int, tiles: int, te: int) -> ProgramSet:
    progs = tuple(
        Program(
            c,
            (
                Alloc("t", (te,)),
                Loop(
                    tiles,
                    (Load("t", "w", Region((Affine(c * te, (("i", cores * te),)),), (te,))),),
                    var="i",
                ),
            ),
        )
        for c in range(cores)
    )
    return ProgramSet(progs, tensors=(TensorDecl("w", (cores * tiles * te,)),))


@pytest.mark.parametrize("attached", [False, True])
def test_closed_form_hbm_grants_are_not_events(attached: bool) -> None:
    """Every transfer a resource served is either a grant the engine computed (an event) or a
    per-channel HBM grant served in closed form with its channel class (not an event)."""
    chip = (
        mesh_chip(2, 2, mem=hbm(channels=4, attach=(0, 1, 2, 3)))
        if attached
        else a2a_chip(4, mem=hbm(channels=4))
    )
    res = Simulator(_stream(4, 6, 128), chip).run()
    e, s = res.stats.events, res.stats
    served = sum(r.transfers for r in s.links + s.ports + s.hbm_channels)
    assert e.reservations + e.closed_form_grants == served
    assert e.events == e.stepped + e.reservations + e.deliveries
    if attached:  # each channel's part travels its own route: no closed form
        assert e.closed_form_grants == 0
    else:  # a 256-byte load covers all four 64-byte-interleaved channels: one class grant
        assert e.closed_form_grants == 3 * 4 * 6
        assert e.deliveries == 4 * 6  # one HBM completion per load


def test_a_deadlocked_run_resumes_after_deepening() -> None:
    """Depth-1 FIFOs deadlock two cores that both send twice before receiving; the wait-for
    graph names the full FIFOs, and deepening them lets the stuck run finish."""

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
    sim = Simulator(ProgramSet((prog(0, "ab", "ba"), prog(1, "ba", "ab")), chans), mesh_chip(1, 2))
    with pytest.raises(DeadlockError):
        sim.run()
    assert sim.waits() == {0: (1, "ab"), 1: (0, "ba")}
    assert sim.channel_depth("ab") == 1
    for name in ("ab", "ba"):
        sim.deepen(name, 2)
    sim.resume()
    assert sim.channel_depth("ab") == 2
    assert all(c.done for c in sim.comp.active)


@pytest.mark.parametrize("attached", [False, True])
def test_a_load_without_a_plan_times_as_one_with_a_plan(attached: bool) -> None:
    """A Load whose extent is a register takes the general path of the request (no plan,
    :mod:`runtime.mem_plan`); with the register equal to the constant extent of a planned Load
    it is the same request, so cycles, statistics and the trace are the same."""
    cores, tiles, te = 4, 6, 128
    chip = (
        mesh_chip(2, 2, mem=hbm(channels=4, attach=(0, 1, 2, 3)))
        if attached
        else a2a_chip(4, mem=hbm(channels=4))
    )
    planned = _stream(cores, tiles, te)
    progs = tuple(
        Program(
            c,
            (
                Alloc("t", (te,)),
                Set("n", te),
                Loop(
                    tiles,
                    (Load("t", "w", Region((Affine(c * te, (("i", cores * te),)),), ("n",))),),
                    var="i",
                ),
            ),
        )
        for c in range(cores)
    )
    general = ProgramSet(progs, tensors=planned.tensors)
    a = Simulator(planned, chip).run(trace=True)
    b = Simulator(general, chip).run(trace=True)
    assert b.cycles == a.cycles > tiles * te * 2 // (4 * 32)
    assert b.stats.hbm_channels == a.stats.hbm_channels
    assert b.stats.events.reservations == a.stats.events.reservations
    assert b.trace_json() == a.trace_json()
