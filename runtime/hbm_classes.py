"""HBM channel classes: the per-channel parts of an HBM request served once per class.

An HBM request is split over the channels by address interleaving; each channel grants its part
first come first served, as every resource does (ELK §5: "packets that share one NoC link are
scheduled sequentially").  Channels whose states are the same and that requests give the same
bytes compute the same grant, so they are kept in *classes* served in closed form:

* a class's members share one ``free`` cycle; their busy cycles are either one value
  (``cbusy``) or, for a class merged from members with different busy cycles, one base value
  per *part* of the members (``cparts``) plus the list of increments every member has received
  since the merge (``clogs``).  A member's busy cycles are its base plus the increments added
  one by one in order: the same float additions the per-channel rule makes, so the statistics
  are bit-identical;
* a request that does not give every member of a class the same bytes refines the class first
  (:meth:`HbmClasses._plan`); the classes a request leaves free at one cycle merge into one
  (:meth:`HbmClasses._merge`: all of them, or for a request over more than four classes each
  set with equal ``free``), so later requests over them are served once.
"""

from __future__ import annotations

import math
from functools import reduce
from itertools import repeat
from operator import add, truediv
from typing import Any

__all__ = ["HbmClasses"]


class HbmClasses:
    """Mixed into :class:`runtime.transfer.Transfers`: the channel-class state (set up by
    :meth:`runtime.engine.Simulator.run`) and the grants of an untraced or traced request."""

    rs: list[list]
    rtrace: list[tuple] | None
    chan_res: list[int]
    hbm_plans: dict[int, tuple]
    hbm_vals: dict[tuple, tuple]
    hver: int
    n_cls: int
    cls_of: list[int]
    cmembers: list[list[int]]
    cfree: list[float]
    cbusy: list[float]
    cparts: dict[int, list[list]]
    clogs: dict[int, list[float]]
    hrate: float
    hbgbusy: list[float]
    cbytes: list[int]
    ccnt: list[int]

    def bg_flush(self) -> None:  # pragma: no cover - runtime.transfer
        raise NotImplementedError

    def _channels(self, x: Any, arrive: int, tail: float) -> tuple[float, float]:
        """Serve HBM request ``x``'s per-channel parts (:meth:`runtime.transfer.Transfers._stage`'s
        rule, applied once per channel class); returns the earliest start and the latest end.

        Per-member byte and grant counts are added up per plan use and written back by
        :meth:`hbm_flush`.  The floats are those the per-channel rule computes, in the same
        order, so cycles, statistics and the trace are unchanged."""
        split = x.split
        plan = self.hbm_plans.get(id(split))
        if plan is None or plan[0] != self.hver or plan[5] is not split:
            plan = self._plan(split)
        plan[2][0] += 1  # bytes and grant counts per class: added up by _flush_uses
        cfree, cbusy = self.cfree, self.cbusy
        classes = plan[1]
        self.n_cls += len(classes)
        if len(classes) == 1 and plan[4] is None and self.rtrace is None:
            # one class with one busy value (the common case: the request covers every member
            # of one class), untraced: the rule below for one class, whose end is the latest
            # (it is no earlier than ``arrive`` and ``tail``) and which merges with nothing
            k, d = classes[0]
            f = cfree[k]
            start = arrive if arrive > f else f
            end = start + d
            if tail > end:
                end = tail
            cbusy[k] += end - start
            cfree[k] = end
            return start, end
        first = math.inf
        last = arrive if arrive > tail else tail
        rt = self.rtrace
        if rt is None:
            # the rule of _stage, per class (d: bytes / rate), split on which bound starts it:
            # a class free before the request starts at ``arrive``, so the earliest start is
            # ``arrive`` if any class is, else the earliest ``free`` (the same values)
            early = False
            logged = plan[4]
            if logged is None:
                for k, d in classes:
                    f = cfree[k]
                    if arrive > f:
                        end = arrive + d
                        if tail > end:
                            end = tail
                        cbusy[k] += end - arrive
                        early = True
                    else:
                        end = f + d
                        if tail > end:
                            end = tail
                        cbusy[k] += end - f
                        if f < first:
                            first = f
                    cfree[k] = end
                    if end > last:
                        last = end
            else:  # the same, a merged class's busy increment logged (lg: its log or None)
                for k, d, lg in logged:
                    f = cfree[k]
                    if arrive > f:
                        end = arrive + d
                        if tail > end:
                            end = tail
                        inc = end - arrive
                        early = True
                    else:
                        end = f + d
                        if tail > end:
                            end = tail
                        inc = end - f
                        if f < first:
                            first = f
                    if lg is None:
                        cbusy[k] += inc
                    else:
                        lg.append(inc)
                    cfree[k] = end
                    if end > last:
                        last = end
            if len(classes) > 4 or (
                len(classes) > 1 and cfree[classes[0][0]] == last == cfree[classes[-1][0]]
            ):
                self._merge(classes)
            return (arrive if early or not classes else first), last
        # traced: no class is merged (see _merge), every class keeps one busy value
        span: dict[int, tuple] = {}
        for k, d in classes:  # as above, keeping each class's span for the trace
            f = cfree[k]
            start = arrive if arrive > f else f
            end = start + d
            if tail > end:
                end = tail
            cfree[k] = end
            cbusy[k] += end - start
            if start < first:
                first = start
            if end > last:
                last = end
            span[k] = (start, end)
        # one trace entry per channel, in channel order
        cls, chan_res, label = self.cls_of, self.chan_res, x.label
        for c, _ in x.split:
            rt.append((chan_res[c], *span[cls[c]], label))
        return (first if classes else arrive), last

    def _parts(self, k: int) -> list[list]:
        """Class ``k``'s members as ``[members, busy cycles]`` parts, its log applied (the
        increments added in order, as the per-channel rule adds them)."""
        parts = self.cparts.get(k)
        if parts is None:
            return [[self.cmembers[k], self.cbusy[k]]]
        log = self.clogs[k]
        return [[m, reduce(add, log, b)] for m, b in parts]

    def _merge(self, classes: tuple) -> None:
        """Merge the classes an untraced request just served that it leaves free at one cycle:
        their members' states then differ in busy cycles at most, kept as parts of the merged
        class with one log of increments (module docstring), so later requests giving them
        equal bytes are served once.  Their byte and grant counts so far are written to their
        channels first, a merged class counting from zero."""
        cfree = self.cfree
        if len({cfree[k] for k, _ in classes}) == len(classes):
            return  # every class free at its own cycle (the common case): nothing to merge
        by_free: dict[float, list[int]] = {}
        for k, _ in classes:
            by_free.setdefault(cfree[k], []).append(k)
        self._flush_uses()
        dirty: set[int] = set()
        for ks in by_free.values():
            if len(ks) > 1:
                self._merge_into(ks)
                dirty.update(ks)
        self._changed(dirty)

    def _merge_into(self, ks: list[int]) -> None:
        """Merge classes ``ks`` (equal ``free``) into the first (see :meth:`_merge`)."""
        rs, chan_res, cls, cmembers = self.rs, self.chan_res, self.cls_of, self.cmembers
        cbytes, ccnt = self.cbytes, self.ccnt
        k0 = ks[0]
        by_busy: dict[float, list[int]] = {}
        for k in ks:
            nb, nc = cbytes[k], ccnt[k]
            for c in cmembers[k]:
                r = rs[chan_res[c]]
                r[2] += nb
                r[3] += nc
            cbytes[k] = ccnt[k] = 0
            for m, b in self._parts(k):
                by_busy.setdefault(b, []).extend(m)
            self.cparts.pop(k, None)
            self.clogs.pop(k, None)
            if k != k0:
                for c in cmembers[k]:
                    cls[c] = k0
                cmembers[k] = []
        cmembers[k0] = [c for m in by_busy.values() for c in m]
        if len(by_busy) == 1:
            self.cbusy[k0] = next(iter(by_busy))
        else:
            self.cparts[k0] = [[m, b] for b, m in by_busy.items()]
            self.clogs[k0] = []

    def _unmerge(self, k: int) -> None:
        """Split merged class ``k`` into one class per part (its log applied), so it can be
        refined like any class (:meth:`_plan` flushes the counts first and ends the change)."""
        parts = self._parts(k)
        del self.cparts[k], self.clogs[k]
        cls = self.cls_of
        for j, (members, bz) in enumerate(parts):
            if j == 0:
                n = k
                self.cbusy[k] = bz
            else:
                n = len(self.cmembers)
                self.cfree.append(self.cfree[k])
                self.cbusy.append(bz)
                self.cbytes.append(self.cbytes[k])
                self.ccnt.append(self.ccnt[k])
                self.cmembers.append(members)
            self.cmembers[n] = members
            for c in members:
                cls[c] = n

    def _plan(self, split: tuple) -> tuple:
        """``(version, ((class, bytes / rate), ...), [uses, used], ((class, bytes per member),
        ...), logged, split, classes)`` for ``split``, refining the channel classes so that
        every class it touches is covered whole with equal bytes (``uses``: requests served
        with it whose bytes and grants are not yet added to their classes, see
        :meth:`_flush_uses`; ``logged``: ``((class, bytes / rate, its log or None), ...)`` when
        a class is a merged one, else None; ``classes``: the classes it touches, for
        :meth:`_changed`).  Plans are kept by the split's ``id``; a plan holds its split, so no
        other split (a LoadValue's one-element split is made per request) can take that id
        while the plan lives."""
        same = self.hbm_vals.get(split)
        if same is not None and same[0] == self.hver:
            # an equal split planned at this version (a request made anew with the same
            # bytes): the same plan, sharing its uses, held with this split for its ``id``
            hit = (*same[:5], split, same[6])
            self.hbm_plans[id(split)] = hit
            return hit
        cls = self.cls_of
        # the split's bytes per channel (its channels are distinct, in channel order): the
        # bytes a class member gets are ``get(c)`` (None when the request skips it); the
        # classes it touches, in the order the split first reaches them
        get = (bd := dict(split)).get
        touched = dict.fromkeys(map(cls.__getitem__, bd))
        dirty: set[int] = set()  # the classes changed (see _changed)
        if self.cparts:  # a merged class to refine: split into its parts first
            for k in touched:
                if k in self.cparts and len(set(map(get, self.cmembers[k]))) > 1:
                    if not dirty:
                        self._flush_uses()  # the counts go to the classes as they are now
                    self._unmerge(k)
                    dirty.add(k)
            if dirty:
                touched = dict.fromkeys(map(cls.__getitem__, bd))
        for k in touched:
            members = self.cmembers[k]
            got = list(map(get, members))
            if len(set(got)) == 1:
                continue
            groups: dict = {}
            for c, b in zip(members, got):
                groups.setdefault(b, []).append(c)
            if not dirty:
                self._flush_uses()  # the counts go to the classes as they are now
            dirty.add(k)
            rest = list(groups.values())
            self.cmembers[k] = rest[0]
            for group in rest[1:]:
                n = len(self.cmembers)
                self.cmembers.append(group)
                self.cfree.append(self.cfree[k])
                self.cbusy.append(self.cbusy[k])
                self.cbytes.append(self.cbytes[k])
                self.ccnt.append(self.ccnt[k])
                for c in group:
                    cls[c] = n
        if dirty:
            self._changed(dirty)
        # every class the split touches is now covered whole with equal bytes: one entry per
        # class, in the order the split first reaches it
        per = dict(zip(map(cls.__getitem__, bd), bd.values()))
        plan = tuple(zip(per, map(truediv, per.values(), repeat(self.hrate))))
        nbytes = tuple(per.items())
        logs = self.clogs
        logged = None
        if logs and not logs.keys().isdisjoint(per):
            logged = tuple((k, d, logs.get(k)) for k, d in plan)
        hit = (self.hver, plan, [0, False], nbytes, logged, split, tuple(per))
        self.hbm_plans[id(split)] = self.hbm_vals[split] = hit
        return hit

    def _changed(self, dirty: set[int]) -> None:
        """Classes ``dirty`` changed (refined, split into parts or merged; the classes made
        by the change are new).  Each change follows one :meth:`_flush_uses` with no request
        served since, so no plan holds uses.  A plan over none of ``dirty`` is still exact:
        its channels are in the same classes, each with the same members (so covered whole
        with equal bytes) and the same log, so it is kept if it was used since the last
        change; the others are dropped (a flush walks only the plans kept or made since)."""
        self.hver = ver = self.hver + 1
        isdisjoint = dirty.isdisjoint
        kept = {
            key: (ver, *plan[1:])
            for key, plan in self.hbm_plans.items()
            if plan[2][1] and isdisjoint(plan[6])
        }
        for plan in kept.values():
            plan[2][1] = False
        self.hbm_plans = kept
        self.hbm_vals = {plan[5]: plan for plan in kept.values()}

    def _flush_uses(self) -> None:
        """Add the bytes and grants of the requests served since the last call to their
        channel classes (:meth:`_channels` counts requests per plan, not per class)."""
        cbytes, ccnt = self.cbytes, self.ccnt
        for plan in self.hbm_plans.values():
            uses = plan[2]
            n = uses[0]
            if n:
                uses[0] = 0
                uses[1] = True  # used since the last change (see _changed)
                for k, b in plan[3]:
                    cbytes[k] += b * n
                    ccnt[k] += n

    def hbm_flush(self) -> None:
        """Write every channel class's state back to its member channels."""
        self._flush_uses()
        self.bg_flush()  # (runtime.transfer)
        rs, chan_res = self.rs, self.chan_res
        hb = self.hbgbusy  # the channel cycles background reads took (runtime.transfer)
        for k in range(len(self.cmembers)):
            f, nb, nc = self.cfree[k], self.cbytes[k], self.ccnt[k]
            for members, bz in self._parts(k):
                for c in members:
                    r = rs[chan_res[c]]
                    r[0] = f
                    r[1] = bz + hb[c]
                    r[2] += nb
                    r[3] += nc
            self.cbytes[k] = self.ccnt[k] = 0
