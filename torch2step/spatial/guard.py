"""An expert's units learn at run time whether it has tokens: one program for every routing.

With dynamic tiling (STeP arXiv 2511.07776 §5.2) an expert's Bufferize keeps its rows in one
buffer, a ``[P_e]`` stream of buffer references with ``P_e = [n_e > 0]``, and every unit after
it handles ``[P_e, ...]`` streams: one element per ``tile_i`` block when the expert has tokens,
nothing when it has none.  The Bufferize takes the Partition's stop token (its count) before
any of those units receives its first element, so it tells them ``P_e`` ahead of their data
(:class:`ExpertGuard`):

* it sends its buffer reference when the count is not zero, else the stream's stop token
  (``SendValue`` with ``stop``) — one message on the reference's channel either way, which
  every unit of the expert reads (a multicast, the weight loads and the Repeat of the
  reference among them);
* each such unit starts with ``RecvValue(ref, v, stop=s)`` (:func:`guard_body`): a reference
  (``s < 0``) runs its program, built for an expert with tokens; the stop token runs only the
  guard's other arm, which takes the stop tokens that reach the unit also on an empty stream
  (a Partition's, forwarded by the routing weights' units) and forwards them.

So the programs are the same whether or not an expert gets a token.  For a run that gives an
expert none they are built from stand-ins of its streams (:func:`standin_streams`): the
streams as one token would make them (their sizes evaluated with the count at 1), whose
elements' forms (one element per block, tiles whose rows the program reads at run time) are
those of any count; the unit's bookkeeping in that run is then nothing but the bytes its
buffers hold (:func:`empty_info`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy as sp

from lowering.isa import Alloc, Cond, Free, If, Instr, RecvValue, SendValue
from torch2step.step.ops_memory import Bufferize, LinearOffChipLoad
from torch2step.step.types import BufferType, DataType, TileType, TupleType
from torch2step.step.values import BufferValue, StreamValue

from .streams import WIRE_RULES, StreamInfo, flat_elements, unit_pieces
from .structure import Structure

__all__ = [
    "ExpertGuard",
    "find_guards",
    "standin_streams",
    "guard_body",
    "head_body",
    "empty_info",
]


@dataclass(frozen=True)
class ExpertGuard:
    """One expert's Bufferize unit ``head`` (its reference stream ``ref``, of ``present``
    elements: ``P_e``), the units after it that handle only ``[P_e, ...]`` streams
    (``units``) and the streams built as one token makes them when it has none
    (``streams``, in graph order)."""

    head: int
    ref: str
    present: sp.Expr
    units: frozenset[int]
    streams: tuple[str, ...]

    @property
    def members(self) -> frozenset[int]:
        """The head and the guarded units."""
        return self.units | {self.head}


def find_guards(st: Structure, grouped: set[str]) -> list[ExpertGuard]:
    """Every expert's guard: a rank-1 Bufferize unit whose Streamify reads end with stop tokens
    (:func:`~.buffer_loop.grouped_channels`) and the units downstream of it all of whose
    streams have sizes of its ``P_e``."""
    graph = st.graph
    outputs = {op.name: outs for op, outs in zip(graph.nodes, graph.node_outputs)}
    values = [v for outs in graph.node_outputs for v in outs]
    order = {v.name: i for i, v in enumerate(values)}
    # per stream, the ``[n > 0]`` conditions its sizes use
    conds = {
        v.name: frozenset(a for d in v.type.shape for a in sp.sympify(d).atoms(sp.Piecewise))
        for v in values
    }
    out = []
    for h, ops in enumerate(st.units):
        head = ops[0]
        if not isinstance(head, Bufferize) or not any(s.name in grouped for s in ops[1:]):
            continue
        present = sp.sympify(outputs[head.name][0].type.shape[0])
        if not isinstance(present, sp.Piecewise):
            continue
        units: set[int] = set()
        for _, k, ins, outs in st.reached((v.name for op in ops for v in outputs[op.name]), h):
            if k not in units and ins and all(present in conds[n] for n in ins + outs):
                units.add(k)
        names = {v.name for v in values if present in conds[v.name]}
        # the Bufferize's input as one token makes it: the Partition's output and its wires
        src = head.input.name
        while src in st.producer:
            names.add(src)
            op = st.producer[src]
            if op.name in st.owner:
                break
            src = op.inputs()[0].name
        streams = tuple(sorted(names, key=order.__getitem__))
        if units:
            out.append(ExpertGuard(h, head.name, present, frozenset(units), streams))
    return out


def standin_streams(
    st: Structure,
    guard: ExpertGuard,
    streams: Mapping[str, StreamInfo],
    bindings: Mapping[str, Any],
) -> dict[str, StreamInfo] | None:
    """The guard's streams as the run would make them with the expert's count at 1
    (``bindings``), zero tiles of their declared types; ``None`` when a size or type does not
    evaluate."""
    env = {k: v for k, v in bindings.items() if isinstance(v, int)}
    types = {v.name: v.type for outs in st.graph.node_outputs for v in outs}
    out: dict[str, StreamInfo] = {}
    for name in guard.streams:
        t = types[name]
        try:
            dims = [_ev(d, env) for d in t.shape]
        except (TypeError, ValueError):
            return None
        data = _nest(dims, lambda t=t: _zeros(t.dtype, env))
        value = StreamValue(t.rank, data)
        flat = flat_elements(value)
        op = st.producer[name]
        if op.name in st.owner:
            pieces = unit_pieces(name, t.dtype, flat)
            out[name] = StreamInfo(name, t.dtype, value, flat, pieces, name)
            continue
        if any(v.name not in out for v in op.inputs()):
            continue  # a wire of streams the guard does not make (read by no member)
        ins = [out[v.name] for v in op.inputs()]
        rule = WIRE_RULES.get(type(op))
        if rule is None:
            return None
        try:
            (pieces,) = rule(op, ins, [value], None)
        except Exception:
            return None
        out[name] = StreamInfo(name, t.dtype, value, flat, pieces)
    return out


def _ev(expr: Any, env: Mapping[str, int]) -> int:
    """A size's value with the symbols (by name) bound by ``env``."""
    e = sp.sympify(expr)
    return int(e.subs({x: env[x.name] for x in e.free_symbols}))


