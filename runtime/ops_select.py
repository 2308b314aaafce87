"""A choice among channels made in simulated time (:class:`~lowering.isa.WaitAny`).

An EagerMerge forwards "whichever input is ready" (STeP arXiv 2511.07776 §3.2.3); §5.3: every
timing-dependent choice of an operator "is made by the simulator as the run proceeds".
``WaitAny(channels, reg)`` is that choice on a core: of the channels' next messages (on each,
the first message no earlier receive of this core takes), the one that arrived first, ties by
the lowest index; ``reg`` gets its index and the core's clock moves to that arrival (if
later).  The message stays in its FIFO for the receive that follows.

Rule in the event simulator: the choice is made at the first cycle ``t >= core.t`` at which
some next message has arrived, among the messages arrived by ``t``.  Resource events of a cycle
run before the cores of that cycle (:mod:`runtime.engine`), and a message sent at ``t`` arrives
after ``t``, so every message arriving by ``t`` is known when the core looks: the choice is
the same whatever order the cores of a cycle run in.  While a next message is on its way the
core looks again every cycle (its arrival cycle is known only once its last hop is reserved);
while none is sent it blocks, and the ``Send`` of one wakes it (``ChanEnd.watch``).

A caller may record the choices: ``Simulator.watch[watch_key(reg)] = []`` gets the index each
``WaitAny`` writing register ``reg`` chose, in order (the decisions a run made in simulated
time, :mod:`torch2step.spatial.dynamic`).
"""

from __future__ import annotations

from typing import Any

from lowering.isa import WaitAny
from runtime import ops
from runtime.scoreboard import advance
from runtime.state import RECV, Core

__all__ = ["OpWaitAny", "h_waitany", "watch_key", "COMPILERS"]


def watch_key(reg: str) -> str:
    """The ``Simulator.watch`` entry recording the choices of the ``WaitAny`` into ``reg``."""
    return f"wait_any:{reg}"


class OpWaitAny(ops.Op):
    """``ends``: this core's end of each channel, in the instruction's order."""

    __slots__ = ("ends", "reg", "key")


def h_waitany(sim: Any, core: Core, op: OpWaitAny) -> bool:
    ends = op.ends
    if core.blocked is None:  # woken by a Send (or first run): no end keeps a stale watch
        for end in ends:
            end.watch = None
    if core.t > sim.now:
        sim.schedule(core, core.t)
        return False
    now = sim.now
    best = -1
    first = 0
    coming = False
    for k, end in enumerate(ends):
        q = end.unmatched
        if q:
            a = q[0].arrival
            if a is None or a > now:
                coming = True
            elif best < 0 or a < first:
                best, first = k, a
    if best >= 0:
        advance(sim, core, first, RECV)
        core.regs[op.reg] = best
        w = sim.watch
        if w is not None:
            log = w.get(op.key)
            if log is not None:
                log.append(best)
        core.pc += 1
        return True
    if coming:  # a message is on its way: look again next cycle
        advance(sim, core, now, RECV)
        sim.schedule(core, now + 1)
        return False
    for end in ends:
        end.watch = core
    core.blocked = ("any", ends)
    return False


def _compile_waitany(comp: Any, ins: WaitAny) -> None:
    if not ins.channels:
        raise comp.fail(ins, "wait_any names no channel; give it at least one")
    ends = []
    for name in ins.channels:
        ch = comp.chans.get(name)
        k = None if ch is None else comp.position(ch)
        if k is None:
            comp.chan(ins, name, False)  # raises: not declared or not delivered here
        ends.append(ch.ends[k])
    comp.code.append(
        ops.make(OpWaitAny, h_waitany, ins, ends=tuple(ends), reg=ins.reg, key=watch_key(ins.reg))
    )


#: Instruction class -> compile step (registered by :mod:`runtime.program`).
COMPILERS = {WaitAny: _compile_waitany}
