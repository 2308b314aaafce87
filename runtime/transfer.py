"""Transfers through the chip's resources, and the FIFO protocol of channels.

A transfer walks its route (a tree of stages, :mod:`runtime.network`).  The first stage is
reserved when the transfer starts; every later stage by an event at the cycle the transfer's head
reaches it, so each resource grants requests first come first served by arrival cycle (ELK
§5: "packets that share one NoC link are scheduled sequentially").  A resource serving ``B`` bytes
at ``r`` bytes/cycle is occupied ``B / r`` cycles, kept exactly (fractional cycles, no rounding per
transfer, so a stream of small requests reaches the resource's full bandwidth); every cycle a core
or the event queue sees — an arrival, a completion — is rounded up to a whole cycle.

Channels (credit-based flow control, Cyclotron §9.1): a send takes one slot in every destination
FIFO; the slot frees when the receiver consumes the message, at ``max(arrival, cycle the receive
was issued)``; receives match messages in order.
"""

from __future__ import annotations

import math
from collections import deque
from heapq import heappush
from typing import Any

import numpy as np

from runtime.hbm_classes import HbmClasses
from runtime.network import FORM_HBM, FORM_LAST, FORM_NEXT, RES_BG, RES_DELAY, RES_HBM, RES_WAKE
from runtime.state import Core, Pending, Post, Slot, StopPost, hold

__all__ = ["Transfers", "up"]


_EPS = 1e-6
_ceil = math.ceil
_new = object.__new__


def up(x: float) -> int:
    """Round a (fractional) cycle up to a whole cycle, ignoring float noise."""
    if x.__class__ is int:
        return x
    return math.ceil(x - _EPS)


class _Msg:
    """A multicast message in flight: one slot per destination (a unicast message travels as
    its only :class:`~runtime.state.Slot`)."""

    __slots__ = ("slots", "label")

    def deliver(self, sim: Any, idx: int, end: int) -> None:
        s = self.slots[idx]
        s.arrival = end
        if s.post is not None:
            sim.consume(s)


class _Hbm:
    """An HBM access in flight: resolves ``pending`` when all its parts have arrived."""

    __slots__ = ("split", "label", "left", "end", "pending")

    def deliver(self, sim: Any, idx: int, end: int) -> None:
        if end > self.end:
            self.end = end
        self.left -= 1
        if self.left == 0 and self.pending is not None:
            sim.resolve(self.pending, self.end)


