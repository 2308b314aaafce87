"""An expert's row units around its region, as loops until the Partition's stop token.

With ``R`` expert regions (STeP arXiv 2511.07776 §5.3, :mod:`torch2step.lower.blocks.moe_lanes`)
each expert keeps two units of its own, both handling the rows of a Partition's output
(``[n_e]``, ending with a stop token carrying the count, STeP §3.2.3) one by one:

* the ``as_ragged`` FlatMap that makes the expert's rows one chunk for its region's EagerMerge
  (its ``[P_e, N_e]`` Promote of the router's output: one chunk of ``N_e`` rows, none when the
  expert has no token) — :func:`emit_chunk_rows`;
* the Map scaling each row the region sends back by the token's routing weight, over the zip
  of the region's Partition output for the expert and the routing weights' Map (both end
  with a stop token of the same count) — :func:`emit_zip_loop`.

Each is a ``Loop`` bounded by the count's bound whose body is guarded by ``If(stop < 0)``
over ``Recv(..., stop=reg)``, as :func:`~.stop_loop.emit_stop_loop` builds it (the zip takes
its other inputs' tokens in the iteration the first one's comes); the element's form is taken
from the declared types when the run gives the expert no token
(:func:`~.stop_loop.declared_element`), so each is one program for every routing.  Their
elements, cycles and FLOPs in a run are counted from its streams (:data:`~.unit_reuse.Tally`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import sympy as sp

from lowering.isa import Cond, If, Instr, Loop, Recv, RecvValue, SendValue, Set
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, FlatMap, Map
from torch2step.step.ops_memory import Bufferize, Streamify
from torch2step.step.ops_routing import EagerMerge, Partition
from torch2step.step.ops_shape import Expand, Promote, Zip
from torch2step.step.types import DataType, TileType, TupleType

from .context import EmitCtx
from .region_tail import chunk_channel, row_source, rows_channel
from .stop_loop import data_first, declared_element, emit_stop_loop
from .streams import _VALUE_DTYPES, StreamInfo
from .structure import Structure
from .unit import Elem, UnitBuilder
from .unit_reuse import EACH, EVERY, FORM

__all__ = ["chunk_channels", "chunk_stops", "emit_chunk_rows", "emit_expand_loop", "emit_zip_loop"]


def _data_only(t: DataType) -> bool:
    """That every message of an element of declared type ``t`` is data (no control value:
    :func:`~.streams.element_parts`)."""
    if isinstance(t, TileType):
        return not (t.dtype in _VALUE_DTYPES and tuple(t.shape) == (1, 1))
    if isinstance(t, TupleType):
        return all(_data_only(e) for e in t.elems)
    return False


def _tiles(op: FlatMap) -> bool:
    """That the chunk's elements carry data only: a chunk zipped with a control member (a
    token id routed on by value, STeP §5.3's lanes) keeps the run's unrolled program, and
    then :func:`chunk_stops` does not end it with a stop token either."""
    t = getattr(op.input.type, "dtype", None)
    return t is not None and _data_only(t)


def _alike(x: StreamInfo) -> bool:
    """Every element of ``x`` has the same messages and tile shapes."""
    if not x.flat:
        return True
    first = x.parts(0)
    shape0 = getattr(x.flat[0], "shape", None)
    return all(x.parts(k) == first for k in range(1, len(x.flat))) and all(
        getattr(v, "shape", None) == shape0 for v in x.flat
    )


def emit_chunk_rows(
    ctx: EmitCtx, b: UnitBuilder, op: Op, memory: Callable[[StreamInfo], int] | None = None
) -> bool:
    """The unit of an expert's ``as_ragged`` FlatMap over the Promote of a Partition output
    (module docstring): a loop until the output's stop token, one cycle per row (after the
    row's pass through an on-chip memory unit, ``memory(x)`` cycles for the stream's first
    element, when the unit is configured so), each row forwarded; ``False`` (nothing
    emitted) when the unit is not such a FlatMap."""
    if not isinstance(op, FlatMap) or getattr(op.fn, "name", None) != "as_ragged":
        return False
    if not _tiles(op):
        return False
    src = ctx.structure.producer.get(op.input.name)
    shape = getattr(op.input.type, "shape", ())
    if not isinstance(src, Promote) or len(shape) != 2 or b.bound is None:
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    if x.value.rank != 1 or len(x.value.data) > 1 or not _alike(x):
        return False
    chans = ctx.structure.sources(op.input.name)
    if len(chans) != 1:
        return False
    (ch,) = chans
    if ch not in b.stops or b.own(ch) or b.next_seq.get(ch, 0) != int(not x.flat):
        return False
    lx, lo = x, out
    if not x.flat:  # no token this run: the loop built from one element of the declared types
        row = declared_element(ctx.streams[ch])  # the Partition's output the Promote wraps
        so = declared_element(out)
        if row is None or so is None:
            return False
        lx = dataclasses.replace(x, flat=row.flat, pieces=row.pieces, _parts=None, _decl=None)
        lo = so
    if any(p.kind != "data" for p in lx.parts(0)) or lo.parts(0) != lx.parts(0):
        return False
    bound = b.bound(shape[1])
    if bound is None:
        return False
    if not x.flat:
        b.next_seq[ch] = 0  # its stop token, taken by the loop

    cfg = ctx.config(op)
    staged = memory(lx) if memory is not None and (cfg.reads_memory or cfg.writes_memory) else 0

    def each(k: int, e: Elem) -> None:
        if staged:
            b.compute(staged, (e,))
        b.compute(1, (e,), const=True)
        b.send(lo, 0, e)

    # the chunk ends with the count (:func:`chunk_stops`): the merge takes it after the rows
    emit_stop_loop(ctx, b, lx, lo, ch, bound, each, forward=True, level=EVERY)
    return True


def chunk_stops(graph: StepProgram, st: Structure, stops: Iterable[str]) -> set[str]:
    """The outputs of the ``as_ragged`` FlatMap units over the Promote of one channel that
    ends with a stop token (an expert's chunk for its region, :func:`emit_chunk_rows`): each
    forwards the token (its count) after the chunk's rows, so the region's EagerMerge reads
    every expert's channel, also one that sends no chunk in a run."""
    stops = set(stops)
    out = set()
    for op in graph.nodes:
        if (
            isinstance(op, FlatMap)
            and getattr(op.fn, "name", None) == "as_ragged"
            and _tiles(op)
            and st.owner.get(op.name) == op.name
            and len(st.units[st.unit_index(op.name)]) == 1
            and isinstance(st.producer.get(op.input.name), Promote)
            and len(st.sources(op.input.name)) == 1
            and st.sources(op.input.name) <= stops
        ):
            out.add(op.name)
    return out


def emit_zip_loop(
    ctx: EmitCtx,
    b: UnitBuilder,
    op: Op,
    steps: list[Any],
    step_of: Callable[[StreamInfo, StreamInfo], Any],
) -> bool:
    """The unit of a Map over a zip of streams that each end with a stop token of the same
    count (an expert's rows back from its region and their routing weights) as a loop until
    the first one's token, the others' taken in the same iteration (module docstring);
    ``steps``: the Map's ``(cycles, flops, row rule)`` per element (``step_of(x, out)``: of
    the one element of stand-ins, when the run gives the stream none).  ``False`` (nothing
    emitted) when the unit is not such a Map."""
    if not isinstance(op, Map) or b.bound is None:
        return False
    shape = getattr(op.input.type, "shape", ())
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    if len(shape) != 1 or x.value.rank != 0 or not _alike(x):
        return False
    sx, so = _zip_standin(ctx, op), declared_element(out)
    # the same program for an empty stream when its elements have the declared forms
    level = (
        EVERY
        if sx is not None
        and so is not None
        and all(
            x.parts(k) == sx.parts(0) and out.parts(k) == so.parts(0) for k in range(len(x.flat))
        )
        else EACH
    )
    empty = not x.flat
    if empty:  # no row this run: the loop built from one element of the declared types
        if sx is None or so is None:
            return False
        steps = [step_of(sx, so)]
        x, out = sx, so
    chans: list[str] = []
    for ch_, _, _ in x.pieces[0]:
        if ch_ is None or ch_ in chans:
            return False
        chans.append(ch_)
    if not data_first(x):  # its first message taken with the token (.stop_loop)
        return False
    if len(chans) < 2 or any(
        ch not in b.stops or b.own(ch) or b.next_seq.get(ch, 0) != int(empty) for ch in chans
    ):
        return False
    if any(s != steps[0] or s[2] is not None for s in steps):
        return False
    if any(p.kind != "data" for k in range(len(x.flat)) for p in out.parts(k)):
        return False
    if any(out.parts(k) != out.parts(0) for k in range(len(x.flat))):
        return False
    bound = b.bound(shape[0])
    if bound is None:
        return False
    if empty:
        for ch in chans:
            b.next_seq[ch] = 0  # their stop tokens, taken by the loop
    first, rest = chans[0], chans[1:]
    counts = {ch: b.stops.pop(ch) for ch in rest}
    c, fl, _ = steps[0]

    def each(k: int, e: Elem) -> None:
        b.send(out, k, b.compute(c, (e,), out.parts(k), flops=fl))
        for ch in rest:  # the next copy of the loop's element receives them again
            b.next_seq[ch] = 0
            b.held.pop((ch, 0), None)

    before = len(b.steps)
    emit_stop_loop(ctx, b, x, out, first, bound, each, level=level)
    # the other inputs end with their tokens in the iteration the first one's came: take them
    # there (``Recv`` with ``stop`` of each, and in the guard's other arm)
    stops = {ch: f"stop.{ch}" for ch in rest}
    b.steps[before:] = [tuple(_take_rest(i, stops) for i in s) for s in b.steps[before:]]
    for ch, n in counts.items():
        b.next_seq[ch] = n + 1
    return True


def _zip_standin(ctx: EmitCtx, op: Map) -> StreamInfo | None:
    """A stand-in for the zip ``op`` maps of one element of its declared types, each part
    on its input's channel (:func:`~.stop_loop.declared_element` of each zipped stream);
    ``None`` when ``op``'s input is not a zip of such streams."""
    z = ctx.structure.producer.get(op.input.name)
    if not isinstance(z, Zip) or z.name in ctx.structure.owner:
        return None
    parts = [declared_element(ctx.streams[v.name]) for v in z.inputs()]  # types only
    if any(p is None or len(p.pieces[0]) != 1 for p in parts):
        return None
    x = ctx.stream(op.input)
    flat = [tuple(p.flat[0] for p in parts)]  # type: ignore[union-attr]
    pieces = [tuple(p.pieces[0][0] for p in parts)]  # type: ignore[union-attr]
    return dataclasses.replace(x, flat=flat, pieces=pieces, _parts=None, _decl=None)


def _take_rest(ins: Instr, stops: dict[str, str]) -> Instr:
    """``ins`` with the guard of the loop's element (``If(stop < 0, (take, If(stop < 0,
    body, done)))``, :func:`~.stop_loop.emit_stop_loop`) taking the other inputs' tokens
    (``stops``: channel -> register) in its other arm, when the first one's came."""
    if isinstance(ins, Loop):
        return Loop(ins.count, tuple(_take_rest(i, stops) for i in ins.body), ins.var)
    if not isinstance(ins, If):
        return ins
    then = tuple(_take_rest(i, stops) for i in ins.then)
    if (
        len(then) == 2
        and isinstance(then[0], Recv)
        and then[0].stop is not None
        and isinstance(then[1], If)
        and then[1].cond == Cond(then[0].stop, "<", 0)
    ):
        done = tuple(RecvValue(ch, reg) for ch, reg in stops.items())
        inner = then[1]
        then = (then[0], If(inner.cond, inner.then, (*done, *inner.orelse)))
    return If(ins.cond, then, ins.orelse)


# ---------------------------------------------------------------- a region's chunk rows


def _packs_reads(st: Structure, readers: dict[str, list[Op]], s: Op) -> bool:
    """That Streamify ``s``'s reads are packed by the single-node unit of a rank-1
    ``retile_row`` Accum, its only reader (:mod:`.buffer_loop`)."""
    rd = readers.get(s.name, [])
    return (
        isinstance(s, Streamify)
        and s.out_shape is None
        and len(rd) == 1
        and isinstance(rd[0], Accum)
        and getattr(rd[0].fn, "name", None) == "retile_row"
        and rd[0].rank == 1
        and st.owner.get(rd[0].name) == rd[0].name
        and len(st.units[st.unit_index(rd[0].name)]) == 1
    )


def _row_reader(st: Structure, readers: dict[str, list[Op]], op: Op, name: str) -> Any:
    """What a reader ``op`` of a region's chunk rows ``name`` does with them, when it loops
    over each chunk's rows until the chunk's stop token: ``("rows", outputs)`` for a
    single-node unit passing rows on (a Map of them, alone or zipped with other chunk rows; an
    Expand along them), ``("done", streams)`` for one taking them in (a rank-1 Bufferize whose
    Streamify reads are each packed by a ``retile_row`` Accum: those reads; the packing of
    the rows into one tile per chunk; a Partition steered by them back from the FlatMap of
    the region's tile, :mod:`.region_tail`); ``None`` otherwise."""
    own = st.owner.get(op.name) == op.name
    unit = st.units[st.unit_index(op.name)] if op.name in st.owner else ()
    if isinstance(op, Expand) and op.ref.name == name and op.input.name != name:
        return ("rows", [op.name]) if own and len(unit) == 1 else None
    if isinstance(op, Bufferize) and op.rank == 1 and unit and unit[0] is op and len(unit) > 1:
        if all(_packs_reads(st, readers, s) for s in unit[1:]):
            return ("done", {s.name for s in unit[1:]})
        return None
    if not own or len(unit) != 1:
        return None
    if isinstance(op, Map):
        return ("rows", [op.name])
    if isinstance(op, Accum) and getattr(op.fn, "name", None) == "retile_row" and op.rank == 1:
        return ("done", set())
    if isinstance(op, Partition) and op.sel.name == name:
        f = st.producer.get(op.input.name)
        return ("done", set()) if f is not None and row_source(st, f) else None
    return None


def chunk_channels(graph: StepProgram, st: Structure, stops: Iterable[str]) -> set[str]:
    """A dynamic-tiling region's chunk rows that end each chunk with a stop token (STeP arXiv
    2511.07776 §3.2.3, §5.3; grouped channels, :mod:`.buffer_loop`): the data output of an
    EagerMerge unit of ragged chunks whose inputs each end with their stop token
    (:func:`chunk_stops`) and every stream of the region's rows made from it, when every
    reader of each loops over a chunk's rows until that token (:func:`_row_reader`: the
    Bufferize of the rows and its row packing, :func:`~.buffer_loop.emit_buffer_loop`; the
    Expand of the chunk's expert index along them, :func:`emit_expand_loop`; a Map of rows,
    :func:`~.region_tail.emit_row_map`; the packing of the routing weights, the Partition
    back to the experts, :mod:`.region_tail`), and the Bufferize's Streamify outputs (a
    token after each read).  A Zip of rows (no unit) is read through."""
    stops = set(stops)
    readers: dict[str, list[Op]] = {}
    for op in graph.nodes:
        for v in op.inputs():
            readers.setdefault(v.name, []).append(op)
    out: set[str] = set()
    for ops in st.units:
        merge = ops[0]
        if len(ops) != 1 or not isinstance(merge, EagerMerge):
            continue
        if any(
            len(getattr(v.type, "shape", ())) != 2
            or sp.sympify(v.type.shape[1]).is_Integer
            or not st.sources(v.name)
            or not st.sources(v.name) <= stops
            for v in merge.ins
        ):
            continue
        data = merge.out_names()[0]
        rows, todo, streams, ok = {data}, [data], set(), bool(readers.get(data))
        zips: list[Op] = []
        while todo and ok:
            name = todo.pop()
            rd = list(readers.get(name, []))
            ok = bool(rd)
            while rd and ok:
                op = rd.pop()
                if isinstance(op, Zip) and op.name not in st.owner:  # a wire: its readers
                    zips.append(op)
                    rd += readers.get(op.name, [])
                    ok = bool(readers.get(op.name))
                    continue
                got = _row_reader(st, readers, op, name)
                if got is None:
                    ok = False
                elif got[0] == "rows":
                    todo += [n for n in got[1] if n not in rows]
                    rows |= set(got[1])
                else:
                    streams |= got[1]
        # a Zip read through zips chunk rows only
        if ok and all(v.name in rows for z in zips for v in z.inputs()):
            out |= rows | streams
    return out


def emit_expand_loop(ctx: EmitCtx, b: UnitBuilder, op: Op) -> bool:
    """The unit of an Expand of one value per chunk along the rows of a region's chunk (its
    reference, ending with the chunk's stop token: :func:`chunk_channels`), built for one
    chunk: the value received, then a loop until the reference's token, each row dequeued
    and the value sent in one cycle (as the unrolled program's), at most the rows' bound
    times.  One program for every chunk size; ``False`` (nothing emitted) when the unit is
    not such an Expand."""
    if not isinstance(op, Expand) or op.rank != 0 or b.bound is None:
        return False
    x, r, out = ctx.stream(op.input), ctx.stream(op.ref), ctx.stream(op.name)
    shape = getattr(op.ref.type, "shape", ())
    if len(shape) != 2 or len(x.flat) != 1 or out.channel is None:
        return False
    ch = chunk_channel(b, r)
    if ch is None:
        return False
    if any(out.parts(k) != out.parts(0) for k in range(len(out.flat))):
        return False
    bound = b.bound(shape[1])
    if bound is None:
        return False
    e = b.recv(x, 0, rotation=2)
    count = b.stops.pop(ch)
    b.step()
    stop = f"stop.{ch}"
    guard = Cond(stop, "<", 0)
    saved = b.received, b.sent, b.busy_cycles
    body: list[Instr] = []
    for _ in range(2):  # one row per copy of the rotating buffers
        b.next_seq[ch] = 0
        row = b.recv(r, 0, rotation=2)
        b.compute(1, (e, row), const=True)
        b.send(out, 0, e)
        instrs, b.cur = b.cur, []
        first = instrs[0]
        if not isinstance(first, Recv) or first.channel != ch:  # pragma: no cover
            raise AssertionError(f"unit %{b.name}: a row must start with its receive")
        body.append(If(guard, (Recv(ch, first.dst, stop), If(guard, tuple(instrs[1:])))))
    b.received, b.sent, b.busy_cycles = saved
    b.emit(Set(stop, -1), Loop(-(-(bound + 1) // 2), tuple(body)))  # every row and the token
    sends = b.has_dsts(out.channel)
    # the units after the region's tiles loop over each chunk's rows (.region_tail): the
    # token forwarded after the chunk's indices, the count sent to the FlatMap back to rows
    token = sends and out.channel in b.grouped
    if token:
        b.emit(SendValue(out.channel, stop, stop=True))
    ctl = rows_channel(op.name)
    if b.has_dsts(ctl):
        b.emit(SendValue(ctl, stop))
        b.sent_seq[ctl] = ctx.streams[ctl].messages
    b.step()
    b.next_seq[ch] = count + 1
    if sends:
        b.sent_seq[out.channel] = ctx.streams[out.name].messages + token
    name = r.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat)
        return n, n * sends, n, 0

    got = ctx.tally(tally)
    b.received += got[0]
    b.sent += got[1]
    b.busy_cycles += got[2]
    ctx.relax(op.ref, EACH)
    if not b.literal_values:  # the value it copies is sent from the register it came in:
        # its output's elements are that value, whatever it is, on every row
        ctx.relax(op.input, FORM)
        ctx.relax(op.name, None)
    else:  # pragma: no cover - a received value is forwarded from its register
        ctx.relax(op.name, EACH)
    return True
