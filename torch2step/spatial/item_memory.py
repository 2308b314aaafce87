"""A decode-attention lane's or region's off-chip accesses as loops until its items' stop
token (STeP arXiv 2511.07776 §5.4; the scheme is :mod:`.item_loop`'s): the
RandomOffChipStore of the results at each item's row block, and a lane's query load.  And
the emitters of the operators whose units :mod:`.item_loop` loops, each trying the loop
first (:func:`item_emitters`, wired into :data:`.plan.EMITTERS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lowering.isa import (
    DTYPE_BYTES,
    Affine,
    Calc,
    Cond,
    If,
    Instr,
    Load,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
)
from torch2step.errors import LoweringError
from torch2step.step.op_base import Op
from torch2step.step.ops_memory import RandomOffChipLoad, RandomOffChipStore
from torch2step.step.ops_shape import Repeat

from .buffer_loop import select
from .context import EmitCtx, tile_shape
from .item_loop import (
    alike,
    counted,
    emit_item_repeat,
    hold_buffers,
    item_bound,
    item_loop,
    lead_channel,
    level,
    template,
)
from .streams import StreamInfo
from .unit import Elem, UnitBuilder

__all__ = ["emit_item_store", "emit_item_load", "item_emitters"]


def _recv_value(b: UnitBuilder, ch: str) -> str:
    """The register a control value of channel ``ch`` is received into (as ``recv`` names
    it), its ``RecvValue`` emitted."""
    reg = f"v.{ch}.0"
    b.emit(RecvValue(ch, reg))
    b.received += 1
    return reg


def _recv_tile(b: UnitBuilder, x: StreamInfo, ch: str, rotation: int) -> Elem:
    """The next buffer for a tile of stream ``x`` (declared static shape) from channel ``ch``,
    its ``Recv`` emitted (as ``recv`` names it)."""
    sx = alike(x, f"unit %{b.name}")
    b.next_seq[ch] = 0
    return b.recv(sx, 0, rotation=rotation)


def emit_item_store(ctx: EmitCtx, b: UnitBuilder, op: RandomOffChipStore) -> bool:
    """A lane's or region's RandomOffChipStore as a loop until its row blocks' token: per item
    ``RecvValue`` the block (with ``stop``), receive the result tile and store it there."""
    if op.waddr.name not in ctx.looped:
        return False
    addrs, data, ack = ctx.stream(op.waddr), ctx.stream(op.wdata), ctx.stream(op.name)
    if ack.channel is not None and b.has_dsts(ack.channel):
        raise LoweringError(f"RandomOffChipStore %{op.name}: its acknowledgements have a reader")
    ach, dch = lead_channel(ctx, op.waddr), lead_channel(ctx, op.wdata)
    stop, _ = f"stop.{ach}", b.stops.pop(ach, None)
    lay = ctx.layouts[op.tensor.name]
    tile = tile_shape(op)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    what = f"RandomOffChipStore %{op.name}"

    def one() -> None:
        reg = _recv_value(b, ach)
        d = _recv_tile(b, data, dch, depth)
        b.store(lay.name, *lay.region_at(op.base, reg, tile, what), d)

    copies, per = template(b, one, depth)
    item_loop(b, copies, (), item_bound(ctx, op.waddr.name), stop)
    b.next_seq[ach] = addrs.messages + 1
    b.next_seq[dch] = data.messages
    counted(ctx, b, op.waddr.name, per)
    ctx.relax(op.waddr, None)  # the blocks reach registers only
    ctx.relax(op.wdata, level(data))
    ctx.relax(op.name, None)
    hold_buffers(b)
    return True


def emit_item_load(ctx: EmitCtx, b: UnitBuilder, op: RandomOffChipLoad) -> bool:
    """A lane's query load as a loop until its row blocks' token: per item ``RecvValue`` the
    block (with ``stop``), load the tile there into the next of ``depth`` rotating buffers and
    send the tile loaded ``depth - 1`` items earlier (the unrolled program's pipelining, as
    :func:`~.kv_tiles.emit_kv_loads` does); the last tiles and the token once it came."""
    if op.name not in ctx.looped:
        return False
    ach = lead_channel(ctx, op.raddr)
    b.stops.pop(ach, None)
    address_loop(ctx, b, op, ach, item_bound(ctx, op.raddr.name), "q", token=True)
    return True


def address_loop(
    ctx: EmitCtx,
    b: UnitBuilder,
    op: RandomOffChipLoad,
    ach: str,
    bound: int,
    reg: str,
    token: bool,
) -> None:
    """A RandomOffChipLoad as one loop over the addresses of channel ``ach`` until its stop
    token (at most ``bound``): per address ``RecvValue`` it into register ``{reg}.at``, load the
    tile there into the next of ``depth`` rotating buffers and send the tile loaded ``depth - 1``
    addresses earlier, so loads run ahead as the unrolled program's do; the last tiles once the
    token came, then (``token``) the token on the output."""
    addrs, out = ctx.stream(op.raddr), ctx.stream(op.name)
    stop = f"stop.{ach}"
    lay = ctx.layouts[op.tensor.name]
    tile = tile_shape(op)
    what = f"RandomOffChipLoad %{op.name}"
    so = alike(out, what)
    ((part,),) = (so.parts(0),)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    sends = out.channel is not None and b.has_dsts(out.channel)
    b._await(lay.name)  # the completion tokens of earlier stores, once ahead of the loop
    names = [b.buffer(("ld",), part.dtype, part.elems, depth) for _ in range(depth)]
    at, g, m, s = (f"{reg}.{x}" for x in ("at", "g", "m", "s"))
    starts, extents = lay.region_at(op.base, at, tile, what)

    def load(i: int) -> tuple[Instr, ...]:
        return (Load(names[i], lay.name, Region(tuple(starts), tuple(extents))),)

    def send(i: int) -> tuple[Instr, ...]:
        return (Send(out.channel, names[i]),) if sends and out.channel else ()

    def back(t: Affine) -> tuple[Instr, ...]:  # the tile loaded depth - 1 addresses before
        return (If(Cond(t, ">=", 0), (Calc(s, "mod", t, depth), *select(s, 0, depth, send))),)

    body: tuple[Instr, ...] = (
        RecvValue(ach, at),
        Calc(m, "mod", g, depth),
        *select(m, 0, depth, load),
        *(back(Affine(1 - depth, ((g, 1),))) if sends else ()),
        Set(g, Affine(1, ((g, 1),))),
    )
    done: tuple[Instr, ...] = ()
    if sends and out.channel:
        for i in range(depth - 1):  # the last depth - 1 tiles, then the token
            done += back(Affine(1 - depth + i, ((g, 1),)))
        if token:
            done += (SendValue(out.channel, stop),)
    b.emit(Set(g, 0))
    item_loop(b, [body], done, bound, stop)
    b.next_seq[ach] = addrs.messages + 1
    if sends and out.channel:
        b.sent_seq[out.channel] = out.messages + int(token)
    counted(ctx, b, op.raddr.name, (1, int(sends), 0, 0))
    ctx.relax(op.raddr, None)
    ctx.relax(op.name, level(out))
    hold_buffers(b)


Emitter = Callable[[EmitCtx, UnitBuilder, tuple[Op, ...]], None]

_ITEM_EMITTERS: dict[type, Callable[[EmitCtx, UnitBuilder, Any], bool]] = {
    Repeat: emit_item_repeat,
    RandomOffChipStore: emit_item_store,
    RandomOffChipLoad: emit_item_load,
}


def item_emitters(base: dict[type, Emitter]) -> dict[type, Emitter]:
    """``base``'s emitters of Repeat, RandomOffChipLoad and RandomOffChipStore, each trying
    its lane's or region's item loop first (module docstring)."""

    def wrap(fallback: Emitter, first: Callable[[EmitCtx, UnitBuilder, Any], bool]) -> Emitter:
        def emit(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
            if not first(ctx, b, ops[0]):
                fallback(ctx, b, ops)

        return emit

    return {cls: wrap(base[cls], first) for cls, first in _ITEM_EMITTERS.items()}
