"""Building one unit's program: receives, unit steps, sends, HBM accesses, buffers, loops.

Emitters (:mod:`.emit_memory`, :mod:`.emit_compute`, :mod:`.emit_routing`) describe what a unit
does element by element with the methods of :class:`UnitBuilder`; the builder turns that into
instructions of :mod:`lowering.isa`:

* ``recv(stream, k)`` receives the messages of element ``k`` (``Recv`` into a buffer for a tile,
  ``RecvValue`` into a register for a control value); parts generated where they are used
  (graph inputs, padding) need no message.  A message reached twice (``Zip(x, x)``) is
  received once.
* ``compute(cycles, ins, outs)`` is one unit step of ``cycles`` (:mod:`.timing`): a ``Compute``
  that waits for its input buffers and writes buffers of the output elements' sizes (with a
  row rule, :mod:`.rows`, both follow the run-time rows of an input tile).
* ``send(stream, k, elem)`` sends element ``k`` of an output stream (nothing if no unit reads
  the stream); a control value received into a register and forwarded is sent from that
  register, one loaded as a ``[1, 1]`` integer tile is read from its buffer (``ReadValue``,
  once the load has landed), one the unit computes carries the run's value.
* ``load`` / ``store`` access an HBM tensor at an element offset held in an address register.
* ``stops`` maps a channel carrying a stop token (a Partition's output, STeP §3.2.3) to its
  element messages: the token is received right after the last of them (at the program's start
  when the stream is empty this run).
* Off-chip dependences (:mod:`.hazards`): ``waits`` maps a tensor to the completion-token
  channels its first ``load`` receives from first; ``notify`` is the token channel a storing
  unit sends on after a fence at its end.

Buffers (named per role, rotating, allocated once at their largest size or held at a count's
bound) and what the program leaves to the run's row counts are the builder's base,
:class:`~.unit_buffers.UnitBuffers`.  Messages are sent flattened (a ``rows x cols`` tile is a
``(rows * cols,)`` message: the bytes are what the simulator times).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sympy import Indexed

from lowering.isa import (
    Affine,
    Barrier,
    Compute,
    Instr,
    Load,
    ReadValue,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
    Store,
)
from torch2step.errors import LoweringError

from .compress import compress
from .hazards import fence_group
from .streams import Part, StreamInfo
from .timing import STEP_KERNEL, RowRule, TimingModel

if TYPE_CHECKING:
    from .context import EmitCtx
from .unit_buffers import Bound, MessageRows, UnitBuffers

__all__ = ["Slot", "Elem", "UnitBuilder"]

_I = TypeVar("_I")

#: One part of an element at the unit: the part and the buffer (data) or register (value)
#: holding it, ``None`` when it was generated locally and is not materialised.
Slot = tuple[Part, str | None]
Elem = tuple[Slot, ...]


class UnitBuilder(UnitBuffers):
    """Instruction steps of one unit (see the module docstring).

    ``has_dsts(channel)`` tells whether any other unit receives a channel; ``own(channel)``
    whether this unit produces it (its own streams are internal, never received); ``waits``
    and ``notify`` are the unit's off-chip dependences (module docstring)."""

    def __init__(
        self,
        name: str,
        timing: TimingModel,
        has_dsts: Callable[[str], bool],
        own: Callable[[str], bool],
        waits: dict[str, list[str]] | None = None,
        notify: str | None = None,
        stops: dict[str, int] | None = None,
        bound: Bound | None = None,
        grouped: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(bound)
        self.name = name
        # whether a control value this unit sends is the run's literal (not a register's)
        self.literal_values = False
        self.timing = timing
        self.has_dsts = has_dsts
        self.own = own
        self.waits = {t: list(chs) for t, chs in (waits or {}).items()}
        self.notify = notify
        self.stops = dict(stops or {})
        # channels with a stop token after each innermost group (:mod:`.buffer_loop`)
        self.grouped = grouped
        self.steps: list[tuple[Instr, ...]] = []
        self.cur: list[Instr] = []
        self.next_seq: dict[str, int] = defaultdict(int)
        self.sent_seq: dict[str, int] = defaultdict(int)  # messages sent per channel
        for ch, n in self.stops.items():
            if n == 0:  # the stop token of an empty stream: received at the start (body)
                self.next_seq[ch] = 1
        self.held: dict[tuple[str, int], str] = {}
        self.content: dict[str, tuple[str, int]] = {}
        self.regs: dict[str, int] = {}
        self.received = 0
        self.sent = 0
        self._made: dict[tuple, Any] = {}
        self._step_of: dict[tuple[int, ...], tuple[Instr, ...]] = {}

    def make(self, cls: type[_I], *args: Any) -> _I:
        """The instruction ``cls(*args)``, one object per distinct value in this unit.

        A unit's program repeats the same few instructions once per element it handles (the
        steps :func:`~.compress.compress` folds into loops); instructions are immutable, so
        the repeats share one object: it is built once (a frozen dataclass's ``__init__``
        costs more than a lookup) and the loop folding finds it by identity, without hashing
        its fields again."""
        key = (cls, args)
        x = self._made.get(key)
        if x is None:
            x = self._made[key] = cls(*args)
        return x  # type: ignore[no-any-return]

    # -- structure -------------------------------------------------------------------------------

    def emit(self, *instrs: Instr) -> None:
        """Append instructions to the current step."""
        self.cur.extend(instrs)

    def step(self) -> None:
        """Close the current step (the unit of loop folding).  Equal steps of the same
        instruction objects (:meth:`make`) are one tuple, so the loop folding looks each
        distinct step up once (the instructions it holds stay alive, so their ids do)."""
        if self.cur:
            key = tuple(map(id, self.cur))
            s = self._step_of.get(key)
            if s is None:
                s = self._step_of[key] = tuple(self.cur)
            self.steps.append(s)
            self.cur = []

    # -- streams ---------------------------------------------------------------------------------

    def recv(self, info: StreamInfo, k: int, rotation: int = 1, role: tuple | None = None) -> Elem:
        """Receive element ``k`` of stream ``info`` (see the module docstring) into buffers of
        ``role`` (default: one role per channel)."""
        slots: list[Slot] = []
        for i, (chan, seq, part) in enumerate(info.pieces[k]):
            if chan is None or self.own(chan):
                slots.append((part, None))
                continue
            nxt = self.next_seq[chan]
            if seq < nxt:
                b = self.held.get((chan, seq))
                if b is None or self.content.get(b) != (chan, seq):
                    raise LoweringError(
                        f"unit %{self.name} reads message {seq} of stream %{chan} twice, after "
                        "it was overwritten; a unit may read one stream through two inputs only "
                        "in lockstep (as Zip(x, x) does)"
                    )
                slots.append((part, b))
                continue
            if seq > nxt:
                raise LoweringError(
                    f"unit %{self.name} would read message {seq} of stream %{chan} before "
                    f"message {nxt}; channels deliver in order, so a unit must read one stream's "
                    "elements in order through all of its inputs"
                )
            self.next_seq[chan] = seq + 1
            if part.kind == "data":
                r = ("in", chan) if role is None else role
                decls, dyn = info.decl()
                rows = sized = None
                decl = decls[i]
                if dyn[i] or decl is not None and not decl.shape[1].is_Integer:
                    rows = self._rows(decl)
                if rows is not None and isinstance(rows[0], Indexed):
                    # a ragged row count, one per element (a KV tile's): this message's rows
                    rows = (MessageRows(chan, seq), rows[1])
                if rows is not None and decl is not None:
                    sized = (*rows, int(decl.shape[1]), 0)
                b = self.buffer((*r, i), part.dtype, part.elems, rotation, sized)
                self._holds(b, rows)
                self.emit(self.make(Recv, chan, b))
            else:
                b = f"v.{chan}.{i}"
                self.emit(self.make(RecvValue, chan, b))
            self.held[(chan, seq)] = b
            self.content[b] = (chan, seq)
            slots.append((part, b))
            if self.stops.get(chan) == seq + 1:  # the stream's stop token follows its last
                self.emit(self.make(RecvValue, chan, f"stop.{chan}"))
                self.next_seq[chan] = seq + 2
        self.received += 1
        return tuple(slots)

    def compute(
        self,
        cycles: int,
        ins: Iterable[Elem] = (),
        outs: Sequence[Part] = (),
        role: str = "out",
        rotation: int = 2,
        flops: int = 0,
        into: Elem | None = None,
        rule: RowRule | None = None,
        const: bool = False,
    ) -> Elem:
        """One unit step of ``cycles`` reading ``ins`` and producing an element of ``outs`` in
        the next buffers of ``role`` (or in the buffers of ``into``: an accumulator).  With
        ``rule`` (:mod:`.rows`) the step's cycles and output sizes follow the run-time rows of
        the rule's part of ``ins[0]`` (``cycles`` and ``outs`` are this run's values).
        ``const``: ``cycles`` are the timing model's for any element (a one-cycle dequeue or
        forward, STeP §4.2), not the sizes of this run's."""
        ins = tuple(ins)
        # the data buffers read, each once, in order (a dict: a step may read thousands)
        in_bufs: list[str] = list(
            dict.fromkeys(b for e in ins for part, b in e if b is not None and part.kind == "data")
        )
        slots: list[Slot] = []
        out_bufs: list[str] = []
        sizes: list[str] = []
        # with a row rule, the outputs' sizes (and capacity) follow the input tile's rows
        applied = False
        rows = None
        if rule is not None and ins:
            held = ins[0][rule.slot][1]
            applied = (
                held is not None
                and held in in_bufs
                and len(rule.outs) == sum(p.kind == "data" for p in outs)
            )
            if applied:
                rows = self.rows_of.get(held)  # type: ignore[arg-type]
        if self.rows_of and not applied and not (const and not outs):
            # cycles and output sizes are this run's: the program depends on the rows of
            # any run-sized tile the step reads or writes
            rows_of = self.rows_of
            if any(b in rows_of for b in in_bufs) or (
                into is not None and any(b in rows_of for _, b in into)
            ):
                self.rows_free = False
        j = 0
        for i, part in enumerate(outs):
            if part.kind == "data":
                b = into[i][1] if into is not None else None
                sized = None
                if rows is not None and rule is not None:
                    a, c = rule.outs[j]
                    sized = (rows[0], rows[1], a, c)
                j += 1
                if b is None:
                    b = self.buffer((role, i), part.dtype, part.elems, rotation, sized)
                elif sized is not None:  # an accumulator: its pool takes the sizes too
                    self._resize(b, sized)
                self._holds(b, rows)
                self.content.pop(b, None)
                out_bufs.append(b)
                sizes.append(str(part.elems))
                slots.append((part, b))
            else:
                slots.append((part, None))
        t = self.timing
        params: tuple = (("cycles", cycles), ("outs", ",".join(sizes)), ("rate", t.enc_rate))
        if rule is not None:
            held = ins[0][rule.slot][1] if ins else None
            if held is not None and held in in_bufs and len(rule.outs) == len(out_bufs):
                params = rule.params(in_bufs.index(held), t.enc_rate)
        outs_t, ins_t = tuple(out_bufs), tuple(in_bufs)
        self.emit(self.make(Compute, STEP_KERNEL, outs_t, ins_t, params, t.enc_dtype))
        self.flops += flops
        self.busy_cycles += cycles
        if rows is not None and rule is not None:
            n = ins[0][rule.slot][0].elems // rule.cols  # the rows of this run's tile
            first = rule.terms[0] if rule.terms else None
            counted = first is not None and first[0] * n + first[1] == flops
            if flops and not counted:
                self.rows_free = False  # FLOPs the rule cannot give for other rows
            self.rule_steps.append((rule, rows[0], cycles, flops, counted))
        return tuple(slots)

    def compute_instr(self, cycles: int, ins: Sequence[str]) -> Compute:
        """The ``Compute`` of a unit step of ``cycles`` that reads buffers ``ins`` and writes
        nothing, not yet emitted (for a step inside a run-time branch; the caller counts its
        cycles in ``busy_cycles`` for the elements this run takes through it)."""
        t = self.timing
        params = (("cycles", cycles), ("outs", ""), ("rate", t.enc_rate))
        return self.make(Compute, STEP_KERNEL, (), tuple(ins), params, t.enc_dtype)

    def consume(self, *elems: Elem) -> None:
        """A single-cycle step that waits for ``elems`` (dequeuing a reference or selector)."""
        self.compute(1, elems, const=True)

    def materialize(self, elem: Elem, parts: Sequence[Part]) -> Elem:
        """``elem`` with every data part of ``parts`` in a buffer (a locally generated tile, or
        a control value that must travel as a tile, is made by a single-cycle step)."""
        missing = [
            i
            for i, (p, (q, b)) in enumerate(zip(parts, elem))
            if (b is None or q.kind != "data") and p.kind == "data"
        ]
        if not missing:
            return elem
        made = self.compute(1, (), [parts[i] for i in missing], role="gen")
        slots = list(elem)
        for i, s in zip(missing, made):
            slots[i] = s
        return tuple(slots)

    def send(self, info: StreamInfo, k: int, elem: Elem) -> None:
        """Send element ``k`` of output stream ``info`` from ``elem``'s buffers."""
        chan = info.channel
        if chan is None or not self.has_dsts(chan):
            return
        parts = info.parts(k)
        if len(parts) != len(elem):  # pragma: no cover - emitters pass matching elements
            raise LoweringError(f"unit %{self.name}: element {k} of %{chan} has other parts")
        elem = self.materialize(elem, parts)
        self.sent_seq[chan] += len(parts)
        _, dyn = info.decl()
        for i, (part, (q, b)) in enumerate(zip(parts, elem)):
            if part.kind == "data":
                assert b is not None
                if i < len(dyn) and dyn[i] and b not in self.rows_of:
                    self.rows_free = False  # a run-sized tile made to this run's size
                self.emit(self.make(Send, chan, b))
            elif b is not None and q.kind == "value" and q.value == part.value:
                # a received control value forwarded: its register
                self.emit(self.make(SendValue, chan, b))
            elif b is not None and q.kind == "data" and q.dtype == part.dtype and q.elems == 1:
                reg = f"val.{chan}"  # a control value loaded as a [1, 1] integer tile: read it
                self.emit(self.make(ReadValue, reg, b, 0), self.make(SendValue, chan, reg))
            else:
                self.emit(self.make(SendValue, chan, part.value))
                self.literal_values = True
        self.sent += 1

    # -- HBM -------------------------------------------------------------------------------------

    def _addr(self, reg: str, value: int) -> Affine:
        old = self.regs.get(reg)
        make = self.make
        if old is None:
            self.emit(make(Set, reg, value))
        elif value != old:
            self.emit(make(Set, reg, make(Affine, value - old, ((reg, 1),))))
        self.regs[reg] = value
        return make(Affine, 0, ((reg, 1),))

    def _region(
        self, starts: Sequence[int | Affine], extents: Sequence[int | Affine], reg: str
    ) -> Region:
        """A region whose literal starts are kept in address registers (``reg``, or ``reg0``,
        ``reg1``... per dimension), so regular address sequences fold into loops."""
        many = len(starts) > 1
        at = tuple(
            self._addr(f"{reg}{d}" if many else reg, x) if isinstance(x, int) else x
            for d, x in enumerate(starts)
        )
        return self.make(Region, at, tuple(extents))

    def load(
        self,
        tensor: str,
        starts: Sequence[int | Affine],
        extents: Sequence[int | Affine],
        dtype: str,
        rotation: int,
        reg: str = "ld",
        elems: int | None = None,
        sized: tuple[object, int, int, int] | None = None,
    ) -> Elem:
        """Load the region ``starts`` / ``extents`` of ``tensor`` (literal starts, kept in
        address registers, or expressions of a received register) into the next buffer.
        ``elems``: the element count of a region whose extents are run-time expressions;
        ``sized``: ``(rows, bound, a, c)`` when they are ``a*rows + c`` of rows the program
        reads at run time, at most ``bound`` (the buffer is held at the bound)."""
        self._await(tensor)
        if elems is not None and sized is None:  # a region the run sizes
            self.rows_free = False
        n = math.prod(extents) if elems is None else elems  # type: ignore[arg-type]
        part = Part("data", dtype, n)
        region = self._region(starts, extents, reg)
        b = self.buffer(("ld",), part.dtype, part.elems, rotation, sized)
        self._holds(b, None if sized is None else (sized[0], sized[1]))
        self.content.pop(b, None)
        self.emit(self.make(Load, b, tensor, region))
        return ((part, b),)

    def store(
        self,
        tensor: str,
        starts: Sequence[int | Affine],
        extents: Sequence[int],
        elem: Elem,
        reg: str = "st",
    ) -> None:
        """Store the (single, data) part of ``elem`` into the region of ``tensor``."""
        ((part, _),) = elem
        data = Part("data", part.dtype, part.elems)
        ((_, b),) = self.materialize(elem, (data,))
        region = self._region(starts, extents, reg)
        assert b is not None
        if b in self.rows_of:  # the region is the run's tile size
            self.rows_free = False
        self.emit(self.make(Store, b, tensor, region))

    def _await(self, tensor: str) -> None:
        """Receive the completion tokens of the earlier stores of ``tensor`` (once)."""
        for ch in self.waits.pop(tensor, ()):
            self.emit(self.make(RecvValue, ch, f"done.{ch}"))

    # -- result ----------------------------------------------------------------------------------

    def body(self) -> tuple[Instr, ...]:
        """The program: allocations, then the steps with repetitions folded into loops, then
        the tokens of off-chip dependences (leftover waits; the fence and the notification)."""
        self.step()
        empty = [RecvValue(ch, f"stop.{ch}") for ch, n in sorted(self.stops.items()) if n == 0]
        if empty:  # streams with no element this run: only their stop tokens arrive
            self.steps.insert(0, tuple(empty))
        for tensor in sorted(self.waits):
            self._await(tensor)
        if self.notify is not None:
            self.emit(Barrier(fence_group(self.name)), SendValue(self.notify, 1))
        self.step()
        return self.allocs() + compress(self.steps)


def check_unit_io(
    b: UnitBuilder,
    ctx: EmitCtx,
    reads: Iterable[str],
    sends: Iterable[str],
    tokens: Mapping[str, int],
) -> None:
    """That the unit of ``b`` received every message of the streams ``reads`` and sent every
    message of ``sends`` in the run of ``ctx`` (``tokens``: the stop tokens per channel)."""
    for ch in reads:
        want = ctx.streams[ch].messages + tokens.get(ch, 0)
        if b.next_seq.get(ch, 0) != want:  # pragma: no cover - emitters read whole streams
            raise LoweringError(
                f"unit %{b.name} received {b.next_seq.get(ch, 0)} of the {want} messages of "
                f"stream %{ch}"
            )
    for ch in sends:
        want = ctx.streams[ch].messages + tokens.get(ch, 0)
        if b.sent_seq.get(ch, 0) != want:
            raise LoweringError(
                f"unit %{b.name} sent {b.sent_seq.get(ch, 0)} of the {want} messages of stream "
                f"%{ch} in this run; its emitter must send every element of its output streams"
            )