def _nest(dims: list[int], make: Any) -> list:
    if len(dims) == 1:
        return [make() for _ in range(dims[0])]
    return [_nest(dims[1:], make) for _ in range(dims[0])]


def _zeros(t: DataType, env: Mapping[str, int]) -> Any:
    if isinstance(t, TileType):
        shape = tuple(_ev(d, env) for d in t.shape)
        return np.zeros(shape, np.int64 if t.dtype.startswith("int") else np.float32)
    if isinstance(t, TupleType):
        return tuple(_zeros(e, env) for e in t.elems)
    if isinstance(t, BufferType):
        rows = [_ev(d, env) for d in t.shape]
        data = _nest(rows, lambda: _zeros(t.elem, env))
        return BufferValue(data, sum(x.nbytes for x in flat_nested(data)))
    raise TypeError(f"no stand-in element of type {t}")


def flat_nested(data: list) -> list:
    """The leaves of nested lists."""
    out: list = []
    for x in data:
        out.extend(flat_nested(x) if isinstance(x, list) else [x])
    return out


def guard_body(
    body: tuple[Instr, ...], ref: str, stop_ins: list[str], stop_outs: list[str]
) -> tuple[Instr, ...]:
    """A guarded unit's program: ``RecvValue(ref, v, stop=s)`` (its own first receive of the
    reference, if it reads it) and ``If(s < 0, program, tokens)``, the program's buffers
    allocated and freed in its arm, the other arm taking the stop tokens of ``stop_ins``
    (which come also on an empty stream) and forwarding the one it reads to ``stop_outs``
    (module docstring)."""
    n = 0
    while n < len(body) and isinstance(body[n], Alloc):
        n += 1
    allocs, rest = body[:n], body[n:]
    stop = f"stop.{ref}"
    first = rest[0] if rest else None
    if isinstance(first, RecvValue) and first.channel == ref and first.stop is None:
        take, rest = RecvValue(ref, first.reg, stop), rest[1:]
    else:
        take = RecvValue(ref, f"ref.{ref}", stop)
    tokens: list[Instr] = [RecvValue(ch, f"stop.{ch}") for ch in stop_ins]
    if stop_outs:
        (src,) = stop_ins
        tokens += [SendValue(ch, f"stop.{src}") for ch in stop_outs]
    # its buffers live in the arm that uses them: an expert without tokens holds none
    frees = tuple(Free(a.buf) for a in allocs)
    return (take, If(Cond(stop, "<", 0), (*allocs, *rest, *frees), tuple(tokens)))


