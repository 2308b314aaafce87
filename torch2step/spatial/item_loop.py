"""Every unit of a decode-attention lane or region loops until its items' stop token: one
program for every assignment of the requests (STeP arXiv 2511.07776 §5.4 dynamic
parallelization; §3.2.3 stop tokens).

A region of :mod:`torch2step.lower.blocks.gqa_regions` receives its ``(request, KV head)``
items from a Partition, whose outputs end with a stop token carrying their count; a lane keeps
its items with ``lane_keep`` (:mod:`.lane_pick`), which ends its output with one too.  Which
items a region or lane takes therefore need not be known when its units are built: each unit
of the item chain is a loop bounded by the items the layer has (``B * Hkv``, the elements of
the stream the Partition or ``lane_keep`` chooses from) until the token, the token forwarded
(:func:`looped_channels` names the streams that so end with one):

* the Repeat of the cursors and of the query tiles, and the ``cursor_block`` Map of the
  output row blocks (computed in registers from the cursor tile: ``ReadValue`` its base and
  stride, ``Calc`` their quotient), receive ``Recv(..., stop=s)`` and forward the token (the
  block's as a ``SendValue`` with ``stop``: its channel carries control values);
* the KV address FlatMap, the K and V loads, the query's Expand and the online softmax loop
  over their items in :mod:`.kv_loop` / :mod:`.kv_tiles` (each item's tile count ahead of its
  tiles, as before; the address FlatMap and the Expand end their headed channels with a
  ``SendValue`` with ``stop``, the softmax its results with the token);
* the finalize Map loops until the softmax's token and sends no token: its results are the
  region's completions that :mod:`.dispatch` watches (one message per item);
* the RandomOffChipStore (:mod:`.item_memory`) takes each item's row block with
  ``RecvValue(..., stop=s)`` and stores the next result tile there, until the block channel's
  token; a lane's query load likewise loads at each block (pipelined across items).

The loops' iterations left after the token test their guard only (two nested loops,
:func:`~.stop_loop.until_stop`); a receive with ``stop`` waits for its message, as the control
values the units already read did.  What each such program reads of the run is the forms of
its streams' elements, not their number nor the items' values (:data:`~.unit_reuse.EVERY`,
an empty region built from the streams' declared types); its elements, cycles and FLOPs in a
run are counted from the run's streams (:data:`~.unit_reuse.Tally`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lowering.isa import (
    Calc,
    Cond,
    If,
    Instr,
    ReadValue,
    Recv,
    RecvValue,
    SendValue,
    Set,
)
from torch2step.errors import LoweringError
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, FlatMap, Map
from torch2step.step.ops_memory import RandomOffChipLoad, RandomOffChipStore
from torch2step.step.ops_routing import Partition
from torch2step.step.ops_shape import Expand, Repeat

from .context import EmitCtx
from .kv_loop import _lane_keep, _single, _unit_readers, tally_into
from .lane_pick import lane_pick_scan
from .stop_loop import declared_element, until_stop
from .streams import StreamInfo
from .structure import Structure, value_readers
from .unit import Elem, UnitBuilder
from .unit_reuse import EACH, EVERY

__all__ = [
    "looped_channels",
    "item_bound",
    "item_loop",
    "item_requests",
    "take_stop",
    "hold_buffers",
    "alike",
    "level",
    "counted",
    "template",
    "lead_channel",
    "emit_item_repeat",
    "emit_item_map",
]


# ---------------------------------------------------------------- which streams


def _only(st: Structure, readers: dict[str, list[Op]], name: str, cls: type) -> list[Op]:
    users = _unit_readers(st, readers, name)
    return [u for u in users if isinstance(u, cls) and _single(st, u)] if users else []


def looped_channels(
    graph: StepProgram, st: Structure, stops: set[str], headed: set[str]
) -> tuple[set[str], set[str]]:
    """The streams of decode attention's lanes and regions that end with a stop token after
    their items (module docstring): for every headed KV address FlatMap over a single-node
    Repeat of an item stream (a Partition's output, or a ``lane_keep`` FlatMap's), the Repeat,
    the address FlatMap, the query's Expand and Repeat, the softmax and the ``cursor_block``
    Map; for a lane also its ``lane_keep`` and query load.  Empty where the chain is not of
    that form (its units then follow the run's items).  Second: those streams and the K and
    V tiles and results of the chains, whose channels exist (and are read) whether or not a
    run gives the lane or region an item."""
    readers = value_readers(graph)
    out: set[str] = set()
    chained: set[str] = set()
    for f in graph.nodes:
        if f.name not in headed or not isinstance(f, FlatMap):
            continue
        rep = st.producer.get(f.input.name)
        if not (isinstance(rep, Repeat) and _single(st, rep) and int(rep.count) == 1):
            continue
        src = rep.input.name
        keep = st.producer.get(src)
        lane = keep is not None and _lane_keep(st, keep) and _single(st, keep)
        if lane:  # its decisions computed in registers (.lane_pick)
            assert keep is not None
            zipped = st.producer[keep.input.name]
            pick = st.producer.get(zipped.ins[1].name)  # type: ignore[attr-defined]
            lane = lane_pick_scan(st, pick) and pick.input.name == zipped.ins[0].name  # type: ignore[union-attr]
        if not (src in stops and isinstance(keep, Partition)) and not lane:
            continue
        users = _unit_readers(st, readers, src)
        blocks = [u for u in users if isinstance(u, Map) and u.fn.name == "cursor_block"]
        if len(users) != 2 or rep not in users or len(blocks) != 1 or not _single(st, blocks[0]):
            continue
        (blk,) = blocks
        expands = _only(st, readers, f.name, Expand)
        if len(expands) != 1:
            continue
        (ex,) = expands
        q1 = st.producer.get(ex.input.name)
        if not (isinstance(q1, Repeat) and _single(st, q1) and int(q1.count) == 1):
            continue
        qsrc = st.producer.get(q1.input.name)
        qload = lane and isinstance(qsrc, RandomOffChipLoad) and _single(st, qsrc)
        if qload:
            assert isinstance(qsrc, RandomOffChipLoad)
            if qsrc.raddr.name != blk.name:
                continue
        elif not (q1.input.name in stops and isinstance(qsrc, Partition)) or lane:
            continue
        sms = _unit_readers(st, readers, ex.name)
        if len(sms) != 1 or not isinstance(sms[0], Accum) or not _single(st, sms[0]):
            continue
        os_ = _unit_readers(st, readers, sms[0].name)
        if len(os_) != 1 or not isinstance(os_[0], Map) or not _single(st, os_[0]):
            continue
        stores = _unit_readers(st, readers, os_[0].name)
        blk_users = _unit_readers(st, readers, blk.name)
        if (
            len(stores) != 1
            or not isinstance(stores[0], RandomOffChipStore)
            or stores[0].waddr.name != blk.name
            or not _single(st, stores[0])
            or any(not isinstance(u, (RandomOffChipStore, RandomOffChipLoad)) for u in blk_users)
            or len(_unit_readers(st, readers, q1.input.name)) != 1
        ):
            continue
        out |= {rep.name, f.name, ex.name, sms[0].name, blk.name, q1.name}
        if lane:
            assert keep is not None and qsrc is not None
            out |= {keep.name, qsrc.name}
        tiles = _unit_readers(st, readers, f.name)
        chained |= {os_[0].name, *(u.name for u in tiles if u is not ex)}
    return out, out | chained


def item_bound(ctx: EmitCtx, name: str) -> int:
    """At most how many items stream ``name`` of a lane or region carries: the elements of
    the stream its Partition or ``lane_keep`` chooses from (``B * Hkv``; the sizes evaluated
    are recorded, the same for every assignment of the same batch)."""
    st = ctx.structure
    op = st.producer[name]
    seen = 0
    while not isinstance(op, Partition) and not _lane_keep(st, op):
        op = st.producer[op.inputs()[0].name]
        seen += 1
        if seen > 16:  # pragma: no cover - looped_channels walked this chain
            raise LoweringError(f"stream %{name} is no lane's or region's item stream")
    src = op.input if isinstance(op, Partition) else st.producer[op.input.name].ins[0]
    return math.prod(ctx.ev(d, f"items of %{name}") for d in src.type.shape)


def lead_channel(ctx: EmitCtx, v: Any) -> str:
    """The one channel stream ``v`` comes from."""
    chans = ctx.structure.sources(v if isinstance(v, str) else v.name)
    if len(chans) != 1:  # pragma: no cover - looped_channels checked the chain
        raise LoweringError(f"stream %{v} must come from one channel")
    (ch,) = chans
    return ch


# ---------------------------------------------------------------- the loop


def _with_stop(first: Instr, stop: str) -> Instr:
    if isinstance(first, Recv):
        return Recv(first.channel, first.dst, stop)
    if isinstance(first, RecvValue):
        return RecvValue(first.channel, first.reg, stop)
    raise AssertionError(f"an item must start with its receive, not {first}")  # pragma: no cover


def item_loop(
    b: UnitBuilder,
    copies: list[tuple[Instr, ...]],
    done: tuple[Instr, ...],
    bound: int,
    stop: str,
) -> None:
    """Emit the loop over at most ``bound`` items until the stop token (module docstring):
    ``copies`` are one item's instructions each (one per copy of the rotating buffers, taken in
    turn), starting with the receive that may take the token; ``done`` runs once it came."""
    guard = Cond(stop, "<", 0)
    body = tuple(If(guard, (_with_stop(c[0], stop), If(guard, c[1:], done))) for c in copies)
    iters = -(-(bound + 1) // len(copies))  # every item and the token
    b.step()
    b.emit(Set(stop, -1), *until_stop(iters, guard, body, f"{stop}.i"))
    b.step()


def template(b: UnitBuilder, make: Callable[[], None], n: int) -> tuple[list, tuple]:
    """``n`` copies of one item's instructions made by ``make`` (the builder's counters left
    as they were) and the counters' increase per copy ``(received, sent, busy, flops)``."""
    b.step()
    before = (b.received, b.sent, b.busy_cycles, b.flops)
    copies = []
    for _ in range(n):
        make()
        copies.append(tuple(b.cur))
        b.cur = []
    per = tuple((x - y) // n for x, y in zip((b.received, b.sent, b.busy_cycles, b.flops), before))
    b.received, b.sent, b.busy_cycles, b.flops = before
    return copies, per


def alike(x: StreamInfo, what: str) -> StreamInfo:
    """``x`` when its elements all have the messages of its first, or its declared element
    when it is empty (the loop is built alike for every count)."""
    if not x.flat:
        one = declared_element(x)
        if one is None:
            raise LoweringError(f"{what}: stream %{x.name} has no element of a static type")
        return one
    if any(x.parts(k) != x.parts(0) for k in range(len(x.flat))):
        raise LoweringError(f"{what}: the items of stream %{x.name} differ in their messages")
    return x


def level(x: StreamInfo) -> str:
    """:data:`EVERY` when an empty ``x`` builds the same program (its declared element has the
    messages of its elements), else :data:`EACH`."""
    one = declared_element(x)
    return EVERY if one is not None and (not x.flat or one.parts(0) == x.parts(0)) else EACH


def counted(ctx: EmitCtx, b: UnitBuilder, name: str, per: tuple, scale: int = 1) -> None:
    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat) * scale
        return tuple(n * p for p in per)  # type: ignore[return-value]

    tally_into(ctx, b, tally)


