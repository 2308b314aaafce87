"""What the shared resources, the event queue and the cores still hold at a cycle, relative to
it: the part of a run's state that the cores' section starts do not show.

:func:`backlog` is recorded when a run with ``copy_starts=True`` starts each layer's first copy
(:func:`runtime.program_layers.h_call`), so that a layer that repeats the one before it can be
told apart from one that only starts on time (:mod:`torch2step.kernel.steady`): a link, port or
HBM channel still busy for longer, a background transfer further behind, or more transfers in
flight would delay a later layer although this one started exactly one period on.
"""

from __future__ import annotations

from typing import Any

__all__ = ["backlog", "backlog_gap"]


#: offsets this small are rounding, not work (a resource's free cycle one rounding above now)
TINY = 1e-9


def _after(t: Any, now: int) -> float:
    """How far ``t`` lies after ``now`` (0: not after)."""
    d = t - now
    return float(d) if d > TINY else 0.0


def backlog(sim: Any, shift: int = 0) -> tuple:
    """The state of ``sim``'s shared resources and cores at its current cycle, relative to
    that cycle (``shift``: the shift of the copies whose layer is being marked, see
    :func:`_where`):

    * per resource (a link, a port; an HBM channel unless the channels are served in classes,
      :mod:`runtime.hbm_classes`), how long it stays busy with what it has granted;
    * per HBM channel served in a class, its class's; the ordinary HBM requests' fluid end
      (what background reads wait behind, :meth:`runtime.transfer.Transfers._stage`);
    * per resource with background work, the transfer in service's tentative end and the
      waiting ones' sizes and arrivals;
    * the event queue: per cycle still to come, its offset, the stages queued there (the
      transfer, :func:`_transfer`; the hop with the rest of its route, bytes and the tail's
      offset) and the cores to resume (their ids);
    * per core, how far its clock is ahead, what it waits for (the kind of wait), whether it
      has finished, its SRAM held, and its outstanding HBM accesses (:func:`_requests`);
    * per core, where its sequencer is (:func:`_where`), its registers and loop counters, the
      receive or read it has posted (``Core.cur``), and its allocated buffers' pending reads
      and writes (:func:`_buffers`);
    * the messages sent and not yet received, per destination core, each with its arrival,
      size and whether a receive is posted for it, the receives posted with no message yet,
      and the FIFO slots still held (:func:`_messages`)."""
    now = sim.now
    classed = bool(sim.cmembers)
    chans = set(sim.chan_res) if classed else set()
    res = tuple(_after(r[0], now) for k, r in enumerate(sim.rs) if k not in chans)
    hbm = (
        tuple(_after(sim.cfree[k], now) for k in sim.cls_of) if classed else (),
        _after(sim.hfg, now),
    )
    bgs = tuple(
        (k, _after(st[0], now), tuple((e[1], _after(e[4], now)) for e in st[3]))
        for k, st in enumerate(sim.bgs)
        if st is not None
    )
    queue = tuple(
        (
            t - now,
            tuple((_transfer(h[0], now), h[1], h[2], _after(h[3], now)) for h in sim.buckets[t][0]),
            tuple(c.id for c in sim.buckets[t][1]),
        )
        for t in sorted(sim.buckets)
        if t >= now
    )
    from runtime.program_layers import OpCall  # (which records backlogs)

    comp = sim.comp
    frames = comp.frames
    cores = tuple(
        (
            _after(c.t, now),
            c.blocked[0] if c.blocked else None,
            c.done,
            c.sram,
            _after(c.dma, now),
            _requests(c.dmaq, now),
            _requests(c.dma_p, now),
            _where(c, frames.get(c.id), shift, OpCall),
            tuple(sorted(c.regs.items())),
            tuple(c.lc),
            tuple(c.li),
            c.bar is not None,
            () if c.cur is None else _pending(c.cur, now),
            _buffers(c, now),
        )
        for c in comp.cores
    )
    return res, hbm, bgs, queue, cores, sim.unreceived, _messages(sim, now)


def _where(core: Any, fr: Any, shift: int, call_cls: type) -> tuple:
    """Where ``core``'s sequencer is, the same in two layers that run alike: in a template
    (:mod:`runtime.program_layers`), its position there and the layer of the copy it runs
    relative to the layer being marked (``shift`` apart: the copy's shift minus ``shift``;
    the template's own section is shift 0); at a copy's call, the template and the copy's
    relative shift; elsewhere (a section emitted for one layer only), its position in its
    program, equal only in the same layer.  ``fr``: the core's call frame (``None``: no
    templates)."""
    pc = core.pc
    if fr is not None:
        if fr.tmpl is not None:
            call = core.code[fr.back - 1]
            return ("copy", pc, call.shift - shift)
        op = core.code[pc] if pc < len(core.code) else None
        if op.__class__ is call_cls:
            return ("call", op.tmpl.start, op.shift - shift)
        for a, b in fr.spans:
            if a <= pc <= b:
                return ("copy", pc, -shift)
    return ("at", pc, core.done)