def head_body(body: tuple[Instr, ...], ref: str) -> tuple[Instr, ...]:
    """The Bufferize's program with the stop token (the count, zero) sent on its reference's
    channel when the buffer holds no row (the other arm of its last ``If(stop > 0, ...)``,
    :func:`~.buffer_loop.emit_buffer_loop`)."""
    out = list(body)
    for i in range(len(out) - 1, -1, -1):
        x = out[i]
        c = getattr(x, "cond", None)
        if isinstance(x, If) and c.op == ">" and c.rhs == 0 and not x.orelse:
            out[i] = dataclasses.replace(x, orelse=(SendValue(ref, c.lhs, stop=True),))
            return tuple(out)
    raise AssertionError(f"no guard on the count in the program of the buffer %{ref}")


def empty_info(info: Any) -> Any:
    """A guarded unit's bookkeeping (``info``, :class:`~.plan.UnitInfo`) in a run that gives
    its expert no token: no element, step, FLOP or buffer (its buffers are allocated in the
    arm it does not run, :func:`guard_body`; the Bufferize's rows are held, none)."""
    return dataclasses.replace(info, flops=0, step_cycles=0, sram_bytes=0, received=0, sent=0)


@dataclass
class Views:
    """The guards of a plan and the view of the run their members are built from: ``ctx`` /
    ``streams`` / ``tokens`` (stop tokens per channel) with the streams of every expert that
    gets no token (``empty``: its guard) made as one token would (:func:`standin_streams`),
    and of every statically tiled expert as one full tile makes them (``tiles``,
    :mod:`.tile_loop`); ``members``: the units built from that view."""

    guards: list[Any]
    empty: list[ExpertGuard]
    ctx: Any
    streams: dict[str, StreamInfo]
    tokens: dict[str, int]
    members: frozenset[int]
    tiles: list[Any] = dataclasses.field(default_factory=list)
    #: per control channel of a tile group (:func:`~.tile_loop.tile_channel`), its head unit
    control: dict[str, int] = dataclasses.field(default_factory=dict)
    #: per unit reading a stream of the view otherwise (a weight load of a packed tile reads
    #: its control channel as its reference), its streams
    overrides: dict[int, dict[str, StreamInfo]] = dataclasses.field(default_factory=dict)

    def streams_of(self, k: int, run: dict[str, StreamInfo]) -> dict[str, StreamInfo]:
        """The streams unit ``k`` is built from (``run``: the run's)."""
        if k in self.overrides:
            return self.overrides[k]
        return self.streams if k in self.members else run

    def ctx_of(self, k: int) -> Any:
        """The context unit ``k`` (a member) is built in."""
        if k in self.overrides:
            return dataclasses.replace(self.ctx, streams=self.overrides[k])
        return self.ctx

    @property
    def ref_tokens(self) -> dict[str, int]:
        """The stop tokens on buffer references' channels in the run: an empty expert's, and
        the one ending every tile group's references."""
        return {g.ref: 1 for g in self.empty} | {g.ref: 1 for g in self.tiles}

    def depth(self, ch: str, depth: int | None, base: int) -> int | None:
        """Channel ``ch``'s FIFO depth (``depth``: the plan's, ``base`` its value): a tile
        group's rows channel holds a tile more, the rows of the next tile that its head
        receives once the current one is read (:func:`~.tile_emit.emit_tile_buffer`)."""
        more = max((g.size for g in self.tiles if ch == g.rows_in), default=0)
        return base + more if more else depth

    def _tile(self, k: int) -> Any:
        return next((g for g in self.tiles if k in g.members), None)

    def prepare(self, k: int, b: Any) -> None:
        """Before unit ``k`` is emitted: a unit of a tile group loops at most the group's
        ``limit`` times, which follows the count's bound (recorded with its program)."""
        g = self._tile(k)
        if g is not None and k != g.head:
            b.bound(g.count)

    def info(self, k: int, info: Any) -> Any:
        """Unit ``k``'s bookkeeping in the run from that of its program in the view."""
        g = self._tile(k)
        if g is not None:
            return g.info(k, info)
        return empty_info(info) if k in self.members else info

    def wrap(
        self, k: int, body: tuple[Instr, ...], stop_ins: list[str], stop_outs: list[str]
    ) -> tuple[Instr, ...]:
        """Unit ``k``'s program (a head or a guarded unit) with its guard: a dynamic head's
        stop token (:func:`head_body`), a guarded unit's arms (:func:`guard_body`), a tile
        group's loop over the tiles (:func:`~.tile_loop.tile_body`; its head loops itself)."""
        from .tile_loop import tile_body

        g = self._tile(k)
        if g is not None:
            return body if k == g.head else tile_body(body, g.ref, g.limit, stop_ins, stop_outs)
        for d in self.guards:
            if d.head == k:
                return head_body(body, d.ref)
            if k in d.units:
                return guard_body(body, d.ref, stop_ins, stop_outs)
        return body