def hold_buffers(b: UnitBuilder) -> None:
    """Allocate every buffer of the unit held (``Alloc.held``, at the capacity it has): the
    loop's rotating buffers hold the items a run gives the lane or region, so the on-chip
    bytes counted are those it holds (none for a lane without an item), as the program
    unrolled over the run's items allocated only the copies it used."""
    for pool in b.pools.values():
        pool.bound = max(pool.bound or 0, pool.cap)


def take_stop(b: UnitBuilder, ch: str) -> tuple[str, int]:
    """The stop register of channel ``ch`` and its elements' messages this run (the builder's
    automatic receive of the token is taken over by the loop)."""
    count = b.stops.pop(ch, None)
    if count is None:  # pragma: no cover - looped_channels put it among the stops
        raise LoweringError(f"unit %{b.name}: channel %{ch} ends with no stop token")
    return f"stop.{ch}", count


def item_requests(
    ctx: EmitCtx,
    b: UnitBuilder,
    v: Any,
    request: Callable[[Elem], None],
    done: Callable[[str], tuple[Instr, ...]],
) -> None:
    """The loop of a unit whose every item is one element of stream ``v`` (data, from a
    channel ending with the items' token) handled by ``request(elem)``, ``done(stop)`` the
    instructions once the token came (in register ``stop``); the elements it receives in a
    run are counted from the run's streams, and ``v`` is read at the level of its forms."""
    x = ctx.stream(v)
    ch = lead_channel(ctx, v)
    stop, count = take_stop(b, ch)
    sx = alike(x, f"unit %{b.name}")

    def one() -> None:
        b.next_seq[ch] = 0
        request(b.recv(sx, 0))

    copies, per = template(b, one, 1)
    item_loop(b, copies, done(stop), item_bound(ctx, x.name), stop)
    b.next_seq[ch] = count + 1
    counted(ctx, b, x.name, per)
    ctx.relax(v, level(x))
    hold_buffers(b)


