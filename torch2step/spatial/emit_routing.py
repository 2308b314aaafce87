"""Unit programs of the routing, merging and repeating operators (STeP §3.2.3, §3.2.5; timed
by §4.2: "data in the selector stream is first dequeued.  In the next cycle, data in the chosen
input stream is dequeued and enqueued to the output stream with a single cycle latency.  The
selection stream is blocked until the routing for the current selection is finished").

* **Partition** — per selector: dequeue it (one cycle), then every element of its chunk: one
  cycle, sent to each output the selector picks (a multi-hot selector copies the chunk); the
  selector is a register read at run time, so the program does not depend on the routing.  At
  the end every output gets its stop token, carrying how many elements it received (STeP
  §3.2.3): an output's reader learns the routing ended from it, even when it got no element.
* **Reassemble** — per selector: dequeue it, then for each selected input every element of that
  input's next chunk, one cycle each.  Chunks of one element of a static tile type (the MoE's
  token rows) are taken at run time: the selector register decides under ``If`` per input,
  inputs in index order, so the program is the same for every routing; other chunks follow the
  order the run's chunks arrived (STeP (revised) §3.2.3).
* **EagerMerge** — a statically tiled region's merge takes whichever input's tile is ready,
  decided in simulated time (:mod:`.merge_any`: ``WaitAny``); otherwise chunks in the run's
  arrival order: each element received and forwarded in one cycle; the one-hot selector
  naming the chunk's input is sent once the chunk's first element is there (the merge cannot
  name an input before that input is ready, STeP §3.2.3), so the units the selector steers (a
  region's weight addresses, §5.3) start with the data.  It reads every input's channel: an
  expert's chunk ends with the count its FlatMap forwards (:mod:`.region_rows`), taken after
  the chunk's rows, or alone when the expert sends none.
* **Expand** / **Repeat** — each input element is received once and re-sent for every element
  of ``ref`` (Expand, which dequeues those too) or ``count`` times (Repeat), one cycle per copy.

Arrival order otherwise (EagerMerge of ragged chunks, Reassemble of larger chunks) is the run's:
the reference interpreter's (equal-rate producers unless ``run(..., arrival=...)`` said
otherwise); the programs follow it (:mod:`.dynamic` searches for the run whose order the
simulation reproduces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowering.isa import Affine, Cond, If, Recv, RecvValue, Send, SendValue, Set
from torch2step.errors import LoweringError
from torch2step.step.op_base import Op
from torch2step.step.ops_routing import EagerMerge, Partition, Reassemble
from torch2step.step.ops_shape import Expand, Repeat
from torch2step.step.types import TileType

from .context import EmitCtx
from .merge_any import emit_merge_any, emit_ragged_any, merge_any
from .region_rows import emit_expand_loop
from .region_tail import emit_row_partition
from .streams import _VALUE_DTYPES, Part, StreamInfo, iter_nodes, leaves
from .unit import UnitBuilder
from .unit_reuse import FORM

__all__ = ["EMITTERS"]


def _forward(b: UnitBuilder, src: StreamInfo, k: int, outs: list[tuple[StreamInfo, int]]) -> None:
    """One element: receive, one cycle, send to each ``(stream, index)``."""
    e = b.recv(src, k, rotation=2)
    b.compute(1, (e,), const=True)
    for out, j in outs:
        b.send(out, j, e)
    b.step()


def _routed(
    b: UnitBuilder,
    src: StreamInfo,
    k: int,
    reg: str,
    outs: list[StreamInfo],
    made: dict[tuple[object, ...], tuple[If, ...]],
) -> bool:
    """One element sent to the outputs whose bit is set in the selector register ``reg`` at
    run time (``If`` per output): the instructions do not depend on the routing.  ``False``
    (nothing emitted) when the element is not all received data (then :func:`_forward`).
    ``made``: the ``If`` s already built, by register and buffers (elements received into the
    same buffers branch alike; the instructions are immutable, so they are shared)."""
    parts = src.parts(k)
    if any(p.kind != "data" for p in parts):
        return False
    e = b.recv(src, k, rotation=2)
    if any(buf is None for _, buf in e):
        return False  # pragma: no cover - a data part generated locally
    b.compute(1, (e,), const=True)
    key = (reg, *(buf for _, buf in e))
    branches = made.get(key)
    if branches is None:
        branches = made[key] = tuple(
            If(
                Cond(reg, "&", 1 << i),
                (
                    *(Send(out.channel, buf) for _, buf in e if buf is not None),
                    Set(_counter(i), Affine(1, ((_counter(i), 1),))),
                ),
            )
            for i, out in enumerate(outs)
            if out.channel is not None and b.has_dsts(out.channel)
        )
    b.emit(*branches)
    b.step()
    return True


def _counter(i: int) -> str:
    """Register counting the elements a Partition sent to output ``i`` (its stop token)."""
    return f"sent.{i}"


def _partition(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    """Per selector, its register decides the outputs at run time (:func:`_routed`), so the
    program is the same for every routing of the same number of elements (STeP §3.2.3:
    Partition routes by the selector it dequeues)."""
    op = ops[0]
    assert isinstance(op, Partition)
    if emit_row_partition(  # a region's rows back to its experts, per chunk (.region_tail)
        ctx, b, op, lambda x, reg, outs, made: _routed(b, x, 0, reg, outs, made), _counter
    ):
        return
    x, s = ctx.stream(op.input), ctx.stream(op.sel)
    outs = [ctx.stream(n) for n in op.out_names()]
    chunks = iter_nodes(x.value.data, s.value.rank + 1)
    depth = x.value.rank - s.value.rank
    cursor = [0] * len(outs)
    live = [i for i, o in enumerate(outs) if o.channel is not None and b.has_dsts(o.channel)]
    b.emit(*(Set(_counter(i), 0) for i in live))
    guarded = False
    forwarded = False
    routed = 0  # elements this run sends through run-time branches
    made: dict[tuple[object, ...], tuple[If, ...]] = {}
    k = 0
    for si, (selv, chunk) in enumerate(zip(s.flat, chunks)):
        sel = b.recv(s, si)
        b.consume(sel)
        reg = sel[0][1] if len(sel) == 1 and sel[0][0].kind == "value" else None
        for _ in leaves(chunk, depth):
            targets = []
            for i in selv.indices:
                targets.append((outs[i], cursor[i]))
                cursor[i] += 1
            if reg is not None and _routed(b, x, k, reg, outs, made):
                guarded = True
                for out, j in targets:  # the messages this run sends (checked by the plan)
                    if out.channel is not None and b.has_dsts(out.channel):
                        b.sent_seq[out.channel] += len(out.parts(j))
                        routed += 1
            else:
                forwarded = True
                _forward(b, x, k, targets)
            k += 1
    for i in live:  # the stop token: how many elements the output received
        chan = outs[i].channel
        assert chan is not None
        b.emit(SendValue(chan, _counter(i) if guarded else cursor[i]))
        b.sent_seq[chan] += 1
    b.step()
    if guarded and not forwarded:
        # every element is routed by its selector's register: the program reads the
        # selectors' values only at run time, and what the outputs receive not at all; the
        # elements a run sends are its bookkeeping, counted from each run's streams
        names = tuple(outs[i].name for i in live)
        _, sent, _, _ = ctx.tally(lambda c: (0, sum(len(c.streams[n].flat) for n in names), 0, 0))
        assert sent == routed
        ctx.relax(op.sel, FORM)
        for n in op.out_names():
            ctx.relax(n, None)
    b.sent += routed


def _match(op: Op, chunk: Any, cands: list[int], chunks: list[list[Any]], nxt: list[int]) -> int:
    for i in cands:
        if nxt[i] < len(chunks[i]) and chunks[i][nxt[i]] is chunk:
            return i
    raise LoweringError(  # pragma: no cover - the interpreter moves chunks, never copies them
        f"{op.op_name} %{op.name}: cannot tell which input a chunk of the run came from"
    )


def _row_part(info: StreamInfo) -> Part | None:
    """The one data part every element of ``info`` has, from its declared type (so it is
    known when this run sends the stream nothing); ``None`` when it is not a static tile."""
    t = info.dtype
    if not isinstance(t, TileType) or not all(_static(d) for d in t.shape):
        return None
    if t.dtype in _VALUE_DTYPES and tuple(t.shape) == (1, 1):
        return None
    return Part("data", t.dtype, int(t.shape[0]) * int(t.shape[1]))


def _static(d: object) -> bool:
    return isinstance(d, int) or bool(getattr(d, "is_Integer", False))


def runtime_reassemble(ctx: EmitCtx, op: Reassemble) -> bool:
    """Whether Reassemble ``op`` decides at run time (:func:`_reassemble_by_selector`): chunks
    of single elements (rank-0 inputs) of one static tile type, a one-value selector."""
    ins, s = [ctx.stream(v) for v in op.ins], ctx.stream(op.sel)
    if ins[0].value.rank != 0:
        return False
    if not all(
        len(pc) == 1 and pc[0][0] is not None and pc[0][2].kind == "value" for pc in s.pieces
    ):
        return False
    parts = {_row_part(i) for i in ins}
    return len(parts) == 1 and None not in parts


def _reassemble_by_selector(ctx: EmitCtx, b: UnitBuilder, op: Reassemble) -> None:
    """Per selector, its register decides at run time which inputs give an element (in input
    order, STeP §3.2.3): each input ``i`` whose bit is set gives its next element, forwarded in
    one cycle (``If`` per input), so the program is the same for every routing.  Each input
    keeps the two rotating buffers of :func:`_forward`, chosen by a parity register."""
    ins = [ctx.stream(v) for v in op.ins]
    s, out = ctx.stream(op.sel), ctx.stream(op.name)
    part = _row_part(ins[0])
    assert part is not None and out.channel is not None
    chans = [i.channel for i in ins]
    send = b.has_dsts(out.channel)
    bufs = {}
    for i, ch in enumerate(chans):
        if ch is not None and not b.own(ch):
            pool = [b.buffer(("in", ch, 0), part.dtype, part.elems, 2) for _ in range(2)]
            bufs[i] = pool
            b.emit(Set(_parity(i), 0))
    made: dict[str, tuple[If, ...]] = {}  # the branches per selector register (immutable)
    for si, selv in enumerate(s.flat):
        sel = b.recv(s, si)
        b.consume(sel)
        ((_, reg),) = sel
        assert reg is not None
        branches = made.get(reg)
        if branches is None:
            branches = made[reg] = tuple(
                _taken(b, reg, i, chans[i], pool, out.channel if send else None)
                for i, pool in bufs.items()
            )
        b.emit(*branches)
        for i in selv.indices:  # the messages this run moves (checked by the plan)
            assert chans[i] is not None
            b.next_seq[chans[i]] += 1
            if send:
                b.sent_seq[out.channel] += 1
        b.step()
    # an input read from a Partition ends with its stop token (STeP §3.2.3): taken once the
    # selectors are done, whatever this run sent on it
    for ch in chans:
        if ch is not None and ch in b.stops:
            b.emit(RecvValue(ch, f"stop.{ch}"))
            b.next_seq[ch] = b.stops.pop(ch) + 1
    b.step()
    # the program reads the selectors' values at run time, the inputs only by their channels
    # and declared type: the elements a run takes are its bookkeeping, counted from its streams
    name = s.name

    def taken(c: EmitCtx) -> tuple[int, int, int, int]:
        n = sum(len(v.indices) for v in c.streams[name].flat)
        return n, n if send else 0, n, 0

    r, sent, cycles, _ = ctx.tally(taken)
    b.received += r
    b.sent += sent
    b.busy_cycles += cycles
    ctx.relax(op.sel, FORM)
    for v in (*op.ins, op.name):
        ctx.relax(v, None)


def _taken(
    b: UnitBuilder, reg: str, i: int, ch: str | None, pool: list[str], out: str | None
) -> If:
    """Input ``i``'s branch of a Reassemble by selector: when bit ``i`` of ``reg`` is set,
    receive into the buffer of ``pool`` the parity register picks, one cycle, send to ``out``
    (unless ``None``), and flip the parity."""
    assert ch is not None
    par = _parity(i)
    arms = []
    for buf in pool:
        body = [Recv(ch, buf), b.compute_instr(1, (buf,))]
        if out is not None:
            body.append(Send(out, buf))
        arms.append(tuple(body))
    flip = Set(par, Affine(1, ((par, -1),)))
    return If(Cond(reg, "&", 1 << i), (If(Cond(par, "==", 0), arms[0], arms[1]), flip))


def _parity(i: int) -> str:
    """Register choosing which of input ``i``'s two buffers receives its next element."""
    return f"par.{i}"


