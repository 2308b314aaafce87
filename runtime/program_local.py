"""Compiling the instructions that touch only their own core: buffers (Alloc, Free), kernels
(Compute) and local control (Set, Loop, If), for :mod:`runtime.program`.

:class:`LocalCompiler` is mixed into the program compiler; it resolves each buffer name to the
core's :class:`~runtime.state.Buf`, each kernel name to its registry entry (shared by the
operations of one kernel with equal parameters), and turns loops and branches into jumps
(ELK §5: a core's compute pipeline runs its kernels in program order).  Equal instructions
shared between cores (a program builder's ``share=True``) are checked and sized once: the
compiler's ``shared`` dict, keyed by the instruction object's ``id``.
"""

from __future__ import annotations

from typing import Any

from lowering.errors import ProgramError
from lowering.isa import DTYPE_BYTES, Alloc, Compute, Free, If, Instr, Loop, Set
from lowering.kernels import get_kernel
from runtime import ops
from runtime.errors import SimulationError
from runtime.state import Buf

__all__ = ["LocalCompiler", "ALLOC", "FREE", "COMPUTE", "H_ALLOC", "H_FREE", "H_COMPUTE"]


class LocalCompiler:
    """The Alloc, Free, Compute, Set, Loop and If steps of :class:`runtime.program._Compiler`
    (which provides the attributes below and :meth:`block`)."""

    shared: dict[int | str, Any]
    costs: dict[tuple, tuple]
    code: list[ops.Op]
    bufs: dict[str, Buf]
    fast: bool
    slots: int

    def fail(self, ins: Instr, msg: str) -> SimulationError:  # pragma: no cover - compiler
        raise NotImplementedError

    def buf(self, name: str) -> Buf:  # pragma: no cover - compiler
        raise NotImplementedError

    def block(self, body: Any) -> None:  # pragma: no cover - compiler
        raise NotImplementedError

    def _set(self, ins: Set) -> None:
        code, make = self.code, ops.make
        code.append(make(ops.OpSet, ops.h_set, ins, reg=ins.reg, value=ops.expr(ins.value)))

    def _alloc(self, ins: Alloc) -> None:
        fields = self.shared.get(id(ins))
        if fields is None:
            fields = self.shared[id(ins)] = self.alloc_fields(ins)
        self.code.append(ALLOC(ops.h_alloc, ins, self.buf(ins.buf), *fields))

    def alloc_fields(self, ins: Alloc) -> tuple:
        """The fields of an Alloc's operation after its buffer (:class:`runtime.ops.OpAlloc`:
        shape, dtype, element bytes, bytes, elements, held), checked; the same for every core
        the instruction is shared by."""
        shape, eb, nbytes, cap = self._size(ins)
        return (shape, ins.dtype, eb, nbytes, cap, ins.held)

    def _size(self, ins: Alloc) -> tuple[tuple[int, ...], int, int, int]:
        """``(shape, element bytes, bytes, elements)`` of an Alloc, checked."""
        key = (tuple(ins.shape), ins.dtype)
        size = _SIZES.get(key)
        if size is None:
            if ins.dtype not in DTYPE_BYTES:
                raise self.fail(
                    ins,
                    f"unknown dtype {ins.dtype!r}; use one of {', '.join(sorted(DTYPE_BYTES))}",
                )
            if any(d < 0 for d in ins.shape):
                raise self.fail(ins, "negative buffer extent")
            eb = DTYPE_BYTES[ins.dtype]
            cap = 1
            for d in ins.shape:
                cap *= d
            size = _SIZES[key] = (tuple(ins.shape), eb, eb * cap, cap)
        return size

    def _free(self, ins: Free) -> None:
        self.code.append(FREE(ops.h_free, ins, buf=self.buf(ins.buf)))

    def _compute(self, ins: Compute) -> None:
        self.code.append(self.compute(ins))

    def _if(self, ins: If) -> None:
        code, make = self.code, ops.make
        c = ins.cond
        if c.op not in ops.CMP:
            raise self.fail(ins, f"unknown comparison {c.op!r}; use one of {' '.join(ops.CMP)}")
        lhs, rhs = ops.expr(c.lhs), ops.expr(c.rhs)
        reg = ops.register_of(lhs)
        if reg is not None and not rhs[1]:  # a register against a constant
            br = make(
                ops.OpIfReg, ops.h_if_reg, ins, reg=reg, cmp=ops.CMP[c.op], const=rhs[0], else_pc=0
            )
        else:
            br = make(ops.OpIf, ops.h_if, ins, lhs=lhs, cmp=ops.CMP[c.op], rhs=rhs, else_pc=0)
        code.append(br)
        self.block(ins.then)
        if ins.orelse:
            jump = make(ops.OpJump, ops.h_jump, ins, target=0)
            code.append(jump)
            br.else_pc = len(code)
            self.block(ins.orelse)
            jump.target = len(code)
        else:
            br.else_pc = len(code)

    def compute(self, ins: Compute) -> ops.Op:
        # operations of one kernel with equal parameters share the kernel entry, the parameter
        # dict and the cost cache per input shapes (a cost depends on nothing else:
        # ops.h_compute)
        hit = self.shared.get(id(ins))
        if hit is None:
            hit = self.shared[id(ins)] = self._kernel(ins)
        kernel, params, cache = hit
        bufs, buf = self.bufs, self.buf
        outs = tuple([bufs.get(b) or buf(b) for b in ins.outs])
        return COMPUTE(
            H_COMPUTE,
            ins,
            kernel,
            outs,
            tuple([bufs.get(b) or buf(b) for b in ins.ins]),
            params,
            ins.dtype,
            cache,
        )

    def _kernel(self, ins: Compute) -> tuple:
        """``(kernel, parameter dict, cost cache)`` of a Compute, shared by the operations of
        one kernel with equal parameters, dtype and output count."""
        key = (ins.kernel, ins.params, ins.dtype, len(ins.outs))
        try:
            hit = self.costs.get(key)
        except TypeError:  # unhashable parameter values
            key, hit = None, None
        if hit is None:
            try:
                kernel = get_kernel(ins.kernel)
            except ProgramError as exc:
                raise self.fail(ins, str(exc)) from None
            if ins.dtype not in DTYPE_BYTES:
                raise self.fail(ins, f"unknown dtype {ins.dtype!r}")
            hit = (kernel, dict(ins.params), {})
            if key is not None:
                self.costs[key] = hit
        return hit

    def loop(self, ins: Loop) -> None:
        code, make = self.code, ops.make
        count = ops.expr(ins.count)
        fastop = None
        if self.fast and ins.body and all(isinstance(i, Compute) for i in ins.body):
            body = [self.compute(i) for i in ins.body]
            touched = tuple(dict.fromkeys(b for c in body for b in c.ins + c.outs))
            fastop = make(
                ops.OpFastLoop,
                ops.h_fastloop,
                ins,
                count=count,
                var=ins.var,
                body=body,
                touched=touched,
                exit_pc=0,
            )
            code.append(fastop)
        slot = self.slots
        self.slots += 1
        head = make(ops.OpLoop, ops.h_loop, ins, count=count, var=ins.var, slot=slot, exit_pc=0)
        code.append(head)
        body_pc = len(code)
        self.block(ins.body)
        code.append(make(ops.OpNext, ops.h_next, ins, slot=slot, var=ins.var, body_pc=body_pc))
        head.exit_pc = len(code)
        if fastop is not None:
            fastop.exit_pc = len(code)


#: (shape, dtype) of an Alloc -> (shape, element bytes, bytes, elements)
_SIZES: dict[tuple, tuple[tuple[int, ...], int, int, int]] = {}
ALLOC = ops.builder(ops.OpAlloc)
FREE = ops.builder(ops.OpFree)
COMPUTE = ops.builder(ops.OpCompute)
H_ALLOC, H_FREE, H_COMPUTE = ops.h_alloc, ops.h_free, ops.h_compute
