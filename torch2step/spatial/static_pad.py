"""Static tiling's padding decided at run time (STeP arXiv 2511.07776 §5.2).

With static tiling an expert's ``N_e`` token rows are cut into ``C_e = ceil(N_e / N)`` tiles of
``N`` rows by a Reshape that pads the last tile with zero rows (and makes padding flags).  The
rows come from a Partition's output, which ends with a stop token carrying the count ``N_e``
(STeP §3.2.3), so which rows of the last tile are real (row ``j`` of tile ``C_e - 1`` while
``(C_e - 1) N + j < N_e``) is known at run time once the token came; the units reading the
padded stream need not be built for this run's padding:

* the expert's Bufferize (:func:`emit_padded_buffer`) receives every row of its last tile with
  ``Recv(..., stop=reg)`` under ``If(stop < 0)`` (the token, when it comes instead of a row,
  lands in the register), then the token itself if the tile was full; each read of the last
  tile (a fused Streamify) sends row ``j`` from its buffer if it is real, or else a zero row
  made in one cycle in that row's buffer (the padding the Reshape makes), the branch
  ``If((C_e - 1) N + j < stop)``;
* the ``retile_row`` Accum packing the padded routing weights into a column
  (:func:`emit_padded_pack`) receives each element of the last tile likewise and appends it,
  or a zero element, to the tile, and forwards the token after the tile;
* the FlatMap turning the expert's scaled tiles back into rows sends the count it received
  (the token the scaling Map forwards) to the FilterPadding unit ahead of its last tile's rows
  (:func:`counted_rows`: a 4-byte control message, the channel's stop token), and the filter
  (:func:`emit_padded_filter`) receives it before that tile and sends row ``j`` of it if
  ``(C_e - 1) N + j`` is below it, else drops it: the padding flags the Reshape made are not
  read.

The work per row is the unrolled program's (STeP §4.2): a padding row of a read costs the
read's step and the one-cycle step making it, so the cycles are those of a program built for
the run's padding, but for the packing taking the token after the last real row's step, not
before it (it may finish a cycle earlier).  The rows of the last tile are held in the tile's
``N`` row buffers (the Bufferize's ``Buf[N]``), a padding row made in its own row's buffer,
not in extra ones: an expert of fewer than ``N`` rows holds ``N`` (the static tile's bytes);
the filter's two output buffers alternate over the last tile's rows, so an expert of one
token holds both.  What a run's padding changes (the one-cycle steps of its padding rows, the
rows the filter sends) is counted from its streams (:data:`~.unit_reuse.Tally`).  These units
read the padded stream at level :data:`~.unit_reuse.SHAPE`: one program for every token count
of as many tiles.  The units of a statically tiled expert found as a tile group loop over
its tiles instead, one program for every tile count (:mod:`.tile_loop`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from lowering.isa import Compute, Cond, If, Instr, Recv, RecvValue, Send, SendValue, Set
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import Accum, FlatMap
from torch2step.step.ops_memory import Bufferize, Streamify
from torch2step.step.ops_shape import Flatten, Reshape, Zip

from .context import EmitCtx
from .stop_loop import forwards_stop
from .streams import Part, StreamInfo
from .structure import Structure
from .timing import STEP_KERNEL
from .unit import Elem, UnitBuilder
from .unit_reuse import SHAPE

__all__ = ["emit_padded_buffer", "emit_padded_pack", "padded_rows"]


def padded_rows(ctx: EmitCtx, b: UnitBuilder, x: StreamInfo) -> tuple[str, int, Part] | None:
    """``(channel, N, part)`` when stream ``x`` is a Reshape's ``[C, N]`` tiles (``C >= 1``) of
    the one-part elements of a channel that ends with a stop token, padded at the end of its
    last tile only, its first row real (a Partition's rows under static tiling); else ``None``."""
    if not isinstance(ctx.structure.producer.get(x.name), Reshape) or x.value.rank != 1:
        return None
    groups = x.value.data
    if not groups or not groups[0] or any(len(g) != len(groups[0]) for g in groups):
        return None
    n = len(groups[0])
    if any(len(pc) != 1 for pc in x.pieces):
        return None
    chans = [pc[0][0] for pc in x.pieces]
    real = [c for c in chans if c is not None]
    last = (len(groups) - 1) * n
    if not real or len(set(real)) != 1 or len(real) <= last or None in chans[: len(real)]:
        return None  # the padding rows are the last ones, the last tile's first row is real
    ch = real[0]
    part = x.parts(0)[0]
    if (
        ch not in b.stops
        or b.stops[ch] != len(real)
        or b.own(ch)
        or b.next_seq.get(ch, 0)
        or part.kind != "data"
        or any(x.parts(k)[0] != part for k in range(len(chans)))
    ):
        return None
    return ch, n, part


def _zero_row(b: UnitBuilder, buf: str, part: Part) -> Compute:
    """The one-cycle step making a padding row in ``buf`` (as ``UnitBuilder.materialize``)."""
    t = b.timing
    params = (("cycles", 1), ("outs", str(part.elems)), ("rate", t.enc_rate))
    return Compute(STEP_KERNEL, (buf,), (), params, t.enc_dtype)


def _guarded_rows(ch: str, stop: str, names: list[str]) -> tuple[Instr, ...]:
    """Receive row ``j`` into ``names[j]`` until the stop token, then the token if it has not
    come yet (the last tile was full)."""
    more = Cond(stop, "<", 0)
    return (
        *(If(more, (Recv(ch, nm, stop),)) for nm in names),
        If(more, (RecvValue(ch, stop),)),
    )


def _pads(name: str) -> Callable[[EmitCtx], int]:
    """The padding rows of stream ``name`` in a run (its parts made where they are used)."""
    return lambda c: sum(1 for pc in c.streams[name].pieces if pc[0][0] is None)


def emit_padded_buffer(ctx: EmitCtx, b: UnitBuilder, op: Bufferize, fused: list[Streamify]) -> bool:
    """The unit of an expert's Bufferize of statically tiled rows and the Streamify nodes
    reading it, its last tile's padding decided at run time (module docstring); ``False``
    (nothing emitted) when the unit is not such a buffer.  The head of a tile group loops
    over the tiles instead (:mod:`.tile_loop`)."""
    if op.name in ctx.tiled:
        from .tile_emit import emit_tile_buffer

        return emit_tile_buffer(ctx, b, op, fused)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    found = padded_rows(ctx, b, x) if op.rank == 1 else None
    if found is None:
        return False
    ch, n, part = found
    tiles = len(x.value.data)
    reads = []
    for s in fused:
        so, ref = ctx.stream(s.name), ctx.stream(s.ref)
        if s.out_shape is not None or so.channel in b.grouped or len(ref.flat) % tiles:
            return False
        reads.append((so, ref, len(ref.flat) // tiles))
    messages = b.stops.pop(ch)
    last, stop = tiles - 1, f"stop.{ch}"
    b.emit(Set(stop, -1))
    b.step()
    held: dict[int, list[Elem]] = {}

    def fill(i: int) -> None:
        if i < last:
            held[i] = [b.recv(x, i * n + j, role=("mem", i % 2, j)) for j in range(n)]
            return
        names = [b.buffer(("mem", i % 2, j, 0), part.dtype, part.elems) for j in range(n)]
        b.emit(*_guarded_rows(ch, stop, names))
        b.received += n
        b.next_seq[ch] = messages + 1
        held[i] = [((part, nm),) for nm in names]

    fill(0)
    ref_k = [0] * len(reads)
    mc = ctx.timing.memory_cycles(part.nbytes)
    for i in range(tiles):
        if i + 1 < tiles:
            fill(i + 1)
        rows = held.pop(i)
        b.compute(1, rows, const=True)
        b.send(out, i, tuple((q, None) for q in out.parts(i)))
        b.step()
        for f, (so, ref, per) in enumerate(reads):
            sends = so.channel is not None and b.has_dsts(so.channel)
            for _ in range(per):
                b.consume(b.recv(ref, ref_k[f]))
                ref_k[f] += 1
                for j, row in enumerate(rows):
                    k = b.sent_seq[so.channel] if sends else 0  # type: ignore[index]
                    if i < last:
                        b.compute(mc, (row,))
                        b.send(so, k, row)
                    else:  # real or padding: decided by the count the token carried
                        nm = row[0][1]
                        assert nm is not None
                        send = (Send(so.channel, nm),) if sends and so.channel else ()
                        real = (b.compute_instr(mc, (nm,)), *send)
                        pad = (b.compute_instr(mc, ()), _zero_row(b, nm, part), *send)
                        b.emit(If(Cond(i * n + j, "<", stop), real, pad))
                        b.busy_cycles += mc
                        if sends:
                            b.sent += 1
                            b.sent_seq[so.channel] += 1  # type: ignore[index]
                    b.step()
    per_last = sum(per for _, _, per in reads)
    pads = _pads(x.name)
    busy = ctx.tally(lambda c: (0, 0, pads(c) * per_last, 0))[2]
    b.busy_cycles += busy
    ctx.relax(x.name, SHAPE)
    return True


def _captured(
    b: UnitBuilder, cycles: int, ins: tuple[Elem, ...], parts: tuple[Part, ...], fl: int, acc: Elem
) -> tuple[tuple[Instr, ...], int, int]:
    """The instructions, cycles and FLOPs of the step appending ``ins`` to the accumulator
    ``acc``, not emitted nor counted (for a run-time branch)."""
    cur, busy, flops = b.cur, b.busy_cycles, b.flops
    b.cur = []
    b.compute(cycles, ins, parts, role="acc", flops=fl, into=acc)
    got = tuple(b.cur), b.busy_cycles - busy, b.flops - flops
    b.cur, b.busy_cycles, b.flops = cur, busy, flops
    return got


def emit_padded_pack(ctx: EmitCtx, b: UnitBuilder, op: Accum, cost: Any) -> bool:
    """The unit of a ``retile_row`` Accum of rank 1 packing statically tiled rows (an expert's
    routing weights), its last tile's padding decided at run time (module docstring);
    ``False`` (nothing emitted) when the unit is not such a packing.  A tile group's packing
    loops over the tiles instead (:mod:`.tile_loop`)."""
    if op.name in ctx.tiled:
        from .tile_emit import emit_tile_pack

        return emit_tile_pack(ctx, b, op, cost)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    found = padded_rows(ctx, b, x)
    if found is None or getattr(op.fn, "name", None) != "retile_row" or op.rank != 1:
        return False
    ch, n, part = found
    tiles = len(x.value.data)
    steps = [
        cost.update_step(
            op.fn,
            x.flat[k],
            x.dtype,
            out.flat[k // n],
            out.dtype,
            x.parts(k),
            out.parts(k // n),
            k % n == n - 1,
        )  # fmt: skip
        for k in range(tiles * n)
    ]
    if any(rule is not None for _, _, rule in steps):
        return False
    messages = b.stops.pop(ch)
    last, stop = tiles - 1, f"stop.{ch}"
    b.emit(Set(stop, -1))
    b.step()
    extra: list[tuple[int, int]] = []  # per row of the last tile: (cycles, FLOPs) of a pad
    for r in range(tiles):
        state: Elem | None = None
        for j in range(n):
            k = r * n + j
            c, fl, _ = steps[k]
            parts = out.parts(r)
            if r < last or j == 0:  # a real row (the last tile's first row is)
                if r == last:
                    inbuf = b.buffer(("in", ch, 0), part.dtype, part.elems)
                    b.emit(Recv(ch, inbuf))
                    b.received += 1
                    e: Elem = ((part, inbuf),)
                else:
                    e = b.recv(x, k)
                ins = (e,) if state is None else (e, state)
                state = b.compute(c, ins, parts, role="acc", flops=fl, into=state)
                b.step()
                continue
            assert state is not None
            inbuf = b.buffer(("in", ch, 0), part.dtype, part.elems)
            b.emit(If(Cond(stop, "<", 0), (Recv(ch, inbuf, stop),)))
            b.received += 1
            real, rc, rf = _captured(b, c, (((part, inbuf),), state), parts, fl, state)
            pad, pc, pf = _captured(b, c, (((part, None),), state), parts, fl, state)
            b.emit(If(Cond(stop, "<", 0), real, pad))
            b.busy_cycles += rc
            b.flops += rf
            extra.append((pc - rc, pf - rf))
            b.step()
        assert state is not None
        if r == last:
            b.emit(If(Cond(stop, "<", 0), (RecvValue(ch, stop),)))
            b.next_seq[ch] = messages + 1
        b.send(out, r, state)
        b.step()
    if (
        out.channel is not None
        and b.has_dsts(out.channel)
        and forwards_stop(op, ctx.structure.sources(op.input.name), {ch})
    ):  # its stop token, after its last element (.stop_loop)
        b.emit(SendValue(out.channel, stop))
        b.sent_seq[out.channel] += 1
        b.step()
    pads = _pads(x.name)

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        p = pads(c)  # the last p rows of the last tile are padding
        cut = extra[len(extra) - p :] if p else []
        return 0, 0, sum(a for a, _ in cut), sum(f for _, f in cut)

    _, _, cyc, fl = ctx.tally(tally)
    b.busy_cycles += cyc
    b.flops += fl
    ctx.relax(x.name, SHAPE)
    return True


def _flags_chunk(st: Structure, value: str) -> int | None:
    """The tile ``N`` of the Reshape whose padding flags stream ``value`` is (through
    Flatten wires), or ``None``."""
    op = st.producer.get(value)
    while isinstance(op, Flatten) and op.name not in st.owner:
        op = st.producer.get(op.input.name)
    if isinstance(op, Reshape) and op.name not in st.owner and value != op.name:
        return op.chunk
    return None


def _filter_of(st: Structure, readers: Mapping[str, list[Op]], op: Op) -> FlatMap | None:
    """The FilterPadding unit reading FlatMap ``op``'s rows zipped with a Reshape's padding
    flags, or ``None``."""
    rd = readers.get(op.name, [])
    if len(rd) != 1 or not isinstance(rd[0], Zip) or rd[0].name in st.owner:
        return None
    zipped = rd[0]
    if len(zipped.ins) != 2 or zipped.ins[0].name != op.name:
        return None
    if _flags_chunk(st, zipped.ins[1].name) is None:
        return None
    f = readers.get(zipped.name, [])
    if (
        len(f) != 1
        or not isinstance(f[0], FlatMap)
        or getattr(f[0].fn, "name", None) != "filter_padding"
        or st.owner.get(f[0].name) != f[0].name
    ):
        return None
    return f[0]


def counted_rows(graph: StepProgram, st: Structure, stops: set[str]) -> set[str]:
    """The single-node FlatMap units (an expert's rows back from its tiles) that send the
    count of a stream ending with a stop token (of ``stops``) to the FilterPadding unit
    reading their rows, ahead of their last tile (:func:`emit_padded_filter`)."""
    readers: dict[str, list[Op]] = defaultdict(list)
    for op in graph.nodes:
        for v in op.inputs():
            readers[v.name].append(op)
    out = set()
    for op in graph.nodes:
        if (
            isinstance(op, FlatMap)
            and st.owner.get(op.name) == op.name
            and len(st.units[st.unit_index(op.name)]) == 1
            and len(st.sources(op.input.name) & stops) == 1
            and _filter_of(st, readers, op) is not None
        ):
            out.add(op.name)
    return out


def emit_padded_filter(ctx: EmitCtx, b: UnitBuilder, op: FlatMap) -> bool:
    """The FilterPadding unit of statically tiled rows: the rows of every tile but the last are
    real; the count comes ahead of the last tile (:func:`counted_rows`) and row ``j`` of it is
    sent if ``(C - 1) N + j`` is below the count, else dropped: the padding flags decided at
    run time (module docstring).  ``False`` (nothing emitted) when the unit is not such a
    filter.  A tile group's filter takes each tile's real rows from its reference instead
    (:mod:`.tile_loop`)."""
    if op.name in ctx.tiled:
        from .tile_emit import emit_tile_filter

        return emit_tile_filter(ctx, b, op)
    st = ctx.structure
    zipped = st.producer.get(op.input.name)
    if getattr(op.fn, "name", None) != "filter_padding" or not isinstance(zipped, Zip):
        return False
    if len(zipped.ins) != 2:
        return False
    n = _flags_chunk(st, zipped.ins[1].name)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    rows = zipped.ins[0].name
    if n is None or rows not in b.stops or not x.flat or len(x.flat) % n:
        return False
    if any(len(pc) != 2 or pc[0][0] != rows or pc[1][0] is not None for pc in x.pieces):
        return False
    data = x.parts(0)[0]
    if data.kind != "data" or any(x.parts(k)[0] != data for k in range(len(x.flat))):
        return False
    last = len(x.flat) - n
    stop = f"stop.{rows}"
    messages = b.stops.pop(rows)
    parts = (data,)
    for k in range(len(x.flat)):
        if k == last:  # the count, ahead of the last tile
            b.emit(RecvValue(rows, stop))
        e = b.recv(x, k)
        if k < last:
            b.send(out, k, b.compute(1, (e,), parts))
        else:
            sent = out.channel is not None and b.has_dsts(out.channel)
            real, c1, _ = _step(b, lambda e=e: b.compute(1, (e,), parts))
            buf = real[-1].outs[0]  # type: ignore[attr-defined]
            pad, c2, _ = _step(b, lambda e=e: b.consume(e))
            assert c1 == c2 == 1
            send = (Send(out.channel, buf),) if sent and out.channel else ()
            b.emit(If(Cond(k, "<", stop), (*real, *send), pad))
            b.busy_cycles += 1
        b.step()
    b.next_seq[rows] = messages + 1
    if out.channel is not None and b.has_dsts(out.channel):
        real = _real(x.name, last)
        b.sent_seq[out.channel] = last + real(ctx)
        b.sent += ctx.tally(lambda c: (0, real(c), 0, 0))[1]
    ctx.relax(x.name, SHAPE)
    ctx.relax(op.name, None)  # its rows' count is the run's; its program is not
    return True


def _step(b: UnitBuilder, fn: Callable[[], Any]) -> tuple[tuple[Instr, ...], int, int]:
    """The instructions, cycles and FLOPs of the step ``fn`` makes on ``b``, not emitted nor
    counted (for a run-time branch)."""
    cur, busy, flops = b.cur, b.busy_cycles, b.flops
    b.cur = []
    fn()
    got = tuple(b.cur), b.busy_cycles - busy, b.flops - flops
    b.cur, b.busy_cycles, b.flops = cur, busy, flops
    return got


def _real(name: str, last: int) -> Callable[[EmitCtx], int]:
    """The real rows of the last tile of the zipped stream ``name`` in a run (its flags)."""
    return lambda c: sum(
        1 for pc in c.streams[name].pieces[last:] if pc[1][2].kind == "value" and not pc[1][2].value
    )
