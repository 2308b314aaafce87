"""An expert's Bufferize and the Streamify reading it as loops over the token count.

With dynamic tiling (STeP arXiv 2511.07776 §5.2) an expert's Bufferize keeps the ``[1, H]``
rows of its tokens, its ``[P_e, N_e]`` stream, in one buffer ``Buf[N_e]`` (STeP (revised)
§3.2.2, Appendix Table 3); a Streamify then reads the buffer once per element of its ``ref``
(one read per ``tile_i`` block) and a ``retile_row`` Accum packs each read into the expert's
``[N_e, H]`` tile.  The rows come from a Partition's output, which ends with a stop token
carrying its count (STeP §3.2.3), so none of these units needs the count when it is built:

* the Bufferize (:func:`emit_buffer_loop`) receives the rows in a ``Loop`` bounded by the
  count's bound (the tokens routed), row ``i`` into the ``i``-th of ``bound`` one-row buffers
  allocated held (``Alloc.held``: the simulator counts what they hold), until the stop token
  ends the stream; the buffer is complete once it came, and its reference is sent if it holds
  a row (``P_e = [N_e > 0]``);
* each fused Streamify reads, per ``ref`` element, the rows ``0 .. count-1``
  (``Loop(count=stop)``: the trip count is the token's value) and ends every read with a stop
  token carrying the count (:func:`grouped_channels`: its channel carries one token per read);
* the ``retile_row`` Accum after it loops until each read's token
  (:func:`~.stop_loop.emit_pack_loop`).

A loop picks the buffer of row ``i`` by a balanced tree of branches on the loop's register
(:func:`select`: ``log2(bound)`` comparisons a row).  The units' work per row is what the
unrolled program did (a receive into the row's buffer; per read, a step of ``row bytes /
on-chip memory bandwidth`` cycles and a send per row, STeP §4.2), so the only new traffic is
the read's stop token.  Their elements, cycles and bytes in a run are counted from its streams
and its count (:data:`~.unit_reuse.Tally`, :class:`~.sizing.Sizing`): one program for every
token count that is not zero.  When the count is zero the Bufferize sends the stream's stop
token instead of its reference, and the units after it run their guards only (:mod:`.guard`):
one program for every count.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from math import prod

from lowering.isa import Cond, If, Instr, Loop, Recv, RecvValue, Send, SendValue, Set
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum
from torch2step.step.ops_memory import Bufferize, Streamify
from torch2step.step.ops_shape import Promote

from .context import EmitCtx
from .static_pad import emit_padded_buffer
from .stop_loop import until_stop
from .streams import Part, iter_nodes
from .structure import Structure
from .unit import UnitBuilder
from .unit_reuse import EACH

__all__ = ["grouped_channels", "group_tokens", "select", "emit_buffer_loop"]


def grouped_channels(graph: StepProgram, st: Structure, stops: Iterable[str]) -> set[str]:
    """The output channels of Streamify nodes that end each read of their buffer with a stop
    token carrying the rows read (module docstring): fused into the unit of a rank-1
    Bufferize of a Promote of one channel ending with a stop token (dynamic tiling), read only
    by the single-node unit of a rank-1 ``retile_row`` Accum."""
    stops = set(stops)
    readers: dict[str, list[Op]] = defaultdict(list)
    for op in graph.nodes:
        for v in op.inputs():
            readers[v.name].append(op)
    out: set[str] = set()
    for ops in st.units:
        head = ops[0]
        if not isinstance(head, Bufferize) or head.rank != 1:
            continue
        src = st.sources(head.input.name)
        if (
            len(src) != 1
            or not src <= stops
            or not isinstance(st.producer.get(head.input.name), Promote)
        ):  # one buffer of the stream's rows: [P_e, N_e], P_e = [N_e > 0]
            continue
        for s in ops[1:]:
            if not isinstance(s, Streamify) or s.out_shape is not None:
                continue
            rd = readers.get(s.name, [])
            if (
                len(rd) == 1
                and isinstance(rd[0], Accum)
                and getattr(rd[0].fn, "name", None) == "retile_row"
                and rd[0].rank == 1
                and st.owner.get(rd[0].name) == rd[0].name
                and len(st.units[st.unit_index(rd[0].name)]) == 1
            ):
                out.add(s.name)
    return out


def group_tokens(value: object, rank: int) -> int:
    """Stop tokens of a grouped channel in a run: one per innermost group of its stream."""
    return len(iter_nodes(value, rank))


def select(reg: str, lo: int, hi: int, leaf: Callable[[int], tuple[Instr, ...]]) -> tuple:
    """``leaf(i)`` for the value ``i`` of register ``reg`` in ``[lo, hi)``: a balanced tree of
    branches (``log2(hi - lo)`` comparisons at run time)."""
    if hi - lo == 1:
        return leaf(lo)
    mid = (lo + hi) // 2
    return (If(Cond(reg, "<", mid), select(reg, lo, mid, leaf), select(reg, mid, hi, leaf)),)


def _form(parts: tuple[Part, ...]) -> tuple:
    """The parts of an element without their control values (a buffer reference's value is
    received into a register and not used)."""
    return tuple((p.kind, p.dtype, p.elems) for p in parts)


def emit_buffer_loop(ctx: EmitCtx, b: UnitBuilder, op: Bufferize, fused: list[Streamify]) -> bool:
    """The unit of an expert's Bufferize and the Streamify nodes fused with it, as loops over
    the rows of the stream that ends with a stop token (module docstring); ``False`` (nothing
    emitted) when the unit is not such a buffer, or the run gives it no row.  Statically tiled
    rows are buffered with their padding decided at run time (:mod:`.static_pad`)."""
    if emit_padded_buffer(ctx, b, op, fused):
        return True
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    shape = getattr(op.input.type, "shape", ())
    if op.rank != 1 or x.value.rank != 1 or len(shape) != 2 or b.bound is None:
        return False
    chans = {ch for pc in x.pieces for ch, _, _ in pc}
    if len(x.value.data) != 1 or not x.flat or len(chans) != 1:
        return False
    (ch,) = chans
    if ch is None or ch not in b.stops or b.own(ch) or b.next_seq.get(ch, 0):
        return False
    first = x.parts(0)
    decls, dyn = x.decl()
    if (
        len(first) != 1
        or first[0].kind != "data"
        or dyn[0]
        or any(x.parts(k) != first for k in range(1, len(x.flat)))
    ):
        return False
    reads = []
    for s in fused:
        so, ref = ctx.stream(s.name), ctx.stream(s.ref)
        rshape = getattr(s.ref.type, "shape", ())
        if (
            s.out_shape is not None
            or so.channel not in b.grouped
            or len(rshape) < 2
            or len(ref.flat) == 0
            or any(_form(ref.parts(k)) != _form(ref.parts(0)) for k in range(len(ref.flat)))
        ):
            return False
        # (the outer elements: the run's, or a region's chunk in its view, .region_loop)
        per = prod(ctx.ev(d, f"reads of unit %{b.name}") for d in rshape[1:])
        reads.append((s, so, ref, len(ref.value.data) * per))
    if any(n != len(ref.flat) for _, _, ref, n in reads):
        return False
    bound = b.bound(shape[1])
    if bound is None:
        return False
    deps, ctx.deps = ctx.deps, None  # a check of the structure, not a dependence on the run
    try:
        ctx.ev(shape[0], f"buffers of unit %{b.name}")  # one buffer: the count is not zero
    finally:
        ctx.deps = deps
    part = first[0]
    cols = part.elems
    names = b.row_buffers(("mem", 0), part.dtype, cols, shape[1], bound, len(x.flat))
    stop, i = f"stop.{ch}", f"i.{ch}"
    messages = b.stops.pop(ch)
    b.step()

    def take(j: int) -> tuple[Instr, ...]:
        return (Recv(ch, names[j], stop),) if j < bound else (RecvValue(ch, stop),)

    guard = Cond(stop, "<", 0)
    b.emit(Set(stop, -1), *until_stop(bound + 1, guard, select(i, 0, bound + 1, take), i))
    b.step()
    b.next_seq[ch] = messages + 1
    recv0, sent0, busy0 = b.received, b.sent, b.busy_cycles
    # the buffer is complete: its reference, then every read of it
    b.compute(1, (), const=True)
    b.send(out, 0, tuple((q, None) for q in out.parts(0)))
    then: list[Instr] = list(b.cur)
    b.cur = []
    mc = ctx.timing.memory_cycles(part.nbytes)
    for s, so, ref, n in reads:
        e = b.recv(ref, 0)
        b.consume(e)
        head, b.cur = b.cur, []
        j = f"j.{so.channel}"
        tail: tuple[Instr, ...] = ()
        sends = so.channel is not None and b.has_dsts(so.channel)

        def row(k: int, sends: bool = sends, ch_out: str | None = so.channel) -> tuple:
            step: tuple[Instr, ...] = (b.compute_instr(mc, (names[k],)),)
            return step + ((Send(ch_out, names[k]),) if sends and ch_out else ())

        if sends and so.channel is not None:
            tail = (SendValue(so.channel, stop),)
            b.sent_seq[so.channel] = so.messages + n
        then.append(Loop(n, (*head, Loop(stop, select(j, 0, bound, row), j), *tail)))
        for c in {c for pc in ref.pieces for c, _, _ in pc} - {None}:
            b.next_seq[c] = ref.messages  # type: ignore[index]
        ctx.relax(s.name, EACH)
    b.received, b.sent, b.busy_cycles = recv0, sent0, busy0
    b.emit(If(Cond(stop, ">", 0), tuple(then)))
    b.step()
    ref_sent = int(out.channel is not None and b.has_dsts(out.channel))
    counted = [
        (ref.name, int(so.channel is not None and b.has_dsts(so.channel)))
        for _, so, ref, _ in reads
    ]
    name = x.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        rows = len(c.streams[name].flat)
        r, s_, busy = rows, ref_sent, 1
        for rname, sends in counted:
            k = len(c.streams[rname].flat)
            r += k
            s_ += k * rows * sends
            busy += k * (1 + rows * mc)
        return r, s_, busy, 0

    r, s_, busy, _ = ctx.tally(tally)
    b.received += r
    b.sent += s_
    b.busy_cycles += busy
    ctx.relax(x.name, EACH)
    return True
