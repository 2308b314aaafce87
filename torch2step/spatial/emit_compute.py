"""Unit programs of the higher-order operators (STeP §3.2.4, timed by §4.2).

Per input element a unit receives the element, spends the roofline cycles of
:meth:`TimingModel.roofline` (FLOPs of the tile function on the element's actual shapes over the
unit's compute bandwidth, memory terms when configured) and:

* **Map** — sends the mapped element;
* **Accum** — updates its accumulator (one buffer per reduction, two rotating so the previous
  result can still be leaving), and sends it when the reduction ends; an empty reduction emits
  the initial value after one cycle (Revet §III-A);
* **Scan** — sends the new state after every update;
* **FlatMap** — then emits the element's expansion, one cycle per produced element: every
  element of the rank-``b`` stream the function returns (``tile_grid``'s ``[rows, cols]``
  addresses, ``tile_rows``' rows), not its ``D'_b`` top-level entries (an element that expands
  to nothing still takes its cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowering.isa import SendValue
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, FlatMap, Map, Scan
from torch2step.step.types import DataType, TileType, TupleType

from .context import EmitCtx
from .control import control_data, lower_value
from .item_loop import emit_item_map
from .kv_loop import emit_cursor_scan, emit_kv_addresses, emit_lane_keep
from .kv_tiles import emit_kv_softmax
from .lane_pick import emit_lane_keep_loop, emit_lane_pick
from .region_rows import emit_chunk_rows, emit_zip_loop
from .region_tail import emit_chunk_pack, emit_chunk_pieces, emit_row_map
from .region_values import emit_value_grid
from .rows import row_rule, with_rows
from .static_pad import counted_rows, emit_padded_filter, emit_padded_pack
from .stop_loop import (
    declared_element,
    emit_pack_loop,
    emit_piece_loop,
    emit_stop_loop,
    forwards_stop,
    stop_channel,
)
from .streams import Part, StreamInfo, declared_leaves, iter_nodes, leaves
from .timing import RowRule, TimingModel, UnitConfig, concrete_type
from .unit import Elem, UnitBuilder
from .unit_reuse import EACH, EVERY, FORM

__all__ = ["EMITTERS"]


def _dtype(t: DataType) -> str:
    if isinstance(t, TileType):
        return t.dtype
    if isinstance(t, TupleType):
        for e in t.elems:
            d = _dtype(e)
            if d:
                return d
    return ""


def _data_bytes(parts: tuple[Part, ...]) -> int:
    return sum(p.nbytes for p in parts if p.kind == "data")


class _Cost:
    """Roofline cycles of a unit's elements, cached by element shapes."""

    def __init__(self, ctx: EmitCtx, op: Op, src: StreamInfo) -> None:
        self.t: TimingModel = ctx.timing
        self.cfg: UnitConfig = ctx.config(op)
        self.src = src
        self._types: dict[Any, DataType] = {}
        self._steps: dict[Any, tuple[int, int]] = {}

    def type_of(self, x: Any, t: DataType) -> DataType:
        key = (_shape_key(x), id(t))
        hit = self._types.get(key)
        if hit is None:
            hit = self._types[key] = concrete_type(x, t)
        return hit

    def cycles(self, flops: int, elem_type: DataType, in_parts: tuple, out_parts: tuple) -> int:
        rate = self.t.rate(_dtype(elem_type), self.cfg)
        return self.t.roofline(flops, _data_bytes(in_parts), _data_bytes(out_parts), rate, self.cfg)

    def _bytes_key(self, in_parts: tuple, out_parts: tuple) -> tuple[int, int]:
        cfg = self.cfg
        return (
            _data_bytes(in_parts) if cfg.reads_memory else 0,
            _data_bytes(out_parts) if cfg.writes_memory else 0,
        )

    def map_step(
        self, f: Any, x: Any, t: DataType, in_parts: tuple, out: tuple[Any, DataType, tuple]
    ) -> tuple[int, int, RowRule | None]:
        """``(cycles, flops, row rule)`` of applying ``f`` to element ``x`` producing ``out =
        (value, declared type, parts)`` (cached by shapes)."""
        out_parts = out[2]
        key = (_shape_key(x), self._bytes_key(in_parts, out_parts))
        hit = self._steps.get(key)
        if hit is None:
            et = self.type_of(x, t)
            fl = self.t.map_flops(f, et)
            rule = row_rule(
                self.t,
                self.cfg,
                self.t.rate(_dtype(et), self.cfg),
                lambda r: self.t.map_flops(f, with_rows(x, t, r)),
                (x, t, in_parts),
                out,
            )
            hit = self._steps[key] = (self.cycles(fl, et, in_parts, out_parts), fl, rule)
        return hit

    def update_step(
        self,
        f: Any,
        x: Any,
        t: DataType,
        s: Any,
        st: DataType,
        in_parts: tuple,
        out_parts: tuple,
        last: bool,
    ) -> tuple[int, int, RowRule | None]:
        """``(cycles, flops, row rule)`` of updating state ``s`` (declared ``st``, parts
        ``out_parts``) by element ``x``; ``last``: the update ends the reduction, so its output
        bytes are timed (cached by shapes)."""
        timed = out_parts if last else ()
        key = (_shape_key(x), _shape_key(s), self._bytes_key(in_parts, timed))
        hit = self._steps.get(key)
        if hit is None:
            et = self.type_of(x, t)
            fl = self.t.update_flops(f, et, self.type_of(s, st))
            rule = row_rule(
                self.t,
                self.cfg,
                self.t.rate(_dtype(et), self.cfg),
                lambda r: self.t.update_flops(f, with_rows(x, t, r), with_rows(s, st, r)),
                (x, t, in_parts),
                (s, st, out_parts),
                out_bytes=last,
                state=(s, st),
            )
            hit = self._steps[key] = (self.cycles(fl, et, in_parts, timed), fl, rule)
        return hit


