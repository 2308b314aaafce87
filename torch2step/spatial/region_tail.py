"""A dynamically tiled region's units after its tiles, as loops over each chunk's rows.

With ``R`` expert regions and dynamic tiling (STeP arXiv 2511.07776 §5.2, §5.3) a region's
chunk is one expert's rows, a ragged size (STeP (revised) §3.1).  After the region's tiles
three units handle the chunk row by row (:mod:`torch2step.lower.blocks.moe_lanes` step 5):

* the FlatMap cutting the chunk's output tile ``[R[i], H]`` back to rows (``tile_rows``,
  ``out``);
* the Map turning each row's lane-local expert index into a one-hot selector (``sel``);
* the Partition sending each row back to its expert (``back``).

The merge ends each chunk's rows with a stop token carrying their count
(:func:`~.region_rows.chunk_channels`), and the selector Expand along them (``j_r``,
:func:`~.region_rows.emit_expand_loop`) loops until it.  So (:func:`row_units`):

* ``j_r`` forwards that token after each chunk's indices on its own channel (a grouped
  channel, STeP §3.2.3: one token per chunk) and sends the count, a 4-byte control value, on
  a channel of its own to ``out`` (:func:`rows_channel`; as a statically tiled expert's
  packing head tells its tile's real rows, :func:`~.tile_loop.tile_channel`);
* ``sel`` loops over a chunk's indices until that token and forwards it
  (:func:`emit_row_map`);
* ``out`` receives the count into a register and loops ``Loop(count=reg)`` over the tile's
  rows, each piece timed by its row rule (:func:`emit_chunk_pieces`, as
  :func:`~.stop_loop.emit_piece_loop` does with a count carried by a stop token);
* ``back`` loops over a chunk's selectors until the token, each selector's row routed by its
  register at run time (:func:`emit_row_partition`); its counters live across the chunks
  (:func:`~.region_loop.region_body`) and each output's stop token is sent once the merge's
  selectors ended.

With the routing weights applied in the region (the default layer, each row zipped with its
token's expert ids and weights) the rows' parts, the expert id along the rows and the weight
picked per row are Maps of chunk rows too (:func:`emit_row_map`: one loop until the first
input's token, the other inputs' tokens taken with it and forwarded), and the picked weights
are packed into one column tile per chunk (:func:`emit_chunk_pack`);
:func:`~.region_rows.chunk_channels` finds every such stream of chunk rows.

Each is a member of its region's loop over the chunks (:mod:`.region_loop`), built for one
chunk, its bookkeeping counted in each chunk's view: one program for every chunk size, count
and order.  The work per row is the unrolled program's (STeP §4.2); the new traffic is the
token per chunk on the indices' and selectors' channels and the count on ``out``'s channel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lowering.isa import Calc, Cond, If, Instr, Loop, Recv, RecvValue, SendValue, Set
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, FlatMap, Map
from torch2step.step.ops_routing import Partition
from torch2step.step.ops_shape import Expand

from .context import EmitCtx
from .stop_loop import _rotate
from .streams import StreamInfo
from .structure import Structure, value_readers
from .unit import Elem, UnitBuilder

__all__ = [
    "RowUnits",
    "emit_chunk_pack",
    "row_units",
    "rows_channel",
    "row_source",
    "emit_row_map",
    "emit_chunk_pieces",
    "emit_row_partition",
]


def rows_channel(expand: str) -> str:
    """The control channel on which a region's selector Expand ``expand`` sends each chunk's
    row count to the FlatMap back to rows."""
    return f"{expand}.rows"


@dataclass
class RowUnits:
    """What :func:`row_units` found: ``grouped``, the channels that now end each chunk with a
    stop token (the indices along the rows and their selectors); ``control``, per count
    channel (:func:`rows_channel`) its sender and reader (node names) and the merge's data
    channel whose chunks it counts; ``paced``: the FlatMaps' outputs (rows taken by the
    Partition one per selector)."""

    grouped: set[str] = field(default_factory=set)
    control: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    paced: set[str] = field(default_factory=set)


def _single(st: Structure, op: Op) -> bool:
    return st.owner.get(op.name) == op.name and len(st.units[st.unit_index(op.name)]) == 1


def row_source(st: Structure, op: Op) -> str | None:
    """The count channel (:func:`rows_channel`) the ``tile_rows`` FlatMap ``op`` reads, when
    it is a region's FlatMap back to rows whose Partition is steered by the selectors of a
    selector Expand's indices (module docstring); else ``None``."""
    if not isinstance(op, FlatMap) or getattr(op.fn, "name", None) != "tile_rows":
        return None
    graph = st.graph
    rd = value_readers(graph).get(op.name, [])
    if len(rd) != 1 or not isinstance(rd[0], Partition) or rd[0].input.name != op.name:
        return None
    sel = st.producer.get(rd[0].sel.name)
    if not isinstance(sel, Map) or getattr(sel.fn, "name", None) != "to_selector":
        return None
    e = st.producer.get(sel.input.name)
    if not isinstance(e, Expand) or not all(_single(st, o) for o in (op, rd[0], sel, e)):
        return None
    return rows_channel(e.name)


