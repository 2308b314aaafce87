"""Decode attention's KV-tile units as loops over each request's tile count, computed at run time
(STeP arXiv 2511.07776 §5.1 FlashAttention, §5.4; STeP (revised) §3.1 ragged dimensions).

A decode request's KV tiles are a ragged dimension ``C[b, kvh]`` learnt from the data
(:mod:`torch2step.lower.blocks.gqa`): the cursor Scan turns the lengths into
``[row_base, n, stride]`` cursors, a FlatMap(``kv_tiles``) cuts each into ``(row, r)`` runs of at
most ``tile`` rows, the K and V loads read one tile per run, the query is expanded along the
runs and an online-softmax Accum reduces each request's tiles.  Here none of these units needs
the run's lengths when it is built:

* the cursor Scan (:func:`emit_cursor_scan`) computes each cursor in registers
  (``row_base += stride``, ``n`` the length received) and writes it into the tile it sends
  (``WriteValue``), so the cursor tiles carry their values in timing mode too, as the integer
  tiles loaded from HBM do (the lengths' tensor is an input no node stores:
  :func:`lengths_carry_values`);
* the address FlatMap (:func:`emit_kv_addresses`) reads each cursor into registers, sends the
  request's tile count ``ceil(n / tile) + ceil(tail / tile)`` and then ``Loop(ceil(n / tile))``
  the runs of its ``n`` rows and the (static) runs of its tail rows from registers;
* the K and V loads (:func:`~.kv_tiles.emit_kv_loads`) take each request's count and loop
  over its addresses, loading each run into the next of ``depth`` rotating buffers held at
  ``tile`` rows and sending the tile ``depth - 1`` loads later, across requests (the
  pipelining of the unrolled program, STeP §4.1);
* the query's Expand (:func:`~.kv_tiles.emit_kv_expand`) takes each count, forwards it ahead of
  the request's query copies and sends one per address it dequeues;
* the online softmax (:func:`~.kv_tiles.emit_kv_softmax`) takes each count from the Expand's
  channel and loops over the request's ``(q, k, v)`` tiles (the first starts the state, the
  others update it, each step timed by its row rule on the K tile's run-time rows:
  :mod:`.rows`); a request without a tile gets the initial state in one cycle, as the
  unrolled program does;
* between the Scan and the address FlatMap, the units that forward the cursor tiles send the
  buffers they received them in, so the tiles keep their values: Repeat, a region's Partition
  (STeP §5.4) and a lane's ``lane_keep`` FlatMap (:func:`emit_lane_keep`, or with its lane
  decisions in registers :func:`~.lane_pick.emit_lane_keep_loop`);
* in a lane or region (STeP §5.4) every one of these units loops over the requests until the
  items' stop token rather than over the run's request count (:mod:`.item_loop`): the address
  FlatMap and the Expand end their headed channels with a ``SendValue`` with ``stop``, which
  the loads, the Expand and the softmax take in place of a request's count.

The count travels as one control value ahead of each request's elements on the address
channel and on the Expand's (:func:`headed_channels`; ``SpatialPlan.messages`` counts it, as it
counts a Streamify's stop tokens): the addresses are control values themselves, so a stop
token after them could not be told from an address by a receive into a register, and a count
lets every consumer loop ``Loop(count)`` without a bound or a guard.  The K and V channels
carry only tiles (their consumer takes the count from the Expand's channel).  The address
channel's FIFOs have one slot more than the others (:mod:`.plan`): the loads, pipelined across
requests, send a request's last tiles only once they have the next request's first address,
which reaches them through the FIFOs (the Expand's too) that also hold the next count.

What each such program reads of the run is the number of requests (the cursors the address
FlatMap receives) and the declared types, not the tile counts: every address, count and row
count is a register, the tiles' rows are the run's (row rules; buffers held at ``tile``
rows, ``Alloc.held``, sized by the most rows a message of their channel holds:
:class:`~.unit_buffers.MessageRows` ``seq=-1``); their elements, cycles and FLOPs in a run are
counted from its streams (:data:`~.unit_reuse.Tally`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowering.isa import (
    Affine,
    Calc,
    Cond,
    If,
    Instr,
    Loop,
    ReadValue,
    SendValue,
    Set,
    WriteValue,
)
from torch2step.errors import LoweringError
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, FlatMap, Scan
from torch2step.step.ops_memory import (
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoadRows,
    RandomOffChipStore,
)
from torch2step.step.ops_routing import Partition
from torch2step.step.ops_shape import Expand, Repeat, Zip
from torch2step.step.types import TileType

from .context import EmitCtx
from .streams import StreamInfo, iter_nodes
from .structure import Structure, value_readers
from .unit import UnitBuilder
from .unit_reuse import FORM

__all__ = [
    "headed_channels",
    "lengths_carry_values",
    "cursor_scan",
    "emit_cursor_scan",
    "emit_kv_addresses",
    "emit_lane_keep",
    "requests_of",
    "groups_of",
    "tally_into",
]

_INT = ("int32", "int64")


def _single(st: Structure, op: Op) -> bool:
    """Whether ``op`` is the only node of its own unit."""
    return st.owner.get(op.name) == op.name and len(st.units[st.unit_index(op.name)]) == 1


def _int_tile(t: Any, shape: tuple[int, int]) -> bool:
    return (
        isinstance(t, TileType)
        and t.dtype in _INT
        and all(d.is_Integer and int(d) == s for d, s in zip(t.shape, shape))
    )


def lengths_carry_values(graph: StepProgram, st: Structure, op: Op) -> bool:
    """Whether the lengths Scan ``op`` receives come, through single-node Repeat units, from
    a load of an integer tensor no node of ``graph`` stores: such a tensor keeps its values in
    timing mode (the run's inputs), and the messages forwarding them carry them (control values
    received into registers), whatever else the graph computes (a router storing its top-k ids
    makes only those tiles value-less: :func:`~.control.control_data`)."""
    stored = {
        o.tensor.name
        for o in graph.nodes
        if isinstance(o, (LinearOffChipStore, RandomOffChipStore))
    }
    src = st.producer.get(op.input.name)  # type: ignore[attr-defined]
    while isinstance(src, Repeat) and _single(st, src):
        src = st.producer.get(src.input.name)
    return (
        isinstance(src, LinearOffChipLoad)
        and src.tensor.dtype in _INT
        and src.tensor.name not in stored
        and src.ref is None
    )


def cursor_scan(op: Op) -> bool:
    """Whether ``op`` is a ``kv_cursor`` Scan over ``[1, 1]`` lengths (control values received
    into registers) from an ``int_row`` state of three values: its update is computed in
    registers (:func:`emit_cursor_scan`)."""
    return (
        isinstance(op, Scan)
        and getattr(op.fn, "name", None) == "kv_cursor"
        and getattr(op.init, "name", None) == "int_row"
        and len(tuple(op.init.get("values", ()))) == 3
        and _int_tile(getattr(op.input.type, "dtype", None), (1, 1))
    )


def _unit_readers(st: Structure, readers: dict[str, list[Op]], name: str) -> list[Op]:
    """The unit nodes reading stream ``name``, through wires (Zip, Promote, Flatten...)."""
    out: list[Op] = []
    for op in readers.get(name, []):
        if op.name in st.owner:
            out.append(op)
        else:
            for v in st.graph.node_outputs[st.graph.nodes.index(op)]:
                out.extend(_unit_readers(st, readers, v.name))
    return out


def headed_channels(graph: StepProgram, st: Structure) -> set[str]:
    """The channels whose every request's elements follow a count message (module docstring):
    the output of a single-node FlatMap(``kv_tiles``) over cursor tiles a ``kv_cursor`` Scan
    computes in registers (through single-node Repeat units), when every unit reading it is a
    single-node RandomOffChipLoadRows or Expand, and the output of each such Expand, when its
    only reader is a single-node rank-1 Accum over a Zip of it and those loads' tiles (or over
    it alone), when the Scan's lengths carry their values (:func:`lengths_carry_values`)."""
    readers = value_readers(graph)
    out: set[str] = set()
    for op in graph.nodes:
        if not (
            isinstance(op, FlatMap)
            and getattr(op.fn, "name", None) == "kv_tiles"
            and _single(st, op)
            and _int_tile(getattr(op.input.type, "dtype", None), (1, 3))
        ):
            continue
        src = _cursor_source(st, op.input.name)
        if src is None or not cursor_scan(src) or not _single(st, src):
            continue
        if not lengths_carry_values(graph, st, src):
            continue
        users = _unit_readers(st, readers, op.name)
        loads = [u for u in users if isinstance(u, RandomOffChipLoadRows)]
        expands = [u for u in users if isinstance(u, Expand) and u.ref.name == op.name]
        if not users or len(loads) + len(expands) != len(users):
            continue
        if not all(_single(st, u) for u in users):
            continue
        tiles = {u.name for u in loads}
        ok = []
        for e in expands:
            acc = _unit_readers(st, readers, e.name)
            if len(acc) != 1 or not _softmax_over(st, acc[0], e.name, tiles):
                break
            ok.append(e.name)
        else:
            out.add(op.name)
            out.update(ok)
    return out


