"""Channels between cores on MPI ranks (Cyclotron §9: SEND/RECV of the per-PE programs become
the target's messages).

* Both ends on one rank: the message is the buffer's array, appended to the destination's
  in-memory FIFO.
* Ends on different ranks: a nonblocking ``isend`` to each destination rank; each rank matches
  arrived messages with nonblocking probes (``improbe``) and receives them with nonblocking
  matched receives (``Imrecv``) into the destination FIFOs, in each channel's order, so a
  receive never blocks the rank and messages overlap the cores' compute.
* A multicast channel whose destinations sit on two or more other ranks is a broadcast: an
  ``Ibcast`` on a communicator of the ranks involved (a header with kind, dtype and shape, then
  the data), posted by the receivers in message order for the statically known number of
  messages (``lowering.analyze_programs``); a channel whose count depends on run-time values
  uses point-to-point messages instead.

FIFO depth (the channel's ``depth`` or the chip's ``fifo_depth``) is kept with credits, as on
the chip: the sender counts messages not yet received by each destination core and waits at a
full FIFO; a destination rank returns credits in batches when its cores receive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from lowering.analysis import analyze_programs
from lowering.isa import DTYPE_BYTES, Channel, ProgramSet
from runtime.layout import numpy_dtype
from runtime.mpi.placement import RankPlan

__all__ = ["Net", "End", "Post", "DTYPES"]

#: Dtype names in a fixed order (their index is the code in broadcast headers).
DTYPES = tuple(sorted(DTYPE_BYTES))
_HDR = 12  # kind, value, dtype code, ndim, up to 8 extents
#: At most this many broadcast communicators per run (MPI context ids are a finite resource).
MAX_BCAST_COMMS = 256

#: A message: ("d", array, dtype name) or ("v", int).
Payload = tuple


class Post:
    """A posted receive of ``core`` into buffer ``buf`` (``None``: a control value)."""

    __slots__ = ("core", "buf", "done", "value", "fill")

    def __init__(self, core: int, buf: Any, fill: Callable[[Post, Payload], None]) -> None:
        self.core = core
        self.buf = buf
        self.done = False
        self.value = 0
        self.fill = fill


class End:
    """Channel ``chan`` at local destination core ``dst``: its FIFO and posted receives."""

    __slots__ = ("chan", "dst", "queue", "posts")

    def __init__(self, chan: Channel, dst: int) -> None:
        self.chan = chan
        self.dst = dst
        self.queue: deque[Payload] = deque()
        self.posts: deque[Post] = deque()


class _BcastIn:
    """Receiver side of a broadcast channel: the message count still to come and the
    ``Ibcast`` in progress."""

    __slots__ = ("comm", "left", "req", "hdr", "data", "dtype")

    def __init__(self, comm: Any, left: int) -> None:
        self.comm = comm
        self.left = left
        self.req: Any = None
        self.hdr = np.zeros(_HDR, np.int64)
        self.data: np.ndarray | None = None
        self.dtype = ""


def _groups(MPI: Any, comm: Any, members: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """A communicator per ``(name, ranks)`` (first rank = root) that includes this rank; made in
    the same global order on every rank, so the collective creations cannot deadlock."""
    out: dict[str, Any] = {}
    for name, ranks in members:
        if comm.rank in ranks:
            grp = comm.Get_group().Incl(ranks)
            out[name] = comm.Create_group(grp)
            grp.Free()
    return out


class Net:
    """Channel state of one rank (collective constructor: every rank of ``comm`` builds it)."""

    def __init__(
        self, MPI: Any, comm: Any, ps: ProgramSet, plan: RankPlan, fifo_depth: int
    ) -> None:
        self.MPI = MPI
        self.rank = comm.rank
        self.data = comm.Dup()
        self.credit_comm = comm.Dup()
        self.plan = plan
        rank_of = plan.rank_of
        self.chans = {ch.name: ch for ch in ps.channels}
        self.index = {ch.name: i for i, ch in enumerate(ps.channels)}
        self.by_index = list(ps.channels)
        self.depth = {
            ch.name: (ch.depth if ch.depth is not None else fifo_depth) for ch in ps.channels
        }
        self.ends: dict[tuple[str, int], End] = {}
        self.local_ends: dict[str, list[End]] = {}
        for ch in ps.channels:
            for d in ch.dsts:
                if rank_of.get(d) == self.rank:
                    end = self.ends[(ch.name, d)] = End(ch, d)
                    self.local_ends.setdefault(ch.name, []).append(end)
        #: messages sent by a local core not yet received, per (channel, destination core)
        self.unreceived: dict[tuple[str, int], int] = {}
        self.remote: dict[str, list[int]] = {}
        counts = self._static_counts(ps)
        bcast: list[tuple[str, list[int]]] = []
        for ch in ps.channels:
            src_rank = rank_of.get(ch.src, -1)
            others = sorted({rank_of[d] for d in ch.dsts if d in rank_of} - {src_rank})
            if src_rank == self.rank:
                self.remote[ch.name] = others
            if len(others) >= 2 and counts.get(ch.name) is not None:
                if len(bcast) < MAX_BCAST_COMMS:
                    bcast.append((ch.name, [src_rank, *others]))
        self.bcast = _groups(MPI, comm, bcast)
        self.bcast_in = {
            name: _BcastIn(c, counts[name]) for name, c in self.bcast.items() if c.rank != 0
        }
        self.sreqs: list[tuple[Any, Any]] = []  # (request, buffers kept alive)
        #: receives started for matched messages, per (source rank, channel tag), in order
        self.incoming: dict[tuple[int, int], deque[Any]] = {}
        self.credits: dict[int, dict[tuple[int, int], int]] = {}
        self.msgs_remote = self.bytes_remote = self.msgs_local = self.broadcasts = 0
        #: bytes of all messages delivered, in the chip's dtypes (the simulator's count)
        self.message_bytes = 0

    @staticmethod
    def _static_counts(ps: ProgramSet) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        src = {ch.name: ch.src for ch in ps.channels}
        for core in analyze_programs(ps).cores:
            for (name, _kind), n in core.sends.items():
                if src.get(name) != core.core:
                    continue
                prev = out.get(name, 0)
                out[name] = None if n is None or prev is None else prev + n
        return out

    # -- sending ------------------------------------------------------------------------------
    def full(self, name: str) -> int | None:
        """A destination core whose FIFO on ``name`` is full, or None when a send may go."""
        depth = self.depth[name]
        for d in self.chans[name].dsts:
            if self.unreceived.get((name, d), 0) >= depth:
                return d
        return None

    def send(self, name: str, payload: Payload) -> None:
        """Deliver ``payload`` to every destination of channel ``name`` (credits checked)."""
        ch = self.chans[name]
        for d in ch.dsts:
            self.unreceived[(name, d)] = self.unreceived.get((name, d), 0) + 1
        size = payload[1].size * DTYPE_BYTES[payload[2]] if payload[0] == "d" else 4
        self.message_bytes += size * len(ch.dsts)
        for end in self.local_ends.get(name, ()):
            end.queue.append(payload)
            self.msgs_local += 1
            self._match(end)
        others = self.remote.get(name, ())
        if not others:
            return
        nbytes = payload[1].nbytes if payload[0] == "d" else 8
        self.msgs_remote += len(others)
        self.bytes_remote += nbytes * len(others)
        sub = self.bcast.get(name)
        if sub is not None:
            hdr = _header(payload)
            self.broadcasts += 1
            self.sreqs.append((sub.Ibcast(hdr, root=0), hdr))
            if payload[0] == "d":
                arr = np.ascontiguousarray(payload[1])
                self.sreqs.append((sub.Ibcast(arr, root=0), arr))
            return
        tag = self.index[name]
        for r in others:
            self.sreqs.append((self.data.isend(payload, dest=r, tag=tag), None))

    # -- receiving ----------------------------------------------------------------------------
    def post(self, name: str, dst: int, post: Post) -> None:
        """Core ``dst`` posts a receive on ``name``; matched now if a message is there."""
        end = self.ends[(name, dst)]
        end.posts.append(post)
        self._match(end)

    def _match(self, end: End) -> None:
        while end.queue and end.posts:
            payload = end.queue.popleft()
            post = end.posts.popleft()
            post.fill(post, payload)
            post.done = True
            self._received(end)

    def _received(self, end: End) -> None:
        ch = end.chan
        src_rank = self.plan.rank_of[ch.src]
        if src_rank == self.rank:
            self.unreceived[(ch.name, end.dst)] -= 1
        else:
            per = self.credits.setdefault(src_rank, {})
            key = (self.index[ch.name], end.dst)
            per[key] = per.get(key, 0) + 1

    def _deliver(self, name: str, payload: Payload) -> None:
        for end in self.local_ends.get(name, ()):
            end.queue.append(payload)
            self._match(end)

    def poll(self) -> bool:
        """Move messages, broadcasts and credits along; True when something arrived."""
        MPI = self.MPI
        got = False
        if self.sreqs:
            self.sreqs = [x for x in self.sreqs if not x[0].Test()]
        status = MPI.Status()
        while True:  # match arrived messages and start their receives (Imrecv)
            msg = self.data.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                break
            key = (status.Get_source(), status.Get_tag())
            self.incoming.setdefault(key, deque()).append(msg.irecv())
        for (_, tag), reqs in self.incoming.items():
            while reqs:  # deliver in message order: a channel's receives complete in turn
                done, payload = reqs[0].test()
                if not done:
                    break
                reqs.popleft()
                self._deliver(self.by_index[tag].name, payload)
                got = True
        while True:
            msg = self.credit_comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                break
            for (idx, dst), n in msg.recv().items():
                self.unreceived[(self.by_index[idx].name, dst)] -= n
            got = True
        for name, b in self.bcast_in.items():
            got |= self._bcast_step(name, b)
        if self.credits:
            for r, per in self.credits.items():
                self.sreqs.append((self.credit_comm.isend(per, dest=r, tag=0), None))
            self.credits = {}
        return got

    def _bcast_step(self, name: str, b: _BcastIn) -> bool:
        got = False
        while b.left > 0:
            if b.req is None:
                b.req = b.comm.Ibcast(b.hdr, root=0)
            if not b.req.Test():
                break
            b.req = None
            if b.data is None:
                kind, value, code, ndim = (int(x) for x in b.hdr[:4])
                if kind == 1:
                    self._deliver(name, ("v", value))
                    b.left -= 1
                    got = True
                    continue
                b.dtype = DTYPES[code]
                shape = tuple(int(x) for x in b.hdr[4 : 4 + ndim])
                b.data = np.empty(shape, numpy_dtype(b.dtype))
                b.req = b.comm.Ibcast(b.data, root=0)
                continue
            data, b.data = b.data, None
            self._deliver(name, ("d", data, b.dtype))
            b.left -= 1
            got = True
        return got

    def pending_sends(self) -> bool:
        """Whether nonblocking sends are still in progress."""
        return bool(self.sreqs)

    def leftovers(self) -> dict[tuple[str, int], int]:
        """Messages sent by this rank's cores that no receive took, per (channel, core)."""
        return {k: n for k, n in self.unreceived.items() if n > 0}

    def free(self) -> None:
        """Release the communicators (after a clean end)."""
        for c in self.bcast.values():
            c.Free()
        self.data.Free()
        self.credit_comm.Free()


def _header(payload: Payload) -> np.ndarray:
    hdr = np.zeros(_HDR, np.int64)
    if payload[0] == "v":
        hdr[0], hdr[1] = 1, payload[1]
        return hdr
    arr, dtype = payload[1], payload[2]
    if arr.ndim > _HDR - 4:
        raise ValueError(f"a {arr.ndim}-d message has more than {_HDR - 4} dimensions")
    hdr[2], hdr[3] = DTYPES.index(dtype), arr.ndim
    hdr[4 : 4 + arr.ndim] = arr.shape
    return hdr