# ---------------------------------------------------------------- the units


def emit_item_repeat(ctx: EmitCtx, b: UnitBuilder, op: Repeat) -> bool:
    """A Repeat (count 1) of a lane's or region's cursors or query tiles as a loop until the
    items' token, forwarding each tile from the buffer it came in and then the token."""
    if op.name not in ctx.looped:
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    ch = lead_channel(ctx, op.input)
    stop, count = take_stop(b, ch)
    sx, so = alike(x, f"Repeat %{op.name}"), alike(out, f"Repeat %{op.name}")
    bound = item_bound(ctx, op.input.name)

    def one() -> None:
        b.next_seq[ch] = 0
        e = b.recv(sx, 0, rotation=2)
        b.compute(1, (e,), const=True)
        b.send(so, 0, e)

    copies, per = template(b, one, 2)
    sends = out.channel is not None and b.has_dsts(out.channel)
    done = (SendValue(out.channel, stop),) if sends and out.channel else ()
    item_loop(b, copies, done, bound, stop)
    b.next_seq[ch] = count + 1
    if sends and out.channel:
        b.sent_seq[out.channel] = out.messages + 1
    counted(ctx, b, op.input.name, per)
    ctx.relax(op.input, level(x))
    ctx.relax(op.name, level(out))
    hold_buffers(b)
    return True


