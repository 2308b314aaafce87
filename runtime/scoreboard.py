"""The buffer scoreboard: when an instruction on a core's sequencer may issue.

Every :class:`~runtime.state.Buf` records its last write (``w``, with the wait category ``wk``)
and last read (``r``, ``rk``) completion cycles, and the operations still pending on it: writes
(``wp`` / ``wq``: Load, Recv) and reads (``rp``: Send, Store) whose completion cycle is not known
yet.  An instruction that reads a buffer waits for its writes; one that writes it waits for its
writes and reads: in-order issue with a buffer scoreboard, the first timing rule of
:mod:`runtime.ops`, which lets a program overlap preloading with compute (ELK §2.2).  A core whose
wait has no known end yet blocks on the pending operation and re-runs the instruction when it
resolves.

:func:`ready` waits for an instruction's buffers: it moves the core's clock to the
instruction's issue cycle, charging the wait to the category of the binding buffer (:func:`advance`),
or blocks the core; :func:`fence` folds the core's outstanding DMA completions (Barrier, end of
program).  The handlers of :mod:`runtime.ops`, :mod:`runtime.ops_comm`,
:mod:`runtime.ops_mem` and :mod:`runtime.ops_control` share these.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from runtime.state import BUSY, CATEGORIES, Buf, Core

__all__ = ["advance", "need_alloc", "fold_w", "fold_r", "ready", "fence", "LONG"]


def advance(sim: Any, core: Core, t: int, cat: int) -> None:
    """Move ``core``'s clock to cycle ``t`` (if later), charging the wait to category ``cat``."""
    d = t - core.t
    if d > 0:
        core.st[cat] += d
        if sim.tracing:
            sim.ctrace.append((core.id, core.t, t, CATEGORIES[cat]))
        core.t = t


def need_alloc(sim: Any, core: Core, b: Buf) -> None:
    """Raise the error for an instruction on buffer ``b`` while it is not allocated."""
    if not b.allocated:
        raise sim.error(
            core, f"buffer {b.name!r} is used before Alloc (or after Free); allocate it first"
        )


def fold_w(sim: Any, core: Core, b: Buf) -> bool:
    """Fold ``b``'s completed pending writes into ``b.w`` (call when ``b.wp`` is set); False
    (core blocked) while one has no known completion yet."""
    q = b.wq
    if q:
        # the queued writes' cycles gathered and compared by builtins (a stream of Loads may
        # queue dozens): the first unknown one blocks, else the latest, the last of equal
        # ones (as folding them in order with ``>=``), moves ``b.w``
        ts = [*map(_time_of, q)]
        if None in ts:
            p = q[ts.index(None)]
            sim.block(core, ("buf", b, p), p)
            return False
        t = max(ts)
        if t >= b.w:
            b.w, b.wk = t, q[len(ts) - 1 - ts[::-1].index(t)].kind
        b.wq = None
    p = b.wp
    if p.time is None:
        sim.block(core, ("buf", b, p), p)
        return False
    if p.time >= b.w:
        b.w, b.wk = p.time, p.kind
    b.wp = None
    return True


def fold_r(sim: Any, core: Core, b: Buf) -> bool:
    """Fold ``b``'s completed pending reads (Sends, Stores) into ``b.r`` (call when ``b.rp`` is
    non-empty); False (core blocked) while one has no known completion yet."""
    rp = b.rp
    for p in rp:
        if p.time is None:
            sim.block(core, ("buf", b, p), p)
            return False
    for p in rp:
        if p.time >= b.r:
            b.r, b.rk = p.time, p.kind
    b.rp = None
    return True


#: ``ready`` on more buffers than this keeps its place when it blocks (``_ready_long``)
LONG = 8


def ready(sim: Any, core: Core, reads: tuple, writes: tuple) -> bool:
    """Wait until ``reads`` hold their data and ``writes`` may be overwritten: move the core's
    clock to that cycle (if later), charging the wait to the category of the buffer that binds
    it (the first one at the latest cycle, in the order checked); False when the core blocked.

    Every buffer waits for its pending writes (read-after-write, write-after-write); a buffer
    written also waits for its pending reads (write-after-read).  The buffers are checked in
    order, each one's writes before its reads, and the first unknown completion blocks."""
    if len(reads) + len(writes) > LONG:
        return _ready_long(sim, core, reads, writes)
    t = t0 = core.t
    cat = BUSY
    for b in reads:
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
        if b.w > t:
            t, cat = b.w, b.wk
    for b in writes:
        if not b.allocated:
            need_alloc(sim, core, b)
        p = b.wp
        if p is not None:
            if p.time is not None and not b.wq:  # fold_w's common case, as above
                if p.time >= b.w:
                    b.w, b.wk = p.time, p.kind
                b.wp = None
            elif not fold_w(sim, core, b):
                return False
        if b.w > t:
            t, cat = b.w, b.wk
        if b.rp and not fold_r(sim, core, b):
            return False
        if b.r > t:
            t, cat = b.r, b.rk
    if t > t0:
        advance(sim, core, t, cat)
    return True


def _ready_long(sim: Any, core: Core, reads: tuple, writes: tuple) -> bool:
    """:func:`ready` for an instruction on many buffers (e.g. a unit step reading every
    message it received): when it blocks on one, the core keeps how far it got (``core.scan``)
    and the retry after the wake-up goes on from there.  The buffers already passed cannot
    change while the core is blocked (only the core itself writes their ``w`` / ``r``), so the
    result is :func:`ready`'s, in one pass instead of one pass per wait."""
    t = t0 = core.t
    cat, i = BUSY, 0
    sc = core.scan
    if sc is not None:
        core.scan = None
        if sc[0] is reads and sc[1] is writes and sc[2] == t0:
            i, t, cat = sc[3], sc[4], sc[5]
    nr = len(reads)
    while i < nr:  # the buffers read: their pending writes
        b = reads[i]
        if not b.allocated:
            need_alloc(sim, core, b)
        if b.wp is not None and not fold_w(sim, core, b):
            core.scan = (reads, writes, t0, i, t, cat)
            return False
        if b.w > t:
            t, cat = b.w, b.wk
        i += 1
    n = nr + len(writes)
    while i < n:  # the buffers written: their pending writes, then their pending reads
        b = writes[i - nr]
        if not b.allocated:
            need_alloc(sim, core, b)
        if b.wp is not None and not fold_w(sim, core, b):
            core.scan = (reads, writes, t0, i, t, cat)
            return False
        if b.w > t:
            t, cat = b.w, b.wk
        if b.rp and not fold_r(sim, core, b):
            core.scan = (reads, writes, t0, i, t, cat)
            return False
        if b.r > t:
            t, cat = b.r, b.rk
        i += 1
    if t > t0:
        advance(sim, core, t, cat)
    return True


def fence(sim: Any, core: Core) -> bool:
    """Fold resolved DMA completions; False (blocked) while one is unknown.  The cycles are
    gathered and compared by builtins (a core may have hundreds outstanding): the first
    unknown one blocks, else the latest, the first of equal ones, moves ``core.dma``."""
    dp = core.dma_p
    if dp:
        ts = [*map(_time_of, dp)]
        if None in ts:
            p = dp[ts.index(None)]
            sim.block(core, ("hbm", p), p)
            return False
        t = max(ts)
        if t > core.dma:
            core.dma, core.dma_k = t, dp[ts.index(t)].kind
        core.dma_p = []
    return True


_time_of = attrgetter("time")
