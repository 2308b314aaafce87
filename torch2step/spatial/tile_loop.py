"""Static tiling's tile count decided at run time: an expert's units loop over its tiles.

With static tiling (STeP arXiv 2511.07776 §5.2) expert ``e``'s ``n_e`` token rows are cut into
``C_e = ceil(n_e / N)`` tiles of ``N`` rows (a Reshape padding the last one), and every unit
of the expert handles ``[C_e, ...]`` streams: the same work for each tile, a full tile or a
padded one alike.  The rows come from a Partition's output, which ends with a stop token
carrying the count (STeP §3.2.3), so no unit needs ``C_e`` when it is built
(:class:`TileGroup`):

* the expert's Bufferize (the group's head, :func:`~.tile_emit.emit_tile_buffer`) loops over
  the tiles until that token, at most ``ceil(bound / N) + 1`` times (``bound``: the tokens
  routed, :func:`~.plan.count_bounds`): it receives up to ``N`` rows, and if the tile holds
  one sends its buffer reference — a control value, the tile's real rows ``r`` — and streams
  it, a zero row made for every row ``j >= r``; once the token came it sends the token (the
  count) on the reference's channel;
* every unit after it (:func:`tile_body`) reads that channel, a multicast, once per tile: a
  reference (``RecvValue`` with ``stop``, the value into a register) runs the unit's program
  for one tile, the token ends its loop — a loop until the stop token (:mod:`.stop_loop`)
  whose body is the program of one full tile, built from a view of the run in which the
  expert has ``N`` rows (:func:`tile_view`).  The stop tokens that reach the unit on its
  other inputs (the routing weights' count, forwarded) are taken after the loop and
  forwarded, as :mod:`.guard`'s other arm does, so ``C_e = 0`` runs the token arm only and
  the unit's buffers are never allocated;
* the routing weights' packing (:func:`~.tile_emit.emit_tile_pack`) loops until its input's
  stop token by itself, ``N`` rows a tile, zeros after the last real one, and the
  FilterPadding unit (:func:`~.tile_emit.emit_tile_filter`) keeps row ``j`` of a tile while
  ``j`` is below the reference's value.

The expert's weight loads loop over the tiles themselves (:func:`~.tile_emit.emit_tile_load`):
before sending a tile's last weight tile they take the next tile's reference and, if it came,
issue its first load, so HBM latency overlaps the tile boundary.

When the expert's tile is packed once (``repeat_tile``, Fig. 2: a ``retile_row`` Accum of the
padded rows, its ``[N, H]`` tiles read by the Repeat and as the weight loads' references) the
packing is the head: a loop like the routing weights' packing that also sends each tile's
real rows, then the stop token, on a control channel of its own (:func:`tile_channel`: a
4-byte message per tile, multicast to the units after it, which read it as they would a
Bufferize's references); its tiles' channel then ends with no token, and the weight loads
take the control message as their reference instead of the ``[N, H]`` tile (a load reads
its reference stream only for its elements' count, STeP §3.2.1), so the packing never waits
for them.

So every unit of a statically tiled expert is one program for every routing.  The work per
tile is the unrolled program's (STeP §4.2): each tile's steps and messages are those of a
full tile (a padding row costs its read's step and the one-cycle step making it), the only new
traffic the token on the reference's channel (and a packed-once head's control messages).  A unit's bookkeeping in a run
(:meth:`TileGroup.info`) is its one-tile program's times ``C_e``, the padding rows' one-cycle
steps added to the head's and the dropped rows taken from the filter's sends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy as sp

from lowering.isa import Alloc, Cond, Free, If, Instr, RecvValue, SendValue
from torch2step.step.ops_compute import Accum, FlatMap
from torch2step.step.ops_memory import Bufferize, Streamify
from torch2step.step.ops_routing import Partition
from torch2step.step.ops_shape import Reshape
from torch2step.step.types import BufferType, TileType, TupleType
from torch2step.step.values import BufferValue, StreamValue

from .stop_loop import until_stop
from .streams import WIRE_RULES, Part, StreamInfo, flat_elements, unit_pieces
from .structure import Structure

__all__ = ["TileGroup", "find_tile_groups", "tile_rows_reg", "tile_body", "tile_view"]


def tile_rows_reg(ref: str) -> str:
    """The register a unit of a tile group receives each tile's reference into (its value:
    the tile's real rows), unless the unit reads the reference itself."""
    return f"ref.{ref}"


