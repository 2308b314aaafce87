"""Reusing unit programs across runs: each unit's program keyed by what it was specialised to.

A spatial plan's unit programs are emitted from one run (:mod:`.plan`); most of them read from
that run only a little: the structure of the streams they receive and send, a few size
expressions.  While a unit is emitted, :class:`EmitCtx` records what its emitter asked of the
run (:class:`Deps`): the streams it looked at (by name, each at the level its program depends
on it), the size expressions it evaluated (and their values), whether each of its output
channels has a reader, the bounds its run-sized buffers were allocated at.  A later run of the
same graph on the same chip reuses the unit's program — the same instruction tuple, not
rebuilt — when everything recorded is the same in it:

* a stream is the same when its messages are (:class:`RunStreams`): the channel and sequence
  number of every message, every message's part (data by dtype and size, control values by
  value), where its stop tokens fall and every tile's shape — floating-point data never enters
  a program.  A unit whose program takes a stream's control values at run time (a Partition's
  selectors, a selector computed in registers, values forwarded from the registers they came
  in) reads it at level :data:`FORM`, without the values; one that takes its tiles' rows at
  run time (row rules, buffers at a bound: :class:`~.sizing.Sizing`) at level :data:`ROWS`,
  without the tiles' sizes; a routing unit reads the streams it routes to by their channels
  only;
* an expression is the same when it evaluates to the same value under the new bindings.

A unit kept for a run that differs from its own in what the program leaves to the run gets
that run's bookkeeping (:class:`~.plan.UnitInfo`): the elements its run-time decisions take
(:data:`Tally`), its FLOPs, step cycles and bytes held (:class:`~.sizing.Sizing`), all
counted from the new run's streams and sizes; so the assembled plan is the one a fresh build
gives.

For a new routing of an MoE built with dynamic tiling this keeps the loads, the routing units
(selector, Partition, Reassemble), the sum and store, every unit of an expert whose token count
did not change, and of an expert whose count changed (but that has tokens in both runs) its
weight loads, repeats, column split, matmuls, activation and scaling, its routing weights'
Map and Accum and the FlatMap back to rows, its Bufferize with its Streamify and the row
packing (loops until a stop token or over the count it carries, :mod:`.stop_loop`,
:mod:`.buffer_loop`, reading their streams at level :data:`EACH`); and of an expert that has
tokens in only one of the runs every unit too: its routing weights' Map and packing, whose
loops are built alike for an empty stream (level :data:`EVERY`), and the units after its
Bufferize, which learn at run time whether it holds a row and are built, for a run that gives
it none, from its streams as one token would make them (:mod:`.guard`: compared in that view,
their bookkeeping then only the bytes their buffers hold).
With static tiling every unit is kept too: an expert's units loop over its tiles until a
stop token and are built from a view of the run with one full tile (:mod:`.tile_loop`).
A cache keeps the streams of the latest runs it emitted units for (two by default), to
compare them with a new run's, stream by stream, each comparison stopping at the first
difference and made once per stream and level.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lowering.isa import Instr

from .unit_buffers import MessageRows

if TYPE_CHECKING:
    from .context import EmitCtx, TensorLayout
    from .plan import UnitInfo
    from .sizing import Sizing
    from .streams import StreamInfo

__all__ = [
    "ALL",
    "BOTH",
    "EACH",
    "EVERY",
    "FORM",
    "SHAPE",
    "ROWS",
    "Deps",
    "looser",
    "RunStreams",
    "Tally",
    "UnitCache",
    "nesting",
]

#: What a unit's program read of a stream: its messages with their control values (``ALL``),
#: or only their channels, kinds and sizes and the stream's structure (``FORM``: a unit that
#: decides from the values at run time, as a Partition does from its selectors).
ALL = "all"
FORM = "form"
#: Or its messages without the sizes of their data (``ROWS``: a unit that reads the rows of
#: its tiles at run time, :class:`~.sizing.Sizing`); control values and the stream's structure
#: (how many elements each dimension has) are compared.
ROWS = "rows"
#: Neither (``FORM`` and ``ROWS``): the channels, kinds and types of its messages and the
#: stream's structure.
BOTH = "form+rows"
#: Or the distinct forms of its elements (each element's messages by channel, kind, type,
#: size and control value, and its tiles' shapes) and its rank, not how many elements it has:
#: a unit that loops over the stream until its stop token (:mod:`.stop_loop`), the same program
#: for every element count.  It compares sizes and values, so only :data:`EVERY` relaxes it.
EACH = "each"
#: Or as :data:`EACH`, an empty stream being the same as any of its rank: a loop until the stop
#: token whose emitter builds the same program for an empty stream, the element's form taken
#: from the stream's declared type (:func:`~.stop_loop.emit_pack_loop`).
EVERY = "every"
#: Or only its structure (how many elements each dimension has) and the channels its
#: messages come from: a unit that decides at run time which of a padded stream's elements are
#: real (static tiling's padding, :mod:`.static_pad`), from the stop token of that channel.
SHAPE = "shape"


def looser(level: str, than: str) -> str:
    """``level`` relaxed by ``than`` (:data:`FORM`, :data:`ROWS`, :data:`EACH`,
    :data:`EVERY` or :data:`SHAPE`)."""
    if SHAPE in (level, than):  # with a level that drops the structure: neither relaxes
        other = than if level == SHAPE else level
        return ALL if other in (EACH, EVERY) else SHAPE
    if EVERY in (level, than):
        return EVERY
    if level == EACH or than == EACH:
        return EACH
    if level == ALL:
        return than
    return level if level == than else BOTH


_ORDER = itertools.count()


def nesting(data: Any, rank: int) -> list:
    """Per level, the lengths of the stream's nodes (the positions of its stop tokens)."""
    out = []
    nodes = [data]
    for _ in range(rank + 1):
        out.append([len(n) for n in nodes])
        nodes = [c for n in nodes for c in n]
    return out