def _reassemble(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Reassemble)
    if runtime_reassemble(ctx, op):
        _reassemble_by_selector(ctx, b, op)
        return
    ins = [ctx.stream(v) for v in op.ins]
    s, out = ctx.stream(op.sel), ctx.stream(op.name)
    rank = ins[0].value.rank
    chunks = [iter_nodes(i.value.data, 1) for i in ins]
    nxt = [0] * len(ins)
    flat = [0] * len(ins)
    o = 0
    gathered = iter_nodes(out.value.data, s.value.rank + 1)
    for si, (selv, got) in enumerate(zip(s.flat, gathered)):
        b.consume(b.recv(s, si))
        for chunk in got:
            i = _match(op, chunk, list(selv.indices), chunks, nxt)
            nxt[i] += 1
            for _ in leaves(chunk, rank):
                _forward(b, ins[i], flat[i], [(out, o)])
                flat[i] += 1
                o += 1


def _eager_merge(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, EagerMerge)
    found = merge_any(ctx, b, op)
    if found is not None:  # whichever input is ready, decided in simulated time
        emit_merge_any(ctx, b, op, found)
        return
    if emit_ragged_any(ctx, b, op):  # whichever expert's ragged chunk is ready (.merge_any)
        return
    ins = [ctx.stream(v) for v in op.ins]
    data, sel = (ctx.stream(n) for n in op.out_names())
    rank = ins[0].value.rank
    chunks = [iter_nodes(i.value.data, 1) for i in ins]
    nxt = [0] * len(ins)
    flat = [0] * len(ins)
    o = 0
    for ci, (chunk, selv) in enumerate(zip(iter_nodes(data.value.data, 1), sel.flat)):
        i = _match(op, chunk, list(selv.indices), chunks, nxt)
        nxt[i] += 1
        named = tuple((p, None) for p in sel.parts(ci))
        for j, _ in enumerate(leaves(chunk, rank)):
            e = b.recv(ins[i], flat[i], rotation=2)
            b.compute(1, (e,), const=True)
            if j == 0:  # the merge takes the chunk once its first element is there
                b.send(sel, ci, named)
            b.send(data, o, e)
            b.step()
            flat[i] += 1
            o += 1
        if not leaves(chunk, rank):  # pragma: no cover - an empty chunk: only its selector
            b.send(sel, ci, named)
        if data.channel in b.grouped and b.has_dsts(data.channel):
            # a ragged region's rows loop until each chunk's stop token (.region_rows)
            b.emit(SendValue(data.channel, len(leaves(chunk, rank)), stop=True))
            b.sent_seq[data.channel] += 1
        b.step()
    tell = sel.channel
    if tell is not None and ctx.tiled.get(op.name) == tell and b.has_dsts(tell):
        # its region's units loop until the selectors' stop token (.region_loop)
        b.emit(SendValue(tell, len(sel.flat), stop=True))
        b.sent_seq[tell] += 1
    # the control values of the chunks (a static tile's padding flags) are forwarded from the
    # registers they came in: the program follows the chunks' order and forms, not the values
    # (its selectors name the inputs in that order, STeP §5.3)
    for v in (*op.ins, data.name):
        ctx.relax(v, FORM)