@dataclass(frozen=True)
class TileGroup:
    """One statically tiled expert: its Bufferize unit ``head`` (reference channel ``ref``),
    the units after it that handle only ``[C_e, ...]`` streams (``units``; ``filters``: the
    FilterPadding ones among them), the routing weights' packing units (``packers``, by
    node name), the tile count ``tiles`` (``ceil(count / size)``), ``reads``: the head's
    reads of one tile, ``limit``: the most tiles (``ceil(bound / size)``), and the streams
    built as one full tile makes them (``streams``, in graph order)."""

    head: int
    ref: str
    count: sp.Symbol
    size: int
    tiles: sp.Expr
    units: frozenset[int]
    filters: frozenset[int]
    packers: frozenset[str]
    limit: int
    streams: tuple[str, ...]
    reads: int = 0
    rows_in: str = ""  # a Bufferize head's rows channel (its FIFO a tile deeper)
    run_tiles: int = 0
    run_pads: int = 0

    @property
    def members(self) -> frozenset[int]:
        """The head and the units after it (built from the one-tile view)."""
        return self.units | {self.head}

    def info(self, k: int, info: Any) -> Any:
        """Unit ``k``'s bookkeeping (:class:`~.plan.UnitInfo`) in the run, from its program's
        for one full tile (module docstring)."""
        c, pads = self.run_tiles, self.run_pads
        if c == 0 and k != self.head:  # its buffers are allocated in the arm it does not run
            return dataclasses.replace(
                info, flops=0, step_cycles=0, sram_bytes=0, received=0, sent=0
            )
        out = dataclasses.replace(
            info,
            flops=info.flops * c,
            step_cycles=info.step_cycles * c,
            received=info.received * c,
            sent=info.sent * c,
        )
        if k == self.head and c:
            out = dataclasses.replace(out, step_cycles=out.step_cycles + pads * self.reads)
        if k in self.filters:
            out = dataclasses.replace(out, sent=out.sent - pads)
        return out


def _ceilings(t: Any) -> frozenset[sp.Expr]:
    return frozenset(a for d in t.shape for a in sp.sympify(d).atoms(sp.ceiling))


