"""Control values computed on a core: integer arithmetic on registers (:class:`~lowering.isa.Calc`)
and an integer element of a buffer read into a register (:class:`~lowering.isa.ReadValue`).

They let a unit program compute the control values it sends from the data it receives (a
selector mask from a token's expert ids: STeP (arXiv 2511.07776) §3.2.3), so the program does
not depend on the values of one run.  ``Calc`` issues in zero cycles (like ``Set``); ``ReadValue``
waits until the buffer's pending write (Load, Recv, Compute) has landed, as an instruction that
reads the buffer does, and then takes no cycle.

:data:`COMPILERS` maps each instruction class to its compile step; :mod:`runtime.program`
registers them.
"""

from __future__ import annotations

from typing import Any

from lowering.isa import CALC_FNS, CALC_OPS, Calc, ReadValue
from runtime import ops
from runtime.scoreboard import ready
from runtime.state import Core

__all__ = ["CALC", "COMPILERS", "OpCalc", "OpReadValue", "h_calc", "h_readvalue"]

#: What each :data:`~lowering.isa.CALC_OPS` operation computes.
CALC = CALC_FNS


class OpCalc(ops.Op):
    __slots__ = ("reg", "f", "lhs", "rhs")


def h_calc(sim: Any, core: Core, op: OpCalc) -> bool:
    regs = core.regs
    regs[op.reg] = op.f(ops.ev(regs, op.lhs), ops.ev(regs, op.rhs))
    core.pc += 1
    return True


class OpReadValue(ops.Op):
    __slots__ = ("reg", "buf", "index")


def h_readvalue(sim: Any, core: Core, op: OpReadValue) -> bool:
    b = op.buf
    if not ready(sim, core, (b,), ()):
        return False
    data = b.data
    if data is None:
        raise sim.error(
            core,
            f"buffer {b.name!r} holds no values to read (in timing mode only integer tensors "
            "that no program stored, and the messages forwarding them, carry values); run in "
            "functional mode or read the value where it is loaded",
        )
    flat = data.reshape(-1)
    if not 0 <= op.index < flat.size:
        raise sim.error(core, f"element {op.index} is outside buffer {b.name!r} of {flat.size}")
    core.regs[op.reg] = int(flat[op.index])
    core.pc += 1
    return True


def _compile_calc(comp: Any, ins: Calc) -> None:
    f = CALC.get(ins.op)
    if f is None:
        raise comp.fail(ins, f"unknown operation {ins.op!r}; use one of {', '.join(CALC_OPS)}")
    comp.code.append(
        ops.make(
            OpCalc, h_calc, ins, reg=ins.reg, f=f, lhs=ops.expr(ins.lhs), rhs=ops.expr(ins.rhs)
        )
    )


def _compile_readvalue(comp: Any, ins: ReadValue) -> None:
    comp.code.append(
        ops.make(OpReadValue, h_readvalue, ins, reg=ins.reg, buf=comp.buf(ins.buf), index=ins.index)
    )


#: Instruction class -> compile step ``(compiler, instruction)`` (see the module docstring).
COMPILERS = {Calc: _compile_calc, ReadValue: _compile_readvalue}