def _expand(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Expand)
    if emit_expand_loop(ctx, b, op):  # along a region's chunk rows (.region_rows)
        return
    x, r, out = ctx.stream(op.input), ctx.stream(op.ref), ctx.stream(op.name)
    cut = x.value.rank - op.rank
    kx = kr = o = 0
    for xs, rs in zip(iter_nodes(x.value.data, cut), iter_nodes(r.value.data, cut)):
        e = b.recv(x, kx, rotation=2)
        kx += len(leaves(xs, op.rank + 1))
        for _ in leaves(rs, op.rank + 1):
            b.compute(1, (e, b.recv(r, kr)), const=True)
            b.send(out, o, e)
            kr += 1
            o += 1
            b.step()
        b.step()
    if all(q.kind == "value" for k in range(len(r.flat)) for q in r.parts(k)):
        # the reference's control values (a request's KV-tile addresses) are dequeued into
        # registers no instruction reads: only the reference's structure steers the program
        ctx.relax(op.ref, FORM)
    if not b.literal_values:  # the values it copies are sent from the registers they came in
        ctx.relax(op.input, FORM)


def _repeat(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Repeat)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    o = 0
    for k, copies in enumerate(iter_nodes(out.value.data, x.value.rank + 1)):
        e = b.recv(x, k, rotation=2)
        if not copies:
            b.consume(e)
        for _ in copies:
            b.compute(1, (e,), const=True)
            b.send(out, o, e)
            o += 1
            b.step()
        b.step()
    if not b.literal_values:  # control values forwarded from the registers they came in
        ctx.relax(op.input, FORM)


#: Operator class -> emitter of its unit's program.
EMITTERS: dict[type, Callable[[EmitCtx, UnitBuilder, tuple[Op, ...]], None]] = {
    Partition: _partition,
    Reassemble: _reassemble,
    EagerMerge: _eager_merge,
    Expand: _expand,
    Repeat: _repeat,
}