def _shape(x: Any) -> Any:
    if hasattr(x, "shape"):
        return tuple(x.shape)
    if isinstance(x, tuple):
        return tuple(_shape(v) for v in x)
    return None


def _leaf_shapes(x: Any) -> list[tuple[int, ...] | None]:
    """The shape of every leaf of element ``x`` (one message each), ``None`` for a value."""
    if hasattr(x, "shape"):
        return [tuple(x.shape)]
    if isinstance(x, tuple):
        return [s for v in x for s in _leaf_shapes(v)]
    return [None]


class RunStreams:
    """The streams of one run, compared with another run's stream by stream (module
    docstring): the messages (channel, sequence number, part: data by dtype and size, control
    values by value), where the stop tokens fall and every tile's shape.  Comparisons are
    remembered, and stop at the first difference."""

    def __init__(self, streams: Mapping[str, StreamInfo], run: int | None = None) -> None:
        self.streams = streams
        self.order = next(_ORDER)
        #: the run these streams are of (another view of one run shares its number:
        #: :mod:`.guard`)
        self.run = self.order if run is None else run
        self._form: dict[str, tuple[list, list]] = {}
        self._masked: dict[tuple[str, str], list] = {}
        self._each: dict[str, tuple[int, frozenset]] = {}
        self._same: dict[tuple[int, str, str], bool] = {}
        self._rows: dict[str, dict[int, int]] = {}

    def _shape_of(self, name: str) -> tuple[list, list]:
        f = self._form.get(name)
        if f is None:
            info = self.streams[name]
            f = self._form[name] = (
                nesting(info.value.data, info.value.rank),
                [_shape(x) for x in info.flat],
            )
        return f

    def _forms(self, name: str) -> tuple[int, frozenset]:
        """The stream's rank and the distinct forms of its elements (level :data:`EACH`)."""
        f = self._each.get(name)
        if f is None:
            info = self.streams[name]
            f = self._each[name] = (
                info.value.rank,
                frozenset(
                    (
                        tuple((ch, p.kind, p.dtype, p.elems, p.value) for ch, _, p in pc),
                        _shape(x),
                    )
                    for pc, x in zip(info.pieces, info.flat)
                ),
            )
        return f

    def _pieces(self, name: str, level: str) -> Any:
        info = self.streams[name]
        if level == ALL:
            return info.pieces
        f = self._masked.get((name, level))
        if f is None:  # the pieces without control values (FORM) or data sizes (ROWS)
            if level == FORM:
                f = [
                    tuple((ch, seq, p.kind, p.dtype, p.elems) for ch, seq, p in pc)
                    for pc in info.pieces
                ]
            elif level == BOTH:
                f = [tuple((ch, seq, p.kind, p.dtype) for ch, seq, p in pc) for pc in info.pieces]
            else:
                f = [
                    tuple(
                        (ch, seq, p.kind, p.dtype, p.value if p.kind == "value" else -1)
                        for ch, seq, p in pc
                    )
                    for pc in info.pieces
                ]
            self._masked[(name, level)] = f
        return f

    def message_rows(self, at: MessageRows) -> int:
        """The rows of the tile in message ``at`` of this run (a ragged row count's value
        for one step of a kept program, :class:`~.unit_buffers.MessageRows`; ``seq < 0``:
        the most rows of any of the channel's messages, 0 without one)."""
        rows = self._rows.get(at.channel)
        if rows is None:
            info = self.streams[at.channel]
            rows = self._rows[at.channel] = {
                seq: shape[0]
                for pc, x in zip(info.pieces, info.flat)
                for (ch, seq, _), shape in zip(pc, _leaf_shapes(x))
                if ch == at.channel and shape is not None
            }
        if at.seq < 0:  # the most rows of any message of the channel
            return max(rows.values(), default=0)
        return rows[at.seq]

    def same(self, name: str, other: RunStreams, level: str = ALL) -> bool:
        """Whether stream ``name`` is the same in ``other`` as in this run, at ``level``
        (:data:`ALL`: its messages with their control values, :data:`FORM`: without them,
        :data:`ROWS`: without the sizes of its tiles, :data:`BOTH`: without either)."""
        key = (other.order, name, level)
        r = self._same.get(key)
        if r is None and level == SHAPE:
            r = name in self.streams and name in other.streams
            if r:
                a, b = self.streams[name], other.streams[name]
                r = self._shape_of(name)[0] == other._shape_of(name)[0] and {
                    pc[0][0] for pc in a.pieces if pc
                } | {None} == {pc[0][0] for pc in b.pieces if pc} | {None}
            self._same[key] = r
        if r is None and level in (EACH, EVERY):
            r = name in self.streams and name in other.streams
            if r:
                (ra, fa), (rb, fb) = self._forms(name), other._forms(name)
                # EVERY: an empty stream is as good as any (the loop takes its token only)
                r = ra == rb and (fa == fb or level == EVERY and not (fa and fb))
            self._same[key] = r
        if r is None:
            r = (
                name in self.streams
                and name in other.streams
                and self._pieces(name, level) == other._pieces(name, level)
                and (
                    self._shape_of(name)[0] == other._shape_of(name)[0]
                    if level in (ROWS, BOTH)
                    else self._shape_of(name) == other._shape_of(name)
                )
            )
            self._same[key] = r
        return r