def _transfer(x: Any, now: int) -> tuple:
    """A transfer in flight: its kind, and for an HBM access (``runtime.transfer._Hbm``) the
    parts still to arrive and the latest arrival so far; for a message, whether a receive is
    posted for it."""
    kind = x.__class__.__name__
    if hasattr(x, "left"):
        return (kind, x.left, _after(x.end, now))
    if hasattr(x, "post"):
        return (kind, x.post is not None)
    return (kind,)


def _pending(p: Any, now: int) -> tuple:
    """A pending access: its kind and how far its completion lies ahead (``-1.0``: not known)."""
    t = p.time
    return (p.__class__.__name__, -1.0 if t is None else _after(t, now))


def _buffers(core: Any, now: int) -> tuple:
    """The allocated buffers of ``core``, sorted (their names differ from layer to layer):
    shape, bytes held, and their pending and last writes and reads relative to ``now``."""
    out = []
    for b in [b for b in core.bufs.values() if b.allocated]:
        w, r = _after(b.w, now), _after(b.r, now)
        out.append(
            (
                b.alloc_shape,
                b.shape,
                b.dtype,
                b.nbytes,
                b.held,
                w,
                b.wk if w else -1,  # what a wait is charged to, if one may come
                () if b.wp is None else _pending(b.wp, now),
                tuple(_pending(p, now) for p in (b.wq or ())[b.wqi :]),
                r,
                b.rk if r else -1,
                tuple(sorted(_pending(p, now) for p in b.rp or ())),
            )
        )
    out.sort()
    return tuple(out)


def _messages(sim: Any, now: int) -> tuple:
    """Per destination core (sorted), the messages it has not received (arrival relative to
    ``now``, ``-1.0`` on the way; elements and dtype; whether a receive is posted), the
    receives it posted that no message matched yet, and the FIFO slots its channels still hold
    (each slot's consumption ahead of ``now``); cores with none are left out."""
    per: dict[int, list] = {}
    for end in [
        e
        for e in _ends(sim)
        if e.unmatched
        or e.posts
        or e.waiter is not None
        # receives match in order, so the newest slot is the last one consumed
        or (e.inflight and ((c := e.inflight[-1].consumed) is None or c > now))
    ]:
        got = per.setdefault(end.dst, [])
        for s in end.inflight:
            c = s.consumed
            if c is not None and c <= now:
                continue  # a slot freed, dropped by the next send's credit check
            a = s.arrival
            _, shape, dtype, value, n = s.payload
            got.append(
                (
                    "m",
                    -1.0 if a is None else _after(a, now),
                    -1.0 if c is None else _after(c, now),
                    n,
                    dtype,
                    value is not None,
                    s.post is not None,
                    end.chan.depth,
                )
            )
        got.extend(("r", p.post_t - now if p.post_t > now else 0) for p in end.posts)
        if end.waiter is not None:
            got.append(("w", end.waiter.id))
    return tuple((d, tuple(sorted(v))) for d, v in sorted(per.items()) if v)


def _ends(sim: Any) -> list:
    """Every FIFO end of the run's program set (listed once per compiled program)."""
    comp = sim.comp
    if comp.fifo_ends is None:
        comp.fifo_ends = [e for ch in comp.chans.values() for e in ch.ends]
    return comp.fifo_ends


def _requests(q: list, now: int) -> tuple:
    """Outstanding HBM requests (a core's DMA queue or the completions a fence folds): how far
    each known completion lies ahead, sorted, and how many are not known yet (those completed
    by now are alike: a full queue drops one of them, a fence takes the latest)."""
    ts = [getattr(d, "time", d) for d in q]
    ahead = sorted(_after(t, now) for t in ts if t is not None)
    return tuple(x for x in ahead if x > 0.0), sum(t is None for t in ts)


def backlog_gap(a: tuple, b: tuple) -> float | None:
    """The largest difference of two :func:`backlog` records in cycles (``None``: they differ
    in more than their times: other resources busy, other transfers or cores queued)."""
    gap = 0.0

    def walk(x: Any, y: Any) -> bool:
        nonlocal gap
        if isinstance(x, tuple):
            if not isinstance(y, tuple) or len(x) != len(y):
                return False
            return all(walk(u, v) for u, v in zip(x, y))
        if isinstance(x, float) and isinstance(y, float):
            if (x > 0) != (y > 0):
                return False
            gap = max(gap, abs(x - y))
            return True
        return bool(x == y)

    return gap if walk(a, b) else None
