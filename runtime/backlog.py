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


def backlog(sim: Any) -> tuple:
    """The state of ``sim``'s shared resources at its current cycle, relative to that cycle:

    * per resource (a link, a port; an HBM channel unless the channels are served in classes,
      :mod:`runtime.hbm_classes`), how long it stays busy with what it has granted;
    * per HBM channel served in a class, its class's; the ordinary HBM requests' fluid end
      (what background reads wait behind, :meth:`runtime.transfer.Transfers._stage`);
    * per resource with background work, the transfer in service's tentative end and the
      waiting ones' sizes and arrivals;
    * the event queue: per cycle still to come, its offset, the stages queued there (their
      hop's resource, bytes and tail's offset) and the cores to resume (their ids);
    * per core, how far its clock is ahead, what it waits for (the kind of wait), whether it
      has finished, its SRAM held, and its outstanding HBM accesses (:func:`_requests`);
    * the messages sent and not yet received (on their way, or waiting in a FIFO)."""
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
            tuple((h[1][0], h[2], _after(h[3], now)) for h in sim.buckets[t][0]),
            tuple(c.id for c in sim.buckets[t][1]),
        )
        for t in sorted(sim.buckets)
        if t >= now
    )
    cores = tuple(
        (
            _after(c.t, now),
            c.blocked[0] if c.blocked else None,
            c.done,
            c.sram,
            _after(c.dma, now),
            _requests(c.dmaq, now),
            _requests(c.dma_p, now),
        )
        for c in sim.comp.cores
    )
    return res, hbm, bgs, queue, cores, sim.unreceived


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
