"""Unit programs of the memory operators (STeP §3.2.1–3.2.2).

* **LinearOffChipLoad** — per ``ref`` element (or once), the tiles of its affine read: ``Load``
  from HBM, then ``Send``.  Loads run ahead of sends by ``d - 1`` tiles over ``d`` rotating
  buffers (:meth:`TimingModel.dma_depth`, at least the §4.1 double buffering), so HBM latency
  overlaps the stream.  A ``ref`` element is dequeued in one cycle before its tiles.
* **RandomOffChipLoad** — per address: ``RecvValue`` the address, ``Load`` the tile at
  ``base + address`` (an expression of the received register), ``Send``; pipelined likewise.
* **RandomOffChipLoadRows** — per ``(row, r)`` address: ``RecvValue`` both, ``Load`` the
  ``r * cols`` contiguous elements from row ``base + row`` (start and extent expressions of
  the received registers: one HBM request per tile), ``Send``; pipelined likewise.
* **LinearOffChipStore** / **RandomOffChipStore** — per tile: ``Recv``, ``Store`` at
  ``base + k`` (or the received address); ``d`` rotating buffers keep ``d`` writes in flight.
  RandomOffChipStore answers each write with an acknowledgement when one is read.
* **Bufferize** (+ the Streamify nodes reading its buffers) — a memory unit: the tiles of each
  buffer are received into the unit's memory (two buffer sets: double buffering, STeP §4.1),
  the next buffer is received while the current one is streamed; once a buffer is complete its
  reference is emitted (one cycle); each Streamify then reads it once per element of its
  ``ref``, each tile costing ``bytes / on-chip memory BW`` cycles (STeP §4.2, §5.1).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from lowering.isa import DTYPE_BYTES, Affine
from torch2step.errors import LoweringError
from torch2step.step.op_base import Op
from torch2step.step.ops_memory import (
    Bufferize,
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipLoadRows,
    RandomOffChipStore,
    Streamify,
)

from .buffer_loop import emit_buffer_loop
from .context import EmitCtx, tile_shape
from .kv_tiles import emit_kv_loads
from .streams import iter_nodes, leaves
from .unit import Elem, UnitBuilder
from .unit_buffers import MessageRows
from .unit_reuse import FORM, ROWS

__all__ = ["EMITTERS"]


def _affine_offsets(ctx: EmitCtx, op: Op, out_shape: tuple, stride: tuple, base: int) -> list[int]:
    dims = [ctx.ev(d, f"{op.op_name} %{op.name} out_shape") for d in out_shape]
    steps = [ctx.ev(s, f"{op.op_name} %{op.name} stride") for s in stride]
    return [
        base + sum(j * s for j, s in zip(idx, steps))
        for idx in itertools.product(*(range(d) for d in dims))
    ]


def _pipelined(
    b: UnitBuilder, n: int, depth: int, front: Callable[[int], None], back: Callable[[int], None]
) -> None:
    """``front(t)`` runs ``depth - 1`` steps ahead of ``back(t)``."""
    for t in range(n + depth - 1):
        if t < n:
            front(t)
        if t >= depth - 1:
            back(t - depth + 1)
        b.step()


def _linear_load(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, LinearOffChipLoad)
    if op.name in ctx.tiled:  # a statically tiled expert's load: a loop over its tiles
        from .tile_emit import emit_tile_load

        if emit_tile_load(ctx, b, op):
            return
    out = ctx.stream(op.name)
    lay = ctx.layouts[op.tensor.name]
    lins = _affine_offsets(ctx, op, op.out_shape, op.stride, op.base)
    refs = ctx.stream(op.ref) if op.ref is not None else None
    groups = len(refs.flat) if refs is not None else 1
    if groups * len(lins) != len(out.flat):  # pragma: no cover - the interpreter agrees
        raise LoweringError(f"LinearOffChipLoad %{op.name}: run and parameters disagree")
    tile = tile_shape(op)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    loaded: dict[int, Elem] = {}
    if refs is not None and not lins:
        for g in range(groups):
            b.consume(b.recv(refs, g))
            b.step()
        return

    def front(t: int) -> None:
        g, j = divmod(t, len(lins))
        if refs is not None and j == 0:
            b.consume(b.recv(refs, g))
        loaded[t] = b.load(lay.name, *lay.region(lins[j], tile), lay.dtype, depth)

    _pipelined(b, len(out.flat), depth, front, lambda t: b.send(out, t, loaded.pop(t)))


def _random_load(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, RandomOffChipLoad)
    out, addrs = ctx.stream(op.name), ctx.stream(op.raddr)
    lay = ctx.layouts[op.tensor.name]
    tile = tile_shape(op)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    loaded: dict[int, Elem] = {}
    what = f"RandomOffChipLoad %{op.name}"
    literal: list[int] = []

    def front(t: int) -> None:
        ((p, reg),) = b.recv(addrs, t)
        if reg is None:
            literal.append(t)
        where = (
            lay.region(op.base + p.value, tile)
            if reg is None
            else lay.region_at(op.base, reg, tile, what)
        )
        loaded[t] = b.load(lay.name, *where, lay.dtype, depth)

    _pipelined(b, len(out.flat), depth, front, lambda t: b.send(out, t, loaded.pop(t)))
    if not literal:
        # every address is received into a register and loaded from: the program reads the
        # addresses' values at run time (a region's expert weights, STeP §5.3)
        ctx.relax(op.raddr, FORM)


def _random_load_rows(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, RandomOffChipLoadRows)
    if emit_kv_loads(ctx, b, op):
        return  # a loop over each request's KV-tile addresses (.kv_loop)
    out, addrs = ctx.stream(op.name), ctx.stream(op.raddr)
    lay = ctx.layouts[op.tensor.name]
    most, cols = tile_shape(op)
    depth = ctx.timing.dma_depth(most * cols * DTYPE_BYTES[lay.dtype])
    loaded: dict[int, Elem] = {}
    regs = True  # every address and row count is a register received at run time

    def front(t: int) -> None:
        nonlocal regs
        (p_row, reg_row), (p_n, reg_n) = b.recv(addrs, t)
        regs = regs and reg_row is not None and reg_n is not None
        # whole rows of a row-major (or full-width-tiled) tensor: row k starts at k * cols
        start = (
            (op.base + p_row.value) * cols
            if reg_row is None
            else Affine(op.base * cols, ((reg_row, cols),))
        )
        extent = p_n.value * cols if reg_n is None else Affine(0, ((reg_n, cols),))
        sized = None
        if regs and out.channel is not None:  # held at the largest tile (its rows: the run's)
            ((ch, seq, _),) = out.pieces[t]
            sized = (MessageRows(ch, seq), most, cols, 0)
        loaded[t] = b.load(
            lay.name, (start,), (extent,), lay.dtype, depth, elems=p_n.value * cols, sized=sized
        )

    _pipelined(b, len(out.flat), depth, front, lambda t: b.send(out, t, loaded.pop(t)))
    if regs:
        # the addresses and row counts reach registers only, a tile is sent at the rows loaded
        # and held in a buffer allocated at the op's tile (Alloc.held): the program is the
        # same for every address set of this structure
        ctx.relax(op.raddr, FORM)
        ctx.relax(op.name, ROWS)


def _linear_store(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, LinearOffChipStore)
    inp = ctx.stream(op.input)
    lay = ctx.layouts[op.tensor.name]
    tile = tile_shape(op)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    for k in range(len(inp.flat)):
        b.store(lay.name, *lay.region(op.base + k, tile), b.recv(inp, k, rotation=depth))
        b.step()


def _random_store(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, RandomOffChipStore)
    addrs, data, ack = ctx.stream(op.waddr), ctx.stream(op.wdata), ctx.stream(op.name)
    lay = ctx.layouts[op.tensor.name]
    tile = tile_shape(op)
    depth = ctx.timing.dma_depth(math.prod(tile) * DTYPE_BYTES[lay.dtype])
    what = f"RandomOffChipStore %{op.name}"
    for k in range(len(addrs.flat)):
        ((p, reg),) = b.recv(addrs, k)
        d = b.recv(data, k, rotation=depth)
        where = (
            lay.region(op.base + p.value, tile)
            if reg is None
            else lay.region_at(op.base, reg, tile, what)
        )
        b.store(lay.name, *where, d)
        if ack.channel is not None and b.has_dsts(ack.channel):
            b.consume(d)
            b.send(ack, k, tuple((q, None) for q in ack.parts(k)))
        b.step()


def _streamify_plan(
    ctx: EmitCtx, s: Streamify, nbuf: int, buf_rank: int, counts: list[int]
) -> list[list[list[int]]]:
    """Per buffer, per ``ref`` element, the buffer's tile indices in read order."""
    ref = ctx.stream(s.ref)
    c = ref.value.rank - buf_rank
    nodes = iter_nodes(ref.value.data, buf_rank + 1)
    if len(nodes) != nbuf:  # pragma: no cover - the interpreter agrees
        raise LoweringError(f"Streamify %{s.name}: ref and buffers disagree")
    plan = []
    for i, node in enumerate(nodes):
        if s.out_shape is not None:
            order = _affine_offsets(ctx, s, s.out_shape, s.stride or (), 0)
        else:
            order = list(range(counts[i]))
        plan.append([order] * len(leaves(node, c)))
    return plan