class Transfers(HbmClasses):
    """Mixed into :class:`runtime.engine.Simulator`: resource reservation, messages, HBM access.

    Uses the simulator's clock ``now``, its calendar ``buckets``/``times`` and the resource
    table ``rs``: per resource ``[free, busy, bytes, grants, rate]`` (free: the cycle it is free
    from; busy: cycles occupied; bytes and grants served; rate: bytes per cycle).  A queued stage is the tuple of
    :meth:`_stage`'s arguments."""

    now: int
    rs: list[list]
    rtrace: list[tuple] | None
    hbm_rd: int
    hbm_wr: int
    n_deliv: int
    msg_bytes: int
    unreceived: int
    buckets: dict[int, tuple[list, list]]
    times: list[int]
    chan_res: list[int]
    attached: bool
    bgs: list[list | None]
    hrate: float
    hagg: float
    hfg: float
    hbgbusy: list[float]
    slow: bool
    #: True while a core runs (not while queued stages are processed), if the run may grant
    #: the HBM channels a core's request reaches in the current cycle at once rather than by
    #: an event (:meth:`runtime.engine.Simulator._loop`).  The same grants in the same order:
    #: a core runs only once every stage queued for the cycle has been processed, and then
    #: nothing but that core's later requests could come between the two — on an all-to-all
    #: chip those reach the HBM channels through the same rule, and a background read reaches
    #: its pool later (a positive HBM + exchange latency).  Off when tracing (the trace lists
    #: spans in the order they are made).
    inline_hbm: bool

    fabric: Any
    comp: Any

    def resolve(self, p: Pending, t: int) -> None:  # pragma: no cover - engine
        raise NotImplementedError

    def wake(self, core: Core, t: int) -> None:  # pragma: no cover - engine
        raise NotImplementedError

    def error(self, core: Core, msg: str) -> Exception:  # pragma: no cover - engine
        raise NotImplementedError

    def _stage(self, x: Any, stage: tuple, nbytes: int, prev_end: Any, arrive: int) -> int:
        """Reserve ``stage`` of transfer ``x`` of ``nbytes`` whose head arrives there at
        ``arrive`` and whose tail left the previous stage at ``prev_end``.  Returns the end
        (a fractional cycle: :func:`up` gives the cycle it is complete).  A stage reserved
        when the head reaches it is queued as the tuple of these arguments (priority 0 of the
        calendar queue), so a hop costs one call; what follows the stage is told by its
        ``form`` (:func:`runtime.network.stage`).

        The one reservation routine of every transfer.  A resource is granted first come first
        served: it starts at ``max(arrive, free)``, is occupied ``nbytes / rate`` cycles and
        ends no earlier than the tail's arrival ``prev_end + lat`` (the same rule serves the HBM
        channel classes in :meth:`_channels`); a delay stage ends ``lat`` after the previous
        stage's tail.  Children that are resources (or HBM channels) are reserved by an event
        when the head reaches them; delay children are taken at once (no resource, so nothing
        can come between); ``delivers`` get the payload when the stage ends."""
        res, lat, children, delivers, form = stage
        if res >= 0:  # the hottest lines of the simulator
            r = self.rs[res]
            f = r[0]
            start = arrive if arrive > f else f
            end = start + nbytes / r[4]
            tail = prev_end + lat
            if tail > end:
                end = tail
            r[0] = end
            r[1] += end - start
            r[2] += nbytes
            r[3] += 1
            if self.slow:  # tracing, or background traffic has been seen (_bg_start)
                if self.rtrace is not None:
                    self.rtrace.append((res, start, end, x.label))
                bg = self.bgs[res]
                if bg is not None and start < bg[0]:
                    bg[0] += end - start  # ahead of the background transfer in service
        elif res == RES_DELAY:
            start = arrive
            end = prev_end + lat
            if end < start:
                end = start
        elif res == RES_HBM:
            start, end = self._channels(x, arrive, prev_end + lat)
            # ahead of the background reads (runtime.network): their share of the bandwidth
            d = nbytes / self.hagg
            h = self.hfg
            self.hfg = (h if h > arrive else arrive) + d
            bg = self.bgs[-1]
            if bg is not None and arrive < bg[0]:
                bg[0] += d
        elif res == RES_WAKE:  # a background queue's alarm (_bg_alarm): ``lat`` is its resource
            self._bg_wake(lat)
            return 0
        else:
            return self._bg(x, stage, nbytes, prev_end, arrive)
        if form == FORM_NEXT:  # one resource child: reserved by an event
            ch = children[0]
            t = (start if start.__class__ is int else _ceil(start - _EPS)) + ch[1]
            b = self.buckets.get(t)
            if b is None:
                b = self.buckets[t] = ([], [])
                heappush(self.times, t)
            b[0].append((x, ch, nbytes, end, t))
        elif form == FORM_LAST:
            # a delay leaf (every path's last hop): ends lat after the tail, not before the
            # head; delivered here, as the end of this routine would
            ch = children[0]
            e = end + ch[1]
            t = (start if start.__class__ is int else _ceil(start - _EPS)) + ch[1]
            if e < t:
                e = t
            if e.__class__ is not int:
                e = _ceil(e - _EPS)
            cls = x.__class__
            if cls is Slot:  # self._deliver(x, ch[3], e), inlined: a message's last hop
                self.n_deliv += 1  # (a unicast route's leaf delivers its one destination)
                x.arrival = e
                if x.post is not None:
                    self.consume(x)
            elif cls is _Hbm and len(ch[3]) == 1:  # an HBM read's data
                self.n_deliv += 1
                if e > x.end:
                    x.end = e
                x.left -= 1
                if x.left == 0 and x.pending is not None:
                    p = x.pending  # self.resolve(p, x.end), inlined: once per HBM read
                    p.time = x.end
                    if p.waiters:
                        self.resolve(p, x.end)
            else:
                self._deliver(x, ch[3], e)
        elif form:
            if form == FORM_HBM:  # HBM channels: reserved by an event, or at once
                ch = children[0]
                t = (start if start.__class__ is int else _ceil(start - _EPS)) + ch[1]
                if t == self.now and self.inline_hbm:
                    # HBM channels a core's request reaches in this cycle: granted at once, in
                    # the order the core issues its requests (see :attr:`inline_hbm`)
                    self._stage(x, ch, nbytes, end, t)
                else:
                    b = self.buckets.get(t)
                    if b is None:
                        b = self.buckets[t] = ([], [])
                        heappush(self.times, t)
                    b[0].append((x, ch, nbytes, end, t))
            else:  # several children, or a delay with children
                head = start if start.__class__ is int else _ceil(start - _EPS)
                buckets = self.buckets
                for ch in children:
                    t = head + ch[1]
                    if ch[0] != RES_DELAY:  # a resource or HBM channels: reserved by an event
                        b = buckets.get(t)
                        if b is None:
                            b = buckets[t] = ([], [])
                            heappush(self.times, t)
                        b[0].append((x, ch, nbytes, end, t))
                    elif ch[2]:
                        self._stage(x, ch, nbytes, end, t)
                    else:  # a delay leaf, as FORM_LAST
                        e = end + ch[1]
                        if e < t:
                            e = t
                        if e.__class__ is not int:
                            e = _ceil(e - _EPS)
                        self._deliver(x, ch[3], e)
        if delivers:
            if end.__class__ is not int:
                end = _ceil(end - _EPS)
            if x.__class__ is Slot:  # self._deliver(x, delivers, end), inlined: a message
                self.n_deliv += 1  # (a unicast message has its one destination)
                x.arrival = end
                if x.post is not None:
                    self.consume(x)
            else:
                self._deliver(x, delivers, end)
        return end  # fractional unless delivered: a caller that uses it rounds it up

    def _deliver(self, x: Any, delivers: tuple, end: int) -> None:
        """Transfer ``x``'s payload reaches destinations ``delivers`` at cycle ``end``."""
        self.n_deliv += len(delivers)
        cls = x.__class__
        if cls is Slot:  # a unicast message: its only destination
            x.arrival = end
            if x.post is not None:
                self.consume(x)
        elif cls is _Hbm:  # _Hbm.deliver, inlined: once per HBM access
            for _ in delivers:
                if end > x.end:
                    x.end = end
                x.left -= 1
                if x.left == 0 and x.pending is not None:
                    self.resolve(x.pending, x.end)
        else:
            for d in delivers:
                x.deliver(self, d, end)

    # -- background traffic ---------------------------------------------------------------------

    def bg_reset(self) -> None:
        """Background traffic state of a new run (set up by :meth:`runtime.engine.Simulator.run`
        once the resources and the HBM channel rate are): per resource and for the HBM pool
        (the last entry, :attr:`runtime.network.Fabric.pool`) the transfer in service; the
        fluid end of the ordinary HBM requests (``hfg``) at the channels' summed bandwidth
        (``hagg``); the channel cycles the pool has served per channel (``hbgbusy``)."""
        self.bgs = [None] * (len(self.rs) + 1)
        nch = len(self.chan_res)
        self.hagg = self.hrate * max(1, nch)
        self.hfg = 0.0
        self.hbgbusy = [0.0] * nch
        self.slow = self.rtrace is not None  # (_stage)
        self.bgwake: dict[int, tuple] = {}  # per resource: its wake-up stage (_bg_alarm)
        self.hbglog: list[tuple] = []  # splits the pool served, in order (bg_flush)

    def bg_flush(self) -> None:
        """Add the channel parts of the background reads the pool served (logged in order by
        :meth:`_bg_wake`) to their channels: bytes and grants, and ``b / rate`` busy cycles
        added to ``hbgbusy`` one read after the other (``numpy.add.accumulate`` adds down a
        column in order, and a channel a read does not touch adds ``0.0``, which changes no
        sum), so the floats are those of adding them one by one at each read's completion."""
        log = self.hbglog
        if not log:
            return
        self.hbglog = []
        nch = len(self.chan_res)
        index: dict[int, int] = {}
        splits: list[tuple] = []
        order = []
        for sp in log:
            k = index.get(id(sp))
            if k is None:
                k = index[id(sp)] = len(splits)
                splits.append(sp)
            order.append(k)
        bmat = np.zeros((len(splits), nch), dtype=np.int64)
        for k, sp in enumerate(splits):
            for c, b in sp:
                bmat[k, c] += b
        uses = np.bincount(np.asarray(order), minlength=len(splits))
        rs, chan_res = self.rs, self.chan_res
        nbytes = (bmat * uses[:, None]).sum(axis=0)
        grants = ((bmat > 0) * uses[:, None]).sum(axis=0)
        for c in range(nch):
            if grants[c]:
                r = rs[chan_res[c]]
                r[2] += int(nbytes[c])
                r[3] += int(grants[c])
        inc = bmat / self.hrate
        acc = np.array(self.hbgbusy, dtype=np.float64)
        ords = np.asarray(order)
        for lo in range(0, len(ords), 4096):
            rows = np.vstack((acc[None, :], inc[ords[lo : lo + 4096]]))
            acc = np.add.accumulate(rows, axis=0)[-1]
        self.hbgbusy = acc.tolist()

    def _bg(self, x: Any, stage: tuple, nbytes: int, prev_end: Any, arrive: int) -> int:
        """A background stage (``RES_BG - res``: transfer ``x`` takes resource ``res`` in the
        cycles ordinary traffic leaves free, :mod:`runtime.network`); a wake-up of resource
        ``stage[1]``'s background queue (``RES_WAKE``) is :meth:`_bg_wake`, called by
        :meth:`_stage`.

        Per resource with background work, ``bgs[res]`` is ``[end, start, entry, queue]``: the
        transfer in service (``entry``), when its service began and its tentative end, pushed
        back by every ordinary reservation that starts before it (see :meth:`_stage`); the
        transfers waiting behind it, first come first served.  One calendar entry per such
        resource wakes it at its tentative end: the transfer completes there unless it was
        pushed back meanwhile.  Returns 0 (the end is not known yet)."""
        res = RES_BG - stage[0]
        entry = (x, nbytes, prev_end, stage, arrive)
        st = self.bgs[res]
        if st is None:
            self._bg_start(res, entry, arrive)
        else:
            st[3].append(entry)
        return 0

    def _bg_start(self, res: int, entry: tuple, t0: float) -> None:
        """Begin serving background ``entry`` on ``res`` from cycle ``t0`` (its arrival, or the
        end of the one before it): after the ordinary traffic already reserved there."""
        if res < len(self.rs):
            r = self.rs[res]
            f, rate = r[0], r[4]
        else:  # the HBM pool: after the ordinary requests' share
            f, rate = self.hfg, self.hagg
        start = t0 if t0 > f else f
        st = self.bgs[res]
        x, nbytes, _, stage, _ = entry
        end = start + nbytes / rate
        if st is None:
            self.bgs[res] = [end, start, entry, deque()]
            self.slow = True
        else:
            st[0], st[1], st[2] = end, start, entry
        # self._bg_alarm(res, end), inlined: once per background transfer
        now, buckets = self.now, self.buckets
        t = end if end.__class__ is int else _ceil(end - _EPS)
        if t < now:
            t = now
        b = buckets.get(t)
        if b is None:
            b = buckets[t] = ([], [])
            heappush(self.times, t)
        wake = self.bgwake.get(res)
        if wake is None:
            wake = self.bgwake[res] = (RES_WAKE, res, (), (), 0)
        b[0].append((None, wake, 0, 0, t))
        head = start if start.__class__ is int else _ceil(start - _EPS)  # up(), inlined
        if head < now:
            head = now
        for ch in stage[2]:  # released when the service begins (module docstring)
            t = head + ch[1]
            b = buckets.get(t)
            if b is None:
                b = buckets[t] = ([], [])
                heappush(self.times, t)
            b[0].append((x, ch, nbytes, start, t))

    def _bg_alarm(self, res: int, end: float) -> None:
        """A calendar entry waking resource ``res``'s background queue at cycle ``end``."""
        t = end if end.__class__ is int else _ceil(end - _EPS)  # up(), inlined
        if t < self.now:
            t = self.now
        b = self.buckets.get(t)
        if b is None:
            b = self.buckets[t] = ([], [])
            heappush(self.times, t)
        wake = self.bgwake.get(res)
        if wake is None:
            wake = self.bgwake[res] = (RES_WAKE, res, (), (), 0)
        b[0].append((None, wake, 0, 0, t))

    def _bg_wake(self, res: int) -> None:
        """Complete ``res``'s background transfer in service if its end has come (else wait
        for its new end), deliver it and begin the next."""
        st = self.bgs[res]
        end = st[0]
        # pushed back by ordinary traffic since the alarm was set: wait for the new end
        if (end if end.__class__ is int else _ceil(end - _EPS)) > self.now:
            self._bg_alarm(res, end)
            return
        x, nbytes, prev_end, stage, _ = st[2]
        rs = self.rs
        if res < len(rs):
            r = rs[res]
            r[1] += nbytes / r[4]
            r[2] += nbytes
            r[3] += 1
            if self.rtrace is not None:
                self.rtrace.append((res, st[1], end, x.label))
        elif self.rtrace is None:  # the HBM pool: each channel's part, added up later
            self.hbglog.append(x.split)
        else:  # traced: the same at once, with one trace entry per channel
            chan_res, hb, rate = self.chan_res, self.hbgbusy, self.hrate
            for c, b in x.split:
                r = rs[chan_res[c]]
                hb[c] += b / rate
                r[2] += b
                r[3] += 1
                self.rtrace.append((chan_res[c], st[1], end, x.label))
        done = (end if end > prev_end else prev_end) + stage[1]
        if done.__class__ is not int:  # up(done), inlined: once per background transfer
            done = _ceil(done - _EPS)
        delivers = stage[3]
        self.n_deliv += len(delivers)
        for d in delivers:
            x.deliver(self, d, done)
        q = st[3]
        if q:
            nxt = q.popleft()
            self._bg_start(res, nxt, end if end > nxt[4] else nxt[4])
        else:
            self.bgs[res] = None

    # -- channels -----------------------------------------------------------------------------

    def send(self, chan: Any, nbytes: int, data: Any, shape: Any, dtype: str, value: Any) -> int:
        """Start a message on ``chan`` now; returns the cycle its tail has left the sender."""
        now = self.now
        w = self.watch
        if w is not None:
            seen = w.get(chan.name)
            if seen == -1:
                w[chan.name] = now
            elif seen.__class__ is list:  # every message's cycle
                seen.append(now)
        ends = chan.ends
        k = len(ends)
        payload = (data, shape, dtype, value, 0 if shape is None else math.prod(shape))
        if k == 1:
            end = ends[0]
            x = _new(Slot)  # Slot(end, payload), without the call: once per message
            x.arrival = x.consumed = None
            x.payload = payload
            x.end = end
            end.inflight.append(x)
            if end.posts:
                posts = end.posts
                x.post = posts[0]
                del posts[0]  # a list or a deque (ChanState.set_depth)
            else:
                x.post = None
                end.unmatched.append(x)
        else:
            x = _Msg()
            x.label = chan.name
            slots = []
            for end in ends:
                s = Slot(end, payload)
                end.inflight.append(s)
                if end.posts:
                    posts = end.posts
                    s.post = posts[0]
                    del posts[0]
                else:
                    end.unmatched.append(s)
                slots.append(s)
            x.slots = slots
        self.msg_bytes += nbytes * k
        self.unreceived += k
        inj = now
        for root in chan.roots:
            e = self._stage(x, root, nbytes, now, now)
            if e > inj:
                inj = e
        return inj if inj.__class__ is int else _ceil(inj - _EPS)

    def credit(self, core: Core, chan: Any) -> int:
        """Cycle >= now at which every destination FIFO of ``chan`` has a free slot; -1 when a
        full FIFO's oldest message has no known consumption yet (the core then waits)."""
        now = self.now
        wait = now
        for end in chan.ends:
            inf = end.inflight
            while inf:
                c = inf[0].consumed
                if c is None or c > now:
                    break
                del inf[0]
            if len(inf) >= chan.depth:
                c = inf[0].consumed
                if c is None:
                    end.waiter = core
                    core.blocked = ("credit", end)
                    return -1
                if c > wait:
                    wait = c
        return wait

    def post(self, end: Any, post: Post) -> None:
        """A receive on ``end``: match the oldest unreceived message or wait for one."""
        if end.unmatched:
            q = end.unmatched
            s = q[0]
            del q[0]
            s.post = post
            if s.arrival is not None:
                self.consume(s)
        else:
            end.posts.append(post)

    def consume(self, s: Slot) -> None:
        """Message ``s`` arrived and a receive took it: complete the receive, free the slot."""
        p = s.post
        c = s.arrival
        if p.post_t > c:
            c = p.post_t
        s.consumed = c
        end = s.end
        self.unreceived -= 1
        b = p.buf
        data, shape, dtype, value, n = s.payload
        if p.__class__ is StopPost:  # a tensor, or the stream's stop token (its value)
            if shape is None:
                b = None
            else:
                p.value = -1
        if b is not None:
            if shape is None:
                raise self.error(
                    p.core,
                    f"channel {end.chan.name!r} carried a control value, not a tensor; use RecvValue",
                )
            if dtype != b.dtype:
                raise self.error(
                    p.core,
                    f"channel {end.chan.name!r} carried {dtype} data into {b.dtype} buffer {b.name!r}",
                )
            if n > b.cap:
                raise self.error(
                    p.core,
                    f"a {list(shape)} message on {end.chan.name!r} does not fit buffer {b.name!r} (capacity {list(b.alloc_shape)})",
                )
            b.shape = shape
            b.data = data
            if b.held:
                hold(self, p.core, b)
        else:
            if value is None:
                raise self.error(
                    p.core,
                    f"channel {end.chan.name!r} carried a tensor, not a control value; use Recv",
                )
            p.value = value
        p.time = c  # self.resolve(p, c), inlined: once per message
        ws = p.waiters
        if ws:
            p.waiters = None
            for core in ws:
                if core.blocked is not None:  # self.wake(core, c), inlined
                    core.blocked = None
                    t = core.t
                    if c > t:
                        t = c
                    if self.now > t:
                        t = self.now
                    bk = self.buckets.get(t)
                    if bk is None:
                        bk = self.buckets[t] = ([], [])
                        heappush(self.times, t)
                    bk[1].append(core)
        w = end.waiter
        if w is not None:
            end.waiter = None
            self.wake(w, c)
        # the message stays in its FIFO's ``inflight`` until ``credit`` drops it: unlink it
        # from the FIFO and the receive, so a finished run leaves no reference cycles there
        s.end = s.post = None

    # -- HBM ------------------------------------------------------------------------------------

    def _hbm(
        self, roots: Any, split: tuple, nbytes: int, label: str, pending: Pending | None
    ) -> int | Pending:
        now = self.now
        x = _new(_Hbm)
        x.split = split
        x.label = label
        x.end = now
        x.pending = None
        if self.attached:
            x.left = len(split)
            for c, b in split:
                self._stage(x, roots[c], b, now, now)
        else:
            # a background read (runtime.network) is delivered by its port slot and its channels
            x.left = 1 if roots[0] >= RES_HBM else 2
            self._stage(x, roots, nbytes, now, now)
        if x.left == 0:
            return x.end
        if pending is None:
            pending = _new(Pending)  # Pending(label), without the call: once per request
            pending.time = pending.waiters = None
            pending.what = label
        x.pending = pending
        return pending

    def hbm_read(
        self,
        core: Core,
        split: tuple,
        nbytes: int,
        label: str,
        pending: Pending | None,
        background: bool = False,
    ) -> int | Pending:
        """Start an HBM -> ``core`` transfer now; its completion cycle or a :class:`Pending`
        (``background``: background traffic at the core's port, :mod:`runtime.network`)."""
        self.hbm_rd += nbytes
        if not nbytes:
            return self.now
        fab = self.fabric
        if background:
            roots = fab.background_roots(core.id)
        else:
            roots = fab._load_cache.get(core.id) or fab.load_roots(core.id)
        return self._hbm(roots, split, nbytes, label, pending)

    def hbm_write(self, core: Core, split: tuple, nbytes: int, label: str) -> int | Pending:
        """Start a ``core`` -> HBM transfer now."""
        self.hbm_wr += nbytes
        if not nbytes:
            return self.now
        return self._hbm(self.fabric.store_roots(core.id), split, nbytes, label, None)
