"""Decode attention's K and V loads, query Expand and online softmax as loops over each
request's tile count (STeP arXiv 2511.07776 §5.1 FlashAttention, §5.4), on the channels whose
every request's elements follow its tile count (:func:`~.kv_loop.headed_channels`; the module
docstring of :mod:`.kv_loop` tells the whole scheme).

* :func:`emit_kv_loads` — per request, the count, then per address ``RecvValue`` the row and the
  row count, ``Load`` the run into the next of ``depth`` rotating buffers held at ``tile``
  rows (chosen by a balanced tree of branches on ``g mod depth``, ``g`` the tiles loaded so
  far) and ``Send`` the tile loaded ``depth - 1`` loads earlier: the unrolled program's
  pipelining (STeP §4.1), across requests; the last ``depth - 1`` tiles at the end.
* :func:`emit_kv_expand` — per request, its query tile, the count (forwarded ahead of the
  copies) and one copy per address dequeued, one cycle each.
* :func:`emit_kv_softmax` — per request, the count from the Expand's channel, then per tile the
  ``(q, k, v)`` messages and one update (the first starts the state) timed by the row rule on
  the K tile's rows; a request without a tile takes the initial state in one cycle.

Their elements, cycles and FLOPs in a run are counted from its streams
(:data:`~.unit_reuse.Tally`); their buffers of run-sized tiles are sized by the most rows a
message of their channel holds (:class:`~.unit_buffers.MessageRows` ``seq=-1``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from lowering.isa import (
    DTYPE_BYTES,
    Affine,
    Calc,
    Compute,
    Cond,
    If,
    Instr,
    Load,
    Loop,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
)
from torch2step.errors import LoweringError
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum
from torch2step.step.ops_memory import RandomOffChipLoadRows
from torch2step.step.ops_shape import Expand, Zip
from torch2step.step.types import TileType, TupleType

from .buffer_loop import select
from .context import EmitCtx, tile_shape
from .item_loop import (
    alike,
    counted,
    hold_buffers,
    item_bound,
    item_loop,
    lead_channel,
    level,
    take_stop,
    template,
)
from .kv_loop import groups_of, requests_of, tally_into
from .streams import Part, iter_nodes, leaves
from .timing import STEP_KERNEL
from .unit import UnitBuilder
from .unit_buffers import MessageRows

__all__ = ["emit_kv_loads", "emit_kv_expand", "emit_kv_softmax", "expand_emitter"]


# ---------------------------------------------------------------- the K and V loads


def emit_kv_loads(ctx: EmitCtx, b: UnitBuilder, op: RandomOffChipLoadRows) -> bool:
    """A K or V load over a headed address channel as a loop over each request's count,
    pipelined across requests (module docstring); ``False`` when the channel is not headed."""
    addrs, out = ctx.stream(op.raddr), ctx.stream(op.name)
    chans = {ch for pc in addrs.pieces for ch, _, _ in pc} or ctx.structure.sources(op.raddr.name)
    if len(chans) != 1 or not chans <= ctx.headed:
        return False
    (ch,) = chans
    lay = ctx.layouts[op.tensor.name]
    most, cols = tile_shape(op)
    dt = lay.dtype
    depth = ctx.timing.dma_depth(most * cols * DTYPE_BYTES[dt])
    looped = ch in ctx.looped  # a lane's or region's requests, until their stop token
    sends = out.channel is not None and b.has_dsts(out.channel)
    rows_at = MessageRows(out.channel or op.name, -1)
    held = max((p.elems for k in range(len(out.flat)) for p in out.parts(k)), default=0)
    names = [b.buffer(("ld",), dt, held, depth, (rows_at, most, cols, 0)) for _ in range(depth)]
    b._await(lay.name)
    start = Affine(op.base * cols, (("ld.row", cols),))
    extent = Affine(0, (("ld.r", cols),))

    def load(i: int) -> tuple[Instr, ...]:
        return (Load(names[i], lay.name, Region((start,), (extent,))),)

    def send(i: int) -> tuple[Instr, ...]:
        return (Send(out.channel, names[i]),) if sends and out.channel else ()

    body: tuple[Instr, ...] = (
        RecvValue(ch, "ld.row"),
        RecvValue(ch, "ld.r"),
        Calc("ld.m", "mod", "ld.g", depth),
        *select("ld.m", 0, depth, load),
    )
    if sends:
        body += (
            If(
                Cond("ld.g", ">=", depth - 1),
                (
                    Calc("ld.s", "mod", Affine(1 - depth, (("ld.g", 1),)), depth),
                    *select("ld.s", 0, depth, send),
                ),
            ),
        )
    body += (Set("ld.g", Affine(1, (("ld.g", 1),))),)
    b.emit(Set("ld.g", 0))
    b.step()
    if looped:
        item_loop(
            b, [(RecvValue(ch, "ld.n"), Loop("ld.n", body))], (), item_bound(ctx, ch), "ld.stop"
        )
    else:
        for _ in range(requests_of(ctx, ch)):
            b.emit(RecvValue(ch, "ld.n"), Loop("ld.n", body))
            b.step()
    if sends:  # the last depth - 1 tiles
        for i in range(depth - 1):
            t = Affine(1 - depth + i, (("ld.g", 1),))
            b.emit(
                If(
                    Cond(t, ">=", 0),
                    (Calc("ld.s", "mod", t, depth), *select("ld.s", 0, depth, send)),
                )
            )
        b.step()
    b.next_seq[ch] = addrs.messages + len(groups_of(addrs)) + looped
    if sends and out.channel is not None:
        b.sent_seq[out.channel] = out.messages
    name = op.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat)
        return n, n * sends, 0, 0

    tally_into(ctx, b, tally)
    ctx.relax(op.raddr, None)  # addresses, counts and rows reach registers only
    ctx.relax(op.name, None)
    return True


# ---------------------------------------------------------------- the query's Expand


def emit_kv_expand(ctx: EmitCtx, b: UnitBuilder, op: Expand) -> bool:
    """The query's Expand along a headed address channel (module docstring); ``False`` when
    the channel (or its own output's) is not headed."""
    x, r, out = ctx.stream(op.input), ctx.stream(op.ref), ctx.stream(op.name)
    chans = {ch for pc in r.pieces for ch, _, _ in pc} or ctx.structure.sources(op.ref.name)
    if len(chans) != 1 or not chans <= ctx.headed or out.channel not in ctx.headed:
        return False
    (ch,) = chans
    cut = x.value.rank - op.rank
    nodes = iter_nodes(x.value.data, cut)
    if any(len(leaves(n, op.rank + 1)) != 1 for n in nodes) or len(nodes) != len(x.flat):
        raise LoweringError(
            f"Expand %{op.name} along the KV-tile addresses of channel %{ch} must expand one "
            "element per request (torch2step.spatial.kv_loop)"
        )
    sends = b.has_dsts(out.channel)
    looped = ch in ctx.looped  # a lane's or region's requests, until their stop token
    bufs: list[str] = []

    def request(e: Any) -> None:
        ((_, buf),) = e
        assert buf is not None
        bufs.append(buf)
        step: tuple[Instr, ...] = (
            RecvValue(ch, "ex.row"),
            RecvValue(ch, "ex.r"),
            b.compute_instr(1, (buf,)),
        )
        if sends:
            b.emit(SendValue(out.channel, "ex.n"))
            step += (Send(out.channel, buf),)
        b.emit(Loop("ex.n", step))

    if looped:  # the count leads (it may be the token), then the query tile
        qch = lead_channel(ctx, op.input)
        qstop, count = take_stop(b, qch)
        sx = alike(x, f"Expand %{op.name}")

        def one() -> None:
            b.emit(RecvValue(ch, "ex.n"))
            b.next_seq[qch] = 0
            request(b.recv(sx, 0, rotation=2))

        copies, per = template(b, one, 2)
        done: tuple[Instr, ...] = (Recv(qch, bufs[0], qstop),)
        if sends:
            done += (SendValue(out.channel, "ex.stop", True),)
        item_loop(b, copies, done, item_bound(ctx, ch), "ex.stop")
        b.next_seq[qch] = count + 1
        counted(ctx, b, op.input.name, per)
        ctx.relax(op.input, level(x))
        hold_buffers(b)
    else:
        for k in range(len(x.flat)):
            e = b.recv(x, k, rotation=2)
            b.emit(RecvValue(ch, "ex.n"))
            request(e)
            b.step()
    b.next_seq[ch] = r.messages + len(groups_of(r)) + looped
    if sends:
        b.sent_seq[out.channel] = out.messages + len(groups_of(out)) + looped
    name = op.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat)
        return n, n * sends, n, 0

    tally_into(ctx, b, tally)
    ctx.relax(op.ref, None)
    ctx.relax(op.name, None)
    return True


