"""What each instruction does on a core's sequencer: one handler per compiled operation.

A handler ``fn(sim, core, op) -> bool`` either completes the operation (moves ``core.pc`` and
``core.t``, returns ``True``: the sequencer goes on with the next one at once) or stops
(``False``): the core yielded to a later cycle, blocked on something whose completion is unknown,
or finished.  A stopped core re-runs the same operation when it resumes, so handlers only change
state once they are sure to complete.

Timing rules (Cyclotron §9.1: each PE interprets its instruction list, SEND/RECV on bounded
channels; STeP §4.2: roofline cycles per kernel):

* In-order issue with a buffer scoreboard (:mod:`runtime.scoreboard`).  ``Load``, ``Store``,
  ``Send`` and ``Recv`` are issued to the core's DMA / network agent and the sequencer moves on;
  an instruction that *reads* a
  buffer waits until the buffer's pending write (Load, Recv, Compute) completes, one that *writes*
  a buffer waits until its pending reads (Send, Store) and writes complete.  Exceptions: a Load may
  be issued behind an earlier Load into the same buffer (HBM completes them in order), so a loop
  of loads streams.  This is what lets programs overlap preloading with compute (ELK
  §2.2).  At most ``dma_queue_depth`` HBM requests per core are outstanding (default 16; Little's law: enough to
  cover the HBM latency); the next one waits for the earliest to complete, so HBM channels
  interleave the requests of many cores instead of serving one core's whole stream first.
* ``Compute`` occupies the core for ``kernel_cycles`` (:mod:`lowering.kernels`); every other
  instruction issues in zero cycles.  ``RecvValue`` and ``LoadValue`` block until the value is
  there (control flow needs it).
* ``Send`` waits for a free slot in every destination FIFO (back-pressure), then the message
  starts on the network at once; the source buffer is read until its tail leaves the core.
* ``Barrier`` first waits for the core's outstanding Loads, Stores and Sends (a fence), then for
  every member of the group; all continue at the cycle the last one arrives.
* At the end of its program a core waits for all its outstanding operations.
* Fast-forward (timing mode): a loop whose body is only Compute runs in closed form when its
  buffers are ready at entry and the body's shapes are a fixed point after one iteration —
  ``cycles(first) + (n - 1) * cycles(second)`` — exactly what stepping would give.

Instructions that touch shared state (HBM, the network, FIFO credits, barriers) run only when the
core's clock equals the simulator's clock, so shared resources see requests in cycle order; purely
local ones (Compute, Set, loops, branches, Recv posting) run ahead without events.  In functional
mode a Load reads and a Store writes HBM when it is issued (in cycle order); a message carries the
source buffer's contents as they were when the Send issued.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from hwmodel.errors import ChipConfigError
from lowering.isa import Affine
from lowering.kernels import Kernel, kernel_cycles
from runtime.errors import SimulationError
from runtime.layout import numpy_dtype
from runtime.scoreboard import advance, fence, fold_r, fold_w, need_alloc, ready
from runtime.state import BUSY, Buf, Core, hold

__all__ = ["Op", "Expr", "expr", "ev", "CMP", "make", "builder"]

#: A compiled integer expression ``(const, ((reg, coef), ...))``.
Expr = tuple

CMP = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "&": lambda a, b: (a & b) != 0,
}


def expr(v: int | str | Affine) -> Expr:
    """The compiled form of an integer operand: a constant, a register name or an
    :class:`~lowering.isa.Affine` expression of registers."""
    if isinstance(v, bool):
        return (int(v), ())
    if isinstance(v, int):
        return (v, ())
    if isinstance(v, str):
        return (0, ((v, 1),))
    if isinstance(v, Affine):
        return (v.const, tuple(v.terms))
    raise SimulationError(f"{v!r} is not an integer, register name or Affine expression")


def ev(regs: dict[str, int], e: Expr) -> int:
    """Value of a compiled expression under the register file."""
    v, terms = e
    for name, coef in terms:
        v += coef * regs[name]
    return v


class Op:
    """A compiled operation: handler ``fn`` and the instruction ``src`` it came from."""

    __slots__ = ("fn", "src")


# -- compute ---------------------------------------------------------------------------------


class OpCompute(Op):
    __slots__ = ("kernel", "outs", "ins", "params", "dtype", "cache")

    kernel: Kernel
    outs: tuple[Buf, ...]
    ins: tuple[Buf, ...]


def _cost(sim: Any, core: Core, op: OpCompute, shapes: tuple) -> tuple[int, tuple]:
    try:
        outs = op.kernel.out_shapes(shapes, op.params)
        cycles = kernel_cycles(sim.core_spec, op.kernel, shapes, op.params, op.dtype)
    except ChipConfigError as exc:  # no compute rate for the kernel's dtype
        raise sim.error(core, f"kernel {op.kernel.name!r} computes in {op.dtype}: {exc}") from None
    except (KeyError, ValueError, IndexError) as exc:
        raise sim.error(
            core, f"kernel {op.kernel.name!r} rejects input shapes {list(shapes)}: {exc}"
        ) from None
    if len(outs) != len(op.outs):
        raise sim.error(
            core,
            f"kernel {op.kernel.name!r} makes {len(outs)} outputs, the instruction names {len(op.outs)}",
        )
    return cycles, tuple((tuple(s), math.prod(s)) for s in outs)


_shape_of = operator.attrgetter("shape")


def h_compute(sim: Any, core: Core, op: OpCompute) -> bool:
    if not ready(sim, core, op.ins, op.outs):
        return False
    t = core.t
    shapes = tuple(map(_shape_of, op.ins))  # the inputs' shapes, gathered by builtins
    hit = op.cache.get(shapes)
    if hit is None:
        hit = op.cache[shapes] = _cost(sim, core, op, shapes)
    cycles, oshapes = hit
    end = t + cycles
    for b, (s, n) in zip(op.outs, oshapes):
        if n > b.cap:
            raise sim.error(
                core,
                f"output {s} does not fit buffer {b.name!r} (capacity {b.alloc_shape}); allocate it larger",
            )
        b.shape = s
        b.w = end
        b.wk = BUSY
        if b.held:
            hold(sim, core, b)
    if sim.functional:
        res = op.kernel.run([b.data for b in op.ins], op.params)
        for b, arr in zip(op.outs, res):
            b.data = np.asarray(arr, dtype=numpy_dtype(b.dtype))
    core.st[BUSY] += cycles
    if sim.tracing and cycles:
        sim.ctrace.append((core.id, t, end, op.kernel.name))
    core.t = end
    core.pc += 1
    return True


class OpFastLoop(Op):
    """Timing mode: a loop whose body is only Compute runs in closed form when all its buffers
    are ready at entry and the body's shapes reach a fixed point after one iteration."""

    __slots__ = ("count", "var", "body", "touched", "exit_pc")


