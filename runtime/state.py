"""Mutable run-time state of the simulator: cores, SRAM buffers, channel FIFOs, pending operations.

Plain ``__slots__`` classes (not frozen dataclasses): they are the simulator's working memory and
are mutated on every event.  The frozen, user-facing results live in :mod:`runtime.stats`.

Stream FIFOs follow DAM's bounded channels (Cyclotron §9.1, STeP §4.2): a channel of depth
``d`` holds at most ``d`` messages per destination that were sent but not yet consumed; a send
blocks while any destination's FIFO is full (back-pressure) and the slot frees when the receiver
consumes the message.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from runtime.network import FORM_NEXT

__all__ = [
    "fifo_depth",
    "hold",
    "BUSY",
    "RECV",
    "SEND",
    "MEM",
    "BAR",
    "CATEGORIES",
    "Pending",
    "Post",
    "ValueRead",
    "Slot",
    "ChanEnd",
    "ChanState",
    "Buf",
    "Core",
    "Group",
]

#: FIFOs deeper than this keep their queues in deques (:meth:`ChanState.set_depth`)
LONG_FIFO = 16

#: Cycle categories of a core (indices into ``Core.st``); idle is whatever is left over.
BUSY, RECV, SEND, MEM, BAR = range(5)
CATEGORIES = ("busy", "stall_recv", "stall_send", "stall_mem", "stall_barrier")


def fifo_depth(declared: int | None, chip: Any) -> int:
    """The depth in messages of a channel's FIFOs: its ``declared`` depth, or else the chip's
    ``core.fifo_depth`` (the one place that decides it; a running simulation changes a
    channel's depth only through :meth:`runtime.Simulator.deepen`)."""
    return chip.core.fifo_depth if declared is None else declared


class Pending:
    """An operation whose completion cycle is not known yet (``time is None``); cores that need
    it wait in ``waiters``.  ``kind`` (per class) is the cycle category a wait on it is charged
    to; ``what`` names the HBM tensor for messages."""

    __slots__ = ("time", "waiters", "what")
    kind = MEM

    def __init__(self, what: str) -> None:
        self.time: int | None = None
        self.waiters: list[Core] | None = None
        self.what = what


class Post(Pending):
    """A receive posted by ``core`` at cycle ``post_t`` into ``buf`` (a tensor message) or for a
    control value (``buf is None``), matched in order with the messages of channel end ``end``."""

    __slots__ = ("core", "buf", "end", "post_t", "value")
    kind = RECV

    def __init__(self, core: Core, buf: Buf | None, end: ChanEnd | None, post_t: int):
        self.time: int | None = None
        self.waiters: list[Core] | None = None
        self.core = core
        self.buf = buf
        self.end = end
        self.post_t = post_t
        self.value: int | None = None


class StopPost(Post):
    """A ``Recv`` with ``stop``: takes a tensor message into ``buf`` or the stream's stop
    token (a control value: ``value``; -1 after a tensor)."""

    __slots__ = ()


class ValueRead(Post):
    """A ``LoadValue``: an HBM read whose completion also carries the value read."""

    __slots__ = ()
    kind = MEM


class Slot:
    """One message on its way to one destination: ``arrival`` when its tail reaches the
    destination, ``consumed`` when a receive took it (the FIFO slot frees then); ``payload`` is
    ``(data, shape, dtype, value, elements)`` (``elements``: the product of ``shape``, 0 for a
    control value)."""

    __slots__ = ("arrival", "consumed", "post", "payload", "end")

    def __init__(self, end: ChanEnd, payload: tuple) -> None:
        self.arrival: int | None = None
        self.consumed: int | None = None
        self.post: Post | None = None
        self.payload = payload
        self.end = end

    @property
    def label(self) -> str:
        """Trace label of a unicast message (its channel)."""
        return self.end.chan.name

    def deliver(self, sim: Any, idx: int, end: int) -> None:
        """A unicast message's tail reached its destination at cycle ``end``."""
        self.arrival = end
        if self.post is not None:
            sim.consume(self)


class ChanEnd:
    """The FIFO of one channel at one destination core."""

    __slots__ = ("chan", "dst", "unmatched", "posts", "inflight", "waiter", "watch")

    def __init__(self, chan: ChanState, dst: int) -> None:
        self.chan = chan
        self.dst = dst
        # oldest first; lists, or deques once the channel is deep (ChanState.set_depth)
        self.unmatched: Any = []  # messages no receive has taken yet
        self.posts: Any = []  # receives no message has matched yet
        self.inflight: Any = []  # messages holding a FIFO slot (not consumed by `now`)
        self.waiter: Core | None = None  # the sender, blocked on a full FIFO
        self.watch: Core | None = None  # the receiver, blocked in a WaitAny with no message


class ChanState:
    """A channel's static route plus its per-destination FIFOs."""

    __slots__ = (
        "name", "src", "dsts", "depth", "roots", "pres", "plat", "pnext", "ends", "end1", "sent",
        "nbytes",
    )  # fmt: skip

    def __init__(self, name: str, src: int, dsts: tuple[int, ...], depth: int, roots: tuple):
        self.name = name
        self.src = src
        self.dsts = dsts
        self.depth = depth
        self.roots = roots
        #: when the route's one first stage is a resource followed by one resource stage and
        #: delivers nowhere (a unicast message's first hop: an all-to-all injection port, a
        #: mesh link), reserved by the send itself (:func:`runtime.ops_comm.h_send`): that
        #: resource (``pres``, else -1), its latency and the stage after it, kept here rather
        #: than read through the route's tuples (one message per channel, as in an all-to-all
        #: exchange, finds those out of cache)
        self.pres, self.plat, self.pnext = -1, 0, None
        if len(roots) == 1:
            res, lat, children, delivers, form = roots[0]
            if res >= 0 and form == FORM_NEXT and not delivers and children[0][0] >= 0:
                self.pres, self.plat, self.pnext = res, lat, children[0]
        self.ends = (
            (ChanEnd(self, dsts[0]),) if len(dsts) == 1 else tuple([ChanEnd(self, d) for d in dsts])
        )
        #: the one FIFO end of a channel to one destination (else None)
        self.end1: ChanEnd | None = self.ends[0] if len(dsts) == 1 else None
        self.sent = 0
        self.nbytes = 0
        if depth > LONG_FIFO:
            self.set_depth(depth)

    def set_depth(self, depth: int) -> None:
        """Change the depth (:meth:`runtime.Simulator.deepen`).  A deep FIFO's queues may grow
        long and are taken from the front, so they become deques (O(1) at the front; a short
        FIFO keeps lists, which are smaller and as fast when short)."""
        self.depth = depth
        if depth > LONG_FIFO:
            for end in self.ends:
                if end.inflight.__class__ is list:
                    end.unmatched = deque(end.unmatched)
                    end.posts = deque(end.posts)
                    end.inflight = deque(end.inflight)


class Buf:
    """An SRAM buffer of one core.  ``w``: cycle its last write completes (``wp``: a write whose
    cycle is unknown yet); ``r``: cycle the last pending read of it (a Send or Store) completes
    (``rp``: unknown ones).  ``wk``/``rk``: the category a wait on them is charged to."""

    __slots__ = (
        "name",
        "dtype",
        "eb",
        "cap",
        "alloc_shape",
        "allocated",
        "shape",
        "data",
        "w",
        "wk",
        "wp",
        "wq",
        "wqi",
        "r",
        "rk",
        "rp",
        "nbytes",
        "held",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = "bf16"
        self.eb = 2
        self.cap = 0
        self.alloc_shape: tuple[int, ...] = ()
        self.allocated = False
        self.shape: tuple[int, ...] = ()
        self.data: Any = None
        self.w = 0
        self.wk = BUSY
        self.wp: Pending | None = None
        self.wq: list[Pending] | None = None  # earlier Loads still in flight behind ``wp``
        self.wqi = 0  # ``wq[:wqi]`` are known to be resolved
        self.r = 0
        self.rk = BUSY
        self.rp: list[Pending] | None = None
        self.nbytes = 0  # bytes counted against the core's SRAM (``held``: its high-water mark)
        self.held = False


class Group:
    """A barrier group: members, arrivals of the current generation."""

    __slots__ = ("name", "members", "arrived", "gen", "release_t")

    def __init__(self, name: str, members: tuple[int, ...]) -> None:
        self.name = name
        self.members = members
        self.arrived: list[Core] = []
        self.gen = 0
        self.release_t = 0


class Core:
    """A core's sequencer: program counter, local clock ``t`` (never behind the instructions it
    has issued), registers, buffers, outstanding DMA, per-category cycle counters."""

    __slots__ = (
        "id",
        "code",
        "pc",
        "t",
        "regs",
        "bufs",
        "lc",
        "li",
        "done",
        "finish",
        "blocked",
        "cur",
        "bar",
        "st",
        "stepped",
        "ff",
        "sram",
        "sram_peak",
        "dma",
        "dma_k",
        "dma_p",
        "dmaq",
        "scan",
    )

    def __init__(self, cid: int) -> None:
        self.id = cid
        self.code: list = []
        self.pc = 0
        self.t = 0
        self.regs: dict[str, int] = {}
        self.bufs: dict[str, Buf] = {}
        self.lc: list[int] = []
        self.li: list[int] = []
        self.done = False
        self.finish = 0
        self.blocked: tuple | None = None
        self.cur: Post | None = None
        self.bar: tuple[Group, int] | None = None
        self.st = [0, 0, 0, 0, 0]
        self.stepped = 0
        self.ff = 0
        self.sram = 0
        self.sram_peak = 0
        self.dma = 0
        self.dma_k = BUSY
        self.dma_p: list[Pending] = []
        self.dmaq: list = []  # outstanding HBM requests: completion cycle or Pending
        self.scan: tuple | None = None  # where a blocked wait on many buffers stopped


def hold(sim: Any, core: Core, b: Buf) -> None:
    """A buffer allocated ``held`` (``Alloc.held``) now holds ``b.shape``: the core's on-chip
    account grows to its new high-water mark (checked against the core's SRAM)."""
    n = math.prod(b.shape) * b.eb
    if n <= b.nbytes:
        return
    core.sram += n - b.nbytes
    b.nbytes = n
    if core.sram > sim.core_spec.sram_bytes:
        raise sim.error(
            core,
            f"SRAM overflow: buffer {b.name!r} now holds {n} bytes, which brings the core to "
            f"{core.sram} bytes held, it has {sim.core_spec.sram_bytes}; use smaller tiles",
        )
    if core.sram > core.sram_peak:
        core.sram_peak = core.sram