# ---------------------------------------------------------------- the online softmax


def _zeros(t: Any, rows: int) -> Any:
    """An element of declared type ``t``, dynamic rows set to ``rows`` (``None``: a part that
    is no static-width tile)."""
    if isinstance(t, TileType):
        if not t.shape[1].is_Integer:
            return None
        r = int(t.shape[0]) if t.shape[0].is_Integer else rows
        return np.zeros((r, int(t.shape[1])))
    if isinstance(t, TupleType):
        vals = tuple(_zeros(e, rows) for e in t.elems)
        return None if any(v is None for v in vals) else vals
    return None


def _data_parts(x: Any, t: Any) -> tuple[Part, ...]:
    if isinstance(t, TupleType):
        return tuple(p for v, s in zip(x, t.elems) for p in _data_parts(v, s))
    return (Part("data", t.dtype, int(x.size)),)


def emit_kv_softmax(ctx: EmitCtx, b: UnitBuilder, op: Accum, cost: Any) -> bool:
    """The online-softmax Accum over a headed channel as a loop over each request's count
    (module docstring); ``False`` when it reads no headed channel or its steps have no row
    rule."""
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    srcs = ctx.structure.sources(op.input.name)
    heads = srcs & ctx.headed
    if op.rank != 1 or len(heads) != 1:
        return False
    (hch,) = heads
    # per part of an element, its channel (in the Zip's order)
    src = ctx.structure.producer.get(op.input.name)
    ins = [v.name for v in src.ins] if isinstance(src, Zip) else [op.input.name]
    chans = [ctx.streams[v].channel for v in ins]  # structural: not the run's
    decls, dyn = x.decl()
    most = 0
    for v in ins:
        info = ctx.structure.producer.get(v)
        if isinstance(info, RandomOffChipLoadRows):
            most = max(most, int(info.tile.shape[0]))
    sx, st = _zeros(x.dtype, most), _zeros(out.dtype, most)
    rule, out_parts = None, ()
    if sx is not None and st is not None and most and not cost.cfg.writes_memory:
        in_parts, out_parts = _data_parts(sx, x.dtype), _data_parts(st, out.dtype)
        _, _, rule = cost.update_step(op.fn, sx, x.dtype, st, out.dtype, in_parts, out_parts, True)
    looped = hch in ctx.looped  # a lane's or region's requests, until their stop token
    reqs = len(out.flat) if looped else requests_of(ctx, hch)
    if (
        rule is None
        or len(chans) != len(decls)
        or any(c is None for c in chans)
        or any(d is None for d in decls)
        or len(out.flat) != reqs
        or any(out.parts(k) != out_parts for k in range(reqs))
    ):
        raise LoweringError(
            f"Accum %{op.name} reads the KV tiles of each request after its tile count "
            f"(channel %{hch}), but its updates have no row rule on the K tile's rows (or "
            "write back to memory, or its input is no Zip of the query and the tiles): "
            "torch2step.spatial.kv_loop builds such an Accum only as a loop over the count"
        )
    t = ctx.timing
    bufs = []
    for i, (ch, decl) in enumerate(zip(chans, decls)):
        assert ch is not None and decl is not None
        elems = int(decl.shape[1]) * (most if dyn[i] else int(decl.shape[0]))
        sized = (MessageRows(ch, -1), most, int(decl.shape[1]), 0) if dyn[i] else None
        held = max((x.parts(k)[i].elems for k in range(len(x.flat))), default=0)
        bufs.append(b.buffer(("in", ch, i), in_parts[i].dtype, held if dyn[i] else elems, 1, sized))
    sends = out.channel is not None and b.has_dsts(out.channel)

    def request() -> None:
        accs = [b.buffer(("acc", i), p.dtype, p.elems, 2) for i, p in enumerate(out_parts)]
        first = Compute(
            STEP_KERNEL, tuple(accs), tuple(bufs), rule.params(rule.slot, t.enc_rate), t.enc_dtype
        )
        update = Compute(
            STEP_KERNEL,
            tuple(accs),
            (*bufs, *accs),
            rule.params(rule.slot, t.enc_rate),
            t.enc_dtype,
        )
        init = Compute(
            STEP_KERNEL,
            tuple(accs),
            (),
            (
                ("cycles", 1),
                ("outs", ",".join(str(p.elems) for p in out_parts)),
                ("rate", t.enc_rate),
            ),
            t.enc_dtype,
        )
        recvs = tuple(Recv(ch, buf) for ch, buf in zip(chans, bufs))  # type: ignore[arg-type]
        body = (*recvs, If(Cond("sm.j", "==", 0), (first,), (update,)))
        b.emit(
            RecvValue(hch, "sm.n"),
            Loop("sm.n", body, "sm.j"),
            If(Cond("sm.n", "==", 0), (init,)),
        )
        if sends and out.channel is not None:
            b.emit(*(Send(out.channel, a) for a in accs))

    if looped:
        copies, _ = template(b, request, 2)
        done = (SendValue(out.channel, "sm.stop"),) if sends and out.channel else ()
        item_loop(b, copies, done, item_bound(ctx, hch), "sm.stop")
        counted(ctx, b, op.name, (0, int(sends), 0, 0))
        ctx.relax(op.name, level(out))
        hold_buffers(b)
    else:
        for _ in range(reqs):
            request()
            b.step()
        b.sent += reqs * sends
    for ch in chans:
        assert ch is not None
        b.next_seq[ch] = ctx.streams[ch].messages + (
            len(groups_of(ctx.streams[ch])) + looped if ch == hch else 0
        )
    if sends and out.channel is not None:
        b.sent_seq[out.channel] = out.messages + looped
    name, fn, dtype = op.input.name, op.fn, x.dtype

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        s = c.streams[name]
        steps = [
            cost.update_step(fn, v, dtype, st, out.dtype, s.parts(k), out_parts, True)
            for k, v in enumerate(s.flat)
        ]  # each tile's update (the roofline of its shapes: its row rule's cycles)
        empty = sum(n == 0 for n in groups_of(s))  # the initial state, one cycle
        return len(steps), 0, sum(c for c, _, _ in steps) + empty, sum(f for _, f, _ in steps)

    tally_into(ctx, b, tally)
    ctx.relax(op.input, None)  # its tiles' count and rows are the run's, read at run time
    return True


Emitter = Callable[[EmitCtx, UnitBuilder, tuple[Op, ...]], None]


def expand_emitter(fallback: Emitter) -> Emitter:
    """The Expand emitter: :func:`emit_kv_expand` where it applies, else ``fallback``."""

    def emit(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
        op = ops[0]
        assert isinstance(op, Expand)
        if not emit_kv_expand(ctx, b, op):
            fallback(ctx, b, ops)

    return emit
