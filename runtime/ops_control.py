"""Control values computed on a core: integer arithmetic on registers (:class:`~lowering.isa.Calc`),
an integer element of a buffer read into a register (:class:`~lowering.isa.ReadValue`) and a
register written into one (:class:`~lowering.isa.WriteValue`).

They let a unit program compute the control values it sends from the data it receives (a
selector mask from a token's expert ids: STeP (arXiv 2511.07776) §3.2.3), so the program does
not depend on the values of one run.  ``Calc`` issues in zero cycles (like ``Set``); ``ReadValue``
waits until the buffer's pending write (Load, Recv, Compute) has landed, as an instruction that
reads the buffer does, and then takes no cycle; ``WriteValue`` waits until the buffer may be
written (its pending writes and reads, Send or Store, done) and takes no cycle: the buffer's
values (a new array of its current shape, zeros where nothing was written, when it held none,
as a step's output does in timing mode) carry the register's value in both modes.

:data:`COMPILERS` maps each instruction class to its compile step; :mod:`runtime.program`
registers them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lowering.isa import CALC_FNS, CALC_OPS, Calc, ReadValue, WriteValue
from runtime import ops
from runtime.layout import numpy_dtype
from runtime.scoreboard import ready
from runtime.state import Core

__all__ = [
    "CALC",
    "COMPILERS",
    "OpCalc",
    "OpReadValue",
    "OpWriteValue",
    "h_calc",
    "h_readvalue",
    "h_writevalue",
    "write_element",
]

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


class OpWriteValue(ops.Op):
    __slots__ = ("buf", "index", "value")


def write_element(b: Any, index: int, value: int) -> str | None:
    """Write ``value`` into element ``index`` of buffer ``b`` (a copy of its values: a message
    sent from it keeps the values it had); the problem, if the element is outside it."""
    shape = b.shape or b.alloc_shape
    size = math.prod(shape) if shape else 0  # not np.prod: microseconds a call
    if not 0 <= index < size:
        return f"element {index} is outside buffer {b.name!r} of {size}"
    data = b.data
    if data is None or data.size != size:
        data = np.zeros(shape, dtype=numpy_dtype(b.dtype))
    else:
        data = np.array(data).reshape(shape)
    data.reshape(-1)[index] = value
    b.data = data
    return None


def h_writevalue(sim: Any, core: Core, op: OpWriteValue) -> bool:
    b = op.buf
    if not ready(sim, core, (), (b,)):
        return False
    problem = write_element(b, op.index, ops.ev(core.regs, op.value))
    if problem is not None:
        raise sim.error(core, problem)
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


def _compile_writevalue(comp: Any, ins: WriteValue) -> None:
    comp.code.append(
        ops.make(
            OpWriteValue,
            h_writevalue,
            ins,
            buf=comp.buf(ins.buf),
            index=ins.index,
            value=ops.expr(ins.value),
        )
    )


#: Instruction class -> compile step ``(compiler, instruction)`` (see the module docstring).
COMPILERS = {
    Calc: _compile_calc,
    ReadValue: _compile_readvalue,
    WriteValue: _compile_writevalue,
}
