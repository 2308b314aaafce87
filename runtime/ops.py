"""What each instruction does on a core's sequencer: one handler per compiled operation.

A handler ``fn(sim, core, op) -> bool`` either completes the operation (moves ``core.pc`` and
``core.t``, returns ``True``: the sequencer goes on with the next one at once) or stops
(``False``): the core yielded to a later cycle, blocked on something whose completion is unknown,
or finished.  A stopped core re-runs the same operation when it resumes, so handlers only change
state once they are sure to complete.

Timing rules (seed 004 §9.1: each PE interprets its instruction list, SEND/RECV on bounded
channels; seed 000 §4.2: roofline cycles per kernel):

* In-order issue with a buffer scoreboard.  ``Load``, ``Store``, ``Send`` and ``Recv`` are issued
  to the core's DMA / network agent and the sequencer moves on; an instruction that *reads* a
  buffer waits until the buffer's pending write (Load, Recv, Compute) completes, one that *writes*
  a buffer waits until its pending reads (Send, Store) and writes complete.  Exceptions: a Load may
  be issued behind an earlier Load into the same buffer (HBM completes them in order), so a loop
  of loads streams.  This is what lets programs overlap preloading with compute (seed 002 §2.2).  At most
  ``dma_queue_depth`` HBM requests per core are outstanding (default 16; Little's law: enough to
  cover the HBM latency); the next one waits for the earliest to complete, so HBM channels
  interleave the requests of many cores instead of serving one core's whole stream first.
* ``Compute`` occupies the core for ``kernel_cycles`` (:mod:`lowering.kernels`); every other
  instruction issues in zero cycles.  ``RecvValue`` and ``LoadValue`` block until the value is
  there (control flow needs it).
* ``Send`` waits for a free slot in every destination FIFO (back-pressure), then the message
  starts on the network at once; the source buffer is read until its tail leaves the core.
* ``Barrier`` first waits for the core's outstanding Loads, Stores and Sends (a fence), then for every
  member of the group; all continue at the cycle the last one arrives.
* At the end of its program a core waits for all its outstanding operations.

Instructions that touch shared state (HBM, the network, FIFO credits, barriers) run only when the
core's clock equals the simulator's clock, so shared resources see requests in cycle order; purely
local ones (Compute, Set, loops, branches, Recv posting) run ahead without events.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from lowering.kernels import Kernel, kernel_cycles
from runtime.layout import TensorInfo, numpy_dtype
from runtime.state import (
    BAR,
    BUSY,
    CATEGORIES,
    MEM,
    RECV,
    SEND,
    Buf,
    ChanEnd,
    ChanState,
    Core,
    Group,
    Post,
    ValueRead,
)

__all__ = ["Op", "Expr", "ev", "CMP"]

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


def ev(regs: dict[str, int], e: Expr) -> int:
    """Value of a compiled expression under the register file."""
    v, terms = e
    for name, coef in terms:
        v += coef * regs[name]
    return v


class Op:
    """A compiled operation: handler ``fn`` and the instruction ``src`` it came from."""

    __slots__ = ("fn", "src")


def _advance(sim: Any, core: Core, t: int, cat: int) -> None:
    d = t - core.t
    if d > 0:
        core.st[cat] += d
        if sim.tracing:
            sim.ctrace.append((core.id, core.t, t, CATEGORIES[cat]))
        core.t = t


def _need(sim: Any, core: Core, b: Buf) -> None:
    if not b.allocated:
        raise sim.error(
            core, f"buffer {b.name!r} is used before Alloc (or after Free); allocate it first"
        )


def _ready(sim: Any, core: Core, t: int, reads: tuple, writes: tuple) -> int:
    """Earliest cycle >= ``t`` at which ``reads`` hold their data and ``writes`` may be
    overwritten (category of the binding wait in ``sim.cat``); -1 when blocked."""
    cat = BUSY
    for b in reads:
        if not b.allocated:
            _need(sim, core, b)
        p = b.wp
        if p is not None:
            if p.time is None:
                sim.block(core, ("buf", b, p), p)
                return -1
            b.wp = None
            if p.time >= b.w:
                b.w, b.wk = p.time, p.kind
        if b.w > t:
            t, cat = b.w, b.wk
    for b in writes:
        if not b.allocated:
            _need(sim, core, b)
        p = b.wp
        if p is not None:
            if p.time is None:
                sim.block(core, ("buf", b, p), p)
                return -1
            b.wp = None
            if p.time >= b.w:
                b.w, b.wk = p.time, p.kind
        if b.w > t:
            t, cat = b.w, b.wk
        rp = b.rp
        if rp:
            for p in rp:
                if p.time is None:
                    sim.block(core, ("buf", b, p), p)
                    return -1
            for p in rp:
                if p.time >= b.r:
                    b.r, b.rk = p.time, p.kind
            b.rp = None
        if b.r > t:
            t, cat = b.r, b.rk
    sim.cat = cat
    return t


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


def h_compute(sim: Any, core: Core, op: OpCompute) -> bool:
    t = _ready(sim, core, core.t, op.ins, op.outs)
    if t < 0:
        return False
    _advance(sim, core, t, sim.cat)
    shapes = tuple([b.shape for b in op.ins])
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


class OpJump(Op):
    __slots__ = ("target",)


def h_jump(sim: Any, core: Core, op: OpJump) -> bool:
    core.pc = op.target
    return True


class OpAlloc(Op):
    __slots__ = ("buf", "shape", "dtype", "eb", "nbytes")


def h_alloc(sim: Any, core: Core, op: OpAlloc) -> bool:
    b = op.buf
    if b.allocated:
        raise sim.error(
            core, f"buffer {b.name!r} is already allocated; Free it first or use another name"
        )
    core.sram += op.nbytes
    if core.sram > sim.core_spec.sram_bytes:
        raise sim.error(
            core,
            f"SRAM overflow: {core.sram} bytes allocated, the core has {sim.core_spec.sram_bytes}; "
            f"free buffers earlier or use smaller tiles",
        )
    if core.sram > core.sram_peak:
        core.sram_peak = core.sram
    b.allocated = True
    b.dtype, b.eb, b.alloc_shape, b.shape = op.dtype, op.eb, op.shape, op.shape
    b.cap = math.prod(op.shape)
    b.nbytes = op.nbytes
    if sim.functional:
        b.data = np.zeros(op.shape, dtype=numpy_dtype(op.dtype))
    core.pc += 1
    return True


class OpFree(Op):
    __slots__ = ("buf",)


def h_free(sim: Any, core: Core, op: OpFree) -> bool:
    b = op.buf
    t = _ready(sim, core, core.t, (), (b,))
    if t < 0:
        return False
    _advance(sim, core, t, sim.cat)
    b.allocated = False
    b.data = None
    core.sram -= b.nbytes
    core.pc += 1
    return True


# -- HBM -------------------------------------------------------------------------------------


class OpMem(Op):
    """Load / Store: ``buf``, tensor ``info``, region as compiled expressions (``fixed``:
    precomputed ``(starts, extents)`` when constant)."""

    __slots__ = ("buf", "info", "starts", "extents", "fixed", "accumulate")

    info: TensorInfo


def _region(sim: Any, core: Core, op: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if op.fixed is not None:
        return op.fixed
    regs = core.regs
    starts = tuple([ev(regs, e) for e in op.starts])
    extents = tuple([ev(regs, e) for e in op.extents])
    shape = op.info.shape
    for s, e, d in zip(starts, extents, shape):
        if s < 0 or e < 0 or s + e > d:
            raise sim.error(
                core,
                f"region starts={starts} extents={extents} is outside tensor {op.info.name!r} "
                f"of shape {shape} (registers {dict(sorted(regs.items()))})",
            )
    return starts, extents


def _slices(starts: tuple, extents: tuple) -> tuple:
    return tuple(slice(s, s + e) for s, e in zip(starts, extents))


def _dma_slot(sim: Any, core: Core) -> bool:
    """True when the core's DMA queue has room for one more HBM request; otherwise the core
    waits (stall_mem) for the earliest outstanding request to complete."""
    q = core.dmaq
    if len(q) < sim.dma_depth:
        return True
    now = sim.now
    keep = []
    first = None
    unknown = None
    for d in q:
        t = d if d.__class__ is int else d.time
        if t is None:
            keep.append(d)
            if unknown is None:
                unknown = d
        elif t > now:
            keep.append(d)
            if first is None or t < first:
                first = t
    core.dmaq = keep
    if len(keep) < sim.dma_depth:
        return True
    if first is not None:
        _advance(sim, core, first, MEM)
        sim.schedule(core, first)
    else:
        sim.block(core, ("hbm", unknown), unknown)
    return False


def h_load(sim: Any, core: Core, op: OpMem) -> bool:
    b = op.buf
    if not b.allocated:
        _need(sim, core, b)
    p = b.wp
    if p is not None:
        if p.time is None:  # an earlier write of unknown completion: keep writes ordered
            sim.block(core, ("buf", b, p), p)
            return False
        if p.time >= b.w:
            b.w, b.wk = p.time, p.kind
        b.wp = None
    rp = b.rp
    if rp:  # write-after-read: wait for Stores / Sends still reading the buffer
        for p in rp:
            if p.time is None:
                sim.block(core, ("buf", b, p), p)
                return False
        for p in rp:
            if p.time >= b.r:
                b.r, b.rk = p.time, p.kind
        b.rp = None
    if b.r > core.t:
        _advance(sim, core, b.r, b.rk)
    if core.t > sim.now:
        sim.schedule(core, core.t)
        return False
    if not _dma_slot(sim, core):
        return False
    starts, extents = _region(sim, core, op)
    info = op.info
    n = math.prod(extents)
    if n > b.cap:
        raise sim.error(
            core,
            f"{list(extents)} elements of {info.name!r} do not fit buffer {b.name!r} (capacity {list(b.alloc_shape)})",
        )
    if info.dtype != b.dtype:
        raise sim.error(
            core,
            f"tensor {info.name!r} is {info.dtype} but buffer {b.name!r} is {b.dtype}; allocate the buffer as {info.dtype}",
        )
    nbytes = n * info.elem_bytes
    done = sim.hbm_read(core, sim.layout.split(info, starts, extents), nbytes, info.name, None)
    core.dmaq.append(done)
    if done.__class__ is int:
        if done >= b.w:
            b.w, b.wk = done, MEM
        if done > core.dma:
            core.dma, core.dma_k = done, MEM
    else:
        b.wp = done
        core.dma_p.append(done)
    b.shape = extents
    if sim.functional:
        b.data = np.array(
            sim.hbm_data[info.name][_slices(starts, extents)], dtype=numpy_dtype(b.dtype)
        )
    core.pc += 1
    return True


def h_store(sim: Any, core: Core, op: OpMem) -> bool:
    b = op.buf
    t = _ready(sim, core, core.t, (b,), ())
    if t < 0:
        return False
    _advance(sim, core, t, sim.cat)
    if t > sim.now:
        sim.schedule(core, t)
        return False
    if not _dma_slot(sim, core):
        return False
    starts, extents = _region(sim, core, op)
    info = op.info
    if tuple(b.shape) != tuple(extents):
        raise sim.error(
            core,
            f"buffer {b.name!r} holds shape {list(b.shape)} but the region of {info.name!r} is {list(extents)}; store a matching region",
        )
    if info.dtype != b.dtype:
        raise sim.error(
            core, f"buffer {b.name!r} is {b.dtype} but tensor {info.name!r} is {info.dtype}"
        )
    nbytes = math.prod(extents) * info.elem_bytes
    done = sim.hbm_write(core, sim.layout.split(info, starts, extents), nbytes, info.name)
    core.dmaq.append(done)
    if done.__class__ is int:
        if done > b.r:
            b.r, b.rk = done, MEM
        if done > core.dma:
            core.dma, core.dma_k = done, MEM
    else:
        if b.rp is None:
            b.rp = [done]
        else:
            b.rp.append(done)
        core.dma_p.append(done)
    if sim.functional:
        sl = _slices(starts, extents)
        arr = sim.hbm_data[info.name]
        if op.accumulate:
            arr[sl] += b.data.astype(arr.dtype)
        else:
            arr[sl] = b.data
    elif info.is_int:
        sim.dirty.add(info.name)
    core.pc += 1
    return True


class OpLoadValue(Op):
    __slots__ = ("reg", "info", "index")


def h_loadvalue(sim: Any, core: Core, op: OpLoadValue) -> bool:
    p = core.cur
    if p is None:
        if core.t > sim.now:
            sim.schedule(core, core.t)
            return False
        if not _dma_slot(sim, core):
            return False
        info = op.info
        idx = tuple([ev(core.regs, e) for e in op.index])
        if any(not 0 <= i < d for i, d in zip(idx, info.shape)):
            raise sim.error(
                core, f"index {idx} is outside tensor {info.name!r} of shape {info.shape}"
            )
        if info.name in sim.dirty:
            raise sim.error(
                core,
                f"{info.name!r} was overwritten by a Store; its values are unknown in timing mode (run in functional mode)",
            )
        p = ValueRead(core, None, None, core.t)
        p.what = info.name
        p.value = int(sim.hbm_data[info.name][idx])
        chan = sim.layout.element_channel(info, idx)
        done = sim.hbm_read(core, ((chan, info.elem_bytes),), info.elem_bytes, info.name, p)
        if done.__class__ is int:
            p.time = done
        core.dmaq.append(done)
        core.cur = p
    if p.time is None:
        sim.block(core, ("hbm", p), p)
        return False
    core.cur = None
    _advance(sim, core, p.time, MEM)
    core.regs[op.reg] = p.value
    core.pc += 1
    return True


# -- channels --------------------------------------------------------------------------------


class OpSend(Op):
    __slots__ = ("chan", "buf", "value")

    chan: ChanState


def h_send(sim: Any, core: Core, op: OpSend) -> bool:
    b = op.buf
    if b is not None and (b.wp is not None or b.w > core.t or not b.allocated):
        t = _ready(sim, core, core.t, (b,), ())
        if t < 0:
            return False
        _advance(sim, core, t, sim.cat)
    if core.t > sim.now:
        sim.schedule(core, core.t)
        return False
    chan = op.chan
    ends = chan.ends
    if len(ends) != 1 or len(ends[0].inflight) >= chan.depth:
        c = sim.credit(core, chan)
        if c < 0:
            return False
        if c > sim.now:
            _advance(sim, core, c, SEND)
            sim.schedule(core, c)
            return False
    if b is None:
        inj = sim.send(chan, 4, None, None, "int32", ev(core.regs, op.value))
    else:
        inj = sim.send(chan, math.prod(b.shape) * b.eb, b.data, b.shape, b.dtype, None)
        if inj > b.r:
            b.r, b.rk = inj, SEND
    if inj > core.dma:
        core.dma, core.dma_k = inj, SEND
    core.pc += 1
    return True


class OpRecv(Op):
    __slots__ = ("end", "buf", "reg")

    end: ChanEnd


def h_recv(sim: Any, core: Core, op: OpRecv) -> bool:
    b = op.buf
    t = core.t
    if b.wp is not None or b.rp or b.w > t or b.r > t or not b.allocated:
        t = _ready(sim, core, t, (), (b,))
        if t < 0:
            return False
        _advance(sim, core, t, sim.cat)
    end = op.end
    post = Post(core, b, end, t)
    b.wp = post
    if end.unmatched:
        s = end.unmatched.pop(0)
        s.post = post
        if s.arrival is not None:
            sim.consume(s)
    else:
        end.posts.append(post)
    core.pc += 1
    return True


def h_recvvalue(sim: Any, core: Core, op: OpRecv) -> bool:
    p = core.cur
    if p is None:
        p = Post(core, None, op.end, core.t)
        core.cur = p
        sim.post(op.end, p)
    if p.time is None:
        sim.block(core, ("value", p), p)
        return False
    core.cur = None
    _advance(sim, core, p.time, RECV)
    core.regs[op.reg] = p.value
    core.pc += 1
    return True


# -- synchronisation -------------------------------------------------------------------------


class OpBarrier(Op):
    __slots__ = ("group",)

    group: Group


def _fence(sim: Any, core: Core) -> bool:
    """Fold resolved DMA completions; False (blocked) while one is unknown."""
    if core.dma_p:
        for p in core.dma_p:
            if p.time is None:
                sim.block(core, ("hbm", p), p)
                return False
        for p in core.dma_p:
            if p.time > core.dma:
                core.dma, core.dma_k = p.time, p.kind
        core.dma_p = []
    return True


def h_barrier(sim: Any, core: Core, op: OpBarrier) -> bool:
    g = op.group
    if core.bar is not None:
        grp, gen = core.bar
        if grp.gen == gen:
            sim.block(core, ("barrier", grp), None)
            return False
        core.bar = None
        _advance(sim, core, grp.release_t, BAR)
        core.pc += 1
        return True
    if not _fence(sim, core):
        return False
    if core.dma > core.t:
        _advance(sim, core, core.dma, core.dma_k)
    if core.t > sim.now:
        sim.schedule(core, core.t)
        return False
    g.arrived.append(core)
    if len(g.arrived) < len(g.members):
        core.bar = (g, g.gen)
        sim.block(core, ("barrier", g), None)
        return False
    g.gen += 1
    g.release_t = sim.now
    for other in g.arrived:
        if other is not core:
            sim.wake(other, sim.now)
    g.arrived = []
    core.pc += 1
    return True


def h_end(sim: Any, core: Core, op: Op) -> bool:
    t = core.t
    cat = BUSY
    for b in core.bufs.values():
        p = b.wp
        if p is not None:
            if p.time is None:
                sim.block(core, ("buf", b, p), p)
                return False
            if p.time > b.w:
                b.w, b.wk = p.time, p.kind
            b.wp = None
        if b.rp:
            for p in b.rp:
                if p.time is None:
                    sim.block(core, ("buf", b, p), p)
                    return False
        if b.w > t:
            t, cat = b.w, b.wk
    if not _fence(sim, core):
        return False
    if core.dma > t:
        t, cat = core.dma, core.dma_k
    _advance(sim, core, t, cat)
    sim.finished(core)
    return False


def make(cls: type, fn: Any, src: Any, **fields: Any) -> Any:
    """A compiled operation of class ``cls`` running ``fn``."""
    op = cls()
    op.fn = fn
    op.src = src
    for k, v in fields.items():
        setattr(op, k, v)
    return op
