"""Instructions that touch shared state: channels (Send, Recv, SendValue, RecvValue) and
barriers (HBM: :mod:`runtime.ops_mem`).  The timing rules are listed in :mod:`runtime.ops`; these
handlers run only when the core's clock equals the simulator's (shared resources see requests in
cycle order), except Recv posting, which is local.
"""

from __future__ import annotations

import math
from heapq import heappush
from typing import Any

from runtime.ops import Op, ev
from runtime.scoreboard import advance, fence, fold_r, fold_w, need_alloc, ready
from runtime.state import (
    BAR,
    BUSY,
    CATEGORIES,
    RECV,
    SEND,
    ChanEnd,
    ChanState,
    Core,
    Group,
    Post,
    Slot,
    StopPost,
)
from runtime.transfer import _EPS

_new = object.__new__
_ceil = math.ceil

__all__ = [
    "OpSend",
    "OpRecv",
    "OpBarrier",
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
    end = chan.end1
    if b is None or end is None or sim.watch is not None:
        return _send(sim, core, op, b, chan, chan.ends)
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
    res = chan.pres
    if res >= 0 and not sim.slow:
        # sim._stage(x, port, nbytes, now, now), inlined for the first hop of a unicast route
        # (a resource whose one child is a resource, ChanState.pres): once per message
        r = sim.rs[res]
        f = r[0]
        start = now if now > f else f
        inj = start + nbytes / r[4]
        lat = chan.plat
        if now + lat > inj:
            inj = now + lat
        r[0] = inj
        r[1] += inj - start
        r[2] += nbytes
        r[3] += 1
        ch = chan.pnext
        t = (start if start.__class__ is int else _ceil(start - _EPS)) + ch[1]
        bk = sim.buckets.get(t)
        if bk is None:
            bk = sim.buckets[t] = ([], [])
            heappush(sim.times, t)
        bk[0].append((x, ch, nbytes, inj, t))
    else:
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
