"""The least of several registers picked in one instruction (:class:`~lowering.isa.ArgMin`).

Decode attention's lanes give each (request, KV head) item to the lane with the fewest KV rows
so far (greedy list scheduling; STeP arXiv 2511.07776 §5.4 balances its parallel regions by the
data).  Written with ``If`` alone that decision is a chain per item: ``lanes - 1`` compares on
``<`` to find the least load, then ``lanes`` compares on ``==`` to grow the chosen one.
``ArgMin(reg, regs, add)`` is the whole chain: ``reg`` gets the index of the least register
of ``regs`` (ties to the lowest index, as ``numpy.argmin``), and with ``add`` that register
grows by ``add`` (evaluated with the registers as they were before the instruction).

Timing: a register operation, zero cycles, like ``Set``, ``Calc`` and ``If`` (:mod:`runtime.ops`:
"every other instruction issues in zero cycles"); it reads and writes registers only, so it
waits on no buffer.  The ``If`` chain it replaces took no cycle either, so a program using it
runs the same cycles as the chain; the simulator executes one operation per decision instead
of ``2 * lanes + 1`` or so.

:data:`COMPILERS` maps the instruction class to its compile step; :mod:`runtime.program`
registers it, and the untimed replay (:mod:`runtime.replay_rules`) runs :func:`h_argmin`
itself (it touches registers only).
"""

from __future__ import annotations

from typing import Any

from lowering.isa import ArgMin
from runtime import ops
from runtime.state import Core

__all__ = ["OpArgMin", "h_argmin", "argmin", "COMPILERS"]


def argmin(values: list[int] | tuple[int, ...]) -> int:
    """The index of the least of ``values``, ties to the lowest index."""
    best, low = 0, values[0]
    for k in range(1, len(values)):
        v = values[k]
        if v < low:
            best, low = k, v
    return best


class OpArgMin(ops.Op):
    """``regs``: the register names; ``add``: the compiled growth (``None``: none)."""

    __slots__ = ("reg", "regs", "add")


def h_argmin(sim: Any, core: Core, op: OpArgMin) -> bool:
    regs = core.regs
    names = op.regs
    best = 0
    low = regs[names[0]]
    for k in range(1, len(names)):
        v = regs[names[k]]
        if v < low:
            best, low = k, v
    add = op.add
    if add is not None:
        grow = ops.ev(regs, add)
        regs[names[best]] = low + grow
    regs[op.reg] = best
    core.pc += 1
    return True


def _compile_argmin(comp: Any, ins: ArgMin) -> None:
    if not ins.regs:
        raise comp.fail(ins, "argmin names no register; give it at least one")
    add = None if ins.add is None else ops.expr(ins.add)
    comp.code.append(ops.make(OpArgMin, h_argmin, ins, reg=ins.reg, regs=tuple(ins.regs), add=add))


#: Instruction class -> compile step (registered by :mod:`runtime.program`).
COMPILERS = {ArgMin: _compile_argmin}