def _shape_key(x: Any) -> Any:
    if hasattr(x, "shape"):
        return tuple(x.shape)
    if isinstance(x, tuple):
        return tuple(_shape_key(v) for v in x)
    return None


def _map(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Map)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    cost = _Cost(ctx, op, x)
    if emit_item_map(  # a lane's or region's loop until its items' stop token (.item_loop)
        ctx,
        b,
        op,
        lambda sx, so: cost.map_step(
            op.fn, sx.flat[0], x.dtype, sx.parts(0), (so.flat[0], out.dtype, so.parts(0))
        ),
    ):
        return
    data = control_data(ctx.structure.graph)
    computed = bool(x.flat)  # every output value is computed in a register at run time
    steps = [
        cost.map_step(op.fn, val, x.dtype, x.parts(k), (out.flat[k], out.dtype, out.parts(k)))
        for k, val in enumerate(x.flat)
    ]
    if emit_row_map(  # a Map of a region's chunk rows, per chunk (.region_tail)
        ctx, b, op, steps, lambda e, y: lower_value(b, op.fn, e, y, data, ctx.region)
    ):
        return
    # a Map of a stream that ends with a stop token forwards it (after its last element)
    fwd = out.channel if len(b.stops) == 1 and out.channel and b.has_dsts(out.channel) else None
    # one element of the declared types: the loop below is built alike for an empty stream
    sx, so = declared_element(x), declared_element(out)
    alike = (
        sx is not None
        and so is not None
        and all(
            x.parts(k) == sx.parts(0) and out.parts(k) == so.parts(0) for k in range(len(x.flat))
        )
    )
    lx, lo, lsteps = x, out, steps
    empty = not x.flat and sx is not None and so is not None and x.channel in b.stops
    if empty:
        assert sx is not None and so is not None
        lx, lo = sx, so
        b.next_seq[x.channel] = 0  # its stop token, taken by the loop
        lsteps = [
            cost.map_step(
                op.fn, sx.flat[0], x.dtype, sx.parts(0), (so.flat[0], out.dtype, so.parts(0))
            )
        ]
    if emit_zip_loop(  # an expert's rows back from its region (.region_rows, §5.3)
        ctx, b, op, steps,
        lambda i, o: cost.map_step(op.fn, i.flat[0], x.dtype, i.parts(0),
                                   (o.flat[0], out.dtype, o.parts(0))),
    ):  # fmt: skip
        return
    looped = stop_channel(b, op, lx)
    if (
        looped is not None
        and all(s == lsteps[0] and s[2] is None for s in lsteps)
        and all(p.kind == "data" for k in range(len(lx.flat)) for p in lo.parts(k))
        and all(lo.parts(k) == lo.parts(0) for k in range(len(lx.flat)))
    ):
        # elements alike, sending data: loop until the Partition's stop token (.stop_loop)
        c, fl, _ = lsteps[0]

        def each(k: int, e: Elem) -> None:
            parts = lo.parts(k)
            y = b.compute(c, (e,), parts, flops=fl)
            b.send(lo, k, lower_value(b, op.fn, e, y, data, ctx.region))

        level = EVERY if alike else EACH
        emit_stop_loop(ctx, b, lx, lo, *looped, each, forward=fwd is not None, level=level)
        return
    if empty:
        b.next_seq[x.channel] = 1  # type: ignore[index]
    for k in range(len(x.flat)):
        e = b.recv(x, k)
        parts = out.parts(k)
        c, fl, rule = steps[k]
        y = lower_value(
            b, op.fn, e, b.compute(c, (e,), parts, flops=fl, rule=rule), data, ctx.region
        )
        computed = computed and all(q.kind == "value" and r is not None for q, r in y)
        b.send(out, k, y)
        b.step()
    if fwd is not None:
        (ch,) = b.stops
        b.emit(SendValue(fwd, f"stop.{ch}"))
        b.sent_seq[fwd] += 1
        b.step()
    if computed:  # the values it sends are the run's data, not part of its program
        ctx.relax(op.name, FORM)
        # and what it computes them from reaches registers only (a region's id into its
        # one-hot selector, STeP §5.4: the assignment is data; an expert id and weight
        # addresses from an EagerMerge's selector, §5.3: .region_values)
        ctx.relax(op.input, FORM)
    elif all(p.kind == "data" for k in range(len(out.flat)) for p in out.parts(k)):
        # it sends tiles only: a control value it receives (a rotary position, a request's
        # KV length) reaches a register no instruction reads, and its steps are timed from
        # the elements' types
        ctx.relax(op.input, FORM)


