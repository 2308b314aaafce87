"""Instructions that touch shared state: HBM (Load, Store, LoadValue), channels (Send, Recv,
SendValue, RecvValue) and barriers.  The timing rules are listed in :mod:`runtime.ops`; these
handlers run only when the core's clock equals the simulator's (shared resources see requests in
cycle order), except Recv posting, which is local.
"""

from __future__ import annotations

import math
from functools import partial
from itertools import repeat
from operator import is_not
from typing import Any

import numpy as np

from runtime.layout import TensorInfo, numpy_dtype
from runtime.mem_plan import _region, _request, _slices  # noqa: F401 - (runtime.replay)
from runtime.ops import Op, ev
from runtime.scoreboard import advance, fence, fold_r, fold_w, need_alloc, ready
from runtime.state import (
    BAR,
    BUSY,
    CATEGORIES,
    MEM,
    RECV,
    SEND,
    ChanEnd,
    ChanState,
    Core,
    Group,
    Pending,
    Post,
    Slot,
    StopPost,
    ValueRead,
    hold,
)
from runtime.transfer import _EPS, _Hbm

_new = object.__new__
_ceil = math.ceil

__all__ = [
    "OpMem",
    "OpLoadValue",
    "OpSend",
    "OpRecv",
    "OpBarrier",
    "h_load",
    "h_store",
    "h_loadvalue",
    "h_send",
    "h_recv",
    "h_recvvalue",
    "h_recvstop",
    "h_recvvaluestop",
    "StopExpr",
    "StopToken",
    "take_value",
    "h_barrier",
    "arrive",
]


# -- HBM -------------------------------------------------------------------------------------


class OpMem(Op):
    """Load / Store: ``buf``, tensor ``info``, region as compiled expressions (``fixed``:
    precomputed ``(starts, extents)`` when constant; ``cext``: the extents when they are);
    ``background``: a Load of background traffic (:class:`lowering.isa.Load`); ``plan``: the
    request's plan, made when it first runs (:mod:`runtime.mem_plan`)."""

    __slots__ = (
        "buf", "info", "starts", "extents", "fixed", "cext", "accumulate", "background", "plan"
    )  # fmt: skip
    _late = ("plan",)

    info: TensorInfo


def _dma_slot(sim: Any, core: Core) -> bool:
    """True when the core's DMA queue has room for one more HBM request; otherwise the core
    waits (stall_mem) for the earliest outstanding request to complete.

    ``core.dmaq`` holds the requests in issue order and may keep completed ones until it is
    full; then one completed request is dropped (it stays completed, so which one is dropped
    and keeping the others change no later decision), or the core waits for the earliest known
    completion, or blocks on the oldest request whose completion is not known yet.  The
    completion cycles are gathered and compared by builtins (``getattr(d, "time", d)``: a
    request's cycle or its Pending's), not element by element."""
    q = core.dmaq
    if len(q) < sim.dma_depth:
        return True
    ts = [*map(getattr, q, _TIME, q)]
    known = [*filter(_known, ts)]
    if known:
        first = min(known)
        if first <= sim.now:
            del q[ts.index(first)]
            return True
        d = first - core.t  # advance(sim, core, first, MEM), inlined
        if d > 0:
            core.st[MEM] += d
            if sim.tracing:
                sim.ctrace.append((core.id, core.t, first, CATEGORIES[MEM]))
            core.t = first
        sim.schedule(core, first)
    else:
        unknown = q[0]
        sim.block(core, ("hbm", unknown), unknown)
    return False


#: (_dma_slot) the attribute name for every queue entry, and the test for a known cycle
_TIME = repeat("time")
_known = partial(is_not, None)


