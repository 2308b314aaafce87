"""From a STeP graph and one run of it to placed per-core programs (the spatial plan).

``build_plan(graph, chip, run)``:

1. classify nodes into units and wires (:mod:`.structure`);
2. turn the run's stream contents into messages (:mod:`.streams`);
3. emit every unit's program with the emitter of its operator class (``EMITTERS``: one table
   from operator class to emitter, STYLE.md) — programs name channels and HBM tensors, not
   cores;
4. place the units, each on cores enough for the bytes its buffers hold in this run
   (:mod:`.placement`);
5. bind channels (one per unit-produced stream that another unit reads, multicast to all of
   them, FIFO depth ``fifo_depth`` or the core's), the completion-token channels and fences
   of off-chip read-after-write dependences (:mod:`.hazards`) and HBM tensors
   (:mod:`.context`); a channel that deadlocks the run is deepened when simulating
   (:mod:`.fifos`), for which ``SpatialPlan.messages`` / ``message_bytes`` count each
   channel's traffic.

The programs are the graph's operators specialised to the structure of this run's streams
where a unit's loops follow it, and run-independent where a unit reads its control values and
sizes at run time.  The routing operators decide from data at run time (STeP §3.2.3), so their
programs are the same for every routing of the same tokens:

* the selector unit (Map ``to_selector``) reads the expert ids of each token from the tile it
  receives into registers and computes the k-hot mask it sends (:mod:`.control`; integer
  tensors and the messages forwarding them carry their values in timing mode too:
  ``SpatialPlan.inputs``), when no node stores an integer tensor (a router that stores its
  top-k ids computes them in a unit step, which the simulator times but does not execute);
* Partition (:mod:`.emit_routing`) reads each selector into a register and decides its outputs
  at run time, and ends every output with a stop token carrying the count it sent, so its
  outputs' channels exist (and are read) even when a run routes nothing to them;
* Reassemble over one-element chunks reads each selector into a register and takes the next
  element of every selected input, in input order, under ``If`` (so it reads every input's
  channel);
* a control value a unit forwards (Repeat, Expand...) is sent from the register it was
  received into, and one loaded as a ``[1, 1]`` integer tile is read from the loaded buffer.

The elements a run takes through those run-time decisions (a Partition's sends, a Reassemble's
selected inputs) are not part of their programs: each run's are counted from its streams
(:data:`~.unit_reuse.Tally`), as are the messages and bytes each channel carries
(``SpatialPlan.messages`` / ``message_bytes``).

A unit step on a tile whose declared rows are dynamic (an expert's ``[n_e, ...]`` tiles, a KV
tile) is timed from the rows of the tile it receives: its ``step_unit`` Compute carries a row
rule (:mod:`.rows`), cycles and output sizes as ``a*rows + c`` of that tile's run-time rows
(a FlatMap's column pieces of such a tile too).  A tile whose rows are a Partition's count is
held in a buffer allocated at the count's bound (:func:`count_bounds`: the selectors routed,
the tokens of an MoE), ``Alloc.held``: the simulator counts against the core's SRAM what the
buffer held at most, so the on-chip bytes reported (``UnitRecord.sram_bytes``, the cores'
simulated peaks) are the run's, not the bound's (dynamic tiling, STeP §5.2), and placement
takes the bytes this run holds.  Such a unit's program is the same for every token count; its
FLOPs, step cycles and bytes in a run follow from its row rules and buffers
(:class:`~.sizing.Sizing`).

A unit that handles every element of a Partition's output alike (the routing weights' Map of
each expert) loops until the output's stop token (:mod:`.stop_loop`): a ``Loop`` bounded by the
count's bound, its body guarded by ``If(stop < 0)`` over ``Recv(..., stop=reg)``, so its program
is the same for every count; a single-unit Map of such a stream forwards the stop token (the
count) after its last element, so the ``retile_row`` Accum that packs the routing weights into
a column loops until it too: its tile grows one row per element (a row rule on the
accumulator), in a buffer held at the bound, and is sent once the token came, followed by the
token.  The scaling Map forwards it, and the FlatMap back to rows loops ``Loop(count=stop)``
over the count it carries.  Their elements, cycles and FLOPs in a run are counted from the
run's streams (:data:`~.unit_reuse.Tally`).

An expert's Bufferize (one buffer of its rows, ``[P_e, N_e]``) loops until the Partition's
stop token too (:mod:`.buffer_loop`): row ``i`` lands in the ``i``-th of ``bound`` one-row
buffers allocated held, each Streamify read of the buffer loops ``Loop(count=stop)`` over the
rows and ends with the count as a stop token (its channel carries one token per read:
:func:`~.buffer_loop.grouped_channels`), and the ``retile_row`` Accum packing each read into
the expert's tile loops until that token (:func:`~.stop_loop.emit_pack_loop`).  So every unit
of an expert is one program for every token count that is not zero.

Whether an expert gets a token at all (``P_e = [n_e > 0]``) is decided at run time too
(:mod:`.guard`): the Bufferize sends its buffer reference, or when it holds no row the
stream's stop token, which every unit after it reads with a ``RecvValue`` with ``stop`` ahead
of its data (the same cycles) and runs its program or only the guard's other arm; for a run
that gives an expert no token its units are built as one token would make them, and the
routing weights' Map and packing from the stream's declared types
(:func:`~.stop_loop.declared_element`).  So every unit of an MoE is one program for every
routing of the same tokens (with dynamic tiling).

Static tiling's tile count and padding (STeP §5.2) are decided at run time too
(:mod:`.tile_loop`): an expert's Bufferize loops over its tiles until the Partition's stop
token (at most ``ceil(bound / N) + 1`` times), sends each tile's reference with the tile's real
rows as its value and then the token on the reference's channel; every unit after it loops,
reading that channel once per tile, over its program for one full tile (built from a view of
the run in which the expert has ``N`` rows), and ends its loop at the token (``C_e = 0``: the
token only, :mod:`.guard`'s other arm); the routing weights' packing loops until its own
input's token and the FilterPadding keeps row ``j`` of a tile while ``j`` is below the
reference's value.  A tile packed once (``repeat_tile``) is packed by a loop that sends each
tile's real rows and then the token on a control channel of its own, read as the references.
(Without a tile group, the unrolled units of :mod:`.static_pad` take the last tile's padding
from the token's count.)

Decode attention's KV-tile units read the KV lengths at run time (:mod:`.kv_loop`,
:mod:`.kv_tiles`): the cursor Scan computes each ``[row_base, n, stride]`` in registers and
writes it into the tile it sends (``WriteValue``); the address FlatMap reads it back, sends the
request's tile count ahead of its ``(row, r)`` runs (one more message per request:
:func:`~.kv_loop.headed_channels`) and loops ``ceil(n / tile)`` times; the K and V loads
(pipelined across requests), the query's Expand and the online softmax loop over that count,
their tiles held in buffers of ``tile_kv`` rows (``Alloc.held``), the softmax timed by row
rules; Repeat, a region's Partition and a lane's ``lane_keep`` forward the cursor tiles they
receive.  Which lane or region takes each request is decided at run time too (STeP §5.4): the
``lane_pick`` Scan keeps the lanes' loads in registers and writes its argmin into the state
tile (:mod:`.lane_pick`), ``lane_keep`` sends a cursor under ``If`` on the decided lane and ends
its items with a stop token, as a region's Partition does, and every unit of a lane or region
loops until that token (:mod:`.item_loop`: bounded by the layer's items, the token forwarded),
so its program is the same for every assignment, the dynamic one decided in simulated time
included.  The lengths must be loaded from an integer tensor no node stores
(:func:`~.kv_loop.lengths_carry_values`; otherwise the addresses are the run's literals).  A Map
sending tiles only (the rotary Map) takes a control value (a position) into a register no
instruction reads: one program for every value.

With expert regions (§5.3) a region computes its expert id and weight-tile addresses in
registers from its EagerMerge's selector (:mod:`.region_values`), holds its tiles of a
chunk's rows at the experts' token bound, and each expert's chunk and scaling loop until the
Partition's stop token (:mod:`.region_rows`); with static tiling the merge takes whichever
expert's tile arrived first in simulated time (``WaitAny``, :mod:`.merge_any`), ends its
selectors with a stop token (the chunks it sent), and every unit of the region loops over the
chunks until it (:mod:`.region_loop`): each program is built for one chunk from a view of the
run holding the region's first, a selector taken per chunk, the Partition back to the experts
keeping its counters across the loop; the weight loads loop over their addresses until the
address unit forwards the token, so their loads run ahead across chunks.

With dynamic tiling the units of a region handling a chunk's tiles loop over the chunks alike
(their tiles' rows read at run time, their bookkeeping counted in each chunk's view and
summed, :mod:`.region_loop`).

With dynamic tiling the units of a region handling a chunk's rows loop too: the Bufferize,
its row packing and the selector Expand until the stop token the merge ends each chunk's rows
with (:mod:`.region_rows`), the selector Map and the Partition back until the token the
Expand forwards, and the FlatMap back to rows over the count the Expand sends it
(:mod:`.region_tail`).

With the routing weights applied in the region, the rows' parts, the expert ids along them
and the weights picked and packed per chunk loop alike.  A region's merge takes whichever
expert's chunk is ready (``WaitAny``, :mod:`.merge_any`), but when its rows carry the routing
data: that merge is what is still baked from the run (unrolled over its chunks in its
order).  :mod:`.reuse` therefore keys a plan by the run's control
signature, and ``Program.report`` re-plans only for a new one; a re-plan takes, unit by unit,
the programs of earlier runs that the new run does not change (:mod:`.unit_reuse`: each unit's
program is kept with what its emitter read of the run, at the level its program depends on
it), so a new routing emits no unit again with dynamic or static tiling (:mod:`.tile_loop`);
a new KV-length set none, under every attention strategy (lanes, regions with a static or the
dynamic assignment); a new chunk order (decided in simulated time, :mod:`.dynamic`) or chunk
count of statically tiled regions none (a region without a chunk: its units built from one
chunk of zero tiles of the declared types); with dynamic tiling none either, but the merges
of the regions whose rows carry the routing data.

An EagerMerge sends each chunk's selector only after the chunk's first element arrived, so the
units its selector steers start with the data, whatever order they follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy as sp

from hwmodel.chip import Chip
from hwmodel.presets import load_chip
from lowering.isa import Channel, Program, ProgramSet, TensorDecl
from runtime.engine import gc_paused
from torch2step.errors import LoweringError
from torch2step.step.graph import Program as StepProgram
from torch2step.step.interpreter import RunResult
from torch2step.step.ops_memory import RandomOffChipLoadRows
from torch2step.step.ops_routing import Partition, Reassemble
from torch2step.step.ops_shape import Expand

from .buffer_loop import group_tokens, grouped_channels
from .context import EmitCtx, int_contents, tensor_layouts
from .emit_compute import EMITTERS as _COMPUTE
from .emit_memory import EMITTERS as _MEMORY
from .emit_routing import EMITTERS as _ROUTING
from .emit_routing import runtime_reassemble
from .emit_shape import EMITTERS as _SHAPE
from .guard import views
from .hazards import fence_group, offchip_deps, token_channel
from .item_loop import looped_channels
from .item_memory import item_emitters
from .kv_loop import headed_channels
from .kv_tiles import expand_emitter
from .placement import Placement, place_structure
from .region_loop import region_body, region_plan
from .region_rows import chunk_channels, chunk_stops
from .region_tail import row_units
from .region_values import ragged_bounds
from .static_pad import counted_rows
from .stop_loop import forwards_stop
from .streams import StreamInfo, build_streams, stream_bytes
from .structure import DEFAULT_WIRES, analyse
from .tile_loop import control_stream
from .timing import TimingModel, UnitConfig, simulation_chip
from .unit import UnitBuilder, check_unit_io
from .unit_reuse import FORM, ROWS, Deps, RunStreams, UnitCache, looser
from .unit_reuse import _Entry as Entry

__all__ = ["EMITTERS", "UnitInfo", "SpatialPlan", "build_plan", "count_bounds"]

#: Operator class -> emitter of the program of a unit whose primary node has that class.
EMITTERS = {
    **_MEMORY,
    **_COMPUTE,
    **_ROUTING,
    **_SHAPE,
    # decode attention's query Expand loops over each request's tile count (.kv_loop)
    Expand: expand_emitter(_ROUTING[Expand]),
    # a lane's or region's units loop until its items' stop token (.item_loop)
    **item_emitters({**_MEMORY, **_ROUTING}),
}


@dataclass(frozen=True, slots=True)
class UnitInfo:
    """What program generation knows of a unit: its FLOPs in this run, the cycles its unit
    steps take (without waiting), its buffers' bytes and the elements it received and sent."""

    name: str
    kinds: tuple[str, ...]
    flops: int
    step_cycles: int
    sram_bytes: int
    received: int
    sent: int