def views(
    st: Structure, ctx: Any, grouped: set[str], stops: set[str], tokens: dict[str, int]
) -> Views:
    """:class:`Views` of the run of ``ctx`` (``grouped``: the channels with a stop token per
    read, :func:`~.buffer_loop.grouped_channels`; ``stops``: those ending with one).  For the
    tile groups (:mod:`.tile_loop`) it sets ``ctx.tiled``, adds each packing head's control
    stream to ``ctx.streams`` and takes that head's tiles' channel out of ``stops`` and
    ``tokens`` (the stop token moves to the control channel)."""
    from .buffer_loop import group_tokens
    from .plan import count_bounds
    from .tile_loop import control_stream, find_tile_groups, group_reads, tile_view, value_types

    guards = find_guards(st, grouped)
    empty = [g for g in guards if ctx.ev(g.present, "an expert's buffers") == 0]
    bindings = dict(ctx.bindings)
    for g in empty:
        bindings.update({s.name: 1 for s in g.present.free_symbols})
    full = dict(ctx.streams)
    made = []
    for g in empty:
        extra = standin_streams(st, g, full, bindings)
        if extra is not None:
            full.update(extra)
            made.append(g)
    # an expert whose streams cannot be made so keeps the programs of its run (unguarded)
    guards = [g for g in guards if g in made or g not in empty]
    tiles = []
    found = find_tile_groups(st, stops, count_bounds(ctx)) if not guards else []
    types = value_types(st) if found else {}
    for t in found:
        c = ctx.ev(t.tiles, "an expert's tiles")
        pads = c * t.size - ctx.ev(t.count, "an expert's rows")
        extra = tile_view(st, t, full, bindings, types)
        if extra is not None:
            full.update(extra)
            tiles.append(dataclasses.replace(t, run_tiles=c, run_pads=pads))
    tiles = [dataclasses.replace(t, reads=group_reads(st, t, full)) for t in tiles]
    control: dict[str, int] = {}
    overrides: dict[int, dict[str, StreamInfo]] = {}
    for t in tiles:
        if t.ref in st.producer:  # a Bufferize's references
            continue
        # a head packing its tile sends each tile's real rows on a channel of its own, then
        # the stop token there: the tiles' channel ends with none (.tile_loop)
        head = st.units[t.head][0].name
        stops.discard(head)
        tokens.pop(head, None)
        n = ctx.ev(t.count, "an expert's rows")
        ctx.streams[t.ref] = control_stream(
            t.ref, [min(t.size, n - i * t.size) for i in range(t.run_tiles)]
        )
        full[t.ref] = control_stream(t.ref, [t.size])
        control[t.ref] = t.head
        # a weight load whose reference is the packed tile takes the control message instead
        # (STeP §3.2.1: a load reads its reference stream only for its elements' count)
        for k in t.units:
            (op, *more) = st.units[k]
            if more or not isinstance(op, LinearOffChipLoad) or op.ref is None:
                continue
            if op.ref.name == head and [v.name for v in op.inputs()] == [head]:
                mine = dict(full)
                mine[head] = dataclasses.replace(
                    full[head], pieces=full[t.ref].pieces, channel=None, _parts=None, _decl=None
                )
                overrides[k] = mine
    if not made and not tiles:
        return Views(guards, [], ctx, ctx.streams, tokens, frozenset())
    ctx.tiled = {n: t.ref for t in tiles for n in _tile_names(st, t)}
    fctx = dataclasses.replace(ctx, streams=full, bindings=bindings)
    ftok = {ch: 1 for ch in stops} | {
        ch: group_tokens(full[ch].value.data, full[ch].value.rank) for ch in grouped
    }
    for t in tiles:  # the stop tokens a tile loop takes after its loop: not its program's
        for k in t.units:
            for o in st.units[k]:
                for v in o.inputs():
                    chans = {c for pc in full[v.name].pieces for c, _, _ in pc}
                    ftok.update({ch: 0 for ch in chans & stops})
                if o.name in stops:
                    ftok[o.name] = 0
    members = frozenset(k for g in made for k in g.members) | frozenset(
        k for t in tiles for k in t.members
    )
    return Views(guards + tiles, made, fctx, full, ftok, members, tiles, control, overrides)


def _tile_names(st: Structure, t: Any) -> list[str]:
    """The node names of a tile group's units and packers (``EmitCtx.tiled``)."""
    return [o.name for k in t.members for o in st.units[k]] + sorted(t.packers)