def h_load(sim: Any, core: Core, op: OpMem) -> bool:
    b = op.buf
    if not b.allocated:
        need_alloc(sim, core, b)
    chain = False
    if b.wp is not None:
        # Loads complete in order behind earlier Loads still in flight (no wait); any other
        # pending write (a Recv) must land first, so program order decides the contents.
        # (every unresolved entry of ``b.wq`` is a Load's Pending: only those are chained)
        wp = b.wp
        if wp.time is None:
            chain = wp.__class__ is Pending
        elif b.wq:
            q, i = b.wq, b.wqi  # entries before ``wqi`` are known to be resolved
            while i < len(q) and q[i].time is not None:
                i += 1
            b.wqi = i
            chain = i < len(q)
        if not chain and not fold_w(sim, core, b):
            return False
    if b.rp and not fold_r(sim, core, b):  # write-after-read: Stores / Sends still reading it
        return False
    if b.r > core.t:
        advance(sim, core, b.r, b.rk)
    if core.t > sim.now:
        sim.schedule(core, core.t)
        return False
    q = core.dmaq
    if len(q) >= sim.dma_depth:
        d = q[0]  # _dma_slot's first choice, inlined: the oldest request has completed
        t = d if d.__class__ is int else d.time
        if t is not None and t <= sim.now:
            del q[0]
        elif not _dma_slot(sim, core):
            return False
    info = op.info
    plan = op.plan
    if plan is not None and len(plan) > 1 and plan[1] is not None and plan[0] is info:
        # _request(sim, core, op, info), inlined for a region moving with the registers (a
        # tile loop's plan, runtime.mem_plan): once per Load
        _, fn, _, extents, n, nbytes, cache = plan
        got = fn(core.regs)
        if got is None:
            _request(sim, core, op, info)  # raises: the region leaves the tensor
        starts, off = got
        key = (info.base + off) % sim.layout.round
        split = cache.get(key)
        if split is None:
            split = cache[key] = sim.layout.split(info, starts, extents)
    else:
        starts, extents, n, nbytes, split = _request(sim, core, op, info)
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
    # sim.hbm_read(core, split, nbytes, info.name, None, op.background), inlined: once per Load
    sim.hbm_rd += nbytes
    if not nbytes:
        done = sim.now
    elif op.background or sim.attached:
        fab = sim.fabric
        roots = fab.background_roots(core.id) if op.background else fab.load_roots(core.id)
        done = sim._hbm(roots, split, nbytes, info.name, None)
    else:  # sim._hbm(roots, split, nbytes, info.name, None), inlined: one root stage
        roots = sim.fabric._load_cache.get(core.id) or sim.fabric.load_roots(core.id)
        now = sim.now
        x = _new(_Hbm)
        x.split = split
        x.label = info.name
        x.end = now
        x.pending = None
        x.left = 1
        sim._stage(x, roots, nbytes, now, now)
        if x.left == 0:
            done = x.end
        else:
            done = _new(Pending)  # Pending(label), without the call
            done.time = done.waiters = None
            done.what = info.name
            x.pending = done
    core.dmaq.append(done)
    if done.__class__ is int:
        if done >= b.w:
            b.w, b.wk = done, MEM
        if done > core.dma:
            core.dma, core.dma_k = done, MEM
    else:
        if chain:
            if b.wq is None:
                b.wq = [b.wp]
                b.wqi = 0
            else:
                b.wq.append(b.wp)
        b.wp = done
        core.dma_p.append(done)
    b.shape = extents
    if b.held:
        hold(sim, core, b)
    if sim.functional or (info.is_int and info.name in sim.hbm_data):  # control data
        b.data = np.array(
            sim.hbm_data[info.name][_slices(starts, extents)], dtype=numpy_dtype(b.dtype)
        )
    core.pc += 1
    return True


def h_store(sim: Any, core: Core, op: OpMem) -> bool:
    b = op.buf
    if not ready(sim, core, (b,), ()):
        return False
    t = core.t
    if t > sim.now:
        sim.schedule(core, t)
        return False
    q = core.dmaq
    if len(q) >= sim.dma_depth:
        d = q[0]  # as in h_load
        t = d if d.__class__ is int else d.time
        if t is not None and t <= sim.now:
            del q[0]
        elif not _dma_slot(sim, core):
            return False
    info = op.info
    starts, extents, _, nbytes, split = _request(sim, core, op, info)
    if tuple(b.shape) != tuple(extents):
        raise sim.error(
            core,
            f"buffer {b.name!r} holds shape {list(b.shape)} but the region of {info.name!r} is {list(extents)}; store a matching region",
        )
    if info.dtype != b.dtype:
        raise sim.error(
            core, f"buffer {b.name!r} is {b.dtype} but tensor {info.name!r} is {info.dtype}"
        )
    done = sim.hbm_write(core, split, nbytes, info.name)
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
        if len(core.dmaq) >= sim.dma_depth and not _dma_slot(sim, core):
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
    return _value_arrived(sim, core, op, p, "hbm", MEM)


# -- channels --------------------------------------------------------------------------------


class StopToken(int):
    """The value of a stream's stop token (a ``SendValue`` with ``stop``) on its way: an
    ``int`` a ``RecvValue`` with ``stop`` tells from a control value of the stream."""

    __slots__ = ()


class StopExpr(tuple):
    """The compiled value of a ``SendValue`` with ``stop`` (:func:`~runtime.ops.expr`'s
    form): its message carries a :class:`StopToken`."""

    __slots__ = ()