def h_fastloop(sim: Any, core: Core, op: OpFastLoop) -> bool:
    n = ev(core.regs, op.count)
    t = core.t
    if n < 3 or any(
        not b.allocated or b.wp is not None or b.rp or b.w > t or b.r > t for b in op.touched
    ):
        core.pc += 1  # fall back to the stepped loop
        return True
    saved = [b.shape for b in op.touched]
    per = []
    states = []
    for _ in range(2):
        cyc = 0
        for c in op.body:
            shapes = tuple([b.shape for b in c.ins])
            hit = c.cache.get(shapes)
            if hit is None:
                hit = c.cache[shapes] = _cost(sim, core, c, shapes)
            cyc += hit[0]
            for b, (s, m) in zip(c.outs, hit[1]):
                if m > b.cap:
                    raise sim.error(core, f"output {s} does not fit buffer {b.name!r}")
                b.shape = s
        per.append(cyc)
        states.append([b.shape for b in op.touched])
    if states[0] != states[1]:
        for b, s in zip(op.touched, saved):
            b.shape = s
        core.pc += 1
        return True
    total = per[0] + per[1] * (n - 1)
    end = t + total
    for c in op.body:
        for b in c.outs:
            b.w, b.wk = end, BUSY
    for b in op.touched:
        if b.held:
            hold(sim, core, b)
    core.st[BUSY] += total
    core.ff += n * len(op.body)
    if sim.tracing and total:
        sim.ctrace.append((core.id, t, end, f"{op.body[0].kernel.name} x{n}"))
    core.t = end
    if op.var is not None:
        core.regs[op.var] = n - 1
    core.pc = op.exit_pc
    return True


# -- local control ---------------------------------------------------------------------------


class OpSet(Op):
    __slots__ = ("reg", "value")


def h_set(sim: Any, core: Core, op: OpSet) -> bool:
    core.regs[op.reg] = ev(core.regs, op.value)
    core.pc += 1
    return True


class OpLoop(Op):
    __slots__ = ("count", "var", "slot", "exit_pc")


def h_loop(sim: Any, core: Core, op: OpLoop) -> bool:
    n = ev(core.regs, op.count)
    if n <= 0:
        core.pc = op.exit_pc
        return True
    core.lc[op.slot] = n
    core.li[op.slot] = 0
    if op.var is not None:
        core.regs[op.var] = 0
    core.pc += 1
    return True


class OpNext(Op):
    __slots__ = ("slot", "var", "body_pc")


def h_next(sim: Any, core: Core, op: OpNext) -> bool:
    i = core.li[op.slot] + 1
    if i < core.lc[op.slot]:
        core.li[op.slot] = i
        if op.var is not None:
            core.regs[op.var] = i
        core.pc = op.body_pc
    else:
        core.pc += 1
    return True


class OpIf(Op):
    __slots__ = ("lhs", "cmp", "rhs", "else_pc")


def h_if(sim: Any, core: Core, op: OpIf) -> bool:
    regs = core.regs
    if op.cmp(ev(regs, op.lhs), ev(regs, op.rhs)):
        core.pc += 1
    else:
        core.pc = op.else_pc
    return True


class OpIfReg(Op):
    """An ``If`` comparing one register with a constant (a loop's or a count's test, nearly
    every ``If`` the spatial programs hold): :func:`h_if` without evaluating two
    expressions."""

    __slots__ = ("reg", "cmp", "const", "else_pc")


