"""Instructions that move data between HBM and a core: Load, Store and LoadValue.  The timing
rules are listed in :mod:`runtime.ops`; these handlers run only when the core's clock equals the
simulator's (HBM channels see requests in cycle order).  A request's region is planned once
(:mod:`runtime.mem_plan`) and reserved through the core's HBM route (:mod:`runtime.transfer`),
behind at most ``dma_queue_depth`` outstanding requests of the core (ELK §5: HBM accessed through
the interconnect).
"""

from __future__ import annotations

from functools import partial
from itertools import repeat
from operator import is_not
from typing import Any

import numpy as np

from runtime.layout import TensorInfo, numpy_dtype
from runtime.mem_plan import _region, _request, _slices  # noqa: F401 - _region: runtime.replay_rules
from runtime.ops import Op, ev
from runtime.ops_comm import _value_arrived
from runtime.scoreboard import advance, fold_r, fold_w, need_alloc, ready
from runtime.state import CATEGORIES, MEM, Core, Pending, ValueRead, hold
from runtime.transfer import _Hbm

_new = object.__new__

__all__ = ["OpMem", "OpLoadValue", "h_load", "h_store", "h_loadvalue"]


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
    completion cycles are compared by builtins, not element by element: when every entry is
    a known cycle (an int) by one ``min`` over the queue, else gathered first
    (``getattr(d, "time", d)``: a request's cycle or its Pending's)."""
    q = core.dmaq
    if len(q) < sim.dma_depth:
        return True
    first = None
    if q[0].__class__ is int and q[-1].__class__ is int:
        # every cycle known, most likely (requests granted at once, e.g. a stream of Loads):
        # the earliest by one ``min`` over the cycles themselves (the same one and the same
        # index as below); a Pending among them makes ``min`` fail and the general rule runs
        try:
            first = min(q)
        except TypeError:
            pass
    if first is not None:
        known = q
        if first <= sim.now:
            del q[q.index(first)]
            return True
    else:
        ts = [*map(getattr, q, _TIME, q)]
        known = [*filter(_known, ts)]
        if known:
            first = min(known)
            if first <= sim.now:
                del q[ts.index(first)]
                return True
    if known:
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