def row_units(graph: StepProgram, st: Structure, grouped: Iterable[str]) -> RowUnits:
    """The regions whose units after the tiles loop over each chunk's rows (module
    docstring): the merge's data channel and its selector Expand's indices are grouped
    (:func:`~.region_rows.chunk_channels`), the indices' ``to_selector`` Map steers the
    Partition back to the experts, whose rows a ``tile_rows`` FlatMap makes, read by it
    only."""
    grouped = set(grouped)
    found = RowUnits()
    for op in graph.nodes:
        if not isinstance(op, Partition):
            continue
        f = st.producer.get(op.input.name)
        ch = row_source(st, f) if f is not None else None
        if ch is None or not isinstance(f, FlatMap):
            continue
        sel = st.producer[op.sel.name]
        e = st.producer[sel.input.name]  # type: ignore[attr-defined]
        assert isinstance(e, Expand)
        data = e.ref.name
        if data not in grouped or e.name not in grouped:  # (the merge's rows, or a Map's)
            continue
        found.grouped |= {e.name, sel.name}
        found.control[ch] = (e.name, f.name, data)
        found.paced.add(f.name)
    return found


def _guarded(
    b: UnitBuilder, ch: str, stop: str, copy: Callable[[], None], done: tuple[Instr, ...]
) -> tuple[Instr, ...]:
    """One element's instructions (``copy()`` emits them, starting with its receive on
    ``ch``) under ``If(stop < 0)``, the receive taking the stop token too; ``done``: the
    instructions once the token came."""
    before = len(b.steps)
    copy()
    instrs = [i for st in b.steps[before:] for i in st] + b.cur
    del b.steps[before:]
    b.cur = []
    first = instrs[0]
    if isinstance(first, RecvValue) and first.channel == ch:
        take: Instr = RecvValue(ch, first.reg, stop)
    elif isinstance(first, Recv) and first.channel == ch:
        take = Recv(ch, first.dst, stop)
    else:  # pragma: no cover
        raise AssertionError(f"unit %{b.name}: a row must start with its receive")
    guard = Cond(stop, "<", 0)
    return (If(guard, (take, If(guard, tuple(instrs[1:]), done))),)


def chunk_channel(b: UnitBuilder, x: StreamInfo) -> str | None:
    """The one channel of ``x`` when it is one chunk of rows, every row with the same
    messages, from a grouped channel (a stop token after each chunk) whose token this unit
    takes; else ``None``."""
    if x.value.rank != 1 or len(x.value.data) != 1 or not x.flat:
        return None
    chans = {c for pc in x.pieces for c, _, _ in pc}
    if len(chans) != 1:
        return None
    (ch,) = chans
    if ch is None or ch not in b.grouped or ch not in b.stops or b.own(ch) or b.next_seq[ch]:
        return None
    if any(x.parts(k) != x.parts(0) for k in range(len(x.flat))):
        return None
    return ch


