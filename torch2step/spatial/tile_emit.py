"""The programs of a statically tiled expert's units that loop over its tiles themselves.

STeP arXiv 2511.07776 §5.2, :mod:`.tile_loop`: the expert's Bufferize (the tile group's head)
and its routing weights' packing loop until the Partition's stop token, a tile of ``N`` rows
per iteration, and its FilterPadding keeps each tile's real rows, the count of them the value
of the tile's buffer reference.  Each step is the one the unrolled program of
:mod:`.static_pad` takes for a tile (STeP §4.2); these programs are the same for every count.
A packing's rows ``1 .. N-1`` (one identical step each) and a FilterPadding's rows (the same
steps but for the row index, a loop variable) are held in loops, so a program's size does not
grow with ``N`` (a 1024-row tile is not 1024 branches for validation and compilation to walk;
control instructions take no cycle, so the run is the same).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import sympy as sp

from lowering.isa import (
    DTYPE_BYTES,
    Affine,
    Calc,
    Cond,
    If,
    Instr,
    Loop,
    Recv,
    RecvValue,
    Send,
    SendValue,
    Set,
)
from torch2step.step.ops_compute import Accum, FlatMap
from torch2step.step.ops_memory import Bufferize, LinearOffChipLoad, Streamify
from torch2step.step.ops_shape import Reshape, Zip

from .context import EmitCtx, tile_shape
from .static_pad import _flags_chunk, _zero_row, padded_rows
from .stop_loop import _rotate, forwards_stop, until_stop
from .streams import Part
from .tile_loop import tile_channel, tile_rows_reg
from .unit import UnitBuilder

__all__ = ["emit_tile_buffer", "emit_tile_pack", "emit_tile_filter", "emit_tile_load"]


def emit_tile_buffer(ctx: EmitCtx, b: UnitBuilder, op: Bufferize, fused: list[Streamify]) -> bool:
    """The head of a tile group (built from its one-tile view): per tile, until the stop
    token, up to ``N`` rows into its ``N`` row buffers, ``r`` the rows it got; if ``r > 0``
    its reference (value ``r``) and each read of it, row ``j`` sent from its buffer if
    ``j < r`` or else a zero row made there; after the loop the token (the count) on the
    reference's channel.  A receive that may be the token waits for its message, so the next
    tile's rows are received once this tile's reads are sent: they wait in the channel's
    FIFO, a tile deeper (:meth:`~.guard.Views.depth`), where the unrolled program's double
    buffering kept them in a second set of row buffers (STeP §4.1).  ``False`` (nothing
    emitted) when the unit is not such a head."""
    ref = ctx.tiled.get(op.name)
    if ref != op.name or op.rank != 1:
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    found = padded_rows(ctx, b, x)
    if found is None or len(x.value.data) != 1 or out.channel is None:
        return False
    ch, n, part = found
    cut = ctx.structure.producer[op.input.name]
    assert isinstance(cut, Reshape)
    rows_in = cut.inputs()[0].type.shape[0]  # type: ignore[attr-defined]
    bound = b.bound(rows_in)
    if bound is None:
        return False
    reads = []
    for s in fused:
        so, rs = ctx.stream(s.name), ctx.stream(s.ref)
        chans = {c for pc in rs.pieces for c, _, _ in pc}
        if s.out_shape is not None or len(chans) != 1 or None in chans or so.channel is None:
            return False
        if any(len(pc) != 1 or pc[0][2].kind != "value" for pc in rs.pieces):
            return False
        reads.append((so.channel, next(iter(chans)), len(rs.flat)))
    messages = b.stops.pop(ch)
    stop, rows, t = f"stop.{ch}", f"rows.{ref}", f"t.{ref}"
    names = [b.buffer(("mem", 0, j, 0), part.dtype, part.elems) for j in range(n)]
    mc = ctx.timing.memory_cycles(part.nbytes)
    more = Cond(stop, "<", 0)
    sends_ref = b.has_dsts(out.channel)

    def tile() -> tuple[Instr, ...]:
        bufs = names
        fill = tuple(If(more, (Recv(ch, nm, stop),)) for nm in bufs)
        got = If(more, (Set(rows, n),), (Set(rows, Affine(0, ((stop, 1), (t, -n)))),))
        then: list[Instr] = [b.compute_instr(1, tuple(bufs))]
        if sends_ref:
            then.append(SendValue(out.channel, rows))  # type: ignore[arg-type]
        for ch_out, ch_ref, per in reads:
            sends = b.has_dsts(ch_out)
            body: list[Instr] = [RecvValue(ch_ref, f"v.{ch_ref}.0"), b.compute_instr(1, ())]
            for j, nm in enumerate(bufs):
                send = (Send(ch_out, nm),) if sends else ()
                real = (b.compute_instr(mc, (nm,)), *send)
                pad = (b.compute_instr(mc, ()), _zero_row(b, nm, part), *send)
                body.append(If(Cond(j, "<", rows), real, pad))
            then.append(Loop(per, tuple(body)))
        return (*fill, got, If(Cond(rows, ">", 0), tuple(then)))

    b.emit(Set(stop, -1))
    b.step()
    b.emit(*until_stop(-(-bound // n) + 1, more, tile(), t))
    b.step()
    if sends_ref:
        b.emit(SendValue(out.channel, stop, stop=True))
    b.step()
    # one full tile's bookkeeping (the view's): its rows, reads and sends
    b.next_seq[ch] = messages + 1
    b.received += n
    b.busy_cycles += 1
    if sends_ref:
        b.sent += 1
        b.sent_seq[out.channel] += 1
    for ch_out, ch_ref, per in reads:
        b.next_seq[ch_ref] = per
        b.received += per
        b.busy_cycles += per * (1 + n * mc)
        if b.has_dsts(ch_out):
            b.sent += per * n
            b.sent_seq[ch_out] += per * n
    return True


def _captured(b: UnitBuilder, fn: Callable[[], Any]) -> tuple[tuple[Instr, ...], Any]:
    """The instructions of the step ``fn`` makes on ``b`` (not emitted nor counted) and what
    it returned."""
    cur, busy, flops = b.cur, b.busy_cycles, b.flops
    b.cur = []
    got = fn()
    instrs = tuple(b.cur)
    b.cur, b.busy_cycles, b.flops = cur, busy, flops
    return instrs, got


def _runs(blocks: list[tuple[Instr, ...]]) -> tuple[Instr, ...]:
    """``blocks`` in order, each run of one block (the same object) repeated as a ``Loop``."""
    out: list[Instr] = []
    for _, run in itertools.groupby(blocks, key=id):
        same = list(run)
        out += [Loop(len(same), same[0])] if len(same) > 1 else same[0]
    return tuple(out)


def emit_tile_pack(ctx: EmitCtx, b: UnitBuilder, op: Accum, cost: Any) -> bool:
    """The routing weights' packing of a tile group (a ``retile_row`` Accum of a Reshape's
    ``[C_e, N]`` rows of a channel ending with a stop token): per tile, until the token, row
    0 starts the tile, each of rows ``1 .. N-1`` is appended if it came or a zero element
    appended if the token came instead, and the tile is sent; then the token.  Built from the
    declared types, so the same program for every count (down to none); its bookkeeping is
    counted from the run's streams.  The head of a tile group packing its tile (built from
    its one-tile view) also sends each tile's real rows on its control channel
    (:func:`~.tile_loop.tile_channel`) and the token there, not on its tiles' channel.
    ``False`` when the unit is not such a packing."""
    if op.name not in ctx.tiled or getattr(op.fn, "name", None) != "retile_row" or op.rank != 1:
        return False
    cut = ctx.structure.producer.get(op.input.name)
    src = ctx.structure.sources(op.input.name)
    if not isinstance(cut, Reshape) or cut.name in ctx.structure.owner or len(src) != 1:
        return False
    (ch,) = src
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    xt, ot = x.dtype, out.dtype
    if ch not in b.stops or b.own(ch) or out.channel is None:
        return False
    n = cut.chunk
    rows_in = cut.inputs()[0].type.shape[0]  # type: ignore[attr-defined]
    bound = b.bound(rows_in)
    shape = getattr(xt, "shape", None)
    if bound is None or shape is None or not all(d.is_Integer for d in shape) or shape[0] != 1:
        return False
    cols = int(shape[1])
    row = Part("data", str(xt.dtype), cols)  # type: ignore[attr-defined]
    whole = Part("data", str(ot.dtype), n * cols)  # type: ignore[attr-defined]
    # the step's cost depends on the shapes and on whether it ends the tile only: two stand-in
    # zero elements (read-only broadcasts, no memory), two costs
    x0 = np.broadcast_to(np.zeros(()), (1, cols))
    s0 = np.broadcast_to(np.zeros(()), (n, cols))
    mid, end = (
        cost.update_step(op.fn, x0, xt, s0, ot, (row,), (whole,), last) for last in (False, True)
    )
    steps = [mid] * (n - 1) + [end]
    if any(rule is not None for _, _, rule in steps):
        return False
    count = b.stops.pop(ch)
    stop, t, m, rows = f"stop.{ch}", f"t.{op.name}", f"m.{op.name}", f"rows.{op.name}"
    # the head of a tile group that packs its tile (.tile_loop): its control channel
    ctl = tile_channel(op.name)
    head = ctx.tiled.get(op.name) == ctl
    tell = head and b.has_dsts(ctl)
    more = Cond(stop, "<", 0)
    inb = b.buffer(("in", ch, 0), row.dtype, cols)
    sends = b.has_dsts(out.channel)

    def tile() -> tuple[Instr, ...]:
        c0, f0, _ = steps[0]
        start, acc = _captured(
            b, lambda: b.compute(c0, (((row, inb),),), (whole,), role="acc", flops=f0)
        )
        made: dict[tuple[int, int], tuple[Instr, ...]] = {}  # one step per distinct cost
        rows_after: list[tuple[Instr, ...]] = []  # rows 1 .. N-1, one step each
        for j in range(1, n):
            c, fl, _ = steps[j]
            got = made.get((c, fl))
            if got is None:
                real, _ = _captured(
                    b,
                    lambda c=c, fl=fl: b.compute(
                        c, (((row, inb),), acc), (whole,), flops=fl, into=acc
                    ),
                )
                pad, _ = _captured(
                    b,
                    lambda c=c, fl=fl: b.compute(
                        c, (((row, None),), acc), (whole,), flops=fl, into=acc
                    ),
                )
                got = made[c, fl] = (If(more, (Recv(ch, inb, stop),)), If(more, real, pad))
            rows_after.append(got)
        # the rows' identical steps as one loop (control instructions take no cycle): the
        # program is O(1) in N, not N branches for validation and compilation to walk
        body: list[Instr] = [*start, *_runs(rows_after)]
        if tell:  # the tile's real rows on the control channel, ahead of the tile
            got = If(more, (Set(rows, n),), (Set(rows, Affine(0, ((stop, 1), (t, -n)))),))
            body += [got, SendValue(ctl, rows)]
        if sends:
            body.append(Send(out.channel, acc[0][1]))  # type: ignore[arg-type]
        return (Recv(ch, inb, stop), If(more, tuple(body)))

    copies = [tile(), tile()]  # the accumulator alternates, as the unrolled program's
    b.emit(Set(stop, -1))
    b.step()
    b.emit(*until_stop(-(-bound // n) + 1, more, (Calc(m, "mod", t, 2), *_rotate(m, copies)), t))
    b.step()
    fwd = sends and not head and forwards_stop(op, src, {ch})
    if fwd:  # its stop token (the count), after its last tile (.stop_loop)
        b.emit(SendValue(out.channel, stop))
    if tell:  # a head's: on its control channel
        b.emit(SendValue(ctl, stop, stop=True))
        b.sent_seq[ctl] = 1
    b.step()
    b.next_seq[ch] = count + 1
    if sends:
        b.sent_seq[out.channel] = out.messages + fwd
    per_c = sum(c for c, _, _ in steps)
    per_f = sum(f for _, f, _ in steps)
    name = x.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        k = len(c.streams[name].flat) // n  # the run's tiles
        return k * n, k * sends, k * per_c, k * per_f

    r, s_, busy, fl = ctx.tally(tally)
    b.received += r
    b.sent += s_
    b.busy_cycles += busy
    b.flops += fl
    ctx.relax(x.name, None)  # its program is the declared types'; its tiles are the run's
    ctx.relax(out.name, None)
    return True


def emit_tile_filter(ctx: EmitCtx, b: UnitBuilder, op: FlatMap) -> bool:
    """The FilterPadding unit of a tile group (built from its one-tile view, its program run
    once per tile): row ``j`` of the tile is sent if ``j`` is below the tile's real rows (the
    reference's value, received into :func:`~.tile_loop.tile_rows_reg`), else dropped, both
    one step.  ``False`` when the unit is not such a filter."""
    ref = ctx.tiled.get(op.name)
    zipped = ctx.structure.producer.get(op.input.name)
    if ref is None or getattr(op.fn, "name", None) != "filter_padding":
        return False
    if not isinstance(zipped, Zip) or len(zipped.ins) != 2:
        return False
    n = _flags_chunk(ctx.structure, zipped.ins[1].name)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    rows = zipped.ins[0].name
    if n is None or len(x.flat) != n:
        return False
    if any(len(pc) != 2 or pc[0][0] != rows or pc[1][0] is not None for pc in x.pieces):
        return False
    data = x.parts(0)[0]
    if data.kind != "data" or any(x.parts(k)[0] != data for k in range(n)):
        return False
    reg = tile_rows_reg(ref)
    sends = out.channel is not None and b.has_dsts(out.channel)
    b.step()
    start = len(b.steps)
    for k in range(n):
        e = b.recv(x, k)
        real, y = _captured(b, lambda e=e: b.compute(1, (e,), (data,)))
        pad, _ = _captured(b, lambda e=e: b.consume(e))
        send = (Send(out.channel, y[0][1]),) if sends and out.channel else ()
        b.emit(If(Cond(k, "<", reg), (*real, *send), pad))
        b.busy_cycles += 1
        if sends:
            b.sent += 1
            b.sent_seq[out.channel] += 1  # type: ignore[index]
        b.step()
    b.steps[start:] = _indexed_loop(b.steps[start:], f"k.{op.name}")
    return True


def _indexed_loop(steps: list[tuple[Instr, ...]], var: str) -> list[tuple[Instr, ...]]:
    """The FilterPadding's row steps (step ``k`` ends with ``If(k < rows, ...)``) as one loop
    over ``var`` when they repeat with a period ``p`` (the rotating buffers') but for ``k``:
    step ``q * p + r`` tests ``r + p * var < rows`` (control instructions take no cycle, so
    the run is the same; the program is O(p) in the tile's ``N`` rows, not ``N`` branches).
    ``steps`` unchanged when they do not repeat."""
    n = len(steps)

    def at(step: tuple[Instr, ...], lhs: Any) -> tuple[Instr, ...]:
        last = step[-1]
        assert isinstance(last, If)
        return (*step[:-1], dataclasses.replace(last, cond=dataclasses.replace(last.cond, lhs=lhs)))

    def same(a: tuple[Instr, ...], b: tuple[Instr, ...]) -> bool:  # equal but for ``k``
        x, y = a[-1], b[-1]
        assert isinstance(x, If) and isinstance(y, If)
        return (
            a[:-1] == b[:-1]
            and x.then == y.then
            and x.orelse == y.orelse
            and (x.cond.op, x.cond.rhs) == (y.cond.op, y.cond.rhs)
        )

    for p in range(1, n // 2 + 1):
        if n % p or not all(same(steps[k], steps[k % p]) for k in range(p, n)):
            continue
        body = tuple(i for r in range(p) for i in at(steps[r], Affine(r, ((var, p),))))
        return [(Loop(n // p, body, var),)]
    return steps


def emit_tile_load(ctx: EmitCtx, b: UnitBuilder, op: LinearOffChipLoad) -> bool:
    """A weight load of a tile group (built from its one-tile view) that loops over the tiles
    itself, its loads pipelined across them (STeP §4.1): before it sends a tile's last weight
    tile it takes the next tile's reference and, if one came (not the stop token), issues that
    tile's first load, the others (up to ``d - 1`` ahead) at the next tile's start.  (Taking
    the reference ``d - 1`` sends early, as the unrolled program did, holds the current tile's
    weights back until the next tile is packed.)  ``False`` when the unit is not such a
    load."""
    ref = ctx.tiled.get(op.name)
    if ref is None or op.ref is None:
        return False
    refs, out = ctx.stream(op.ref), ctx.stream(op.name)
    tiles = sp.sympify(op.ref.type.shape[0])  # type: ignore[attr-defined]
    if (
        len(refs.flat) != 1
        or len(refs.pieces[0]) != 1
        or refs.pieces[0][0][0] != ref
        or refs.pieces[0][0][2].kind != "value"
        or not isinstance(tiles, sp.ceiling)
        or len(tiles.free_symbols) != 1
    ):
        return False
    from .emit_memory import _affine_offsets

    (count,) = tiles.free_symbols
    size = sp.simplify(count / tiles.args[0])
    bound = b.bound(count)
    lay = ctx.layouts[op.tensor.name]
    lins = _affine_offsets(ctx, op, op.out_shape, op.stride, op.base)
    n = len(lins)
    if bound is None or not size.is_Integer or n == 0 or n != len(out.flat):
        return False
    tile = tile_shape(op)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    ahead = min(depth - 1, n)
    stop, v = f"stop.{ref}", f"v.{ref}.0"
    more = Cond(stop, "<", 0)
    loads, held = [], []
    for j in range(n):
        instrs, e = _captured(
            b, lambda j=j: b.load(lay.name, *lay.region(lins[j], tile), lay.dtype, depth)
        )
        loads.append(instrs)
        held.append(e)
    sends = [_captured(b, lambda j=j: b.send(out, j, held[j]))[0] for j in range(n)]
    consume = b.compute_instr(1, ())
    take = RecvValue(ref, v, stop)
    # the next tile's first load is issued before this tile's last send (its reference
    # taken then), the others at the next tile's start
    body: list[Instr] = [i for j in range(1, ahead) for i in loads[j]]
    for t in range(n):
        if t + ahead < n:
            body += loads[t + ahead]
        if t == n - 1:
            body += [take, If(more, (consume, *loads[0]))]
        body += sends[t]
    limit = -(-bound // int(size))
    first = [consume, *loads[0]]
    b.emit(take, If(more, (*first, *until_stop(limit, more, tuple(body), f"t.{ref}"))))
    b.step()
    b.next_seq[ref] = 1
    b.received += 1
    b.busy_cycles += 1
    return True
