"""An EagerMerge that takes whichever input is ready, decided in simulated time (STeP arXiv
2511.07776 §3.2.3, §5.3: "Every data- or timing-dependent choice of a STeP operator
(EagerMerge's next input ...) is made by the simulator as the run proceeds").

A statically tiled region's merge (§5.2, §5.3) reads each expert's rows from the Partition's
output (one channel per expert, ending with its stop token: the count; with the routing
weights applied in the region, one channel per part of a row: the row, the token's expert ids
and weights, each ending with its token) and takes them in tiles of ``N`` rows, the rows past
the count padding (a padding flag per row).  Its program is a loop
while some expert has not ended (at most its tiles' bound plus one per expert):

* ``WaitAny`` over the experts' (first parts') channels (:class:`~lowering.isa.WaitAny`): the
  expert whose next message arrived first (ties: the lowest index) into a register;
* under ``If`` on it, that expert's next tile: its first row received with ``Recv(...,
  stop)``; a row starts a tile — one cycle, the one-hot selector naming the expert sent with
  it (the merge names an input once it is ready, so the units the selector steers start with
  the data), the row and its flag 0 forwarded — and each of the ``N - 1`` rows after it is
  received and forwarded alike until the stop token came, then made as padding (two cycles:
  the dequeue and the generated tile, as the unrolled program's) with flag 1.  The stop token
  instead of a first row ends the expert with no tile.

After the loop, when its region's units loop over the chunks (:mod:`.region_loop`), it sends
the stop token on the selector channel, the chunks it sent (counted in a register).

So each expert's tiles leave in the order their first rows arrived, and the program is the same
for every chunk order and every routing within the experts' bounds: the decision is
the simulation's, not the reference interpreter's.  What it takes in a run is counted from the
run's streams (:meth:`~.context.EmitCtx.tally`).

A dynamically tiled region's merge (ragged chunks, one of all an expert's rows, STeP (revised)
§3.1) whose region's units loop over each chunk's rows (its data channel grouped:
:func:`~.region_rows.chunk_channels`, :mod:`.region_tail`) is such a loop too
(:func:`emit_ragged_any`), with the routing weights applied after the regions (a row is one
part) or in them (the default layer: a row's parts, the token's row, expert ids and weights,
come on the expert's one channel, the first part the one whose arrival the ``WaitAny`` sees):
per expert, ``WaitAny`` picks the expert whose first message
(a row, or the stop token of an expert without one) arrived first; a row starts its chunk —
the selector sent with it, every row forwarded in one cycle until the expert's stop token,
whose count then ends the chunk's rows on the data channel — and the token alone ends an
expert without a chunk.  So one simulation decides every region's order, and the merge's
program is the same for every routing, chunk size and order.

Taking a chunk as soon as its first row arrives starts its region's weight reads then (the
selector names the expert, §5.3), possibly while the routing is still reading the token ids
and rows: on an HBM serving each channel first come first served, those small reads queue
behind the weight tiles.  Qwen3-30B-A3B at batch 64 with 4 dynamically tiled regions (Fig. 9):
every region names its first chunk at ~200 cycles, the index and row loads of the routing end
at ~37.5K cycles instead of ~0.9K.  The layer takes 704,686 cycles with the 125 FIFOs the
run's own order needs deep (:mod:`.fifos`; a search restarting the timed simulation after each
deadlock ends with the same channels and cycles); 603,499 cycles were reported while the
depths were found for the untimed replay's guess of the order (the lowest ready input), which
deepened channels this run's order does not need.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowering.isa import (
    Affine,
    Compute,
    Cond,
    If,
    Instr,
    Loop,
    Recv,
    RecvValue,
    Send,
    SendValue,
    Set,
    WaitAny,
)
from torch2step.step.ops_routing import EagerMerge
from torch2step.step.ops_shape import Zip
from torch2step.step.types import TileType, TupleType

from .context import EmitCtx
from .region_loop import chunk_count
from .streams import Part, StreamInfo, iter_nodes
from .timing import STEP_KERNEL
from .unit import UnitBuilder

__all__ = ["MergeAny", "merge_any", "emit_merge_any", "emit_ragged_any", "pick"]


def pick(op: EagerMerge) -> str:
    """The register merge ``op``'s ``WaitAny`` writes (the input it takes next); its choices
    are recorded under :func:`runtime.ops_select.watch_key` of it."""
    return f"pick.{op.name}"


#: The register counting the inputs whose stop token has not come.
OPEN = "open"


@dataclass(frozen=True)
class MergeAny:
    """What a run-time merge needs: each input's channels (one per data part of a row, the
    first the one its ``WaitAny`` watches) and tile-count bound, the rows per tile and the
    row's data parts (a row, or a row with its token's routing data)."""

    parts: tuple[tuple[str, ...], ...]
    tiles: tuple[int, ...]
    rows: int
    row: tuple[Part, ...]

    @property
    def chans(self) -> tuple[str, ...]:
        """Each input's first part's channel."""
        return tuple(p[0] for p in self.parts)


def _part_channels(ctx: EmitCtx, name: str, k: int) -> list[str] | None:
    """The channel of each of the ``k`` data parts of merge input ``name``'s rows: for the Zip
    of the parts' tiles and their padding flags, each part's (or, for one part, the input's
    own)."""
    z = ctx.structure.producer.get(name)
    if isinstance(z, Zip) and z.name not in ctx.structure.owner:
        names = [v.name for v in z.inputs()[:k]]
    elif k == 1:
        names = [name]
    else:
        return None
    out: list[str] = []
    for n in names:
        src = ctx.structure.sources(n)
        if len(src) != 1:
            return None
        out.extend(src)
    return out


def merge_any(ctx: EmitCtx, b: UnitBuilder, op: EagerMerge) -> MergeAny | None:
    """A :class:`MergeAny` when merge ``op`` takes its inputs at run time (module docstring):
    every input a stream of tiles of ``N`` elements, each a row received whole from the
    input's own channels (one per part, each ending with its stop token) and a padding flag
    made here, or a padding row and flag made here; the outputs sent as row and flag, and a
    one-value selector; else ``None``."""
    ins = [ctx.stream(v) for v in op.ins]
    data, sel = (ctx.stream(n) for n in op.out_names())
    if data.channel is None or sel.channel is None or b.bound is None:
        return None
    if not all(len(pc) == 1 and pc[0][2].kind == "value" for pc in sel.pieces):
        return None
    row = _declared_row(ins[0])
    if row is None:
        return None
    k = len(row)
    parts: list[tuple[str, ...]] = []
    tiles: list[int] = []
    rows: set[int] = set()
    for v, info in zip(op.ins, ins):
        shape = getattr(v.type, "shape", ())
        if info.value.rank != 1 or len(shape) != 2 or not _integer(shape[1]):
            return None
        chans = _part_channels(ctx, v.name, k)
        if chans is None or len(set(chans)) != k:
            return None
        for pc in info.pieces:  # a real row from the part channels, or a padding row
            if len(pc) != k + 1 or pc[k][0] is not None or pc[k][2].kind != "value":
                return None
            if tuple(p for _, _, p in pc[:k]) != row:
                return None
            got = [ch for ch, _, _ in pc[:k]]
            if got != chans and any(ch is not None for ch in got):
                return None
        for ch in chans:
            if b.own(ch) or ch not in b.stops or any(ch in p for p in parts):
                return None
            if b.next_seq[ch] != (b.stops[ch] == 0):  # nothing taken yet (but a token)
                return None
        bound = b.bound(shape[0])
        if bound is None:
            return None
        parts.append(tuple(chans))
        tiles.append(bound)
        rows.add(int(shape[1]))
    if len(rows) != 1:
        return None
    if any(len(pc) != k + 1 or tuple(p for _, _, p in pc[:k]) != row for pc in data.pieces):
        return None
    return MergeAny(tuple(parts), tuple(tiles), rows.pop(), row)


def _declared_row(info: StreamInfo) -> tuple[Part, ...] | None:
    """The data parts of an element ``(row tile, ..., padding flag)`` of ``info``'s declared
    type (the row, and the token's routing data when the region applies the weights)."""
    t = info.dtype
    if not isinstance(t, TupleType) or len(t.elems) < 2:
        return None
    out = []
    for e in t.elems[:-1]:
        if not isinstance(e, TileType) or not all(_integer(d) for d in e.shape):
            return None
        out.append(Part("data", e.dtype, int(e.shape[0]) * int(e.shape[1])))
    return tuple(out)


def _integer(d: object) -> bool:
    return isinstance(d, int) or bool(getattr(d, "is_Integer", False))


def emit_merge_any(ctx: EmitCtx, b: UnitBuilder, op: EagerMerge, m: MergeAny) -> None:
    """Emit merge ``op``'s loop over its inputs' tiles in their arrival order (module
    docstring)."""
    data, sel = (ctx.stream(n) for n in op.out_names())
    out, tell = data.channel, sel.channel
    assert out is not None and tell is not None
    # a region no expert gives a token to has no reader of its outputs in this run
    send, named = b.has_dsts(out), b.has_dsts(tell)
    counts = [b.stops.pop(c) for p in m.parts for c in p]
    # a region whose units loop over its chunks (.region_loop): the selectors end with a
    # stop token carrying the chunks sent
    end = named and ctx.tiled.get(op.name) == tell
    cnt = chunk_count(op)
    b.step()
    t = b.timing
    fwd = (("cycles", 1), ("outs", ""), ("rate", t.enc_rate))
    sizes = ",".join(str(p.elems) for p in m.row)
    make = (("cycles", 1), ("outs", sizes), ("rate", t.enc_rate))
    gens = [
        tuple(b.buffer(("gen", j), p.dtype, p.elems, 2) for j, p in enumerate(m.row))
        for _ in range(2)
    ]
    branches: list[tuple[Instr, ...]] = []
    for i, chans in enumerate(m.parts):
        ch = chans[0]
        bufs = [
            tuple(b.buffer(("in", c, j), p.dtype, p.elems, 2) for j, (c, p) in
                  enumerate(zip(chans, m.row)))
            for _ in range(2)
        ]  # fmt: skip
        stop = f"stop.{ch}"
        more = Cond(stop, "<", 0)
        # the other parts' channels end with their tokens where the first one's came
        ends = (If(Cond(stop, ">=", 0), tuple(RecvValue(c, f"stop.{c}") for c in chans[1:])),)
        ends = ends if len(chans) > 1 else ()

        def real(
            buf: tuple[str, ...], first: bool = False, i: int = i, chans: tuple = chans
        ) -> tuple[Instr, ...]:
            head = (SendValue(tell, 1 << i),) if first and named else ()
            if first and end:  # one chunk more (the count the stop token carries)
                head = (*head, Set(cnt, Affine(1, ((cnt, 1),))))
            sends = (*(Send(out, x) for x in buf), SendValue(out, 0)) if send else ()
            return (
                *(Recv(c, x) for c, x in zip(chans[1:], buf[1:])),  # the row's other parts
                Compute(STEP_KERNEL, (), buf, fwd, t.enc_dtype),
                *head,
                *sends,
            )

        def row(
            k: int, ch: str = ch, stop: str = stop, bufs: list = bufs, ends: tuple = ends
        ) -> tuple:
            buf, gen = bufs[k % 2], gens[k % 2]
            pad = (
                Compute(STEP_KERNEL, (), (), fwd, t.enc_dtype),
                Compute(STEP_KERNEL, gen, (), make, t.enc_dtype),
                *((*(Send(out, x) for x in gen), SendValue(out, 1)) if send else ()),
            )
            return (
                If(Cond(stop, "<", 0), (Recv(ch, buf[0], stop), *ends)),
                If(Cond(stop, "<", 0), real(buf), pad),
            )

        tile: list[Instr] = list(real(bufs[0], True))
        rest = m.rows - 1
        if rest >= 2:
            tile.append(Loop(rest // 2, (*row(1), *row(2))))
        if rest % 2:
            tile.extend(row(1))
        done = Set(OPEN, Affine(-1, ((OPEN, 1),)))
        branches.append(
            (
                Recv(ch, bufs[0][0], stop),
                *ends,
                If(more, tuple(tile)),
                If(Cond(stop, ">=", 0), (done,)),
            )
        )
    b.emit(*(Set(f"stop.{ch}", -1) for ch in m.chans), Set(OPEN, len(m.chans)))
    if end:
        b.emit(Set(cnt, 0))
    iterations = sum(m.tiles) + len(m.chans)  # every tile, and each stop token alone
    reg = pick(op)
    take = (WaitAny(m.chans, reg), *_select(reg, branches, 0))
    b.emit(Loop(iterations, (If(Cond(OPEN, ">", 0), take),)))
    if end:
        b.emit(SendValue(tell, cnt, stop=True))
    b.step()
    for ch, n in zip([c for p in m.parts for c in p], counts):
        b.next_seq[ch] = n + 1
    if b.has_dsts(out):
        b.sent_seq[out] = ctx.streams[data.name].messages
    if b.has_dsts(tell):
        b.sent_seq[tell] = ctx.streams[sel.name].messages + end
    names = [v.name for v in op.ins]

    def taken(c: EmitCtx) -> tuple[int, int, int, int]:
        elems = pads = tiles = 0
        for n in names:
            info = c.streams[n]
            elems += len(info.flat)
            pads += sum(pc[0][0] is None for pc in info.pieces)
            tiles += len(iter_nodes(info.value.data, 1))
        return elems, elems * send + tiles * named, elems + pads, 0

    r, s, cycles, _ = ctx.tally(taken)
    b.received += r
    b.sent += s
    b.busy_cycles += cycles
    for v in (*op.ins, *op.out_names()):
        ctx.relax(v, None)


def _select(reg: str, branches: list[tuple[Instr, ...]], i: int) -> tuple[Instr, ...]:
    """``branches[reg]``, chosen at run time."""
    if i == len(branches) - 1:
        return branches[i]
    return (If(Cond(reg, "==", i), branches[i], _select(reg, branches, i + 1)),)


def _ragged_inputs(
    ctx: EmitCtx, b: UnitBuilder, op: EagerMerge
) -> tuple[list[str], tuple[Part, ...]] | None:
    """Each input's channel and the rows' data parts, when merge ``op`` takes ragged chunks at
    run time (:func:`emit_ragged_any`): its data channel ends each chunk with a stop token
    (grouped), its selector is one value per chunk, and every input is at most one chunk of
    rows, each row one data part (the token's row, the §5.3 artifact's layer) or several (with
    the routing weights applied in the region, the row zipped with its token's expert ids and
    weights), all from the input's own channel, which ends with its stop token."""
    data, sel = (ctx.stream(n) for n in op.out_names())
    if data.channel is None or sel.channel is None or data.channel not in b.grouped:
        return None
    if not all(len(pc) == 1 and pc[0][2].kind == "value" for pc in sel.pieces):
        return None
    chans: list[str] = []
    row: set[tuple[Part, ...]] = set()
    for v in op.ins:
        info = ctx.stream(v)
        shape = getattr(v.type, "shape", ())
        if info.value.rank != 1 or len(shape) != 2 or _integer(shape[1]):
            return None
        if len(info.value.data) > 1 or b.bound(shape[1]) is None:
            return None
        own = set(ctx.structure.sources(v.name))
        for pc in info.pieces:
            if not pc or any(p.kind != "data" or ch is None for ch, _, p in pc):
                return None
            row.add(tuple(p for _, _, p in pc))
            own |= {ch for ch, _, _ in pc}
        if len(own) != 1:
            return None
        (ch,) = own
        if b.own(ch) or ch not in b.stops or ch in chans:
            return None
        if b.next_seq[ch] != (b.stops[ch] == 0):  # nothing taken yet (but an empty one's token)
            return None
        chans.append(ch)
    if not row:  # no expert of the region has a token this run: the row from the type
        t = getattr(op.ins[0].type, "dtype", None)
        leaves = t.elems if isinstance(t, TupleType) else (t,)
        made = []
        for x in leaves:
            shape = getattr(x, "shape", ())
            if not isinstance(x, TileType) or not all(_integer(d) for d in shape):
                return None
            made.append(Part("data", x.dtype, int(shape[0]) * int(shape[1])))
        row = {tuple(made)}
    if len(row) != 1 or any(tuple(p for _, _, p in pc) not in row for pc in data.pieces):
        return None
    return chans, row.pop()


def emit_ragged_any(ctx: EmitCtx, b: UnitBuilder, op: EagerMerge) -> bool:
    """Emit a dynamically tiled region's merge as a loop taking whichever expert's chunk is
    ready first (module docstring); ``False`` (nothing emitted) when ``op`` is no such
    merge."""
    found = _ragged_inputs(ctx, b, op)
    if found is None:
        return False
    chans, parts = found
    data, sel = (ctx.stream(n) for n in op.out_names())
    out, tell = data.channel, sel.channel
    assert out is not None and tell is not None
    send, named = b.has_dsts(out), b.has_dsts(tell)
    bounds = [b.bound(v.type.shape[1]) or 0 for v in op.ins]  # type: ignore[attr-defined]
    counts = [b.stops.pop(ch) for ch in chans]
    end = named and ctx.tiled.get(op.name) == tell
    cnt = chunk_count(op)
    b.step()
    t = b.timing
    fwd = (("cycles", 1), ("outs", ""), ("rate", t.enc_rate))
    branches: list[tuple[Instr, ...]] = []
    for i, (ch, bound) in enumerate(zip(chans, bounds)):
        # two copies of each part's buffer, rows alternating between them
        bufs = [
            tuple(b.buffer(("in", ch, j), p.dtype, p.elems, 2) for j, p in enumerate(parts))
            for _ in range(2)
        ]
        stop = f"stop.{ch}"
        more = Cond(stop, "<", 0)

        def real(
            buf: tuple[str, ...], first: bool = False, i: int = i, ch: str = ch
        ) -> tuple[Instr, ...]:
            head = (SendValue(tell, 1 << i),) if first and named else ()
            if first and end:  # one chunk more (the count the stop token carries)
                head = (*head, Set(cnt, Affine(1, ((cnt, 1),))))
            sends = tuple(Send(out, x) for x in buf) if send else ()
            return (*(Recv(ch, x) for x in buf[1:]),  # the row's other parts
                    Compute(STEP_KERNEL, (), buf, fwd, t.enc_dtype), *head, *sends)  # fmt: skip

        def row(buf: tuple[str, ...], ch: str = ch, stop: str = stop, more: Cond = more) -> tuple:
            return (If(more, (Recv(ch, buf[0], stop),)), If(more, real(buf)))

        # the rows after the first and the expert's stop token (its count)
        rest = Loop(-(-bound // 2), (*row(bufs[1]), *row(bufs[0])))
        token = (SendValue(out, stop, stop=True),) if send else ()
        chunk = (*real(bufs[0], True), rest, *token)
        done = Set(OPEN, Affine(-1, ((OPEN, 1),)))
        branches.append((Recv(ch, bufs[0][0], stop), If(more, chunk), done))
    b.emit(*(Set(f"stop.{ch}", -1) for ch in chans), Set(OPEN, len(chans)))
    if end:
        b.emit(Set(cnt, 0))
    reg = pick(op)
    take = (WaitAny(tuple(chans), reg), *_select(reg, branches, 0))
    b.emit(Loop(len(chans), (If(Cond(OPEN, ">", 0), take),)))  # each expert's chunk or token
    if end:
        b.emit(SendValue(tell, cnt, stop=True))
    b.step()
    for ch, n in zip(chans, counts):
        b.next_seq[ch] = n + 1
    if send:
        b.sent_seq[out] = data.messages + len(data.value.data)
    if named:
        b.sent_seq[tell] = sel.messages + end
    names = [v.name for v in op.ins]

    def taken(c: EmitCtx) -> tuple[int, int, int, int]:
        elems = sum(len(c.streams[n].flat) for n in names)
        chunks = sum(len(c.streams[n].value.data) for n in names)
        return elems, elems * send + chunks * named, elems, 0

    r, s, cycles, _ = ctx.tally(taken)
    b.received += r
    b.sent += s
    b.busy_cycles += cycles
    for v in (*op.ins, *op.out_names()):
        ctx.relax(v, None)
    return True