class OpSend(Op):
    __slots__ = ("chan", "buf", "value")

    chan: ChanState


def h_send(sim: Any, core: Core, op: OpSend) -> bool:
    b = op.buf
    if b is not None and (b.wp is not None or b.w > core.t or not b.allocated):
        # ready(sim, core, (b,), ()), inlined: once per message
        if not b.allocated:
            need_alloc(sim, core, b)
        p = b.wp
        if p is not None:
            if p.time is not None and not b.wq:  # fold_w(sim, core, b), its common case
                if p.time >= b.w:
                    b.w, b.wk = p.time, p.kind
                b.wp = None
            elif not fold_w(sim, core, b):
                return False
        if b.w > core.t:
            advance(sim, core, b.w, b.wk)
    now = sim.now
    if core.t > now:
        sim.schedule(core, core.t)
        return False
    chan = op.chan
    ends = chan.ends
    if b is None or len(ends) != 1 or sim.watch is not None:
        return _send(sim, core, op, b, chan, ends)
    end = ends[0]
    inf = end.inflight
    if len(inf) >= chan.depth:
        c = sim.credit(core, chan)
        if c < 0:
            return False
        if c > now:
            advance(sim, core, c, SEND)
            sim.schedule(core, c)
            return False
    # sim.send(chan, ...), inlined for a tensor to one destination: once per message
    shape = b.shape
    n = math.prod(shape)
    nbytes = n * b.eb
    x = _new(Slot)  # Slot(end, payload), without the call
    x.arrival = x.consumed = None
    x.payload = (b.data, shape, b.dtype, None, n)
    x.end = end
    inf.append(x)
    posts = end.posts
    if posts:
        x.post = posts[0]
        del posts[0]  # a list or a deque (ChanState.set_depth)
    else:
        x.post = None
        end.unmatched.append(x)
    sim.msg_bytes += nbytes
    sim.unreceived += 1
    inj = now
    for root in chan.roots:
        e = sim._stage(x, root, nbytes, now, now)
        if e > inj:
            inj = e
    if inj.__class__ is not int:  # up(inj), inlined
        inj = _ceil(inj - _EPS)
    if inj > b.r:
        b.r, b.rk = inj, SEND
    w = end.watch  # a receiver waiting in a WaitAny polls the message's arrival
    if w is not None:
        end.watch = None
        sim.wake(w, now)
    if inj > core.dma:
        core.dma, core.dma_k = inj, SEND
    core.pc += 1
    return True


def _send(sim: Any, core: Core, op: OpSend, b: Any, chan: ChanState, ends: list) -> bool:
    """``h_send``'s general case: a control value, several destinations or a watched
    channel (:meth:`runtime.transfer.Transfers.send`)."""
    if len(ends) != 1 or len(ends[0].inflight) >= chan.depth:
        c = sim.credit(core, chan)
        if c < 0:
            return False
        if c > sim.now:
            advance(sim, core, c, SEND)
            sim.schedule(core, c)
            return False
    if b is None:
        v = ev(core.regs, op.value)
        if op.value.__class__ is StopExpr:
            v = StopToken(v)
        inj = sim.send(chan, 4, None, None, "int32", v)
    else:
        inj = sim.send(chan, math.prod(b.shape) * b.eb, b.data, b.shape, b.dtype, None)
        if inj > b.r:
            b.r, b.rk = inj, SEND
    for end in ends:  # a receiver waiting in a WaitAny polls the message's arrival
        w = end.watch
        if w is not None:
            end.watch = None
            sim.wake(w, sim.now)
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
        # ready(sim, core, (), (b,)), inlined: once per message
        if not b.allocated:
            need_alloc(sim, core, b)
        p = b.wp
        if p is not None:
            if b.wq:
                if not fold_w(sim, core, b):
                    return False
            elif p.time is not None:  # fold_w(sim, core, b), its common case
                if p.time >= b.w:
                    b.w, b.wk = p.time, p.kind
                b.wp = None
            else:  # fold_w's wait, inlined: sim.block(core, ("buf", b, p), p)
                core.blocked = ("buf", b, p)
                if p.waiters is None:
                    p.waiters = [core]
                else:
                    p.waiters.append(core)
                return False
        cat = BUSY
        if b.w > t:
            t, cat = b.w, b.wk
        if b.rp and not fold_r(sim, core, b):
            return False
        if b.r > t:
            t, cat = b.r, b.rk
        c0 = core.t
        if t > c0:  # advance(sim, core, t, cat), inlined
            core.st[cat] += t - c0
            if sim.tracing:
                sim.ctrace.append((core.id, c0, t, CATEGORIES[cat]))
            core.t = t
        t = core.t
    end = op.end
    post = _new(Post)  # Post(core, b, end, t), without the call: once per message
    post.time = post.waiters = post.value = None
    post.core = core
    post.buf = b
    post.end = end
    post.post_t = t
    b.wp = post
    q = end.unmatched
    if q:  # sim.post(end, post), inlined: match the oldest unreceived message
        s = q[0]
        del q[0]
        s.post = post
        if s.arrival is not None:
            sim.consume(s)
    else:
        end.posts.append(post)
    core.pc += 1
    return True