def _reduce(ctx: EmitCtx, b: UnitBuilder, op: Accum | Scan) -> None:
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    cost = _Cost(ctx, op, x)
    cut = x.value.rank + 1 - op.rank
    scan = isinstance(op, Scan)
    k = 0
    for r, sub in enumerate(iter_nodes(x.value.data, cut)):
        elems = leaves(sub, op.rank)
        state = None
        if not elems and not scan:
            state = b.compute(1, (), out.parts(r), role="acc")
        for n, val in enumerate(elems):
            e = b.recv(x, k)
            o = k if scan else r
            parts = out.parts(o)
            last = scan or n == len(elems) - 1
            c, fl, rule = cost.update_step(
                op.fn, val, x.dtype, out.flat[o], out.dtype, x.parts(k), parts, last
            )
            ins = (e,) if state is None else (e, state)
            into = None if scan or state is None else state
            state = b.compute(c, ins, parts, role="acc", flops=fl, into=into, rule=rule)
            if scan:
                b.send(out, k, state)
            k += 1
            b.step()
        if not scan:
            assert state is not None
            b.send(out, r, state)
            b.step()
    if x.flat and all(q.kind == "value" for k in range(len(x.flat)) for q in x.parts(k)):
        # every element is a control value received into a register that no instruction
        # reads: the updates are timed from the elements' types (a request's KV length into
        # the cursor Scan), so the program is the same for every value the run sends
        ctx.relax(op.input, FORM)


def _accum(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Accum)
    cost = _Cost(ctx, op, ctx.stream(op.input))
    if emit_chunk_pack(ctx, b, op, lambda: emit_pack_loop(ctx, b, op, cost)):
        return  # a region's chunk rows packed per chunk (.region_tail)
    if emit_padded_pack(ctx, b, op, cost) or emit_pack_loop(ctx, b, op, cost):
        return
    if emit_kv_softmax(ctx, b, op, cost):
        return  # a loop over each request's KV tiles (.kv_loop)
    _reduce(ctx, b, op)
    out = ctx.stream(op.name)
    if (
        out.channel is not None
        and b.has_dsts(out.channel)
        and len(b.stops) == 1
        and forwards_stop(op, ctx.structure.sources(op.input.name), set(b.stops))
    ):  # its stop token, after its last element (.stop_loop)
        (ch,) = b.stops
        b.emit(SendValue(out.channel, f"stop.{ch}"))
        b.sent_seq[out.channel] += 1
        b.step()


def _scan(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Scan)
    cost = _Cost(ctx, op, ctx.stream(op.input))
    if emit_cursor_scan(ctx, b, op, cost) or emit_lane_pick(ctx, b, op, cost):
        return  # a KV cursor or a lane decision computed in registers (.kv_loop, .lane_pick)
    _reduce(ctx, b, op)