#: The per-run part of a unit's bookkeeping that its program does not fix: ``(received, sent,
#: busy cycles, FLOPs)`` of the elements a run-time decision takes (a Partition's sends, a
#: Reassemble's selected inputs, the elements of a loop until a stop token), computed from a
#: run's streams.
Tally = Callable[["EmitCtx"], tuple[int, int, int, int]]


@dataclass
class Deps:
    """What one unit's emitter asked of the run: ``streams`` looked at (name -> :data:`ALL` or
    :data:`FORM`), ``evals`` (expression, value) evaluated, ``dsts`` (channel, has a reader);
    ``tally``: the bookkeeping of the run-time decisions of its program, if any (:data:`Tally`,
    recomputed for every run that reuses the program)."""

    streams: dict[str, str] = field(default_factory=dict)
    evals: list[tuple[Any, int]] = field(default_factory=list)
    dsts: dict[str, bool] = field(default_factory=dict)
    tally: Tally | None = None
    tallied: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: a program that reads its tiles' rows at run time: its bookkeeping as functions of
    #: the row counts (:class:`~.sizing.Sizing`)
    sizing: Sizing | None = None
    #: the bounds of run-dependent row counts its buffers were allocated at
    bounds: dict[Any, int | None] = field(default_factory=dict)

    def count(self, tally: Tally, ctx: EmitCtx) -> tuple[int, int, int, int]:
        """Record ``tally`` as the unit's run-time bookkeeping and return its counts in the
        run of ``ctx`` (the emitter adds them to its builder's)."""
        self.tally = tally
        self.tallied = tally(ctx)
        return self.tallied

    def tracking(self, has_dsts: Callable[[str], bool]) -> Callable[[str], bool]:
        """``has_dsts`` that records every channel it is asked about."""

        def ask(ch: str) -> bool:
            r = has_dsts(ch)
            self.dsts[ch] = r
            return r

        return ask


