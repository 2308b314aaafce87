"""An expert region's units loop over its chunks until the merge's stop token.

With ``R`` expert regions and static tiling (STeP arXiv 2511.07776 §5.2, §5.3) a region's
EagerMerge takes its experts' tiles of ``N`` rows in the order they are ready
(:mod:`.merge_any`), ``M = sum_e ceil(n_e / N)`` chunks, and every unit after it handles
``[M, ...]`` streams: the same work for each chunk (a full tile, padding rows alike; the
chunk's expert, weight addresses and padding index computed in registers from the selector,
:mod:`.region_values`).  So no unit needs ``M`` when it is built (:class:`RegionGroup`):

* the merge (the group's head) ends its selector stream with a stop token after its last
  chunk, carrying the chunks it sent (STeP §3.2.3, as a Partition ends its outputs);
* every unit of the region (:func:`region_body`) reads that selector channel, a multicast,
  once per chunk: a selector runs the unit's program for one chunk, the token ends its loop
  (:func:`~.tile_loop.tile_body`: a loop until the stop token whose body is the program of
  one chunk, at most the chunk count's bound times), built from a view of the run that holds
  the region's first chunk only (:func:`region_view`); the unit reading the selector itself
  (the expert's index) takes it as its loop's reference;
* the Partition back to the experts keeps its counters across the loop: they are set before
  it and each output's stop token (the count it received) is sent after it.  Only a
  Partition that routes each element by its selector's register does so
  (:func:`routes_at_run_time`); one of control values (the dispatch lanes' chunk counts)
  forwards them as the run's selectors say and keeps the run's unrolled program.

The weight loads (RandomOffChipLoad at the addresses the region computes from the selector)
loop over their addresses instead, until the address unit forwards the merge's stop token
after its last chunk's (:func:`emit_region_load`), so their loads run ahead across the chunks
as the unrolled program's do (a loop per chunk drained the DMA pipeline at every chunk).

The work per chunk is the unrolled program's (STeP §4.2), the only new traffic the stop token
on the selector and address channels.  A unit's bookkeeping in a run
(:meth:`RegionGroup.info`) is its one-chunk program's times ``M``, but the Partition's sends,
which are the run's real rows (its padding output has no reader).  A region that takes no
chunk in a run is built from one chunk of zero tiles of its streams' declared types
(:func:`_blank_view`).

With dynamic tiling (a region's chunk is one expert's rows, a ragged size, STeP (revised)
§3.1) the same loop serves the units that handle a chunk's tiles (``ragged`` groups: the
expert index, weight addresses and loads, the matmuls, activation, repeats and column split,
whose tiles' rows are read at run time, :mod:`.rows`); their bookkeeping in a run is their
program's counted again in each chunk's view and summed (:meth:`RegionPlan.info`).  So do
the units reading the chunk's rows, when the merge ends each chunk's rows with a stop token
carrying their count (a grouped channel, :func:`~.region_rows.chunk_channels`): the Bufferize
of the rows and the packing of its reads (:mod:`.buffer_loop`), the Expand of the chunk's
expert index along its rows (:func:`~.region_rows.emit_expand_loop`), each a loop over one
chunk's rows until its token, inside the loop over the chunks; a view of chunk ``i`` binds
the ragged size's index to ``i``, so their buffers' rows evaluate to that chunk's.  The units
handling the chunk's rows after its tiles (back to rows, the selectors, the Partition) loop
over each chunk's rows as well (``paced``, :mod:`.region_tail`); the merge keeps the run's
program, unrolled in its order; a ragged region that takes no chunk is built from a blank
chunk of one row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import sympy as sp

from lowering.isa import (
    Instr,
    SendValue,
    Set,
)
from torch2step.step.ops_memory import RandomOffChipLoad
from torch2step.step.ops_routing import EagerMerge, Partition

from .buffer_loop import group_tokens
from .context import EmitCtx
from .item_memory import address_loop
from .region_views import chunk_views, region_view
from .streams import _VALUE_DTYPES, StreamInfo, declared_leaves
from .structure import Structure
from .tile_loop import tile_body
from .unit import UnitBuilder

__all__ = [
    "RegionPlan",
    "region_plan",
    "RegionGroup",
    "find_region_groups",
    "routes_at_run_time",
    "region_view",
    "region_body",
    "emit_region_load",
    "chunk_count",
]


def chunk_count(op: EagerMerge) -> str:
    """The register merge ``op`` counts the chunks it sent in (its stop token's value)."""
    return f"chunks.{op.name}"


@dataclass(frozen=True)
class RegionGroup:
    """One statically tiled region: its merge unit ``head`` (selector channel ``ref``), the
    units after it that handle only ``[M, ...]`` streams (``units``; ``partitions``: the
    Partition back to the experts among them), the chunk count ``chunks`` (``M``), ``limit``:
    its bound, ``streams``: the region's streams (the view cuts them to one chunk) and the
    run's chunks (``run_chunks``)."""

    head: int
    ref: str
    chunks: sp.Expr
    units: frozenset[int]
    partitions: frozenset[int]
    limit: int
    streams: tuple[str, ...]
    run_chunks: int = 0
    #: the weight loads (one-node RandomOffChipLoad units reading a member's addresses only):
    #: loops until their address channel's stop token (:func:`emit_region_load`)
    loads: frozenset[int] = frozenset()
    #: per member unit, the address channels it ends with the merge's stop token
    forwards: tuple[tuple[int, tuple[str, ...]], ...] = ()
    #: dynamic tiling: the chunks are ragged (an expert's rows each), the members are the
    #: units handling a chunk's tiles, their rows read at run time (:func:`chunk_views`)
    ragged: bool = False

    @property
    def members(self) -> frozenset[int]:
        """The units built from the one-chunk view (not the head)."""
        return self.units

    def info(self, k: int, info: Any, sent: int) -> Any:
        """Unit ``k``'s bookkeeping (:class:`~.plan.UnitInfo`) in the run from its program's
        for one chunk (module docstring; ``sent``: a Partition's elements sent in the run)."""
        c = self.run_chunks
        return dataclasses.replace(
            info,
            sram_bytes=info.sram_bytes if c else 0,  # its buffers live in the loop's arm
            flops=info.flops * c,
            step_cycles=info.step_cycles * c,
            received=info.received * c,
            sent=sent if k in self.partitions else info.sent * c,
        )


def _outer(t: Any) -> sp.Expr | None:
    shape = getattr(t, "shape", ())
    return sp.sympify(shape[0]) if shape else None


def find_region_groups(
    st: Structure,
    stops: set[str],
    bounds: Mapping[str, int],
    grouped: AbstractSet[str] = frozenset(),
    paced: AbstractSet[str] = frozenset(),
    streams: Mapping[str, StreamInfo] | None = None,
) -> list[RegionGroup]:
    """Every statically tiled region (:class:`RegionGroup`, run counts not yet set): a
    single-node EagerMerge unit of tiles of a static row count, each input's messages from one
    channel ending with a stop token, whose chunk count's symbols have bounds (``bounds``: a
    Partition count's by name), and the units downstream of it all of whose inputs have that
    chunk count as their outer size; a Partition among them only when it routes at run time
    (:func:`routes_at_run_time`, of the run's ``streams`` when given), else it keeps the
    run's unrolled program."""
    graph = st.graph
    outputs = {op.name: outs for op, outs in zip(graph.nodes, graph.node_outputs)}
    values = [v for outs in graph.node_outputs for v in outs]
    order = {v.name: i for i, v in enumerate(values)}
    outer = {v.name: _outer(v.type) for v in values}
    types = {v.name: v.type for v in values}
    out = []
    for h, ops in enumerate(st.units):
        merge = ops[0]
        if len(ops) != 1 or not isinstance(merge, EagerMerge):
            continue
        data, sel = outputs[merge.name]
        m = outer[data.name]
        if (
            m is None
            or m.is_Integer
            or not {x.name for x in m.free_symbols} <= bounds.keys()
            or any(len(v.type.shape) != 2 for v in merge.ins)
            or any(not st.sources(v.name) or not st.sources(v.name) <= stops for v in merge.ins)
        ):
            continue
        # static tiles of N rows, or (dynamic tiling) one ragged chunk of an expert's rows
        ragged = not all(sp.sympify(v.type.shape[1]).is_Integer for v in merge.ins)
        if not ragged and not m.atoms(sp.ceiling):
            continue
        limit = int(m.subs({x: bounds[x.name] for x in m.free_symbols}))
        units: set[int] = set()
        parts: set[int] = set()
        names = {n for n, e in outer.items() if e is not None and e == m}
        for _, k, ins, outs in st.reached((data.name, sel.name), h):
            if k in units:
                continue
            if ragged and not all(_tiles_only(types[n]) for n in ins + outs):
                # a row unit handles a chunk's rows one by one: a member when it loops until
                # the chunk's stop token (each input of rows a grouped channel, .region_rows
                # ``chunk_channels``, or rows taken one per selector of one: ``paced``,
                # .region_tail), or cuts a chunk's tile into rows by a count it receives
                # (``paced`` too), else it keeps the run's unrolled program
                rows = [n for n in ins if not _tiles_only(types[n])]
                looped = {n for n in rows if st.sources(n) and st.sources(n) <= grouped}
                if rows and (not looped or not set(rows) - looped <= paced):
                    continue
                if not rows and not {n for n in outs if not _tiles_only(types[n])} <= paced:
                    continue
            op = st.units[k][0]
            if isinstance(op, Partition) and not routes_at_run_time(op, types, streams):
                continue
            if ins and all(outer[n] == m for n in ins):
                units.add(k)
                if isinstance(op, Partition):
                    parts.add(k)
                    names |= {v.name for v in outputs[st.units[k][0].name]}
        readers = {
            r
            for r, ops in enumerate(st.units)
            for o in ops
            for v in o.inputs()
            if v.name == sel.name
        }
        if units and readers <= units:  # every reader of the selectors loops until the token
            loads, fwd = _loads(st, units)
            region = tuple(sorted(names, key=order.__getitem__))
            out.append(RegionGroup(h, sel.name, m, frozenset(units - loads), frozenset(parts),
                                   limit, region, 0, loads, fwd, ragged))  # fmt: skip
    return out


def routes_at_run_time(
    op: Partition, types: Mapping[str, Any], streams: Mapping[str, StreamInfo] | None = None
) -> bool:
    """Whether Partition ``op`` (``types``: the graph's stream types by name) can loop over a
    region's chunks (:func:`region_body`): its program for one chunk routes each element by its selector's register, counting what each
    output got in a register (:func:`~.emit_routing._routed`), so the loop keeps the counters
    across the chunks and each output's stop token sends the count of the whole run.  That
    needs every element to be received data (a control value, an expert id or a padding flag,
    is forwarded to the outputs the run's selectors name when it is built, and its stop tokens
    carry that chunk's counts): every part of its input's declared type a tile that cannot be
    a ``[1, 1]`` integer one (those travel as control values, :func:`~.streams.element_parts`),
    and of the run's elements (``streams``) every message data, every selector one value."""
    for t in declared_leaves(types[op.input.name].dtype):
        if t is None:  # a selector or buffer reference: a control value
            return False
        one = all(not sp.sympify(d).is_Integer or int(d) == 1 for d in t.shape)
        if t.dtype in _VALUE_DTYPES and one:
            return False
    if streams is None:
        return True
    x, s = streams.get(op.input.name), streams.get(op.sel.name)
    return (
        x is not None
        and s is not None
        and all(p.kind == "data" for pc in x.pieces for _, _, p in pc)
        and all(len(pc) == 1 and pc[0][2].kind == "value" for pc in s.pieces)
    )


def _tiles_only(t: Any) -> bool:
    """That a stream of type ``t`` has one size per chunk (its dimensions after the chunks'
    are integers): its elements are a chunk's tiles, not its rows."""
    return all(sp.sympify(d).is_Integer for d in getattr(t, "shape", ())[1:])


def _loads(st: Structure, units: set[int]) -> tuple[frozenset[int], tuple]:
    """The region's weight loads that loop over their addresses (:func:`emit_region_load`)
    and per address unit the channels it ends with the stop token: a one-node
    RandomOffChipLoad reading one channel of a member that only such loads read."""
    readers: dict[str, set[int]] = {}
    for k, ops in enumerate(st.units):
        own = {o.name for o in ops}
        for o in ops:
            for v in o.inputs():
                if v.name not in own:
                    for ch in st.sources(v.name):
                        readers.setdefault(ch, set()).add(k)
    loads: set[int] = set()
    chans: dict[int, set[str]] = {}
    for k in sorted(units):
        ops = st.units[k]
        if len(ops) != 1 or not isinstance(ops[0], RandomOffChipLoad):
            continue
        src = st.sources(ops[0].raddr.name)
        if len(src) != 1:
            continue
        (ch,) = src
        p = st.unit_index(st.producer[ch].name)
        if p not in units or not all(
            r in units and len(st.units[r]) == 1 and isinstance(st.units[r][0], RandomOffChipLoad)
            for r in readers.get(ch, ())
        ):
            continue
        loads.add(k)
        chans.setdefault(p, set()).add(ch)
    return frozenset(loads), tuple((p, tuple(sorted(c))) for p, c in sorted(chans.items()))


def region_body(
    body: tuple[Instr, ...], group: RegionGroup, k: int, stop_ins: list[str]
) -> tuple[Instr, ...]:
    """Unit ``k``'s program (``body``: for one chunk) looping over the region's chunks until
    the merge's stop token (module docstring); a Partition's counters are set before the loop
    and its stop tokens sent after it, an address unit's weight loads get the token after its
    addresses."""
    partition = k in group.partitions
    head: list[Instr] = []
    tail: list[Instr] = []
    rest = list(body)
    if partition:
        n = 0
        while n < len(rest) and type(rest[n]).__name__ == "Alloc":
            n += 1
        while n < len(rest) and isinstance(rest[n], Set) and str(rest[n].reg).startswith("sent."):
            head.append(rest.pop(n))
        while rest and isinstance(rest[-1], SendValue) and not rest[-1].stop:
            tail.insert(0, rest.pop())
    looped = tile_body(tuple(rest), group.ref, group.limit, stop_ins, [])
    token = f"stop.{group.ref}"
    tail += [SendValue(ch, token, stop=True) for ch in dict(group.forwards).get(k, ())]
    return (*head, *looped, *tail)


def emit_region_load(ctx: EmitCtx, b: UnitBuilder, op: RandomOffChipLoad, bound: int) -> None:
    """A region's weight load as one loop over its addresses until their channel's stop
    token (at most ``bound`` addresses): per address ``RecvValue`` it (with ``stop``), load the
    tile there into the next of ``depth`` rotating buffers and send the tile loaded
    ``depth - 1`` addresses earlier, so loads run ahead across the chunks as the unrolled
    program's do (:func:`~.item_memory.address_loop`, without a token on the tiles: the
    region's units read them per chunk); the last tiles once the token came."""
    (ach,) = ctx.structure.sources(op.raddr.name)
    address_loop(ctx, b, op, ach, bound, "w", token=False)


@dataclass
class RegionPlan:
    """The statically tiled regions of a plan (module docstring): per member unit its group
    and one-chunk view, per weight load its group, and the streams each of them reads its
    channels from."""

    members: dict[int, tuple[RegionGroup, dict[str, StreamInfo]]]
    loads: dict[int, RegionGroup]
    views: dict[int, dict[str, StreamInfo]]
    #: the context of a view (the plan's with the view's streams)
    make_ctx: Callable[..., EmitCtx]
    #: the run's streams
    streams: Mapping[str, StreamInfo]
    #: per region head, the context, run streams and stop tokens its members are built in
    contexts: dict[int, tuple[EmitCtx, Any, dict[str, int]]] = dataclasses.field(
        default_factory=dict
    )
    #: per ragged region's head, each chunk's context and run streams
    chunks: dict[int, list[tuple[EmitCtx, Any]]] = dataclasses.field(default_factory=dict)
    make_run: Callable[[dict[str, StreamInfo]], Any] | None = None
    #: channels with a stop token after each innermost group (:mod:`.buffer_loop`; a ragged
    #: region's chunk rows): a view counts its own
    grouped: frozenset[str] = frozenset()

    def refs(self) -> dict[int, str]:
        """Per member, the selector channel it reads once per chunk."""
        return {k: g.ref for k, (g, _) in self.members.items()}

    def bind(self, tokens: Mapping[str, int], run_streams: Any, make: Any) -> None:
        """Make each region's member context (``make(view)``: the run streams of a view)."""
        self.make_run = make
        for g, view in self.members.values():
            if g.head not in self.contexts:
                # the loop takes the merge's stop token, and forwards it after the addresses
                tok = {**tokens, g.ref: 0} | {ch: 0 for _, chans in g.forwards for ch in chans}
                tok |= {
                    ch: group_tokens(view[ch].value.data, view[ch].value.rank)
                    for ch in self.grouped
                    if ch in view and ch in tokens
                }
                self.contexts[g.head] = (self.make_ctx(view), make(view), tok)

    def context(self, k: int) -> tuple[EmitCtx, Any, dict[str, int]]:
        """Member ``k``'s context, run streams and stop tokens."""
        return self.contexts[self.members[k][0].head]

    def emit(self, ctx: EmitCtx, b: UnitBuilder, k: int, op: Any) -> None:
        """Emit the weight load ``k`` (``op``) as a loop over its addresses."""
        g = self.loads[k]
        per = math.prod(int(d) for d in op.raddr.type.shape[1:])  # addresses per chunk
        emit_region_load(ctx, b, op, (b.bound(g.chunks) or g.limit) * per)

    def info(self, k: int, info: Any, sent: int, entry: Any = None) -> Any:
        """Member ``k``'s bookkeeping in the run (``sent``: a Partition's sends in it); of a
        ragged region's member, its program's (``entry``: :class:`~.unit_reuse._Entry`)
        counted again in each chunk's view and summed (its buffers: the most any held)."""
        g = self.members[k][0]
        if not g.ragged:
            return g.info(k, info, sent)
        views = self.chunks.get(g.head)
        if views is None:
            views = self.chunks[g.head] = [
                (self.make_ctx(v, i), self.make_run(v))
                for i, v in enumerate(chunk_views(g, self.streams))
            ]
        got = [entry.retally(c, r).info for c, r in views]
        return dataclasses.replace(
            info,
            flops=sum(x.flops for x in got),
            step_cycles=sum(x.step_cycles for x in got),
            received=sum(x.received for x in got),
            sent=sum(x.sent for x in got),
            sram_bytes=max((x.sram_bytes for x in got), default=0),
        )

    def depths(self, base: int) -> dict[str, int]:
        """Per region's selector channel, its FIFO depth: every chunk's selector and the stop
        token (``base``: the plan's depth, if deeper)."""
        return {g.ref: max(base, g.limit + 1) for g, _ in self.members.values()}

    def ragged(self, k: int) -> bool:
        """Whether member ``k`` is a ragged region's (its bookkeeping per chunk)."""
        return k in self.members and self.members[k][0].ragged


def region_plan(
    st: Structure,
    ctx: EmitCtx,
    stops: set[str],
    streams: Mapping[str, StreamInfo],
    tokens: dict[str, int],
    bounds: Mapping[str, int],
    grouped: AbstractSet[str] = frozenset(),
    tail: Any = None,
) -> RegionPlan:
    """The statically tiled regions of the run of ``ctx`` whose one-chunk view evaluates: each
    merge is told to end its selectors with the stop token (``ctx.tiled``), which ``tokens``
    counts, as it counts the one each address unit forwards."""
    members: dict[int, tuple[RegionGroup, dict[str, StreamInfo]]] = {}
    loads: dict[int, RegionGroup] = {}
    views: dict[int, dict[str, StreamInfo]] = {}
    paced = tail.paced if tail is not None else frozenset()
    control = tail.control if tail is not None else {}
    for g in find_region_groups(st, stops, bounds, grouped, paced, streams):
        # a chunk's row count for the FlatMap back to rows, one per chunk (.region_tail)
        ctl = tuple(ch for ch, (_, d, _) in control.items() if st.unit_index(d) in g.units)
        g = dataclasses.replace(g, streams=g.streams + ctl)
        view = region_view(st, g, streams)
        if view is None:  # its one-chunk view does not evaluate: the run's programs
            continue
        g = dataclasses.replace(g, run_chunks=ctx.ev(g.chunks, "a region's chunks"))
        ctx.tiled = {**ctx.tiled, st.units[g.head][0].name: g.ref}
        tokens[g.ref] = 1
        tokens.update({ch: 1 for _, chans in g.forwards for ch in chans})
        members.update({k: (g, view) for k in g.units})
        loads.update({k: g for k in g.loads})
        views.update({k: view for k in g.units | g.loads})

    # the types of the ragged regions' streams, each group walked once (members maps every
    # unit of a group to it)
    ragged = {id(g): g for g, _ in members.values() if g.ragged}.values()
    types = [
        v.type
        for g in ragged
        for outs in st.graph.node_outputs
        for v in outs
        if v.name in g.streams
    ]
    # a ragged region's chunk sizes are indexed by the chunk (STeP (revised) §3.1): a view of
    # chunk ``i`` binds the index, so a size of its rows evaluates to that chunk's
    index = sorted({str(x) for t in types for x in getattr(t, "index", ()) if x is not None})
    # (a region the run gives no chunk has no table of chunk sizes: its blank chunk's one row)
    blank = {
        str(x.base): {(0,): 1}
        for t in types
        for d in getattr(t, "shape", ())
        for x in sp.sympify(d).atoms(sp.Indexed)
        if str(x.base) not in ctx.bindings
    }

    def make_ctx(view: dict[str, StreamInfo], i: int = 0) -> EmitCtx:
        if not index:
            return dataclasses.replace(ctx, streams=view, region=True)
        env = {**ctx.bindings, **blank, **dict.fromkeys(index, i)}
        return dataclasses.replace(ctx, streams=view, bindings=env, region=True)

    return RegionPlan(members, loads, views, make_ctx, streams, grouped=frozenset(grouped))