def h_if_reg(sim: Any, core: Core, op: OpIfReg) -> bool:
    if op.cmp(core.regs[op.reg], op.const):
        core.pc += 1
    else:
        core.pc = op.else_pc
    return True


def register_of(e: Expr) -> str | None:
    """The register a compiled expression is, unscaled and unshifted; else None."""
    v, terms = e
    if v == 0 and len(terms) == 1 and terms[0][1] == 1:
        return terms[0][0]
    return None


class OpJump(Op):
    __slots__ = ("target",)


def h_jump(sim: Any, core: Core, op: OpJump) -> bool:
    core.pc = op.target
    return True


class OpAlloc(Op):
    """``cap``: the buffer's elements; ``held``: the Alloc's ``held`` (compiled in)."""

    __slots__ = ("buf", "shape", "dtype", "eb", "nbytes", "cap", "held")


def h_alloc(sim: Any, core: Core, op: OpAlloc) -> bool:
    b = op.buf
    if b.allocated:
        raise sim.error(
            core, f"buffer {b.name!r} is already allocated; Free it first or use another name"
        )
    if op.held:  # a held buffer counts what it holds (``hold``): nothing yet
        b.nbytes = 0
    else:
        nbytes = b.nbytes = op.nbytes
        sram = core.sram = core.sram + nbytes
        if sram > sim.sram_bytes:
            raise sim.error(
                core,
                f"SRAM overflow: buffer {b.name!r} ({op.nbytes} bytes) brings the core to "
                f"{core.sram} bytes allocated, it has {sim.core_spec.sram_bytes}; free buffers "
                "earlier or use smaller tiles",
            )
        if sram > core.sram_peak:
            core.sram_peak = sram
    b.allocated = True
    b.dtype, b.eb, b.alloc_shape, b.shape = op.dtype, op.eb, op.shape, op.shape
    b.cap = op.cap
    b.held = op.held
    if sim.functional:
        b.data = np.zeros(op.shape, dtype=numpy_dtype(op.dtype))
    core.pc += 1
    return True


class OpFree(Op):
    __slots__ = ("buf",)


def h_free(sim: Any, core: Core, op: OpFree) -> bool:
    b = op.buf  # ready(sim, core, (), (b,)), inlined (a kernel program frees every tile)
    if not b.allocated:
        need_alloc(sim, core, b)
    if b.wp is not None and not fold_w(sim, core, b):
        return False
    t = t0 = core.t
    cat = BUSY
    if b.w > t:
        t, cat = b.w, b.wk
    if b.rp and not fold_r(sim, core, b):
        return False
    if b.r > t:
        t, cat = b.r, b.rk
    if t > t0:
        advance(sim, core, t, cat)
    b.allocated = False
    b.data = None
    core.sram -= b.nbytes
    core.pc += 1
    return True


def h_end(sim: Any, core: Core, op: Op) -> bool:
    t = core.t
    cat = BUSY
    for b in core.bufs.values():
        if b.wp is not None and not fold_w(sim, core, b):
            return False
        if b.rp:
            for p in b.rp:
                if p.time is None:
                    sim.block(core, ("buf", b, p), p)
                    return False
        if b.w > t:
            t, cat = b.w, b.wk
    if not fence(sim, core):
        return False
    if core.dma > t:
        t, cat = core.dma, core.dma_k
    advance(sim, core, t, cat)
    sim.finished(core)
    return False


def make(cls: type, fn: Any, src: Any, **fields: Any) -> Any:
    """A compiled operation of class ``cls`` running ``fn``; ``fields`` sets every other slot of
    ``cls`` (a missing or unknown one is a ``TypeError``)."""
    return builder(cls)(fn, src, **fields)


def builder(cls: type) -> Any:
    """The constructor :func:`make` uses for ``cls``: ``build(fn, src, **fields)`` (fetch it
    once where many operations of one class are built)."""
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _builder(cls)
    return build


#: operation class -> its constructor (:func:`_builder`)
_BUILDERS: dict[type, Any] = {}


def _builder(cls: type) -> Any:
    """A constructor for ``cls`` that assigns each slot with one attribute store, as
    :mod:`dataclasses` generates ``__init__`` (compiling a large chip builds millions of
    operations; a ``setattr`` call per field was most of that cost).  The slots a class lists
    in ``_late`` are not parameters: they start as ``None`` (state a handler fills in when the
    operation first runs, e.g. :class:`runtime.ops_mem.OpMem`'s ``plan``)."""
    late = getattr(cls, "_late", ())
    names = [n for k in reversed(cls.__mro__) for n in getattr(k, "__slots__", ()) if n not in late]
    body = "".join(f"    op.{n} = {n}\n" for n in names)
    body += "".join(f"    op.{n} = None\n" for n in late)
    code = f"def build({', '.join(names)}):\n    op = new(cls)\n{body}    return op\n"
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    exec(code, scope)  # noqa: S102 - names are the class's own slot identifiers
    return scope["build"]
