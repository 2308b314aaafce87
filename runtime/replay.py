"""Untimed replay: the unit programs in their functional order, to find where they deadlock.

The programs on the simulator's cores make no timing-dependent choices (every receive names
its channel, control flow reads only registers, control values and integer data; the one
exception, :class:`~lowering.isa.WaitAny`, whose choice is the timed run's, follows here the
order a timed run recorded (:attr:`Replay.order`: it waits for the input recorded next, so the
choice is data), or without one takes the lowest index holding a message when the core looks
(one fair schedule's choice, not necessarily the timed run's)), so they form
a Kahn process network on bounded channels (Cyclotron §9.1, DAM's bounded channels; STeP arXiv
2511.07776 §4.2).  Its channel histories, and the state in which it deadlocks (where every
program stands, which messages each FIFO holds), do not depend on timing: any fair schedule
reaches the same one.  :class:`Replay` reaches it without the timing model — no clocks, no
resource reservations, no events: a ready queue of cores, each run until it blocks on

* a message: an instruction reading or overwriting a buffer whose receive has no message yet,
  or a ``RecvValue`` / ``Recv`` with stop waiting for its value;
* FIFO space: a ``Send`` to a destination whose FIFO holds ``depth`` messages no receive has
  taken;
* a barrier, until every member has arrived.

Everything else completes at once (HBM accesses, compute, the DMA queue: they only take time).
Buffers keep their shapes and types as the simulator's do (an Alloc's, a kernel's shape rule,
a Load's extents, a received message's): a ``WriteValue`` writes a control value into the shape
its buffer has then (a decode request's cursor, STeP arXiv 2511.07776 §5.1), and a control Load
reads in the buffer's type.  Only the shapes a ``WriteValue`` can read are followed: a kernel
whose output reaches no ``WriteValue`` (through other kernels, sends and receives) skips its
shape rule (:func:`runtime.replay_rules.shape_readers`), as nothing else reads a shape.
A message is taken when a receive is matched with it, which frees its FIFO slot; in the timed
simulation the slot frees when the message has also arrived, which always happens later, so
the deadlocked states agree.  Each blocked core is checked in the order the simulator's
handlers check (reads before writes, destinations in order), so the wait-for graph
(:meth:`waits`, :func:`runtime.report.wait_for`) is the simulator's at the same deadlock.

:meth:`runtime.Simulator.replay` builds one on the simulator's compiled programs, and
:meth:`Replay.close` puts them back as compiled, so the timed run needs no second compile.  It has the simulator's deadlock interface —
:meth:`resume` raises :class:`~runtime.DeadlockError` when stuck, :meth:`waits`, :meth:`deepen` —
so :func:`torch2step.spatial.fifos.discover_deep` runs on either.  Anything the replay does not
model (an operation it has no rule for) raises :class:`ReplayUnsupported`; callers then search
on the timed simulation.  The rules, one per simulator handler, are in :mod:`runtime.replay_rules`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from runtime.checks import describe
from runtime.errors import DeadlockError, SimulationError
from runtime.program import Compiled
from runtime.replay_rules import RULES, skip_unread_shapes
from runtime.report import wait_for
from runtime.state import Core, Post, StopPost

__all__ = ["Replay", "ReplayUnsupported"]


class ReplayUnsupported(SimulationError):
    """The programs use an operation the untimed replay has no rule for."""


class Replay:
    """The untimed replay of compiled programs ``comp`` (module docstring); ``hbm``: the
    integer HBM tensors control data is read from (timing mode's inputs)."""

    copy_starts = None  # records no copies' starts (runtime.program_layers.h_call)

    def __init__(
        self,
        comp: Compiled,
        hbm: dict[str, np.ndarray],
        name: str,
        give_back: Callable[[Compiled], None] | None = None,
    ) -> None:
        self.comp = comp
        self.give_back = give_back
        self.hbm = hbm
        self.name = name
        self.dirty: set[str] = set()
        #: ``WaitAny`` register -> the inputs to choose, in order (a timed run's recorded
        #: choices, :func:`runtime.ops_select.watch_key`); a register not listed, or past its
        #: list, takes the lowest ready index (:func:`runtime.replay_rules._waitany`)
        self.order: dict[str, list[int]] = {}
        #: ``WaitAny`` register -> the inputs this replay chose, in order
        self.chosen: dict[str, list[int]] = {}
        self.queue: deque[Core] = deque(comp.active)
        self.ndone = 0
        self.shapes: dict[tuple, tuple] = {}  # (Compute, input shapes) -> output shapes
        #: what the replay changes of each buffer's declaration, to put back (:meth:`close`)
        self.decl = [
            (b, b.dtype, b.alloc_shape, b.shape) for core in comp.cores for b in core.bufs.values()
        ]
        #: each active core's program as ``(rule, operation)`` pairs, indexed by ``pc`` (the
        #: rule looked up once, not at every step; a layer call rebinds the operations' fields
        #: in place, so the pairs stay valid)
        self.steps: dict[int, list[tuple[Any, Any]]] = {}
        table = RULES
        for core in comp.active:
            steps = self.steps[core.id] = []
            for op in core.code:
                rule = table.get(op.fn)
                if rule is None:
                    raise ReplayUnsupported(
                        f"untimed replay has no rule for `{describe(op.src)}` ({op.fn.__name__})"
                    )
                steps.append((rule, op))
        skip_unread_shapes(self.steps)  # Computes whose output shapes nothing reads

    # -- the simulator's deadlock interface ----------------------------------------------------

    def resume(self) -> None:
        """Run every runnable core until all finish (returns) or the rest are blocked
        (raises :class:`DeadlockError` naming them)."""
        queue, plan = self.queue, self.steps
        while queue:
            core = queue.popleft()
            steps = plan[core.id]
            while True:
                rule, op = steps[core.pc]
                if not rule(self, core, op):
                    break
        if self.ndone < len(self.comp.active):
            stuck = [c for c in self.comp.active if not c.done]
            lines = [
                f"deadlock (untimed replay): {len(stuck)} core(s) are blocked "
                f"(program set {self.name!r})"
            ]
            lines += [f"  core {c.id} at `{describe(c.code[c.pc].src)}`" for c in stuck]
            raise DeadlockError("\n".join(lines))

    run = resume

    def close(self) -> None:
        """Put the compiled programs back in their state before the replay (everything a rule
        here or a register-only handler changes; FIFO depths keep :meth:`deepen`'s) and hand
        them to ``give_back`` (the simulator they were borrowed from).  The replay is unusable
        afterwards."""
        comp = self.comp
        for core in comp.cores:
            core.pc = 0
            core.regs = {}
            core.lc = [0] * len(core.lc)
            core.li = [0] * len(core.li)
            core.blocked = core.cur = core.bar = core.scan = None
            core.done = False
            for b in core.bufs.values():
                b.wp = None
                b.data = None
        for b, dtype, alloc_shape, shape in self.decl:
            b.dtype, b.alloc_shape, b.shape = dtype, alloc_shape, shape
        for ch in comp.chans.values():
            for end in ch.ends:
                end.unmatched.clear()
                end.posts.clear()
                end.waiter = end.watch = None
        for g in comp.groups.values():
            g.arrived = []
            g.gen = 0
        comp.rebind()
        give_back, self.give_back = self.give_back, None
        del self.comp
        if give_back is not None:
            give_back(comp)

    def waits(self) -> dict[int, tuple[int | None, str | None]]:
        """Each unfinished core's ``(core it waits on, full channel or None)``."""
        return wait_for(self)

    def channel_depth(self, name: str) -> int:
        """The current FIFO depth of channel ``name``."""
        return self.comp.chans[name].depth

    def deepen(self, name: str, depth: int) -> None:
        """Make channel ``name``'s FIFOs ``depth`` deep; a sender stopped on one retries."""
        state = self.comp.chans[name]
        state.set_depth(depth)
        for end in state.ends:
            w = end.waiter
            if w is not None:
                end.waiter = None
                self.wake(w)

    # -- scheduling ----------------------------------------------------------------------------

    def wake(self, core: Core) -> None:
        if core.blocked is not None:
            core.blocked = None
            self.queue.append(core)

    def block(self, core: Core, why: tuple, post: Post | None) -> bool:
        core.blocked = why
        if post is not None:
            if post.waiters is None:
                post.waiters = [core]
            else:
                post.waiters.append(core)
        return False

    def error(self, core: Core, msg: str) -> SimulationError:
        ins = core.code[core.pc].src if core.pc < len(core.code) else None
        return SimulationError(f"core {core.id} (untimed replay), `{describe(ins)}`: {msg}")

    def match(self, post: Post, payload: tuple) -> None:
        """A receive took a message: its value or data lands, its FIFO slot frees."""
        data, tensor, value, shape = payload
        post.time = 0
        b = post.buf
        if post.__class__ is StopPost:
            if tensor:
                post.value = -1
            else:
                b = None
        if b is not None:
            if not tensor:
                raise self.error(post.core, "a receive into a buffer took a control value")
            b.data = data
            b.shape = shape
        else:
            if value is None:
                raise self.error(post.core, "a value receive took a tensor")
            post.value = value
        ws = post.waiters
        if ws:
            post.waiters = None
            for c in ws:
                self.wake(c)
        w = post.end.waiter
        if w is not None:
            post.end.waiter = None
            self.wake(w)