def _flat_map(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, FlatMap)
    if emit_padded_filter(ctx, b, op):  # static tiling's FilterPadding (.static_pad)
        return
    if emit_value_grid(ctx, b, op):  # a region's weight addresses in registers (.region_values)
        return
    if emit_chunk_rows(  # an expert's rows as its region's chunk (.region_rows)
        ctx, b, op,
        lambda i: _Cost(ctx, op, i).cycles(0, concrete_type(i.flat[0], i.dtype), i.parts(0),
                                           i.parts(0)),
    ):  # fmt: skip
        return
    if emit_chunk_pieces(  # a region's chunk tile back to rows (.region_tail)
        ctx, b, op, lambda j: _piece_rule(ctx.stream(op.input), 0, ctx.stream(op.name), j)
    ):
        return
    if emit_kv_addresses(ctx, b, op) or emit_lane_keep_loop(ctx, b, op):
        return  # a lane keeping its items by the decisions in registers (.lane_pick)
    if emit_lane_keep(ctx, b, op):
        return  # a request's KV-tile addresses from its cursor's registers (.kv_loop)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    cost = _Cost(ctx, op, x)
    spec = op.fn.spec
    depth = out.value.rank - x.value.rank + 1  # the expansion's rank + 1 (STeP table 4)
    # the count of its input's stop token, sent to the FilterPadding unit ahead of the last
    # tile's rows (.static_pad)
    count = (
        out.channel
        if out.channel
        and b.has_dsts(out.channel)
        and op.name in counted_rows(ctx.structure.graph, ctx.structure, set(b.stops))
        else None
    )
    if count is not None and not x.flat:
        (src,) = b.stops
        b.emit(SendValue(count, f"stop.{src}"))
        b.sent_seq[count] += 1
    if len(x.flat) == 1 and count is None and not (cost.cfg.reads_memory or cost.cfg.writes_memory):
        val = x.flat[0]
        produced = len(iter_nodes(spec.impl(op.fn, *(val if spec.nargs > 1 else (val,))), depth))
        fl = ctx.timing.map_flops(op.fn, cost.type_of(val, x.dtype))
        if not fl and emit_piece_loop(
            ctx, b, x, out, produced, lambda j: _piece_rule(x, 0, out, j)
        ):  # one piece per row of the count, the count from the stop token (.stop_loop)
            return
    j = 0
    for k, val in enumerate(x.flat):
        e = b.recv(x, k)
        if count is not None and k == len(x.flat) - 1:  # its stop token came with it
            (src,) = b.stops
            b.emit(SendValue(count, f"stop.{src}"))
            b.sent_seq[count] += 1
        produced = len(iter_nodes(spec.impl(op.fn, *(val if spec.nargs > 1 else (val,))), depth))
        et = cost.type_of(val, x.dtype)
        fl = ctx.timing.map_flops(op.fn, et)
        cfg = cost.cfg
        if fl or cfg.reads_memory or cfg.writes_memory:
            out_parts = tuple(p for i in range(j, j + produced) for p in out.parts(i))
            b.compute(cost.cycles(fl, et, x.parts(k), out_parts), (e,), flops=fl)
        elif not produced:
            b.consume(e)
        b.step()
        for _ in range(produced):  # one step each, so the expansion folds into a loop
            y = b.compute(1, (e,), out.parts(j), rule=_piece_rule(x, k, out, j))
            b.send(out, j, y)
            j += 1
            b.step()


def _piece_rule(x: StreamInfo, k: int, out: StreamInfo, j: int) -> RowRule | None:
    """A FlatMap's piece of a tile keeping the tile's run-time rows (split_cols of an
    expert's ``[n_e, H]`` tile): one cycle, output sizes ``cols * rows`` of the rows the
    input tile holds (:mod:`.rows`), so the step is the same for every row count."""
    ins, outs = declared_leaves(x.dtype), declared_leaves(out.dtype)
    dyn = [i for i, t in enumerate(ins) if t is not None and not t.shape[0].is_Integer]
    if len(dyn) != 1 or not all(t is not None and t.shape[1].is_Integer for t in outs):
        return None
    slot = dyn[0]
    decl, part = ins[slot], x.parts(k)[slot]
    assert decl is not None
    if part.kind != "data" or not decl.shape[1].is_Integer or not int(decl.shape[1]):
        return None
    cols = int(decl.shape[1])
    rows = part.elems // cols
    sizes = []
    for t, p in zip(outs, out.parts(j)):
        assert t is not None
        if p.kind != "data":
            continue
        if t.shape[0] == decl.shape[0]:
            sizes.append((int(t.shape[1]), 0))
        elif t.shape[0].is_Integer:
            sizes.append((0, p.elems))
        else:
            return None
        if sizes[-1][0] * rows + sizes[-1][1] != p.elems:  # pragma: no cover - types agree
            return None
    return RowRule(slot, cols, (), tuple(sizes))


#: Operator class -> emitter of its unit's program.
EMITTERS: dict[type, Callable[[EmitCtx, UnitBuilder, tuple[Op, ...]], None]] = {
    Map: _map,
    Accum: _accum,
    Scan: _scan,
    FlatMap: _flat_map,
}