def find_tile_groups(st: Structure, stops: set[str], bounds: Mapping[str, int]) -> list[TileGroup]:
    """Every statically tiled expert (:class:`TileGroup`, its run counts not yet set): a
    rank-1 Bufferize unit of a Reshape's ``[ceil(n / N), N]`` tiles of one channel ending with
    a stop token, and the units downstream of it all of whose inputs have sizes of that tile
    count (``bounds``: a Partition count's bound by symbol name)."""
    graph = st.graph
    outputs = {op.name: outs for op, outs in zip(graph.nodes, graph.node_outputs)}
    values = [v for outs in graph.node_outputs for v in outs]
    order = {v.name: i for i, v in enumerate(values)}
    ceils = {v.name: _ceilings(v.type) for v in values}
    frees = {v.name: _free(v.type) for v in values}
    packs = [  # the units packing rows of a Reshape's tiles
        (k, os[0])
        for k, os in enumerate(st.units)
        if len(os) == 1 and _packs(os[0]) and isinstance(st.producer.get(os[0].input.name), Reshape)
    ]
    by_symbol: dict[sp.Symbol, list[str]] = {}  # a size's symbol -> the values with it
    for v in values:
        for x in frees[v.name]:
            by_symbol.setdefault(x, []).append(v.name)
    out = []
    for h, ops in enumerate(st.units):
        head = ops[0]
        packed = len(ops) == 1 and _packs(head)  # the tile packed once (Fig. 2)
        if not (isinstance(head, Bufferize) and head.rank == 1 or packed):
            continue
        cut = st.producer.get(head.input.name)
        tiles = sp.sympify(outputs[head.name][0].type.shape[0])
        src = st.sources(head.input.name)
        if (
            not isinstance(cut, Reshape)
            or cut.name in st.owner
            or not isinstance(tiles, sp.ceiling)
            or len(tiles.free_symbols) != 1
            or len(src) != 1
            or not src <= stops
            or not isinstance(st.producer.get(next(iter(src))), Partition)
        ):
            continue
        (count,) = tiles.free_symbols
        if count.name not in bounds or sp.simplify(tiles - sp.ceiling(count / cut.chunk)) != 0:
            continue
        units: set[int] = set()
        filters: set[int] = set()
        for op, k, ins, _ in st.reached((v.name for o in ops for v in outputs[o.name]), h):
            if k not in units and ins and all(tiles in ceils[n] for n in ins):
                units.add(k)
                if isinstance(op, FlatMap) and getattr(op.fn, "name", None) == "filter_padding":
                    filters.add(k)
        packers = {
            o.name for k, o in packs if k not in units and k != h and tiles in ceils[o.input.name]
        }
        names = set(by_symbol.get(count, ()))
        names |= {v.name for k in units for o in st.units[k] for v in outputs[o.name]}
        streams = tuple(sorted(names, key=order.__getitem__))
        limit = -(-bounds[count.name] // cut.chunk)
        ref = tile_channel(head.name) if packed else head.name
        rows_in = "" if packed else next(iter(src))
        group = TileGroup(h, ref, count, cut.chunk, tiles, frozenset(units), frozenset(filters),
                          frozenset(packers), limit, streams, 0, rows_in)  # fmt: skip
        out.append(group)
    return out


def _packs(op: Any) -> bool:
    """Whether ``op`` is a ``retile_row`` Accum of rank 1 (rows packed into a tile)."""
    return isinstance(op, Accum) and getattr(op.fn, "name", None) == "retile_row" and op.rank == 1


def tile_channel(head: str) -> str:
    """The control channel on which a tile group whose head packs its tile (no Bufferize
    references) sends each tile's real rows, then the stop token."""
    return f"{head}.tiles"


def control_stream(name: str, rows: list[int]) -> StreamInfo:
    """The control stream of :func:`tile_channel`: one ``int32`` value per tile, its real
    rows (a 4-byte message each)."""
    t = TileType((1, 1), "int32")
    flat = [np.full((1, 1), r, np.int32) for r in rows]
    pieces = [((name, k, Part("value", "int32", 1, r)),) for k, r in enumerate(rows)]
    return StreamInfo(name, t, StreamValue(0, flat), flat, pieces, name)


def _free(t: Any) -> set[sp.Symbol]:
    return {s for d in t.shape for s in sp.sympify(d).free_symbols}


def tile_view(
    st: Structure,
    group: TileGroup,
    streams: Mapping[str, StreamInfo],
    bindings: dict[str, Any],
    types: Mapping[str, Any] | None = None,
) -> dict[str, StreamInfo] | None:
    """The group's streams as a run would make them with one full tile (its count at ``N``:
    ``bindings`` updated; a FilterPadding's real rows, ``N`` too), or ``None`` when a size or
    type does not evaluate (``types``: :func:`value_types`, if made already)."""
    bindings[group.count.name] = group.size
    types = value_types(st) if types is None else types
    for k in group.filters:
        for o in st.units[k]:
            for s in _free(types[o.name]):
                bindings[s.name] = group.size
    env = {k: v for k, v in bindings.items() if isinstance(v, int)}
    out: dict[str, StreamInfo] = {}
    cuts: dict[str, tuple[StreamInfo, StreamInfo]] = {}
    for name in group.streams:
        op = st.producer[name]
        if isinstance(op, Reshape) and op.name not in st.owner:  # the tile: the same rows
            if op.name not in cuts:
                made = _cut(st, op, out, env, types)
                if made is None:
                    return None
                cuts[op.name] = made
            rows, flags = cuts[op.name]
            out[name] = rows if name == rows.name else flags
            continue
        if op.name in st.owner:
            made = _unit_stream(types[name], name, env)
            if made is None:
                return None
            out[name] = made
            continue
        if any(v.name not in out for v in op.inputs()):
            continue  # a wire of streams the view does not make (read by no member)
        made = _wire(types[name], op, name, out, env)
        if made is None:
            return None
        out[name] = made
    return out


def value_types(st: Structure) -> dict[str, Any]:
    """Every value's declared type by name (for :func:`tile_view`, worked out once)."""
    return {v.name: v.type for outs in st.graph.node_outputs for v in outs}


def _wire(
    t: Any, op: Any, name: str, made: Mapping[str, StreamInfo], env: Mapping[str, int]
) -> StreamInfo | None:
    """A wire's output stream (declared type ``t``) in the view, from its inputs' (made
    already)."""
    ins = [made[v.name] for v in op.inputs()]
    rule = WIRE_RULES.get(type(op))
    if rule is None:
        return None
    flat = [x for i in ins[:1] for x in i.flat]
    if len(ins) > 1:  # a Zip: tuples of its inputs' elements
        if any(len(i.flat) != len(flat) for i in ins):
            return None
        flat = [tuple(i.flat[k] for i in ins) for k in range(len(flat))]
    try:
        dims = [_size(d, env) for d in t.shape]
    except (KeyError, TypeError, ValueError):
        return None
    if np.prod(dims) != len(flat):
        return None
    value = StreamValue(t.rank, _nested(dims, iter(flat)))
    try:
        (pieces,) = rule(op, ins, [value], None)
    except Exception:
        return None
    return StreamInfo(name, t.dtype, value, flat_elements(value), pieces)


def _nested(dims: list[int], it: Any) -> list:
    if len(dims) == 1:
        return [next(it) for _ in range(dims[0])]
    return [_nested(dims[1:], it) for _ in range(dims[0])]


def _unit_stream(t: Any, name: str, env: Mapping[str, int]) -> StreamInfo | None:
    """A unit's output stream in the view: zero elements of its declared type ``t``
    (read-only broadcasts, no memory), as many as its sizes evaluate to."""
    try:
        dims = [_size(d, env) for d in t.shape]
        count = int(np.prod(dims))
        blank = _blank(t.dtype, env)  # one read-only element, the same for all
        flat = [blank] * count
    except (KeyError, TypeError, ValueError):
        return None
    value = StreamValue(t.rank, _nested(dims, iter(flat)))
    flat = flat_elements(value)
    return StreamInfo(name, t.dtype, value, flat, unit_pieces(name, t.dtype, flat), name)


_SIZES: dict[tuple[Any, tuple[int, ...]], int] = {}


def _size(d: Any, env: Mapping[str, int]) -> int:
    """Size expression ``d`` at ``env`` (memoised: the experts' views repeat the same ones)."""
    e = sp.sympify(d)
    if e.is_Integer:
        return int(e)
    xs = sorted(e.free_symbols, key=lambda x: x.name)
    key = (e, tuple(env[x.name] for x in xs))
    got = _SIZES.get(key)
    if got is None:
        if len(_SIZES) > 100_000:
            _SIZES.clear()
        got = _SIZES[key] = int(e.subs(dict(zip(xs, key[1]))))
    return got


def _blank(t: Any, env: Mapping[str, int]) -> Any:
    """A zero element of declared type ``t`` (tiles as read-only broadcasts)."""
    if isinstance(t, TileType):
        dt = np.int64 if t.dtype.startswith("int") else np.float32
        return np.broadcast_to(np.zeros((), dt), tuple(_size(d, env) for d in t.shape))
    if isinstance(t, TupleType):
        return tuple(_blank(e, env) for e in t.elems)
    if isinstance(t, BufferType):
        rows = [_size(d, env) for d in t.shape]
        tiles = [_blank(t.elem, env)] * int(np.prod(rows))
        return BufferValue(_nested(rows, iter(tiles)), sum(x.nbytes for x in tiles))
    raise TypeError(f"no stand-in element of type {t}")


def _cut(
    st: Structure,
    op: Reshape,
    made: Mapping[str, StreamInfo],
    env: Mapping[str, int],
    types: Mapping[str, Any],
) -> tuple[StreamInfo, StreamInfo] | None:
    """A Reshape's rows and flags streams in the view: its input's elements (made already)
    as one tile, its flags all false."""
    src = made.get(op.inputs()[0].name)
    outs = next(vs for o, vs in zip(st.graph.nodes, st.graph.node_outputs) if o is op)
    if src is None or len(outs) != 2 or src.value.rank != 0:
        return None
    rows_t, flags_t = types[outs[0].name], types[outs[1].name]
    tiles = [src.flat[i : i + op.chunk] for i in range(0, len(src.flat), op.chunk)]
    if any(len(t) != op.chunk for t in tiles):
        return None
    rows = StreamValue(rows_t.rank, [list(t) for t in tiles])
    flag = np.broadcast_to(np.zeros((), np.float32), (1, 1))  # one read-only false flag
    flags = StreamValue(flags_t.rank, [[flag] * len(t) for t in tiles])
    try:
        pieces, fpieces = WIRE_RULES[Reshape](op, [src], [rows, flags], None)
    except Exception:
        return None
    return (
        StreamInfo(outs[0].name, rows_t.dtype, rows, flat_elements(rows), pieces),
        StreamInfo(outs[1].name, flags_t.dtype, flags, flat_elements(flags), fpieces),
    )


def group_reads(st: Structure, group: TileGroup, view: Mapping[str, StreamInfo]) -> int:
    """The head's reads of one tile in the one-tile view (one per ``ref`` element of each
    Streamify fused with it)."""
    return sum(
        len(view[s.ref.name].flat) for s in st.units[group.head][1:] if isinstance(s, Streamify)
    )


def tile_body(
    body: tuple[Instr, ...], ref: str, limit: int, stop_ins: list[str], stop_outs: list[str]
) -> tuple[Instr, ...]:
    """A unit's program looping over its expert's tiles (module docstring): ``body`` is its
    program for one tile; each tile's reference is received with ``stop`` (into the unit's own
    register when ``body`` starts by receiving it), the token ends the loop, then the stop
    tokens of ``stop_ins`` are taken and the one read forwarded on ``stop_outs``."""
    n = 0
    while n < len(body) and isinstance(body[n], Alloc):
        n += 1
    allocs, rest = body[:n], body[n:]
    stop = f"stop.{ref}"
    reg = tile_rows_reg(ref)
    first = rest[0] if rest else None
    frees = tuple(Free(a.buf) for a in allocs)
    more = Cond(stop, "<", 0)
    tokens: list[Instr] = [RecvValue(ch, f"stop.{ch}") for ch in stop_ins]
    if stop_outs:
        (src,) = stop_ins
        tokens += [SendValue(ch, f"stop.{src}") for ch in stop_outs]
    if isinstance(first, RecvValue) and first.channel == ref and first.stop == stop:
        # a unit that loops over the tiles itself (:func:`~.tile_emit.emit_tile_load`)
        (arm,) = rest[1:]
        assert isinstance(arm, If) and arm.cond == more and not arm.orelse
        return (first, If(more, (*allocs, *arm.then, *frees)), *tokens)
    if isinstance(first, RecvValue) and first.channel == ref and first.stop is None:
        reg, rest = first.reg, rest[1:]
    take = RecvValue(ref, reg, stop)
    loop = until_stop(limit, more, (*rest, take), f"t.{ref}")
    return (take, If(more, (*allocs, *loop, *frees)), *tokens)