def _cursor_source(st: Structure, name: str) -> Op | None:
    """The node making the cursor tiles of stream ``name``, through single-node units that
    forward the tiles they receive: Repeat, a Partition routing the requests over regions
    (its received buffers sent under the selector's bits: STeP §5.4), and a lane's
    ``lane_keep`` FlatMap over a Zip of the cursors and the lane decisions
    (:func:`emit_lane_keep`)."""
    src = st.producer.get(name)
    while src is not None and _single(st, src):
        if isinstance(src, (Repeat, Partition)):
            src = st.producer.get(src.input.name)
        elif _lane_keep(st, src):
            zipped = st.producer[src.input.name]
            assert isinstance(zipped, Zip)
            src = st.producer.get(zipped.ins[0].name)
        else:
            break
    return src


def _lane_keep(st: Structure, op: Op) -> bool:
    """Whether ``op`` is a ``lane_keep`` FlatMap over a Zip (a wire) of a stream of ``[1, 3]``
    cursor tiles and the lane decisions."""
    if not (isinstance(op, FlatMap) and getattr(op.fn, "name", None) == "lane_keep"):
        return False
    zipped = st.producer.get(op.input.name)
    return (
        isinstance(zipped, Zip)
        and zipped.name not in st.owner
        and len(zipped.ins) == 2
        and _int_tile(getattr(zipped.ins[0].type, "dtype", None), (1, 3))
    )


