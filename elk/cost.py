"""Partition plans and their cost model (ELK §4.3 "cost model for execution time", §5
"execution plan generation").

A plan is a tile grid per dimension (ELK §5 writes e.g. ``<90, 9>``), mapped to cores: in order
on an all-to-all chip, dimension by dimension on a mesh (a matmul's ``k`` tiles down the mesh
rows and ``n`` tiles along the columns, so the streams of the weight-stationary dataflow move
between neighbours under dimension-order routing).  Each plan has a per-core space, an execution
time from the core roofline (compute vs local SRAM bandwidth, :mod:`lowering.kernels`) plus its
inter-core exchange at the port / link bandwidth, and the time with preload traffic sharing the
ports ("ELK divides total traffic by link bandwidth", ELK §4.3).  The preload time of an
operator is the HBM roofline or the interconnect delivery time, whichever is larger (ELK §4.2).

Matrix products use the weight-stationary dataflow of Cyclotron (``lowering.matmul``): the
weight block stays on its core, activation rows stream along grid rows, partial sums down grid
columns; decode attention splits batch, KV heads and the KV length (flash-decoding style
partials combined on one core per group); vector operators split rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from elk.allocate import Option, pareto
from elk.chipcosts import ChipCosts
from elk.errors import ElkError
from elk.grids import footprint, grid
from elk.meshio import with_hbm_io
from elk.ops import Operator, input_on_chip
from elk.schedule import Item

__all__ = [
    "ChipCosts",
    "Plan",
    "plans_for",
    "item_for",
    "items_for",
    "grid",
    "footprint",
    "chunks",
    "CHUNKS",
    "scatter_axis",
    "halves",
]


@dataclass(frozen=True, slots=True)
class Plan:
    """One partition plan: ``tiles`` per dimension (matmul ``(tm, tk, tn)``: time tiles of the
    rows, grid rows, grid columns; attention ``(tb, tg, ts)``; vector ``(tr,)``), the cores it
    uses, on-chip ``space`` (bytes over all cores, preloaded data included), ``core_space``,
    ``time`` alone and ``contended`` with preloads on the ports, ``xbytes`` moved between cores,
    ``preload_space`` (bytes held while preloaded) and ``slack``: cycles into the execution
    before its kernel needs the last preloaded piece (the kernel consumes the preload piece by
    piece, :func:`chunks`, so its preload may still be arriving while it starts); ``quiet``:
    cycles into the execution before a core of it receives a message sent during it (its
    input activation was pushed by the producer before), which is when a preload queued on
    its ports first holds it up; ``0`` when it receives none (a row-wise operator): the
    queued pieces then hold up the next execution instead, so they are charged here;
    ``scatter``: a matrix product whose grid columns combine their partial sums by a
    reduce-scatter, each core ending with one slice of the column's result cut along this
    axis of the ``M x N/tn`` block (0 rows, 1 columns); ``-1``: a tree reduction onto the top
    grid row (:func:`_matmul`); ``port``: cycles the busiest core's port spends receiving the
    execution's own traffic (its input activation, partial sums, statistics), the rest of
    the execution being free for preload pieces where the port serves them behind execute
    traffic (:func:`item_for`)."""

    kind: str
    tiles: tuple[int, ...]
    cores: int
    space: int
    core_space: int
    time: float
    contended: float
    xbytes: int
    preload_space: int
    slack: float = 0.0
    quiet: float = 0.0
    scatter: int = -1
    port: float = 0.0

    def label(self) -> str:
        return "<" + ", ".join(str(t) for t in self.tiles) + ">"


#: Loads a core's preload share is split into (at most): the kernels consume the preloaded
#: data piece by piece, so computing on one piece overlaps loading the next (ELK §4.5: a
#: preload only blocks the ``execute`` reading its buffers).
CHUNKS = 8


def chunks(extent: int) -> int:
    """Number of preload pieces of a tile ``extent`` rows long (a divisor, at most CHUNKS)."""
    return max(d for d in range(1, CHUNKS + 1) if extent % d == 0)


#: Smallest tile side (elements) a plan may cut a matrix or KV length into: smaller tiles only
#: add messages (every plan must stay "compatible with the target hardware", ELK §4.3).
MIN_TILE = 16


def _divisors(n: int, cap: int | None = None) -> list[int]:
    out = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    out += [n // d for d in out if d * d != n]
    out = sorted(set(out))
    return [d for d in out if cap is None or d <= cap]


def _kernel(c: ChipCosts, flops: float, nbytes: float) -> float:
    return max(math.ceil(flops / c.flops), math.ceil(nbytes / c.sram_bw))


def _levels(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def scatter_axis(m: int, nb: int, tk: int) -> int:
    """The axis a grid column of ``tk`` cores cuts its ``m x nb`` partial sums along for a
    reduce-scatter (:func:`_matmul`): columns when ``tk`` divides ``nb``, else rows when it
    divides ``m``; ``-1`` when neither does (a tree reduction then)."""
    if tk <= 1:
        return -1
    if nb % tk == 0:
        return 1
    return 0 if m % tk == 0 else -1


def halves(tk: int) -> bool:
    """Whether a grid column of ``tk`` cores reduce-scatters by recursive halving (``tk`` a
    power of two above one); other columns use the direct form (:func:`_matmul`)."""
    return tk > 1 and tk & (tk - 1) == 0


def _matmul(c: ChipCosts, op: Operator) -> list[Plan]:
    """Weight-stationary with broadcast activations (Cyclotron's weight-stationary dataflow
    with the activation multicast along grid rows instead of streamed, so one token block needs
    no chain of dependent computes): grid ``tk x tn``; the first core of each grid row loads its
    activation block and multicasts it along the row, every core multiplies by its stationary
    weight block.  The partial sums of a grid column are combined (ELK §2.2: "these cores will
    exchange the partial results via the interconnect"):

    * all-to-all: by a reduce-scatter, after which every core keeps one reduced slice of its
      column's block (:func:`scatter_axis`) for the next operator to gather; each port moves
      ``(tk - 1) / tk`` of the block once (a tree would move the whole block ``log2 tk`` times
      through one port).  A power-of-two column halves recursively (:func:`halves`): in each of
      ``log2 tk`` steps a core sends the half of its kept slices without its own to the core
      that keeps them and adds the other half it receives, so it sends ``log2 tk`` messages;
      the product is computed straight into the pieces the steps send.  Other columns
      reduce-scatter directly: the product is written as ``tk`` slices and in step ``s`` every
      core sends the slice of core ``r + s`` and adds the slice core ``r - s`` sent
      (``tk - 1`` messages, each added as the next arrives);
    * mesh (or when ``tk`` divides neither side): pairwise down each grid column in
      ``ceil(log2 tk)`` rounds between neighbours, the top row keeping the result."""
    m, k, n = op.dims
    e = op.elem
    rows_cap = c.mesh[0] if c.mesh else c.cores
    cols_cap = c.mesh[1] if c.mesh else c.cores
    out = []
    for tk in _divisors(k, rows_cap):
        for tn in _divisors(n, cols_cap):
            cores = tk * tn
            if (
                cores > c.cores
                or (tk > 1 and k // tk < MIN_TILE)
                or (tn > 1 and n // tn < MIN_TILE)
            ):
                continue
            kb, nb = k // tk, n // tn
            w, a, cc = kb * nb * e, m * kb * e, m * nb * e
            axis = scatter_axis(m, nb, tk) if c.links is None and c.mesh is None else -1
            sl = cc // tk  # a reduce-scatter slice
            halving = axis >= 0 and halves(tk)
            # the pieces of the product plus the receive buffers: the first half received
            # (recursive halving) or two slices (direct); the tree's second whole block
            recv = (cc // 2 if halving else 2 * sl) if axis >= 0 else cc
            core_space = w + a + cc + recv
            if core_space > c.sram:
                continue
            # one product per preloaded weight piece (:func:`chunks`), each after the first
            # reading and writing the accumulator again in SRAM (the kernel of
            # ``lowering.elk_programs``: matmul, then matmul_acc per piece)
            nc = chunks(kb)
            wp, ap = w // nc, a // nc
            comp = _kernel(c, 2 * m * kb * nb // nc, ap + wp + cc) + (nc - 1) * _kernel(
                c, 2 * m * kb * nb // nc, ap + wp + 2 * cc
            )
            add = _kernel(c, m * nb, 3 * cc)
            lv = _levels(tk)
            hops_row = (tn / 2) if c.mesh else 1.0
            hops_col = (tk / 2) if c.mesh else 1.0

            def total(
                f: float,
                a: int = a,
                cc: int = cc,
                comp: int = comp,
                add: int = add,
                lv: int = lv,
                tk: int = tk,
                tn: int = tn,
                hr: float = hops_row,
                hc: float = hops_col,
                axis: int = axis,
                sl: int = sl,
                nb: int = nb,
            ) -> float:
                bcast = (a / c.port * f + c.net_lat * hr) if tn > 1 else 0.0
                reduce = lv * (cc / c.port * f + c.net_lat * hc + add)
                out = cc
                if axis >= 0 and halves(tk):
                    # recursive halving: log2 tk steps, each sending half the kept slices and
                    # adding the half received before the next step sends part of it
                    reduce = 0.0
                    d = tk // 2
                    while d >= 1:
                        reduce += d * sl / c.port * f + c.net_lat
                        reduce += _kernel(c, m * nb // tk * d, 3 * sl * d)
                        d //= 2
                    out = sl
                elif axis >= 0:
                    # tk - 1 slices in through the port, each added as the next arrives
                    msg, plus = sl / c.port * f, _kernel(c, m * nb // tk, 3 * sl)
                    reduce = (tk - 1) * max(msg, plus) + min(msg, plus) + c.net_lat
                    out = sl
                if c.links is not None:
                    # mesh: the first grid column gathers the activation over the links into
                    # it, piece by piece (:func:`chunks`), each piece multicast along the row
                    # and multiplied as it arrives; the result stays on the top row for the
                    # next operator to gather
                    parts = (c.gather(a, (tk, tn)) * f, bcast, float(comp))
                    slow = max(parts)
                    stream = slow + (sum(parts) - slow) / chunks(k // tk)
                    return stream + c.net_lat * (tk + tn) + reduce
                load_a = max(a / c.port * f, m * k * e / c.hbm_bw) + c.hbm_lat + c.net_lat
                store = max(out / c.port * f, m * n * e / c.hbm_bw) + c.net_lat
                # the row's first core multicasts each activation piece as it arrives, so only
                # the last piece's multicast follows the gather (the pieces of :func:`chunks`)
                if tn > 1:
                    bcast = a / c.port * f / chunks(k // tk) + c.net_lat * hr
                return load_a + bcast + comp + reduce + store

            xb = cores * a + (tk - 1) * tn * cc
            space = k * n * e + cores * (a + 2 * cc)
            pieces = chunks(kb)
            if c.links is not None:
                first = c.gather(a, (tk, tn)) + c.net_lat * (tk + tn)
            else:
                first = max(a / c.port, m * k * e / c.hbm_bw) + c.hbm_lat + c.net_lat
            # the multicast along the grid rows, else the first partial sum down the columns
            quiet = first if tn > 1 else (first + comp if tk > 1 else 0.0)
            # the last weight piece is needed when the last product starts, as ``total``
            # times the execution: after the activation's gather, the multicast of its last
            # piece (each piece is multicast as it arrives) and the products of the other
            # pieces; on a mesh, where gather, multicast and products stream piece by piece,
            # at the end of the stream less the last product (before the partial sums'
            # reduction down the grid columns)
            if c.links is None:
                if tn > 1:
                    first += a / c.port / pieces + c.net_lat * hops_row
                slack = first + comp * (pieces - 1) / pieces
            else:
                reduce = lv * (cc / c.port + c.net_lat * hops_col + add)
                slack = total(1.0) - reduce - comp / pieces
            out.append(
                Plan(
                    "matmul",
                    (1, tk, tn),
                    cores,
                    space,
                    core_space,
                    total(1.0),
                    total(1.0 / (1.0 - c.rho)),
                    xb,
                    k * n * e,
                    slack,
                    quiet,
                    axis,
                    # received: the activation block, then the partial sums (a reduce-scatter
                    # brings tk - 1 slices, direct or halving; the tree a block per level)
                    (a + ((tk - 1) * sl if axis >= 0 else lv * cc)) / c.port,
                )
            )
    return out


def _attention(c: ChipCosts, op: Operator) -> list[Plan]:
    b, hq, hkv, d, length = op.dims
    e = op.elem
    g = hq // hkv
    out = []
    for tb in _divisors(b):
        for tg in _divisors(hkv):
            for ts in _divisors(length, c.mesh[1] if c.mesh else None):
                cores = tb * tg * ts
                if ts > 1 and length // ts < MIN_TILE:
                    continue
                # on a mesh the (batch, KV head) groups go down the rows and the KV length along
                # the columns; groups of fewer than half a row's columns sit side by side
                # (:func:`footprint`), so a row holds ``cols // ts`` of them
                if cores > c.cores or (c.mesh and tb * tg > c.mesh[0] * (c.mesh[1] // ts)):
                    continue
                bb, hb, lb = b // tb, hkv // tg, length // ts
                kv = 2 * bb * hb * lb * d * e
                q = bb * hb * g * d * e
                part = bb * hb * g * (d + 2) * 4
                core_space = kv + q + part * 2
                if core_space > c.sram:
                    continue
                pieces = chunks(lb)
                # one flash-decoding partial per preloaded piece, merged into the running one
                # in fp32 (a quarter of the 16-bit rate): read two partials, write one
                merge = _kernel(c, 4 * 6 * bb * hb * g * (d + 2), 3 * part)
                comp = _kernel(c, 4 * bb * hb * g * lb * d, kv + 2 * q + part)
                comp += (pieces - 1) * merge
                qall = b * hq * d * e / c.hbm_bw
                load_q = max(q / c.port, qall) + c.hbm_lat + c.net_lat

                def total(
                    f: float,
                    ts: int = ts,
                    part: int = part,
                    bb: int = bb,
                    hb: int = hb,
                    load_q: float = load_q,
                    qall: float = qall,
                    comp: int = comp,
                    q: int = q,
                    merge: int = merge,
                ) -> float:
                    gather = (ts - 1) * part / c.port * f + c.net_lat if ts > 1 else 0.0
                    comb = (ts - 1) * merge + _kernel(c, bb * hb * g * (d + 2), part)
                    return load_q * f + comp + gather + comb + max(q / c.port * f, qall) + c.net_lat

                space = op.hbm_bytes + cores * (q + 2 * part)
                xb = (ts - 1) * part * tb * tg + cores * q * 2
                out.append(
                    Plan(
                        "attention",
                        (tb, tg, ts),
                        cores,
                        space,
                        core_space,
                        total(1.0),
                        total(1.0 / (1.0 - c.rho)),
                        xb,
                        op.hbm_bytes,
                        load_q + comp * (pieces - 1) / pieces,
                        load_q + comp if ts > 1 else 0.0,  # the partials' gather
                        port=(q + (ts - 1) * part) / c.port,  # the queries, the partials
                    )
                )
    return out


def _vector(c: ChipCosts, op: Operator) -> list[Plan]:
    """Row-wise operators tiled over rows and columns (``<tr, tc>``; ELK §5 slices every
    dimension).  Each core loads its ``rows/tr x cols/tc`` block, computes and stores it.  An
    operator that reduces whole rows (``op.row_reduce``: norms, routing) with ``tc > 1`` sends
    its per-row partial sums to the first core of its grid row, which multicasts the combined
    statistic back (two small messages per row).  A layer-graph node (``op.node``) runs whole on
    one core."""
    r, cols = op.dims
    e = op.elem
    rows_cap = c.mesh[0] if c.mesh else c.cores
    cols_cap = c.mesh[1] if c.mesh else c.cores
    out = []
    col_tiles = [1] if op.node is not None else _divisors(cols, cols_cap)
    row_tiles = [1] if op.node is not None else _divisors(r, rows_cap)
    for tr in row_tiles:
        for tc in col_tiles:
            if tr * tc > c.cores or (tc > 1 and cols // tc < MIN_TILE):
                continue
            rb, cb = r // tr, cols // tc
            tile = rb * cb * e
            params = op.param_bytes // tc
            core_space = 3 * tile + params + (8 * rb if op.row_reduce else 0)
            if core_space > c.sram:
                continue
            comp = _kernel(c, op.flops_per_elem * rb * cb, 3 * tile + params)
            every = r * cols * e / c.hbm_bw  # all rows through the HBM (mesh: its edge links)
            red = op.row_reduce and tc > 1
            hops = (tc / 2) if c.mesh else 1.0

            def total(
                f: float,
                tile: int = tile,
                comp: int = comp,
                every: float = every,
                red: bool = red,
                tc: int = tc,
                rb: int = rb,
                hops: float = hops,
            ) -> float:
                move = max(tile / c.port * f, every)
                # the store's HBM latency ends the operator (the next one reads the rows)
                t = move + c.hbm_lat + c.net_lat + comp + move + c.net_lat + c.hbm_lat
                if red:  # gather the partials on the row's first core, multicast the result
                    t += (tc - 1) * 4 * rb / c.port * f + 4 * rb / c.port * f + 2 * c.net_lat * hops
                return t

            cores = tr * tc
            out.append(
                Plan(
                    "vector",
                    (tr, tc),
                    cores,
                    cores * core_space,
                    core_space,
                    total(1.0),
                    total(1.0 / (1.0 - c.rho)),
                    2 * tile * cores + (2 * (tc - 1) * 4 * rb * tr if red else 0),
                    op.param_bytes,
                    0.0,
                    # the row statistics' exchange, right after the input tile arrived
                    max(tile / c.port, every) + c.hbm_lat + c.net_lat if red else 0.0,
                    port=(tile + (tc * 4 * rb if red else 0)) / c.port,  # the tile, statistics
                )
            )
    return out


@lru_cache(maxsize=4096)
def _generated(
    c: ChipCosts,
    kind: str,
    dims: tuple[int, ...],
    dtype: str,
    fpe: int,
    pbytes: int,
    reduce: bool = False,
    whole: bool = False,
) -> tuple[Plan, ...]:
    """Every partition plan the generator of ``kind`` makes for the operator these fields
    describe (the input of :func:`_plans` and :func:`_quicker_loads`)."""
    op = Operator(
        "p",
        kind,  # type: ignore[arg-type]
        dims,
        dtype,
        flops_per_elem=fpe,
        param_bytes=pbytes,
        row_reduce=reduce,
        node="whole" if whole else None,
    )
    gen = {"matmul": _matmul, "attention": _attention, "vector": _vector}[kind]
    return tuple(gen(c, op))


@lru_cache(maxsize=4096)
def _plans(
    c: ChipCosts,
    kind: str,
    dims: tuple[int, ...],
    dtype: str,
    fpe: int,
    pbytes: int,
    reduce: bool = False,
    whole: bool = False,
) -> tuple[Plan, ...]:
    plans = _generated(c, kind, dims, dtype, fpe, pbytes, reduce, whole)
    if not plans:
        raise ElkError(
            f"{kind} operator {dims} has no partition plan whose tile fits one core's "
            f"{c.sram} bytes of SRAM on {c.name}; use a chip with more cores or SRAM"
        )
    front = pareto([Option(p.space, p.time, p) for p in plans])
    return tuple(o.ref for o in front)  # type: ignore[misc]


@lru_cache(maxsize=4096)
def _quicker_loads(
    c: ChipCosts,
    kind: str,
    dims: tuple[int, ...],
    dtype: str,
    fpe: int,
    pbytes: int,
    reduce: bool = False,
    whole: bool = False,
) -> tuple[Plan, ...]:
    """Plans off the space/time Pareto curve that preload faster than every plan of the curve
    needing no more space and no more time (ELK §4.2: an operator's preload time is the HBM
    roofline or the interconnect delivery, whichever is larger, so a grid over more cores can
    load a port-bound operator sooner and queue less on each core); the fastest of each
    preload time, space ascending."""
    front = _plans(c, kind, dims, dtype, fpe, pbytes, reduce, whole)

    def load(p: Plan) -> float:
        return c.load(p.preload_space, p.preload_space / max(1, p.cores), grid=footprint(p, c.mesh))

    best: dict[float, Plan] = {}
    for p in _generated(c, kind, dims, dtype, fpe, pbytes, reduce, whole):
        if p in front:
            continue
        lp = load(p)
        if any(load(f) <= lp for f in front if f.space <= p.space and f.time <= p.time):
            continue
        if lp not in best or (p.time, p.space) < (best[lp].time, best[lp].space):
            best[lp] = p
    return tuple(sorted(best.values(), key=lambda p: (p.space, p.time)))


def plans_for(c: ChipCosts, op: Operator) -> tuple[Plan, ...]:
    """The Pareto-optimal execute-state plans of ``op`` (space ascending)."""
    try:
        return _plans(
            c,
            op.kind,
            op.dims,
            op.dtype,
            op.flops_per_elem,
            op.param_bytes,
            op.row_reduce,
            op.node is not None,
        )
    except ElkError as err:  # the plans are kept by shape: name the operator here
        raise ElkError(f"operator {op.name!r}: {err}") from None


def item_for(c: ChipCosts, op: Operator) -> Item:
    """The scheduler's view of ``op``: Pareto plans (then the plans that preload faster,
    :func:`_quicker_loads`), preload-state plans and preload time.
    Weights, KV blocks and parameters have one owner core in these plans, so the preload-state
    plan equals the execute-state one (no data distribution)."""
    front = plans_for(c, op)
    key = (op.kind, op.dims, op.dtype, op.flops_per_elem, op.param_bytes, op.row_reduce)
    plans = front + _quicker_loads(c, *key, op.node is not None)
    execs = tuple(Option(p.space, p.time, p) for p in plans)
    preloads = tuple((Option(p.preload_space, 0.0, p),) for p in plans)
    loads = tuple(
        c.load(p.preload_space, p.preload_space / max(1, p.cores), grid=footprint(p, c.mesh))
        for p in plans
    )
    # the cycles a queued preload holds an execution's messages up: its share of a core's
    # port, or on an edge-fed mesh the busiest link of its routes, which the execution's
    # messages between the cores of the same mesh region cross too (ELK §4.3)
    ports = tuple(
        c.hbm_link(p.preload_space / max(1, p.cores), footprint(p, c.mesh)) for p in plans
    )
    first = (
        tuple(
            c.load(
                p.preload_space,
                p.preload_space / max(1, p.cores),
                grid=footprint(p, c.mesh),
                in_turn=False,
            )
            for p in plans
        )
        if c.edge_fed
        else ()
    )
    return Item(
        op.name,
        execs,
        preloads,
        min(loads),
        hbm_bytes=op.hbm_bytes,
        contended=tuple(p.contended for p in plans),
        layer=op.layer,
        slot=op.slot,
        loads=loads,
        core_spaces=tuple(p.core_space for p in plans),
        grids=tuple(footprint(p, c.mesh) for p in plans),
        ports=ports,
        front=len(front),
        slacks=tuple(p.slack for p in plans),
        quiets=tuple(_free(c, p) for p in plans),
        hbm_time=op.hbm_bytes / c.hbm_bw,
        first_loads=first,
    )


def _free(c: ChipCosts, p: Plan) -> float:
    """Cycles of plan ``p``'s execution a preload queued on its cores' ports takes without
    holding the execution up (``Item.quiets``, :func:`elk.contention._lead`).  On an
    all-to-all chip a core's port serves execute traffic ahead of preload pieces
    (:mod:`runtime.network`: ELK §3.2, §4.3, preload and execute traffic share the
    interconnect's bandwidth), so the pieces pass whenever the port is not receiving the
    execution's own traffic: ``time - port``.  On a mesh the links serve both first come first
    served: the pieces pass only before the execution's first message reaches its cores
    (``quiet``)."""
    if c.mesh:
        return p.quiet
    return max(p.quiet, p.time - p.port)


def items_for(c: ChipCosts, ops: list[Operator]) -> list[Item]:
    """:func:`item_for` of every operator (a routed operator's ``after`` set to the index of
    the operator named by its ``routed_by``).  ``Item.hbm_input`` / ``hbm_output`` mark the
    executions whose HBM activation reads / stores queue behind the preload requests the HBM
    channels hold, first come first served: on a mesh.  On an all-to-all chip the HBM serves
    execute requests ahead of preload reads (:mod:`runtime.network`: ELK §3.2, §4.3 preload
    and execute traffic share the HBM bandwidth), so no execution waits for them there."""
    index = {op.name: k for k, op in enumerate(ops)}
    out = []
    for k, op in enumerate(ops):
        it = item_for(c, op)
        hbm_in = not input_on_chip(ops[k - 1] if k else None, op)
        hbm_out = k + 1 == len(ops) or not input_on_chip(op, ops[k + 1])
        if (hbm_in or hbm_out) and c.mesh:
            it = dataclasses.replace(it, hbm_input=hbm_in, hbm_output=hbm_out)
            if c.edge_fed:
                it = with_hbm_io(c, op, it, hbm_in, hbm_out)
        if op.routed_by is not None:
            if op.routed_by not in index:
                raise ElkError(
                    f"operator {op.name!r} is routed by {op.routed_by!r}, which is not in the "
                    "operator list; add the routing operator before it"
                )
            it = dataclasses.replace(it, after=index[op.routed_by])
        out.append(it)
    return out