#: A unit's key besides its recorded run: the channels it reads and its stop-token counts.
Hashable = Any


@dataclass(frozen=True)
class _Entry:
    key: Hashable
    deps: Deps
    run: RunStreams
    body: tuple[Instr, ...]
    info: UnitInfo
    tallied: tuple[int, int, int, int] = (0, 0, 0, 0)

    def retally(self, ctx: EmitCtx, run: RunStreams) -> _Entry:
        """This entry for the run of ``ctx`` / ``run``: the same program, its bookkeeping
        (:data:`Tally`) counted again in that run."""
        d = self.deps
        info, new = self.info, self.tallied
        if d.tally is not None:
            new = d.tally(ctx)
            r, s, c, f = (a - b for a, b in zip(new, self.tallied))
            info = dataclasses.replace(
                info,
                received=info.received + r,
                sent=info.sent + s,
                step_cycles=info.step_cycles + c,
                flops=info.flops + f,
            )
        if d.sizing is not None:

            def rows(expr: Any) -> int:
                if isinstance(expr, MessageRows):  # a ragged count: its message in this run
                    return run.message_rows(expr)
                return ctx.ev(expr, f"rows of unit %{info.name}")

            info = dataclasses.replace(
                info,
                flops=d.sizing.flops(rows) + new[3],
                step_cycles=d.sizing.cycles(rows) + new[2],
                sram_bytes=d.sizing.sram_bytes(rows),
            )
        return dataclasses.replace(self, run=run, info=info, tallied=new)


class UnitCache:
    """Unit programs of one graph on one chip (with one set of unit configurations and wires)
    by unit index, each with the :class:`Deps` it was emitted under; ``emitted`` / ``reused``
    count the units built and taken as they were.  ``size``: the runs whose programs (and
    streams) are kept, the oldest dropped first."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.entries: dict[int, list[_Entry]] = {}
        self.emitted = 0
        self.reused = 0
        self._layouts: dict[str, TensorLayout] | None = None
        self._setup: Hashable = None

    def bind(self, setup: Hashable, layouts: dict[str, TensorLayout]) -> None:
        """Start a plan for ``setup`` (graph, chip, configurations, wires) whose off-chip
        tensors have ``layouts``; the programs kept are dropped when either differs."""
        if setup != self._setup or layouts != self._layouts:
            self.entries.clear()
            self._setup, self._layouts = setup, layouts
        runs = sorted({e.run.run for kept in self.entries.values() for e in kept})
        if len(runs) >= self.size:  # keep the programs of the latest runs (and their streams)
            latest = set(runs[len(runs) - self.size + 1 :])
            for k, kept in list(self.entries.items()):
                self.entries[k] = [e for e in kept if e.run.run in latest]

    def lookup(
        self,
        k: int,
        key: Hashable,
        ctx: EmitCtx,
        run: RunStreams,
        has_dsts: Callable[[str], bool],
        bound: Callable[[Any], int | None],
    ) -> _Entry | None:
        """A program of unit ``k`` emitted under ``key`` whose recorded run is the same in the
        run of ``ctx`` / ``run`` (module docstring; ``bound``: the run's bounds of row counts),
        or ``None``."""
        for e in self.entries.get(k, ()):
            d = e.deps
            if (
                e.key == key
                and all(has_dsts(ch) == r for ch, r in d.dsts.items())
                and all(bound(rows) == v for rows, v in d.bounds.items())
                and all(ctx.ev(x, "unit reuse") == v for x, v in d.evals)
                and all(run.same(s, e.run, lv) for s, lv in d.streams.items())
            ):
                self.reused += 1
                if e.run is not run:  # kept with the latest run it served, to compare with next
                    e = e.retally(ctx, run)
                    self.entries[k].insert(0, e)
                    del self.entries[k][self.size :]
                return e
        return None

    def store(
        self,
        k: int,
        key: Hashable,
        deps: Deps,
        run: RunStreams,
        body: tuple[Instr, ...],
        info: UnitInfo,
    ) -> None:
        """Keep unit ``k``'s program, emitted under ``key`` with ``deps`` in ``run``."""
        self.emitted += 1
        kept = self.entries.setdefault(k, [])
        kept.insert(0, _Entry(key, deps, run, body, info, deps.tallied))
        del kept[self.size :]