def emit_lane_keep(ctx: EmitCtx, b: UnitBuilder, op: FlatMap) -> bool:
    """A lane's ``lane_keep`` FlatMap forwarding each cursor tile it keeps from the buffer it
    received it in (one cycle, as a FlatMap's piece), so the tile keeps the values the cursor
    Scan wrote (:func:`emit_cursor_scan`); which items it keeps is the run's (the lane
    decisions are not computed in registers).  ``False`` when ``op`` is not one."""
    st = ctx.structure
    if not _lane_keep(st, op):
        return False
    src = _cursor_source(st, op.name)
    if src is None or not cursor_scan(src) or not lengths_carry_values(st.graph, st, src):
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    depth = out.value.rank - x.value.rank + 1  # the expansion's rank + 1 (STeP table 4)
    impl = op.fn.spec.impl
    kept = [len(iter_nodes(impl(op.fn, *val), depth)) for val in x.flat]
    if sum(kept) != len(out.flat) or any(
        len(x.parts(k)) != 2 or x.pieces[k][0][0] is None for k in range(len(x.flat))
    ):
        return False
    j = 0
    for k, n in enumerate(kept):
        e = b.recv(x, k)
        if not n:
            b.consume(e)
        b.step()
        for _ in range(n):
            b.compute(1, (e,), const=True)
            b.send(out, j, (e[0],))
            j += 1
            b.step()
    return True


def _softmax_over(st: Structure, op: Op, head: str, tiles: set[str]) -> bool:
    """Whether ``op`` is a single-node rank-1 Accum over ``head`` or a Zip of ``head`` and
    streams of ``tiles`` (each read once)."""
    if not (isinstance(op, Accum) and op.rank == 1 and _single(st, op)):
        return False
    src = st.producer.get(op.input.name)
    if op.input.name == head:
        return True
    if not isinstance(src, Zip) or src.name in st.owner:
        return False
    names = [v.name for v in src.ins]
    return names.count(head) == 1 and len(set(names)) == len(names) and set(names) - {head} <= tiles


# ---------------------------------------------------------------- the cursor Scan


def emit_cursor_scan(ctx: EmitCtx, b: UnitBuilder, op: Scan, cost: Any) -> bool:
    """A ``kv_cursor`` Scan whose state is computed in registers and written into the tile it
    sends (module docstring); ``False`` (nothing emitted) when ``op`` is not one, or its input
    elements are not control values received into registers."""
    if not cursor_scan(op) or not lengths_carry_values(ctx.structure.graph, ctx.structure, op):
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    if any(len(x.parts(k)) != 1 or x.parts(k)[0].kind != "value" for k in range(len(x.flat))):
        return False
    base, _, stride = (ctx.ev(v, f"state of unit %{b.name}") for v in op.init.get("values"))
    cut = x.value.rank + 1 - op.rank
    advance = Set("cur.base", Affine(stride, (("cur.base", 1),)))
    k = 0
    for sub in iter_nodes(x.value.data, cut):
        state = None
        b.emit(Set("cur.base", base))
        b.step()
        for val in iter_nodes(sub, op.rank):
            e = b.recv(x, k)
            parts = out.parts(k)
            c, fl, rule = cost.update_step(
                op.fn, val, x.dtype, out.flat[k], out.dtype, x.parts(k), parts, True
            )
            ins = (e,) if state is None else (e, state)
            state = b.compute(c, ins, parts, role="acc", flops=fl, rule=rule)
            ((_, buf),) = state
            ((_, n),) = e
            assert buf is not None and n is not None
            b.emit(
                advance,
                b.make(WriteValue, buf, 0, "cur.base"),
                b.make(WriteValue, buf, 1, n),
                b.make(WriteValue, buf, 2, stride),
            )
            b.send(out, k, state)
            k += 1
            b.step()
    ctx.relax(op.input, FORM)  # the lengths reach registers: their values are the run's
    return True


