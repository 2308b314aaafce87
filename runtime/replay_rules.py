"""The untimed replay's rules (:mod:`runtime.replay`): one per simulator handler, each the
handler without clocks, resources or events — it runs the operation, or blocks the core where the
simulator's handler would wait (for a message, for FIFO space, at a barrier) and says so by
returning ``False``.  Register-only operations run the simulator's own handlers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from runtime import ops, ops_comm, ops_control, ops_mem, ops_pick, ops_select, program_layers
from runtime.layout import numpy_dtype
from runtime.ops_control import write_element
from runtime.state import Core, Post, StopPost

if TYPE_CHECKING:
    from runtime.replay import Replay

__all__ = ["RULES", "shape_readers", "skip_unread_shapes"]


def _free(rp: Replay, core: Core, bufs: tuple) -> bool:
    """True when no buffer of ``bufs`` (in the handlers' check order) waits for a message."""
    for b in bufs:
        p = b.wp
        if p is not None:
            if p.time is None:
                return rp.block(core, ("buf", b, p), p)
            b.wp = None
    return True


def _ready(rp: Replay, core: Core, op: Any) -> bool:
    """Compute ``op``'s buffers are all written, or ``core`` blocks on the first that is not
    (a retry goes on where it stopped, as the simulator's handler: scoreboard._ready_long)."""
    i = 0
    sc = core.scan
    if sc is not None:
        core.scan = None
        if sc[0] is op:
            i = sc[1]
    bufs = op.ins + op.outs
    n = len(bufs)
    while i < n:
        b = bufs[i]
        p = b.wp
        if p is not None:
            if p.time is None:
                if i:
                    core.scan = (op, i)
                return rp.block(core, ("buf", b, p), p)
            b.wp = None
        i += 1
    return True


def _compute(rp: Replay, core: Core, op: Any) -> bool:
    """A Compute whose output shapes the replay follows: it waits for its buffers, then
    applies the kernel's shape rule (:func:`_shapes`)."""
    if not _ready(rp, core, op):
        return False
    _shapes(rp, core, op)
    core.pc += 1
    return True


def _compute_unread(rp: Replay, core: Core, op: Any) -> bool:
    """:func:`_compute` of a Compute whose output shapes nothing reads (:func:`shape_readers`):
    it waits for its buffers as the simulator's handler does and leaves their shapes alone."""
    if not _ready(rp, core, op):
        return False
    core.pc += 1
    return True


def shape_readers(code: list[Any]) -> set[int] | None:
    """The ids of the Compute operations of ``code`` (every active core's operations) whose
    output shapes the replay must follow: a buffer's shape matters only to a ``WriteValue``
    into it (:func:`runtime.ops_control.write_element` writes into that shape), and it comes
    from the Compute that wrote the buffer (its shape rule reads its inputs' shapes) or from
    the ``Send`` whose message a receive took into it.  The closure of those dependencies
    back from every ``WriteValue``; every other Compute's shapes are never read, so the
    replay skips its shape rule.  ``None`` (follow every shape) when a layer call rebinds the
    operations' buffers (:mod:`runtime.program_layers`)."""
    writers: dict[int, list[Any]] = {}  # buffer -> the Computes writing it
    recv_chans: dict[int, list[str]] = {}  # buffer -> the channels received into it
    senders: dict[str, list[Any]] = {}  # channel -> the buffers sent on it
    need: set[int] = set()
    recvs = (ops_comm.h_recv, ops_comm.h_recvstop)
    for op in code:
        fn = op.fn
        if fn is program_layers.h_call or fn is program_layers.h_ret:
            return None
        if fn is ops.h_compute or fn is ops.h_fastloop:
            for c in op.body if fn is ops.h_fastloop else (op,):
                for b in c.outs:
                    writers.setdefault(id(b), []).append(c)
        elif fn is ops_control.h_writevalue:
            need.add(id(op.buf))
        elif fn in recvs:
            recv_chans.setdefault(id(op.buf), []).append(op.end.chan.name)
        elif fn is ops_comm.h_send and op.buf is not None:
            senders.setdefault(op.chan.name, []).append(op.buf)
    live: set[int] = set()
    todo = list(need)
    while todo:
        key = todo.pop()
        found: list[Any] = []
        for c in writers.pop(key, ()):
            if id(c) not in live:
                live.add(id(c))
                found += c.ins
        for ch in recv_chans.pop(key, ()):
            found += senders.pop(ch, ())
        for b in found:
            if id(b) not in need:
                need.add(id(b))
                todo.append(id(b))
    return live


def skip_unread_shapes(steps: dict[int, list[tuple[Any, Any]]]) -> None:
    """Give the Computes of ``steps`` (each core's ``(rule, operation)`` pairs) whose output
    shapes nothing reads (:func:`shape_readers`) the rule that skips their shape rule."""
    live = shape_readers([op for pairs in steps.values() for _, op in pairs])
    if live is None:
        return
    for pairs in steps.values():
        for i, (rule, op) in enumerate(pairs):
            if rule is _compute and id(op) not in live:
                pairs[i] = (_compute_unread, op)


def _shapes(rp: Replay, core: Core, op: Any) -> None:
    """The output shapes of Compute ``op`` from its inputs' (the kernel's shape rule, as the
    simulator's ``h_compute``; only a later :func:`_writevalue` reads them)."""
    shapes = tuple([b.shape for b in op.ins])
    key = (op, shapes)
    outs = rp.shapes.get(key)
    if outs is None:
        try:
            outs = rp.shapes[key] = tuple(tuple(s) for s in op.kernel.out_shapes(shapes, op.params))
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise rp.error(
                core, f"kernel {op.kernel.name!r} rejects {list(shapes)}: {exc}"
            ) from None
    for b, s in zip(op.outs, outs):
        b.shape = s


def _fastloop(rp: Replay, core: Core, op: Any) -> bool:
    for b in op.touched:
        if b.wp is not None and b.wp.time is None:
            core.pc += 1  # step the loop: it blocks where the simulator's would
            return True
    n = ops.ev(core.regs, op.count)
    if n > 0 and op.var is not None:
        core.regs[op.var] = n - 1
    last = None
    for _ in range(n):  # the body's shapes, iterated to their fixed point (h_fastloop's)
        for c in op.body:
            _shapes(rp, core, c)
        now = [b.shape for b in op.touched]
        if now == last:
            break
        last = now
    core.pc = op.exit_pc
    return True


def _alloc(rp: Replay, core: Core, op: Any) -> bool:
    """The buffer takes its allocated shape and type (as the simulator's ``h_alloc``): a
    :func:`_writevalue` writes into that shape, a control :func:`_load` into that type."""
    b = op.buf
    b.dtype, b.alloc_shape, b.shape = op.dtype, op.shape, op.shape
    core.pc += 1
    return True


def _free_buf(rp: Replay, core: Core, op: Any) -> bool:
    if not _free(rp, core, (op.buf,)):
        return False
    op.buf.data = None
    core.pc += 1
    return True


def _readvalue(rp: Replay, core: Core, op: Any) -> bool:
    b = op.buf
    if not _free(rp, core, (b,)):
        return False
    if b.data is None:
        raise rp.error(core, f"buffer {b.name!r} holds no values to read")
    flat = b.data.reshape(-1)
    if not 0 <= op.index < flat.size:
        raise rp.error(core, f"element {op.index} is outside buffer {b.name!r}")
    core.regs[op.reg] = int(flat[op.index])
    core.pc += 1
    return True


def _writevalue(rp: Replay, core: Core, op: Any) -> bool:
    b = op.buf
    if not _free(rp, core, (b,)):
        return False
    problem = write_element(b, op.index, ops.ev(core.regs, op.value))
    if problem is not None:
        raise rp.error(core, problem)
    core.pc += 1
    return True


def _load(rp: Replay, core: Core, op: Any) -> bool:
    b = op.buf
    if not _free(rp, core, (b,)):
        return False
    info = op.info
    if info.is_int and info.name in rp.hbm:  # control data (HBM keeps its inputs in timing mode)
        starts, extents = ops_mem._region(rp, core, op)
        b.data = np.array(
            rp.hbm[info.name][ops_mem._slices(starts, extents)], dtype=numpy_dtype(b.dtype)
        )
    else:
        extents = op.cext if op.cext is not None else ops_mem._region(rp, core, op)[1]
    b.shape = extents
    core.pc += 1
    return True


def _store(rp: Replay, core: Core, op: Any) -> bool:
    if not _free(rp, core, (op.buf,)):
        return False
    if op.info.is_int:
        rp.dirty.add(op.info.name)
    core.pc += 1
    return True


def _loadvalue(rp: Replay, core: Core, op: Any) -> bool:
    info = op.info
    idx = tuple([ops.ev(core.regs, e) for e in op.index])
    if info.name in rp.dirty or any(not 0 <= i < d for i, d in zip(idx, info.shape)):
        raise rp.error(core, f"LoadValue of {info.name!r} at {idx}")
    core.regs[op.reg] = int(rp.hbm[info.name][idx])
    core.pc += 1
    return True


def _send(rp: Replay, core: Core, op: Any) -> bool:
    b = op.buf
    if b is not None:
        p = b.wp  # _free of the one buffer, inline
        if p is not None:
            if p.time is None:
                return rp.block(core, ("buf", b, p), p)
            b.wp = None
    chan = op.chan
    depth = chan.depth
    ends = chan.ends
    for end in ends:
        if len(end.unmatched) >= depth:
            end.waiter = core
            core.blocked = ("credit", end)
            return False
    if b is None:
        v = ops.ev(core.regs, op.value)
        if op.value.__class__ is ops_comm.StopExpr:
            v = ops_comm.StopToken(v)
        payload = (None, False, v, None)
    else:
        payload = (b.data, True, None, b.shape)
    for end in ends:
        q = end.posts
        if q:
            p = q[0]
            del q[0]
            rp.match(p, payload)
        else:
            end.unmatched.append(payload)
            w = end.watch
            if w is not None:  # a core waiting in a WaitAny
                end.watch = None
                rp.wake(w)
    core.pc += 1
    return True


def _waitany(rp: Replay, core: Core, op: Any) -> bool:
    """``WaitAny`` untimed.  With an order to follow (:attr:`Replay.order`: the choices a timed
    run of the programs recorded for its register), the next recorded input: the core waits
    for that input's message alone, so the choice is data, not timing, and the programs are a
    Kahn network again (:mod:`runtime.replay`).  Otherwise the lowest index whose FIFO holds a
    message the core has not posted a receive for, when the core looks (the schedule's order,
    not timing's).  Either way the choice is appended to :attr:`Replay.chosen`."""
    for end in op.ends:
        end.watch = None
    chosen = rp.chosen.setdefault(op.reg, [])
    order = rp.order.get(op.reg) if rp.order else None
    if order is not None and len(chosen) < len(order):
        k = order[len(chosen)]
        end = op.ends[k]
        if end.unmatched:
            return _chose(core, op, chosen, k)
        end.watch = core
        # the wait-for edge goes to the one producer the recorded choice waits on
        core.blocked = ("value", Post(core, None, end, 0))
        return False
    for k, end in enumerate(op.ends):
        if end.unmatched:
            return _chose(core, op, chosen, k)
    for end in op.ends:
        end.watch = core
    core.blocked = ("any", op.ends)
    return False


def _chose(core: Core, op: Any, chosen: list[int], k: int) -> bool:
    core.regs[op.reg] = k
    chosen.append(k)
    core.pc += 1
    return True


def _post(rp: Replay, end: Any, post: Post) -> None:
    if end.unmatched:
        q = end.unmatched
        payload = q[0]
        del q[0]
        rp.match(post, payload)
    else:
        end.posts.append(post)


def _take(rp: Replay, end: Any) -> tuple:
    """The first message waiting in FIFO ``end``, taken (a receive matched at once: its slot
    frees, so a sender stopped on the FIFO retries, as :meth:`runtime.replay.Replay.match`)."""
    q = end.unmatched
    payload = q[0]
    del q[0]
    w = end.waiter
    if w is not None:
        end.waiter = None
        rp.wake(w)
    return payload  # type: ignore[no-any-return]


# A receive whose message is already waiting takes it at once, without a Post: the buffer (or
# register) gets its contents as :meth:`runtime.replay.Replay.match` would give them, and the
# buffer has no pending write (a matched Post's is complete, so the next check drops it).


def _recv(rp: Replay, core: Core, op: Any) -> bool:
    b = op.buf
    p = b.wp
    if p is not None:
        if p.time is None:
            return rp.block(core, ("buf", b, p), p)
        b.wp = None
    end = op.end
    if end.unmatched:
        data, tensor, _, shape = _take(rp, end)
        if not tensor:
            raise rp.error(core, "a receive into a buffer took a control value")
        b.data = data
        b.shape = shape
    else:
        post = Post(core, b, end, 0)
        b.wp = post
        end.posts.append(post)
    core.pc += 1
    return True


def _arrived(rp: Replay, core: Core, op: Any, p: Post) -> bool:
    if p.time is None:
        return rp.block(core, ("value", p), p)
    core.cur = None
    core.regs[op.reg] = p.value
    core.pc += 1
    return True


def _value_now(rp: Replay, core: Core, op: Any) -> Any:
    """The control value a value receive takes at once (``None``: no message waits; then a
    Post waits for it, :attr:`Core.cur`)."""
    end = op.end
    if core.cur is None and end.unmatched:
        value = _take(rp, end)[2]
        if value is None:
            raise rp.error(core, "a value receive took a tensor")
        return value
    return None


def _recvvalue(rp: Replay, core: Core, op: Any) -> bool:
    value = _value_now(rp, core, op)
    if value is not None:
        core.regs[op.reg] = value
        core.pc += 1
        return True
    p = core.cur
    if p is None:
        p = core.cur = Post(core, None, op.end, 0)
        op.end.posts.append(p)
    return _arrived(rp, core, op, p)


def _recvvaluestop(rp: Replay, core: Core, op: Any) -> bool:
    value = _value_now(rp, core, op)
    if value is not None:
        ops_comm.take_value(core.regs, op.reg, value)
        core.pc += 1
        return True
    p = core.cur
    if p is None:
        p = core.cur = Post(core, None, op.end, 0)
        op.end.posts.append(p)
    if p.time is None:
        return rp.block(core, ("value", p), p)
    core.cur = None
    ops_comm.take_value(core.regs, op.reg, p.value)
    core.pc += 1
    return True


def _recvstop(rp: Replay, core: Core, op: Any) -> bool:
    p = core.cur
    if p is None:
        b = op.buf
        if not _free(rp, core, (b,)):
            return False
        p = core.cur = StopPost(core, b, op.end, 0)
        b.wp = p
        _post(rp, op.end, p)
    return _arrived(rp, core, op, p)


def _barrier(rp: Replay, core: Core, op: Any) -> bool:
    g = op.group
    if core.bar is not None:
        grp, gen = core.bar
        if grp.gen == gen:
            return rp.block(core, ("barrier", grp), None)
        core.bar = None
        core.pc += 1
        return True
    others = ops_comm.arrive(g, core)
    if others is None:
        return rp.block(core, ("barrier", g), None)
    for other in others:
        rp.wake(other)
    core.pc += 1
    return True


def _end(rp: Replay, core: Core, op: Any) -> bool:
    if not _free(rp, core, tuple(core.bufs.values())):
        return False
    core.done = True
    rp.ndone += 1
    return False


#: simulator handler -> its untimed rule (register-only operations run the simulator's own)
RULES: dict[Any, Any] = {
    ops.h_compute: _compute,
    ops.h_fastloop: _fastloop,
    ops.h_set: ops.h_set,
    ops.h_loop: ops.h_loop,
    ops.h_next: ops.h_next,
    ops.h_if: ops.h_if,
    ops.h_if_reg: ops.h_if_reg,
    ops.h_jump: ops.h_jump,
    ops.h_alloc: _alloc,
    ops.h_free: _free_buf,
    ops.h_end: _end,
    ops_control.h_calc: ops_control.h_calc,
    ops_pick.h_argmin: ops_pick.h_argmin,
    ops_control.h_readvalue: _readvalue,
    ops_control.h_writevalue: _writevalue,
    ops_mem.h_load: _load,
    ops_mem.h_store: _store,
    ops_mem.h_loadvalue: _loadvalue,
    ops_comm.h_send: _send,
    ops_comm.h_recv: _recv,
    ops_comm.h_recvvalue: _recvvalue,
    ops_comm.h_recvstop: _recvstop,
    ops_comm.h_recvvaluestop: _recvvaluestop,
    ops_comm.h_barrier: _barrier,
    ops_select.h_waitany: _waitany,
    program_layers.h_call: program_layers.r_call,
    program_layers.h_ret: program_layers.r_ret,
}