@dataclass(frozen=True)
class SpatialPlan:
    """Placed programs of one graph and run: ``programs`` run on ``sim_chip`` (``chip`` as
    :func:`~.timing.simulation_chip` adapts it); ``messages`` / ``message_bytes``: per channel,
    the messages and bytes it carries in this run; ``inputs``: the HBM contents the programs
    read as control data (the run's integer tensors, in layout order)."""

    graph: StepProgram
    chip: Chip
    sim_chip: Chip
    placement: Placement
    programs: ProgramSet
    units: tuple[UnitInfo, ...]
    messages: dict[str, int]
    message_bytes: dict[str, int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def flops(self) -> int:
        """FLOPs of all tile functions in this run."""
        return sum(u.flops for u in self.units)


def _channels_of(info: StreamInfo) -> set[str]:
    if info.channel is not None:
        return {info.channel} if info.pieces else set()
    return {ch for pcs in info.pieces for ch, _, _ in pcs if ch is not None}


def count_bounds(ctx: EmitCtx) -> dict[str, int]:
    """Per chunk-count symbol of a Partition (an expert's token count), its bound: the
    selectors the Partition routes by (each sends a chunk to an output at most once: the
    tokens, for an MoE's router), so a buffer of tiles whose rows are that count can be
    allocated once for every routing of those tokens; and per ragged row count of a
    RandomOffChipLoadRows (a KV tile's rows, by the name of its indexed base), the op's tile
    rows."""
    out: dict[str, int] = {}
    for op in ctx.structure.graph.nodes:
        if isinstance(op, Partition) and op.name in ctx.structure.owner:
            n = len(ctx.streams[op.sel.name].flat)
            for sym in op.counts():  # the first Partition naming it: the router's
                out.setdefault(sym.name, n)  # (a region's names its experts' counts again)
        elif isinstance(op, RandomOffChipLoadRows):  # a KV tile: at most the op's tile rows
            (t,) = op.out_types()
            rows = sp.sympify(t.dtype.shape[0])
            if isinstance(rows, sp.Indexed):  # one count per address (a ragged size)
                out[str(rows.base)] = int(op.tile.shape[0])
            elif isinstance(rows, sp.Symbol):
                out[rows.name] = int(op.tile.shape[0])
    out.update(ragged_bounds(ctx.structure.graph, out))  # a region's chunks (§5.3)
    return out


def build_plan(
    graph: StepProgram,
    chip: Chip | str,
    run: RunResult,
    *,
    configs: Mapping[str, UnitConfig] | None = None,
    walk: str = "hilbert",
    wires: Iterable[str] = DEFAULT_WIRES,
    fifo_depth: int | None = None,
    units: UnitCache | None = None,
) -> SpatialPlan:
    """Placed per-core programs for ``graph`` on ``chip`` driven by ``run`` (see the module
    docstring).  ``configs`` maps node names to :class:`UnitConfig`; ``units``: unit programs
    of earlier runs, taken as they are where this run is the same for them (and this run's
    new ones kept), :mod:`.unit_reuse`.

    The cyclic garbage collector is paused meanwhile: generation allocates many small acyclic
    objects, and every collection would rescan the run's large stream contents."""
    with gc_paused():
        return _build_plan(graph, load_chip(chip), run, configs, walk, wires, fifo_depth, units)


def _build_plan(
    graph: StepProgram,
    c: Chip,
    run: RunResult,
    configs: Mapping[str, UnitConfig] | None,
    walk: str,
    wires: Iterable[str],
    fifo_depth: int | None,
    units: UnitCache | None = None,
) -> SpatialPlan:
    wires = tuple(wires)
    st = analyse(graph, wires)
    streams = build_streams(st, run)
    timing = TimingModel(c)
    ctx = EmitCtx(st, streams, timing, run.bindings, tensor_layouts(graph, run), configs or {})
    unit_of_chan = {
        name: st.unit_index(op.name) for name, op in st.producer.items() if op.name in st.owner
    }
    # a Partition's outputs end with a stop token (STeP §3.2.3): their channels exist, and
    # are read, whether or not this run routes an element to them
    stops = {
        name
        for name, op in st.producer.items()
        if isinstance(op, Partition) and op.name in st.owner
    }
    # a single-node unit of a Map, or of a retile_row Accum, reading one such stream forwards
    # its stop token (:mod:`.stop_loop`)
    for op in graph.nodes:
        if st.owner.get(op.name) == op.name and len(st.units[st.unit_index(op.name)]) == 1:
            if forwards_stop(op, st.sources(op.input.name) if hasattr(op, "input") else (), stops):
                stops.add(op.name)
    stops |= counted_rows(graph, st, stops)  # static tiling's counts (.static_pad)
    stops |= chunk_stops(graph, st, stops)  # an expert's chunk for its region (.region_rows)
    # a Streamify reading an expert's buffer ends each read with a stop token (its count),
    # for the retile_row Accum after it to loop until (:mod:`.buffer_loop`)
    grouped = grouped_channels(graph, st, stops)
    grouped |= chunk_channels(graph, st, stops)  # a ragged region's chunks (.region_rows)
    # and its units after the tiles loop over each chunk's rows: the indices and selectors
    # end each chunk with a token, its count goes to the FlatMap back to rows (.region_tail)
    tail = row_units(graph, st, grouped)
    grouped |= tail.grouped
    for ch, (src, _, data) in tail.control.items():
        streams[ch] = control_stream(ch, [len(c) for c in streams[data].value.data])
        unit_of_chan[ch] = st.unit_index(src)
    # decode attention's KV-tile addresses and query copies follow each request's count
    headed = headed_channels(graph, st)
    ctx.headed = frozenset(headed)
    # a lane's or region's item streams end with a stop token too (.item_loop)
    looped, chained = looped_channels(graph, st, stops, headed)
    ctx.looped = frozenset(looped)
    stops |= looped - headed
    tokens = {ch: 1 for ch in stops} | {
        ch: group_tokens(streams[ch].value.data, streams[ch].value.rank) + (ch in looped)
        for ch in grouped | headed
    }
    # an expert's units learn at run time whether it has tokens (:mod:`.guard`): built from
    # the streams one token makes when it has none (the view ``vw``)
    vw = views(st, ctx, grouped, stops, tokens)
    unit_of_chan |= vw.control  # a tile group's control channel (.tile_loop)
    # a statically tiled region's units loop over its chunks until its merge's stop token,
    # built from a view of the run holding its first chunk (.region_loop)
    tiled = count_bounds(ctx) if not vw.members else {}
    rp = region_plan(st, ctx, stops, streams, tokens, tiled, grouped, tail)
    dsts: dict[str, set[int]] = {}
    reads: list[set[str]] = []
    for k, ops in enumerate(st.units):
        view = rp.views[k] if k in rp.views else vw.streams_of(k, streams)
        mine: set[str] = set()
        # a unit that decides at run time which input gives the next element reads every
        # input's channel, whether or not this run sends anything on it
        whole = isinstance(ops[0], Reassemble) and runtime_reassemble(ctx, ops[0])
        # (a region's EagerMerge reads an expert's chunk channel also when the run sends it
        # nothing, when that chunk ends with a stop token: .region_rows ``chunk_stops``)
        for op in ops:
            for v in op.inputs():
                # the channels the elements actually come from (a Reshape's padding flags are
                # made where they are used, so they are no read of the Reshape's input)
                info = view[v.name]
                empty = set()
                if not info.pieces:
                    empty = st.sources(v.name) if whole else st.sources(v.name) & (stops | chained)
                for ch in _channels_of(info) | empty:
                    if unit_of_chan[ch] != k:
                        dsts.setdefault(ch, set()).add(k)
                        mine.add(ch)
        reads.append(mine)
    for ch, (_, dst, _) in tail.control.items():  # a chunk's row count (.region_tail)
        k = st.unit_index(dst)
        if k in rp.members:
            reads[k].add(ch)
            dsts.setdefault(ch, set()).add(k)
    heads = {g.head: g.ref for g in vw.guards}
    guarded = {k: g.ref for g in vw.guards for k in g.units}
    guarded |= rp.refs()
    for k, ref in guarded.items():  # every member reads the buffer reference (or its token)
        reads[k].add(ref)
        dsts.setdefault(ref, set()).add(k)
    sends: dict[int, list[str]] = {}
    for ch in dsts:
        sends.setdefault(unit_of_chan[ch], []).append(ch)
    waits: list[dict[str, list[str]]] = [{} for _ in st.units]
    notify: dict[int, str] = {}
    token_dsts: dict[str, set[int]] = {}
    for dep in offchip_deps(graph):
        src = st.unit_index(dep.store)
        ch = token_channel(dep.store)
        for ld in dep.loads:
            k = st.unit_index(ld)
            if k != src and k not in token_dsts.setdefault(ch, set()):
                token_dsts[ch].add(k)
                waits[k].setdefault(dep.tensor, []).append(ch)
                notify[src] = ch
    bodies = []
    infos = []
    run_streams = RunStreams(streams)
    full_streams = RunStreams(vw.streams, run_streams.order) if vw.members else run_streams
    rp.bind(tokens, run_streams, lambda view: RunStreams(view, run_streams.order))
    outputs = {op.name: [v.name for v in outs] for op, outs in zip(graph.nodes, graph.node_outputs)}
    bounds = count_bounds(ctx)
    if units is not None:
        setup = (id(graph), c, tuple(sorted(wires)), tuple(sorted((configs or {}).items())))
        units.bind(setup, ctx.layouts)
    known: dict[object, int | None] = {}

    def bound(rows: object) -> int | None:
        """The bound of a tile's run-dependent rows (recorded: a unit's buffers follow it)."""
        value = known.get(rows, -1)
        if value == -1:
            expr = sp.sympify(rows)
            names = {x.name for x in expr.free_symbols}
            value = None
            if isinstance(expr, sp.Indexed) and str(expr.base) in bounds:
                value = bounds[str(expr.base)]  # a ragged size: one count per element
            elif names and names <= bounds.keys():
                v = expr.subs({x: bounds[x.name] for x in expr.free_symbols})
                value = int(v) if v.is_Integer else None
            known[rows] = value
        if ctx.deps is not None:
            ctx.deps.bounds[rows] = value
        return value

    has_dsts = dsts.__contains__  # whether channel ``ch`` has a destination
    owned: dict[int, set[str]] = {}  # unit -> the channels it sends on
    for ch, u in unit_of_chan.items():
        owned.setdefault(u, set()).add(ch)

    def info_of(k: int, info: UnitInfo, entry: Any = None) -> UnitInfo:
        """Unit ``k``'s bookkeeping in the run from its program's (in its view; ``entry``:
        the program kept, :mod:`.unit_reuse`)."""
        if k in rp.members:  # per chunk; a Partition's sends: the run's rows (.region_loop)
            op = st.units[k][0]
            sent = sum(len(streams[n].flat) for n in op.out_names() if n in dsts)
            return rp.info(k, info, sent, entry)
        return vw.info(k, info)

    for k, ops in enumerate(st.units):
        emit = EMITTERS.get(type(ops[0]))
        if emit is None:
            raise LoweringError(
                f"no spatial unit program for {ops[0].op_name} %{ops[0].name}; emitters exist for "
                f"{', '.join(sorted(t.__name__ for t in EMITTERS))}"
            )
        vctx, vrs, vtok = (ctx, run_streams, tokens)
        if k in vw.members:
            vctx, vrs, vtok = (vw.ctx_of(k), full_streams, vw.tokens)
        elif k in rp.members:
            vctx, vrs, vtok = rp.context(k)
        unit_stops = {
            ch: vctx.streams[ch].messages
            for ch in reads[k]
            if (ch in stops or ch in grouped) and vtok.get(ch, 1) > 0
        }
        # where a stop token falls is part of the streams a unit's emitter reads (recorded in
        # its Deps), not of its key: a unit that decides at run time reads it as data
        key = (frozenset(reads[k]), tuple(sorted(unit_stops)))
        hit = units.lookup(k, key, vctx, vrs, has_dsts, bound) if units is not None else None
        if hit is not None:  # the unit's program, not rebuilt (:mod:`.unit_reuse`)
            bodies.append(hit.body)
            infos.append(info_of(k, hit.info, hit))  # in this run (no token, its tiles: .guard)
            continue
        deps = vctx.deps = Deps()
        b = UnitBuilder(
            ops[0].name,
            timing,
            deps.tracking(has_dsts),
            owned.get(k, set()).__contains__,
            waits[k],
            notify.get(k),
            unit_stops,
            bound,
            frozenset(grouped),
        )
        vw.prepare(k, b)
        if k in rp.members:  # its loop's bound follows the chunk count's (recorded)
            b.bound(rp.members[k][0].chunks)
        try:
            if k in rp.loads:  # a loop over its addresses (.region_loop)
                rp.emit(vctx, b, k, ops[0])
            else:
                emit(vctx, b, ops)
        finally:
            vctx.deps = None
        # the guard's receive of the buffer reference is not the emitter's
        own = [ch for ch in reads[k] if guarded.get(k) != ch or b.next_seq.get(ch)]
        check_unit_io(b, vctx, own, sends.get(k, ()), vtok)
        body = b.body()
        if k in rp.members:
            ins = sorted(ch for ch in reads[k] if ch in stops)
            body = region_body(body, rp.members[k][0], k, ins)
        elif k in heads or k in guarded:
            ins = sorted(ch for ch in reads[k] if ch in stops)
            outs = sorted(ch for ch in sends.get(k, ()) if ch in stops)
            body = vw.wrap(k, body, ins, outs)
        bodies.append(body)
        infos.append(
            UnitInfo(
                ops[0].name,
                tuple(o.op_name for o in ops),
                b.flops,
                b.busy_cycles,
                b.sram_bytes,
                b.received,
                b.sent,
            )
        )
        if units is not None or rp.ragged(k):  # (a ragged region's: counted per chunk)
            sizing = b.sizing()
            if sizing is not None:
                # what its run-time decisions take is counted apart (Deps.tally)
                _, _, cyc, fl = deps.tallied
                sizing = dataclasses.replace(
                    sizing, fixed=sizing.fixed - cyc, fixed_flops=sizing.fixed_flops - fl
                )
                # the program reads the rows of its tiles at run time: the same program for
                # other row counts, its bookkeeping counted from them (:mod:`.unit_reuse`)
                deps.sizing = sizing
                for name, level in deps.streams.items():
                    deps.streams[name] = looser(level, ROWS)
            if not b.literal_values:
                # every control value it sends comes from a register (received, loaded, or
                # computed at run time): its outputs' values are data, not its program's
                for op in ops:
                    for name in outputs[op.name]:
                        if name in deps.streams:
                            deps.streams[name] = looser(deps.streams[name], FORM)
            if units is not None:
                units.store(k, key, deps, vrs, bodies[-1], infos[-1])
        # no token: its guard only; or per tile (.guard), per chunk (.region_loop)
        kept = Entry(key, deps, vrs, bodies[-1], infos[-1], deps.tallied) if rp.ragged(k) else None
        infos[-1] = info_of(k, infos[-1], kept)
    placement = place_structure(st, c, walk=walk, memory={u.name: u.sram_bytes for u in infos})
    core = [u.core for u in placement.units]
    # a headed address channel's FIFOs have a slot more, for the count ahead of a request's
    # addresses: the K and V loads pipeline across requests and take the next request's first
    # address through a FIFO that also holds its count (.kv_loop)
    extra = (fifo_depth if fifo_depth is not None else c.core.fifo_depth) + 1
    # a region's selectors (4-byte control values) are read by every unit of the region, the
    # last of them a chunk's pipeline behind the merge: their FIFO holds every chunk's
    # selector and the stop token, so the merge never waits for the slowest (.region_loop)
    deep = rp.depths(extra - 1)
    channels = tuple(
        Channel(
            ch,
            core[unit_of_chan[ch]],
            tuple(sorted(core[d] for d in dsts[ch])),
            extra
            if ch in headed and not isinstance(st.producer[ch], Expand)
            else deep[ch]
            if ch in deep
            else vw.depth(ch, fifo_depth, extra - 1),  # a tile group's rows: a tile more
        )
        for ch in streams
        if ch in dsts
    ) + tuple(
        Channel(ch, core[src], tuple(sorted(core[d] for d in token_dsts[ch])), fifo_depth)
        for src, ch in sorted(notify.items())
    )
    # an expert with no token: the stop token on its buffer reference's channel
    absent = vw.ref_tokens
    messages = {ch: streams[ch].messages + tokens.get(ch, 0) + absent.get(ch, 0) for ch in dsts} | {
        ch: 1 for ch in token_dsts
    }
    message_bytes = {
        ch: stream_bytes(streams[ch]) + 4 * (tokens.get(ch, 0) + absent.get(ch, 0)) for ch in dsts
    } | {ch: 4 for ch in token_dsts}
    fences = tuple((fence_group(st.units[src][0].name), (core[src],)) for src in sorted(notify))
    tensors = tuple(TensorDecl(lay.name, lay.decl_shape, lay.dtype) for lay in ctx.layouts.values())
    programs = ProgramSet(
        tuple(
            sorted((Program(core[k], body) for k, body in enumerate(bodies)), key=lambda p: p.core)
        ),
        channels,
        tensors,
        fences,
        graph.name,
        (("graph", graph.name), ("chip", c.name), ("placement", placement.walk)),
    )
    pool = max((len(u.cores) for u in placement.units), default=1)
    return SpatialPlan(
        graph,
        c,
        simulation_chip(c, pool),
        placement,
        programs,
        tuple(infos),
        messages,
        message_bytes,
        int_contents(ctx.layouts, run.tensors),
    )