def _bufferize(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Bufferize)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    cut = x.value.rank + 1 - op.rank
    counts = [len(leaves(n, op.rank)) for n in iter_nodes(x.value.data, cut)]
    starts = list(itertools.accumulate([0, *counts]))
    nbuf = len(counts)
    fused = [s for s in ops[1:] if isinstance(s, Streamify)]
    if emit_buffer_loop(ctx, b, op, fused):  # loops over the count (.buffer_loop)
        return
    plans = [_streamify_plan(ctx, s, nbuf, out.value.rank, counts) for s in fused]
    ref_k = [0] * len(fused)
    out_k = [0] * len(fused)
    held: dict[int, list[Elem]] = {}

    def fill(i: int) -> None:
        held[i] = [b.recv(x, starts[i] + j, role=("mem", i % 2, j)) for j in range(counts[i])]

    if nbuf:
        fill(0)
    for i in range(nbuf):
        if i + 1 < nbuf:
            fill(i + 1)
        tiles = held.pop(i)
        b.compute(1, tiles, const=True)
        b.send(out, i, tuple((q, None) for q in out.parts(i)))
        b.step()
        for f, (s, plan) in enumerate(zip(fused, plans)):
            so, ref = ctx.stream(s.name), ctx.stream(s.ref)
            for order in plan[i]:
                b.consume(b.recv(ref, ref_k[f]))
                ref_k[f] += 1
                for j in order:
                    tile = tiles[j]
                    nbytes = sum(p.nbytes for p, _ in tile if p.kind == "data")
                    b.compute(ctx.timing.memory_cycles(nbytes), (tile,))
                    b.send(so, out_k[f], tile)
                    out_k[f] += 1
                    b.step()
    for f, s in enumerate(fused):
        if out_k[f] != len(ctx.stream(s.name).flat):  # pragma: no cover
            raise LoweringError(f"Streamify %{s.name}: emitted {out_k[f]} tiles, the run has more")


#: Operator class -> emitter of its unit's program.
EMITTERS: dict[type, Callable[[EmitCtx, UnitBuilder, tuple[Op, ...]], None]] = {
    LinearOffChipLoad: _linear_load,
    RandomOffChipLoad: _random_load,
    RandomOffChipLoadRows: _random_load_rows,
    LinearOffChipStore: _linear_store,
    RandomOffChipStore: _random_store,
    Bufferize: _bufferize,
}