def _value_arrived(
    sim: Any, core: Core, op: Any, p: Any, wait: str = "value", cat: int = RECV
) -> bool:
    """The end of a value read (a receive; a LoadValue: ``wait="hbm"``, ``cat=MEM``): wait for
    ``p`` to arrive (the wait charged to category ``cat``), then its value is in ``op.reg``."""
    if p.time is None:
        sim.block(core, (wait, p), p)
        return False
    core.cur = None
    advance(sim, core, p.time, cat)
    core.regs[op.reg] = p.value
    core.pc += 1
    return True


def h_recvvalue(sim: Any, core: Core, op: OpRecv) -> bool:
    p = core.cur
    if p is None:
        p = Post(core, None, op.end, core.t)
        core.cur = p
        sim.post(op.end, p)
    return _value_arrived(sim, core, op, p)


def h_recvvaluestop(sim: Any, core: Core, op: OpRecv) -> bool:
    """``RecvValue`` with ``stop`` (``op.reg``: the value's and the stop's registers): a
    control value or the stream's stop token, waited for (the program branches on which)."""
    p = core.cur
    if p is None:
        p = Post(core, None, op.end, core.t)
        core.cur = p
        sim.post(op.end, p)
    if p.time is None:
        sim.block(core, ("value", p), p)
        return False
    core.cur = None
    advance(sim, core, p.time, RECV)
    take_value(core.regs, op.reg, p.value)
    core.pc += 1
    return True


def take_value(regs: dict[str, int], reg: tuple[str, str], value: int) -> None:
    """The registers a ``RecvValue`` with ``stop`` sets from the message's ``value``."""
    if value.__class__ is StopToken:
        regs[reg[1]] = int(value)
    else:
        regs[reg[0]] = value
        regs[reg[1]] = -1


def h_recvstop(sim: Any, core: Core, op: OpRecv) -> bool:
    """``Recv`` with ``stop``: a tensor into the buffer or the stop token's value, waited for
    (the program branches on which one came)."""
    p = core.cur
    if p is None:
        b = op.buf
        t = core.t
        if b.wp is not None or b.rp or b.w > t or b.r > t or not b.allocated:
            if not ready(sim, core, (), (b,)):
                return False
            t = core.t
        p = StopPost(core, b, op.end, t)
        b.wp = p
        core.cur = p
        sim.post(op.end, p)
    return _value_arrived(sim, core, op, p)


# -- synchronisation -------------------------------------------------------------------------


class OpBarrier(Op):
    __slots__ = ("group",)

    group: Group


def h_barrier(sim: Any, core: Core, op: OpBarrier) -> bool:
    g = op.group
    if core.bar is not None:
        grp, gen = core.bar
        if grp.gen == gen:
            sim.block(core, ("barrier", grp), None)
            return False
        core.bar = None
        advance(sim, core, grp.release_t, BAR)
        core.pc += 1
        return True
    if not fence(sim, core):
        return False
    if core.dma > core.t:
        advance(sim, core, core.dma, core.dma_k)
    if core.t > sim.now:
        sim.schedule(core, core.t)
        return False
    others = arrive(g, core)
    if others is None:
        sim.block(core, ("barrier", g), None)
        return False
    g.release_t = sim.now
    for other in others:
        sim.wake(other, sim.now)
    core.pc += 1
    return True


def arrive(g: Group, core: Core) -> list[Core] | None:
    """``core`` arrives at barrier ``g`` (the bookkeeping the simulator and the untimed replay
    share): None while members are missing (``core.bar`` then records the generation it
    waits in), or, for the last one, the members that waited, to be released (a new
    generation begins)."""
    g.arrived.append(core)
    if len(g.arrived) < len(g.members):
        core.bar = (g, g.gen)
        return None
    g.gen += 1
    others = [c for c in g.arrived if c is not core]
    g.arrived = []
    return others