def _one_value_chunk(b: UnitBuilder, x: StreamInfo) -> str | None:
    """The channel of ``x`` when it is one chunk of rows of one control value each, from a
    grouped channel whose token this unit takes (else ``None``)."""
    ch = chunk_channel(b, x)
    if ch is None or len(x.parts(0)) != 1:
        return None
    return ch if x.parts(0)[0].kind == "value" else None


def _row_channels(b: UnitBuilder, x: StreamInfo) -> list[str] | None:
    """The channels of ``x``'s elements, in their order within an element, when ``x`` is one
    chunk of rows, every element with the same messages, each channel grouped (a stop token
    after each chunk) with its token taken by this unit; else ``None``."""
    if x.value.rank != 1 or len(x.value.data) != 1 or not x.flat:
        return None
    chans: list[str] = []
    for ch, _, _ in x.pieces[0]:
        if ch is None:
            return None
        if ch not in chans:
            chans.append(ch)
    if any(ch not in b.grouped or ch not in b.stops or b.own(ch) or b.next_seq[ch] for ch in chans):
        return None
    first = [(ch, p) for ch, _, p in x.pieces[0]]
    if any([(ch, p) for ch, _, p in pc] != first for pc in x.pieces[1:]):
        return None
    return chans


def emit_row_map(
    ctx: EmitCtx,
    b: UnitBuilder,
    op: Op,
    steps: list[Any],
    lower: Callable[[Elem, Elem], Elem],
) -> bool:
    """The unit of a Map over a region's chunk rows (module docstring: the selectors; with
    the routing weights in the region, also the rows' parts, the expert ids and the weights
    picked), built for one chunk: a loop until the stop token of its first input channel,
    each row received (every part from its channel), one step (``steps``: its ``(cycles,
    flops, rule)`` per element), its output computed (a control value in a register:
    ``lower``) and sent; the other channels' tokens taken in the iteration the first one's
    came, and forwarded when its output is grouped too.  ``False`` (nothing emitted) when the
    unit is not such a Map."""
    if not isinstance(op, Map) or b.bound is None:
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    chans = _row_channels(b, x)
    if chans is None or out.channel is None:
        return False
    if any(s != steps[0] or s[2] is not None for s in steps):
        return False
    if any(out.parts(k) != out.parts(0) for k in range(len(out.flat))):
        return False
    shape = getattr(op.input.type, "shape", ())
    bound = b.bound(shape[1]) if len(shape) == 2 else None
    if bound is None:
        return False
    c, fl, _ = steps[0]
    ch, rest = chans[0], chans[1:]
    counts = [b.stops.pop(c_) for c_ in chans]
    b.step()
    stop = f"stop.{ch}"
    sends = b.has_dsts(out.channel)
    token = sends and out.channel in b.grouped
    # the other inputs end with their tokens where the first one's came: take them there
    done: tuple[Instr, ...] = tuple(RecvValue(c_, f"stop.{c_}") for c_ in rest)
    if token:
        done += (SendValue(out.channel, stop, stop=True),)
    saved = b.received, b.sent, b.busy_cycles, b.flops

    def copy() -> None:
        for c_ in chans:
            b.next_seq[c_] = 0
        e = b.recv(x, 0, rotation=2)
        b.send(out, 0, lower(e, b.compute(c, (e,), out.parts(0), flops=fl)))

    body = [i for _ in range(2) for i in _guarded(b, ch, stop, copy, done)]
    b.received, b.sent, b.busy_cycles, b.flops = saved
    b.emit(Set(stop, -1), Loop(-(-(bound + 1) // 2), tuple(body)))  # every row and the token
    b.step()
    for c_, n in zip(chans, counts):
        b.next_seq[c_] = n + 1
    if sends:
        b.sent_seq[out.channel] = out.messages + token
    name = x.name

    def tally(t: EmitCtx) -> tuple[int, int, int, int]:
        n = len(t.streams[name].flat)
        return n, n * sends, n * c, n * fl

    got = ctx.tally(tally)
    b.received += got[0]
    b.sent += got[1]
    b.busy_cycles += got[2]
    b.flops += got[3]
    # its rows' forms are their declared types', control values reach registers and those it
    # sends are computed from them: the same program for every chunk's rows and expert
    ctx.relax(op.input, None)
    ctx.relax(op.name, None)
    return True


def emit_chunk_pieces(ctx: EmitCtx, b: UnitBuilder, op: Op, piece: Callable[[int], Any]) -> bool:
    """The unit of a region's FlatMap back to rows (module docstring), built for one chunk:
    the chunk's row count received from the selector Expand (:func:`rows_channel`) into a
    register, the chunk's output tile received, then ``Loop(count=reg)`` over its rows, one
    cycle each (``piece(j)``: the row rule of piece ``j``).  ``False`` (nothing emitted)
    when the unit is not such a FlatMap."""
    ctl = row_source(ctx.structure, op)
    if ctl is None or ctl not in ctx.streams or b.own(ctl) or b.next_seq.get(ctl, 0):
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)  # type: ignore[attr-defined]
    counts = ctx.streams[ctl]
    if len(x.flat) != 1 or x.value.rank != 0 or len(counts.flat) != 1:
        return False
    n = len(out.flat)
    if out.channel is None or not n or counts.pieces[0][0][2].value != n:
        return False
    rules = [piece(j) for j in range(n)]
    if any(r is None or r != rules[0] for r in rules) or any(
        out.parts(j) != out.parts(0) or out.parts(j)[0].kind != "data" for j in range(n)
    ):
        return False
    reg = f"rows.{ctl}"
    b.emit(RecvValue(ctl, reg))
    b.next_seq[ctl] = 1
    e = b.recv(x, 0)
    b.step()
    ruled, busy0, sent0 = len(b.rule_steps), b.busy_cycles, b.sent
    copies = []
    for _ in range(2):  # one piece per copy of the rotating buffers
        b.send(out, 0, b.compute(1, (e,), out.parts(0), rule=rules[0]))
        copies.append(tuple(b.cur))
        b.cur = []
    per_sent = (b.sent - sent0) // 2
    del b.rule_steps[ruled:]
    b.busy_cycles, b.sent = busy0, sent0
    j, m = f"j.{ctl}", f"m.{ctl}"
    b.emit(Loop(reg, (Calc(m, "mod", j, 2), *_rotate(m, copies)), j))
    b.step()
    if b.has_dsts(out.channel):
        b.sent_seq[out.channel] = out.messages
    name = out.name

    def tally(t: EmitCtx) -> tuple[int, int, int, int]:
        k = len(t.streams[name].flat)
        return 0, k * per_sent, k, 0

    got = ctx.tally(tally)
    b.sent += got[1]
    b.busy_cycles += got[2]
    ctx.relax(ctl, None)  # the count reaches a register
    ctx.relax(op.name, "each")
    return True


def emit_row_partition(
    ctx: EmitCtx,
    b: UnitBuilder,
    op: Op,
    route: Callable[[StreamInfo, str, list[StreamInfo], dict], bool],
    counter: Callable[[int], str],
) -> bool:
    """The unit of a region's Partition back to the experts (module docstring), built for
    one chunk: a loop until the selectors' stop token, each selector received into a
    register (one cycle), then its row received and sent to the outputs the register picks
    (``route(rows, reg, outs, made)``: the routing branches of element 0, emitted); the
    counters set before and the outputs' stop tokens sent after (the chunks' loop keeps them
    outside, :func:`~.region_loop.region_body`).  ``False`` (nothing emitted) when the unit
    is not such a Partition."""
    if not isinstance(op, Partition) or b.bound is None:
        return False
    x, s = ctx.stream(op.input), ctx.stream(op.sel)
    outs = [ctx.stream(n) for n in op.out_names()]
    sch = _one_value_chunk(b, s)
    if sch is None or x.value.rank != 1 or len(x.value.data) != 1 or len(x.flat) != len(s.flat):
        return False
    xch = {c for pc in x.pieces for c, _, _ in pc}
    if len(xch) != 1 or None in xch or any(b.own(c) or b.next_seq[c] for c in xch):
        return False
    if any(len(x.parts(k)) != 1 or x.parts(k) != x.parts(0) for k in range(len(x.flat))):
        return False
    if x.parts(0)[0].kind != "data":
        return False
    shape = getattr(op.sel.type, "shape", ())
    bound = b.bound(shape[1]) if len(shape) == 2 else None
    if bound is None:
        return False
    (rch,) = xch
    live = [i for i, o in enumerate(outs) if o.channel is not None and b.has_dsts(o.channel)]
    b.emit(*(Set(counter(i), 0) for i in live))
    count = b.stops.pop(sch)
    b.step()
    stop = f"stop.{sch}"
    saved = b.received, b.sent, b.busy_cycles
    made: dict[tuple[object, ...], Any] = {}

    def copy() -> None:
        b.next_seq[sch] = 0
        b.next_seq[rch] = 0
        sel = b.recv(s, 0)
        b.consume(sel)
        reg = sel[0][1]
        assert reg is not None
        if not route(x, reg, outs, made):  # pragma: no cover - checked above
            raise AssertionError(f"unit %{b.name}: a row must be routed by its selector")

    body = [i for _ in range(2) for i in _guarded(b, sch, stop, copy, ())]
    b.received, b.sent, b.busy_cycles = saved
    b.emit(Set(stop, -1), Loop(-(-(bound + 1) // 2), tuple(body)))
    b.step()
    b.next_seq[sch] = count + 1
    b.next_seq[rch] = x.messages
    for i in live:  # the stop token: how many elements the output received
        chan = outs[i].channel
        assert chan is not None
        b.emit(SendValue(chan, counter(i)))
        b.sent_seq[chan] = outs[i].messages + 1
    b.step()
    sname, keep = s.name, frozenset(live)

    def tally(t: EmitCtx) -> tuple[int, int, int, int]:
        sels = t.streams[sname].flat
        n = len(sels)
        return 2 * n, sum(i in keep for v in sels for i in v.indices), 2 * n, 0

    got = ctx.tally(tally)
    b.received += got[0]
    b.sent += got[1]
    b.busy_cycles += got[2]
    ctx.relax(op.sel, None)  # the selectors reach registers
    ctx.relax(op.input, "each")
    for n in op.out_names():
        ctx.relax(n, None)
    return True


def emit_chunk_pack(ctx: EmitCtx, b: UnitBuilder, op: Op, pack: Callable[[], bool]) -> bool:
    """The unit of a ``retile_row`` Accum packing a region's chunk rows (the routing weights
    picked for the chunk's expert, STeP §5.3 with the weights in the region) into one tile per
    chunk, built for one chunk: ``pack()`` (:func:`~.stop_loop.emit_pack_loop`) loops until
    the rows' stop token, in a buffer held at the rows' bound, and sends the tile; the token
    is not forwarded (the tile's readers loop over the chunks, :mod:`.region_loop`).  ``False``
    (nothing emitted) when the unit is not such a packing."""
    if not isinstance(op, Accum) or getattr(op.fn, "name", None) != "retile_row":
        return False
    src = ctx.structure.sources(op.input.name)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    if len(src) != 1 or x.value.rank != 1 or len(x.value.data) != 1 or out.channel is None:
        return False
    (ch,) = src
    if ch not in b.grouped or out.channel in b.grouped:
        return False
    saved = b.grouped
    b.grouped = saved - {ch}  # one group in the chunk's view: the loop over its rows
    try:
        if not pack():
            return False
    finally:
        b.grouped = saved
    if b.has_dsts(out.channel):  # the count it forwards after the tile: not in a region
        token = SendValue(out.channel, f"stop.{ch}")
        last = b.steps[-1]
        if token not in last:  # pragma: no cover - emit_pack_loop's last step
            raise AssertionError(f"unit %{b.name}: no stop token after the packed tile")
        b.steps[-1] = tuple(i for i in last if i != token)
        b.sent_seq[out.channel] -= 1
    return True