# ---------------------------------------------------------------- the address FlatMap


def requests_of(ctx: EmitCtx, ch: str) -> int:
    """The requests whose tiles headed channel ``ch`` carries: the cursors the FlatMap
    cutting the addresses receives (that stream is recorded: a kept program is checked
    against its structure, not against the tile counts)."""
    op = ctx.structure.producer[ch]
    if isinstance(op, Expand):
        op = ctx.structure.producer[op.ref.name]
    assert isinstance(op, FlatMap)
    return len(ctx.stream(op.input).flat)


def groups_of(info: StreamInfo) -> list[int]:
    """Elements per innermost group (per request) of a stream."""
    return [len(n) for n in iter_nodes(info.value.data, info.value.rank)]


def tally_into(
    ctx: EmitCtx, b: UnitBuilder, fn: Callable[[EmitCtx], tuple[int, int, int, int]]
) -> None:
    r, s, busy, flops = ctx.tally(fn)
    b.received += r
    b.sent += s
    b.busy_cycles += busy
    b.flops += flops


def emit_kv_addresses(ctx: EmitCtx, b: UnitBuilder, op: FlatMap) -> bool:
    """The address FlatMap as loops over registers (module docstring); ``False`` when its
    output channel is not headed."""
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    if out.channel not in ctx.headed or getattr(op.fn, "name", None) != "kv_tiles":
        return False
    cfg = ctx.config(op)
    if cfg.reads_memory or cfg.writes_memory or ctx.timing.map_flops(op.fn, op.input.type.dtype):
        raise LoweringError(
            f"FlatMap %{op.name} cuts KV-tile addresses in one cycle per run from its cursor's "
            "registers (torch2step.spatial.kv_loop); give it no memory-reading or -writing "
            "unit configuration"
        )
    tile, tail = int(op.fn.get("tile")), int(op.fn.get("tail", 0))
    sends = b.has_dsts(out.channel)
    ch = out.channel
    tails = [(t, min(tile, tail - t)) for t in range(0, tail, tile)]

    def request(e: Any) -> None:
        ((_, buf),) = e
        assert buf is not None
        b.emit(
            ReadValue("kv.base", buf, 0),
            ReadValue("kv.n", buf, 1),
            ReadValue("kv.stride", buf, 2),
            Calc("kv.tiles", "ceildiv", "kv.n", tile),
        )
        if sends:
            b.emit(SendValue(ch, Affine(len(tails), (("kv.tiles", 1),))))
        if not tails:  # a request of no row still takes its cycle (emit_compute._flat_map)
            b.emit(If(Cond("kv.tiles", "==", 0), (b.compute_instr(1, (buf,)),)))
        step: list[Instr] = [b.compute_instr(1, (buf,))]
        if sends:
            step += [SendValue(ch, "kv.row"), SendValue(ch, "kv.r")]
        row = Set("kv.row", Affine(0, (("kv.base", 1), ("kv.j", tile))))
        rows = Calc("kv.r", "min", tile, Affine(0, (("kv.n", 1), ("kv.j", -tile))))
        b.emit(Loop("kv.tiles", (row, rows, *step), "kv.j"))
        for t, r in tails:  # the tail rows end the cache: static runs from the cursor's end
            b.emit(
                Set("kv.row", Affine(t - tail, (("kv.base", 1), ("kv.stride", 1)))),
                Set("kv.r", r),
                *step,
            )

    looped = op.name in ctx.looped
    if looped:  # a lane's or region's requests, until their stop token (.item_loop)
        from .item_loop import item_requests

        item_requests(
            ctx, b, op.input, request, lambda stop: (SendValue(ch, stop, True),) if sends else ()
        )
    else:
        for k in range(len(x.flat)):
            request(b.recv(x, k))
            b.step()
    groups = groups_of(out)
    if sends:
        b.sent_seq[ch] = out.messages + len(groups) + looped
    name = op.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        per = groups_of(c.streams[name])
        return 0, sum(per) * sends, sum(max(n, 1) if not tails else n for n in per), 0

    tally_into(ctx, b, tally)
    ctx.relax(op.name, None)  # its sends follow the cursors' values at run time
    return True