def emit_item_map(
    ctx: EmitCtx, b: UnitBuilder, op: Map, step: Callable[[StreamInfo, StreamInfo], Any]
) -> bool:
    """A lane's or region's ``cursor_block`` Map (the row block in registers, the token
    forwarded with ``stop``) or finalize Map (its results, no token: :mod:`.dispatch` counts
    them) as a loop until the items' token; ``step(x, y)``: ``(cycles, flops, rule)`` of the
    Map on the first element of stream ``x`` giving that of ``y``."""
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    src = ctx.structure.producer.get(op.input.name)
    block = op.name in ctx.looped
    if not block and not (src is not None and src.name in ctx.looped and isinstance(src, Accum)):
        return False
    ch = lead_channel(ctx, op.input)
    stop, count = take_stop(b, ch)
    what = f"Map %{op.name}"
    sx = alike(x, what)
    sends = out.channel is not None and b.has_dsts(out.channel)
    bound = item_bound(ctx, op.input.name)
    if block:
        if ctx.config(op).reads_memory or ctx.timing.map_flops(op.fn, op.input.type.dtype):
            raise LoweringError(f"{what} computes a row block in registers: no FLOPs, no memory")

        def one() -> None:
            b.next_seq[ch] = 0
            e = b.recv(sx, 0, rotation=2)
            ((_, buf),) = e
            assert buf is not None
            b.compute(1, (e,), const=True)
            b.emit(
                ReadValue("blk.base", buf, 0),
                ReadValue("blk.stride", buf, 2),
                Calc("blk", "floordiv", "blk.base", "blk.stride"),
            )
            if sends and out.channel:
                b.emit(SendValue(out.channel, "blk"))
                b.sent += 1

        done: tuple[Instr, ...] = (SendValue(out.channel, stop, True),) if sends else ()
    else:
        so = alike(out, what)
        cyc, fl, rule = step(sx, so)

        def one() -> None:
            b.next_seq[ch] = 0
            e = b.recv(sx, 0, rotation=2)
            y = b.compute(cyc, (e,), so.parts(0), flops=fl, rule=rule)
            b.send(so, 0, y)

        done = ()
    copies, per = template(b, one, 2)
    item_loop(b, copies, done, bound, stop)
    b.next_seq[ch] = count + 1
    if sends and out.channel:
        b.sent_seq[out.channel] = out.messages + block
    counted(ctx, b, op.input.name, per)
    ctx.relax(op.input, level(x))
    ctx.relax(op.name, None if block else level(out))  # blocks: values from registers
    hold_buffers(b)
    return True
