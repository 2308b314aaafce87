"""A unit that loops over a stream until its stop token: one program for every element count.

A Partition's output ends with a stop token carrying its count (STeP arXiv 2511.07776 §3.2.3),
so a unit that handles each element of such a stream alike (the same messages, the same step,
the same output) need not know the count when it is built: its program is a ``Loop`` bounded by
the count's bound (the tokens routed, :func:`~.plan.count_bounds`) whose body is guarded by
``If(stop < 0)`` over ``Recv(..., stop=reg)`` — a data message runs the element's step and
sends its output, the stop token ends the unit's work (the remaining iterations test the guard
only, in zero cycles).  Its rotating buffers rotate as in the unrolled program: each iteration
handles one element per buffer copy.

The stop token is taken after the last element's step rather than before it (the unit cannot
know which element is the last), so the last element leaves as soon as it is made, not once the
Partition has routed every selector.  A ``Recv`` with ``stop`` waits for its message (the
branch depends on it), as ``RecvValue`` does.

A Map so looped forwards the stop token on its output (its value, the count, after its last
element: :func:`emit_stop_loop` ``forward``), and a ``retile_row`` Accum over such a stream of
``[1, c]`` rows is a loop too (:func:`emit_pack_loop`): the accumulator's size follows the rows
it already holds, so no step needs the count; it sends its tile followed by the token.  A
Map over that tile forwards it again, and the FlatMap cutting the tile into rows
(:func:`emit_piece_loop`) loops ``Loop(count=stop)``: the trip count is the token's value.

What such a unit reads of the run is the forms of its streams' elements, not their number
(:data:`~.unit_reuse.EACH`); the elements, messages and step cycles of a run are counted from
its streams (:data:`~.unit_reuse.Tally`), so a program kept from a run with another count
(:mod:`.unit_reuse`) gets the new run's bookkeeping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from lowering.isa import Affine, Calc, Compute, Cond, If, Instr, Loop, Recv, Send, SendValue, Set
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, Map
from torch2step.step.types import TileType, TupleType

from .context import EmitCtx
from .streams import Part, StreamInfo, unit_pieces
from .timing import STEP_KERNEL, RowRule
from .unit import Elem, UnitBuilder
from .unit_reuse import EACH, EVERY

__all__ = [
    "data_first",
    "declared_element",
    "forwards_stop",
    "stop_channel",
    "until_stop",
    "emit_stop_loop",
    "emit_pack_loop",
    "emit_piece_loop",
]

#: ``step(k, elem)``: the unit's work on element ``k`` received as ``elem``: its step(s) and
#: sends.
Step = Callable[[int, Elem], None]


def forwards_stop(op: Op, sources: Iterable[str], stops: set[str]) -> bool:
    """Whether the single-node unit of ``op``, reading from channels ``sources``, ends its
    output with the stop token of the one of them that has one (and its value): a Map (one
    element out per element in), or a ``retile_row`` Accum of rank 1 reading one channel (its
    token's value is the rows it packed: the count)."""
    src = set(sources)
    if len(src & stops) != 1:
        return False
    if isinstance(op, Map):
        return True
    return (
        isinstance(op, Accum)
        and getattr(op.fn, "name", None) == "retile_row"
        and op.rank == 1
        and len(src) == 1
    )


def until_stop(count: int, guard: Cond, body: tuple[Instr, ...], var: str) -> tuple[Instr, ...]:
    """At most ``count`` iterations of ``body`` while ``guard`` holds (the stop token has not
    come), ``var`` holding the iteration index: two loops nested ``ceil(sqrt(count))`` deep,
    so once the token came the iterations left test the guard about ``2*sqrt(count)`` times,
    not ``count`` times (control instructions take no cycle, but each is an event the
    simulator handles)."""
    inner = math.isqrt(count - 1) + 1 if count > 1 else 1
    if count <= 16:
        return (Loop(count, (If(guard, body),), var),)
    outer = -(-count // inner)
    o, k = f"{var}.o", f"{var}.k"
    at = Set(var, Affine(0, ((o, inner), (k, 1))))
    return (Loop(outer, (If(guard, (Loop(inner, (If(guard, (at, *body)),), k),)),), o),)


def declared_element(x: StreamInfo) -> StreamInfo | None:
    """A stand-in for stream ``x`` with one element of its declared type (zero tiles of the
    declared static shapes) and that element's messages as a unit sends them, so a loop over
    ``x`` until its stop token is built alike whether or not the run gives ``x`` an element;
    ``None`` when the type has a tile of dynamic shape or a control value (whose value would
    be part of the element's form), or ``x`` is no unit's output."""
    val = _zeros(x.dtype)
    if val is None or x.channel is None:
        return None
    pieces = unit_pieces(x.channel, x.dtype, [val])
    if any(p.kind != "data" for _, _, p in pieces[0]):
        return None
    return dataclasses.replace(x, flat=[val], pieces=pieces, _parts=None, _decl=None)


def _zeros(t: Any) -> Any:
    if isinstance(t, TileType):
        if not (t.shape[0].is_Integer and t.shape[1].is_Integer):
            return None
        return np.zeros((int(t.shape[0]), int(t.shape[1])))
    if isinstance(t, TupleType):
        vals = tuple(_zeros(e) for e in t.elems)
        return None if any(v is None for v in vals) else vals
    return None


def data_first(x: StreamInfo) -> bool:
    """Whether every element of ``x`` begins with a data message, so that a loop over ``x``
    can take each element's first message with ``Recv(..., stop=reg)``: a Partition's stop
    token is a plain control value (its count), which such a ``Recv`` tells from data, but a
    ``RecvValue`` with ``stop`` takes only a value sent as a stop token, so it cannot tell an
    element that begins with a control value (a token index, a padding flag) from the token.
    A unit over such a stream keeps its unrolled program."""
    return all(pc and pc[0][2].kind == "data" for pc in x.pieces)


def stop_channel(b: UnitBuilder, op: Op, x: StreamInfo) -> tuple[str, int] | None:
    """``(channel, bound)`` when ``op``'s unit can loop over its input ``x`` until the stop
    token: ``x`` is a rank-0 stream of a count with a bound, received whole from one channel
    that ends with a stop token, every element with the same messages (and tile shapes),
    beginning with a data message (:func:`data_first`)."""
    shape = getattr(op.input.type, "shape", ())  # type: ignore[attr-defined]
    if len(shape) != 1 or x.value.rank != 0 or not x.flat or b.bound is None:
        return None
    chans = {ch for pc in x.pieces for ch, _, _ in pc}
    if len(chans) != 1:
        return None
    (ch,) = chans
    if ch is None or ch not in b.stops or b.own(ch) or b.next_seq.get(ch, 0):
        return None
    first = x.parts(0)
    if not data_first(x) or any(x.parts(k) != first for k in range(1, len(x.flat))):
        return None
    shape0 = getattr(x.flat[0], "shape", None)
    if any(getattr(v, "shape", None) != shape0 for v in x.flat):
        return None
    bound = b.bound(shape[0])
    if bound is None:
        return None
    return ch, bound


def emit_stop_loop(
    ctx: EmitCtx,
    b: UnitBuilder,
    x: StreamInfo,
    out: StreamInfo,
    ch: str,
    bound: int,
    step: Step,
    rotation: int = 2,
    forward: bool = False,
    level: str = EACH,
) -> None:
    """Emit the unit's loop over ``x`` (from channel ``ch``, at most ``bound`` elements) until
    its stop token, ``step`` doing each element's work (module docstring); ``out`` is the
    stream it sends one element on per element received, ending with the stop token (its
    value: the count) when ``forward``.  ``x`` and ``out`` may be stand-ins of one element
    of an empty stream (:func:`declared_element`); ``level``: what the program read of the
    streams (:data:`EVERY` when an empty stream gives the same program)."""
    stop = f"stop.{ch}"
    count = b.stops.pop(ch)
    b.step()
    recv0, sent0, busy0, flops0 = b.received, b.sent, b.busy_cycles, b.flops
    body: list[Instr] = []
    for _ in range(rotation):  # one element per copy of the rotating buffers
        b.next_seq[ch] = 0
        e = b.recv(x, 0)
        step(0, e)
        instrs, b.cur = b.cur, []
        first = instrs[0]
        if not isinstance(first, Recv) or first.channel != ch:  # pragma: no cover
            raise AssertionError(f"unit %{b.name}: an element must start with its receive")
        take = Recv(first.channel, first.dst, stop)
        guard = Cond(stop, "<", 0)
        done = (SendValue(out.channel, stop),) if forward and out.channel else ()
        body.append(If(guard, (take, If(guard, tuple(instrs[1:]), done))))
    per_recv = (b.received - recv0) // rotation
    per_sent = (b.sent - sent0) // rotation
    per_busy = (b.busy_cycles - busy0) // rotation
    per_flops = (b.flops - flops0) // rotation
    b.received, b.sent, b.busy_cycles, b.flops = recv0, sent0, busy0, flops0
    iterations = -(-(bound + 1) // rotation)  # every element and the stop token
    b.emit(Set(stop, -1), Loop(iterations, tuple(body)))
    b.step()
    b.next_seq[ch] = count + 1
    if out.channel is not None and b.has_dsts(out.channel):
        b.sent_seq[out.channel] = ctx.streams[out.name].messages + forward
    name = x.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat)
        return n * per_recv, n * per_sent, n * per_busy, n * per_flops

    _count(ctx, b, tally)
    ctx.relax(x.name, level)
    ctx.relax(out.name, level)


def emit_pack_loop(ctx: EmitCtx, b: UnitBuilder, op: Accum, cost: Any) -> bool:
    """The unit of a ``retile_row`` Accum packing the rows of a stream that ends with a stop
    token (an expert's routing weights, one ``[1, c]`` row each, into its ``[n_e, c]`` column)
    as a loop until the token: the first row starts the tile, every other appends one, its
    size following the rows the tile already holds (a row rule on the accumulator: one cycle,
    ``c*rows + c`` elements), in a buffer allocated at the count's bound (``Alloc.held``); the
    tile is sent once the token came, if it holds a row.  On a channel with a token after each
    group of rows (a Streamify's reads of an expert's buffer, :mod:`.buffer_loop`) it packs one
    tile per group, in a loop over the groups (two accumulators, alternating).  One program for
    every count; ``False`` (nothing emitted) when the unit is not such a packing."""
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    decl = getattr(out.dtype, "shape", None)
    src = ctx.structure.sources(op.input.name)
    decls, dyn = x.decl()
    if len(src) != 1 or len(decls) != 1 or decls[0] is None or dyn[0]:
        return False
    (ch,) = src
    grouped = ch in b.grouped
    rank = 2 if grouped else 1
    shape = getattr(op.input.type, "shape", ())
    if (
        getattr(op.fn, "name", None) != "retile_row"
        or op.rank != 1
        or x.value.rank != rank
        or len(x.value.data) > 1
        or decl is None
        or not decl[1].is_Integer
        or len(shape) != rank + 1
        or b.bound is None
    ):
        return False
    count = b.stops.get(ch)
    if count is None or b.own(ch) or b.next_seq.get(ch, 0) != int(count == 0):
        return False
    # one tile per group of rows (per read of a buffer), also when the stream is empty
    reps = 1
    for d in shape[1:-1]:
        reps *= ctx.ev(d, f"reductions of unit %{b.name}")
    groups = (x.value.data[0] if x.value.data else []) if grouped else x.value.data
    if grouped and not groups:  # an empty buffer is read no time (its unit is the run's)
        return False
    n = len(groups[0]) if groups else 0
    cols = int(decl[1])
    row = decls[0]
    first = (Part("data", str(row.dtype), int(row.shape[0] * row.shape[1])),)
    part = Part("data", str(out.dtype.dtype), n * cols)  # type: ignore[attr-defined]
    if (
        len(groups) not in (0, reps)
        or first[0].elems != cols
        or any(len(g) != n for g in groups)
        or any(x.parts(k) != first for k in range(len(x.flat)))
        or any(out.parts(g) != (part,) for g in range(len(groups)))
    ):
        return False
    bound = b.bound(decl[0])
    if bound is None:
        return False
    if x.flat:
        steps = {
            cost.update_step(
                op.fn, v, x.dtype, out.flat[k // n], out.dtype, first, (part,), k % n == n - 1
            )
            for k, v in enumerate(x.flat)
        }
    else:  # no row this run: the step of a row of its declared tile on a one-row tile
        one = np.zeros((1, cols))
        steps = {
            cost.update_step(
                op.fn, one, x.dtype, one, out.dtype, first, (Part("data", part.dtype, cols),), True
            )
        }
    if len(steps) != 1:
        return False
    ((cyc, fl, rule),) = steps
    if cyc != 1 or rule is not None:
        return False
    stop, idx = f"stop.{ch}", f"i.{ch}"
    del b.stops[ch]
    b.step()
    inb = b.buffer(("in", ch, 0), first[0].dtype, cols)  # as UnitBuilder.recv names it
    t = b.timing
    sends = out.channel is not None and b.has_dsts(out.channel)
    copies = []
    for _ in range(min(reps, 2) if grouped else 1):
        acc = b.buffer(("acc", 0), part.dtype, part.elems, 2, (decl[0], bound, cols, 0))
        b._holds(acc, (decl[0], bound))
        start = Compute(
            STEP_KERNEL,
            (acc,),
            (inb,),
            (("cycles", 1), ("outs", str(cols)), ("rate", t.enc_rate)),
            t.enc_dtype,
        )
        append = Compute(
            STEP_KERNEL,
            (acc,),
            (inb, acc),
            RowRule(1, cols, (), ((cols, cols),)).params(1, t.enc_rate),
            t.enc_dtype,
        )
        guard = Cond(stop, "<", 0)
        update = If(Cond(idx, "==", 0), (start,), (append,))
        body: tuple[Instr, ...] = (
            Set(stop, -1),
            *until_stop(bound + 1, guard, (Recv(ch, inb, stop), If(guard, (update,))), idx),
        )
        if sends and out.channel is not None:
            body += (If(Cond(stop, ">", 0), (Send(out.channel, acc),)),)
            if not grouped:  # forwarded after the tile (its value: the count)
                body += (SendValue(out.channel, stop),)
        copies.append(body)
    if grouped:
        r, m = f"r.{ch}", f"m.{ch}"
        rot = (Calc(m, "mod", r, 2),) if len(copies) > 1 else ()
        b.emit(Loop(reps, (*rot, *_rotate(m, copies)), r))
    else:
        b.emit(*copies[0][:2])
        b.step()
        b.emit(*copies[0][2:])
    b.step()
    b.next_seq[ch] = count + (reps if grouped else 1)
    if sends and out.channel is not None:
        b.sent_seq[out.channel] = out.messages + (not grouped)
    name = x.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        s = c.streams[name]
        k = len(s.flat)
        gs = s.value.data[0] if grouped and s.value.data else [s.flat]
        return k, sum(len(g) > 0 for g in gs) * (sends or not grouped), k * cyc, k * fl

    _count(ctx, b, tally)
    ctx.relax(x.name, EACH if grouped else EVERY)  # the same program for an empty stream
    ctx.relax(out.name, None)  # one tile per reduction of the input, sent from the buffer
    return True


def emit_piece_loop(
    ctx: EmitCtx,
    b: UnitBuilder,
    x: StreamInfo,
    out: StreamInfo,
    produced: int,
    piece: Callable[[int], Any],
    rotation: int = 2,
) -> bool:
    """A FlatMap unit that cuts the one tile it receives into one piece per row of the count
    (``retile_streamify`` of an expert's scaled ``[n_e, H]`` tile, one cycle each: ``piece(j)``
    the row rule of piece ``j``) as ``Loop(count=stop)``: the tile's stream ends with a stop
    token whose value is the count (forwarded from the Partition), so the loop's trip count is
    a register, not the run's.  ``False`` (nothing emitted) when the unit is not such a cut."""
    chans = {ch for pc in x.pieces for ch, _, _ in pc}
    if len(x.flat) != 1 or x.value.rank != 0 or len(chans) != 1 or produced < 1:
        return False
    (ch,) = chans
    decls, dyn = x.decl()
    if ch is None or ch not in b.stops or b.own(ch) or len(decls) != 1 or not dyn[0]:
        return False
    decl = decls[0]
    assert decl is not None
    deps, ctx.deps = ctx.deps, None  # a check of the structure, not a dependence on the run
    try:
        rows = ctx.ev(decl.shape[0], f"rows of unit %{b.name}")
    finally:
        ctx.deps = deps
    if rows != produced:  # the forwarded count is the rows of the tile
        return False
    rules = [piece(j) for j in range(produced)]
    if any(r is None or r != rules[0] for r in rules) or any(
        out.parts(j) != out.parts(0) or out.parts(j)[0].kind != "data" for j in range(produced)
    ):
        return False
    e = b.recv(x, 0)
    b.step()
    ruled, busy0, sent0 = len(b.rule_steps), b.busy_cycles, b.sent
    copies = []
    for _ in range(rotation):
        y = b.compute(1, (e,), out.parts(0), rule=rules[0])
        b.send(out, 0, y)
        copies.append(tuple(b.cur))
        b.cur = []
    per_sent = (b.sent - sent0) // rotation
    del b.rule_steps[ruled:]
    b.busy_cycles, b.sent = busy0, sent0
    j, m = f"j.{ch}", f"m.{ch}"
    body = (Calc(m, "mod", j, rotation), *_rotate(m, copies))
    b.emit(Loop(f"stop.{ch}", body, j))
    b.step()
    if out.channel is not None and b.has_dsts(out.channel):
        b.sent_seq[out.channel] = out.messages
    name = out.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat)
        return 0, n * per_sent, n, 0

    _count(ctx, b, tally)
    ctx.relax(out.name, EACH)
    return True


def _count(
    ctx: EmitCtx, b: UnitBuilder, fn: Callable[[EmitCtx], tuple[int, int, int, int]]
) -> None:
    """Add to the unit's received / sent elements, busy cycles and FLOPs what ``fn`` counts
    from the run's streams (:meth:`EmitCtx.tally`: again for every run that reuses the unit)."""
    r, s, busy, flops = ctx.tally(fn)
    b.received += r
    b.sent += s
    b.busy_cycles += busy
    b.flops += flops


def _rotate(m: str, copies: list[tuple[Instr, ...]]) -> tuple[Instr, ...]:
    """``copies[m]``, chosen by register ``m`` at run time."""
    if len(copies) == 1:
        return copies[0]
    return (If(Cond(m, "==", 0), copies[0], _rotate_from(m, copies, 1)),)


def _rotate_from(m: str, copies: list[tuple[Instr, ...]], i: int) -> tuple[Instr, ...]:
    if i == len(copies) - 1:
        return copies[i]
    return (If(Cond(m, "==", i), copies[i], _rotate_from(m, copies, i + 1)),)
