"""Interconnect contention between preloads and executions (ELK §4.3: "to estimate the
contention overhead on each interconnect link, ELK divides total traffic by link bandwidth";
links serve the messages sharing them one after another, ELK §6.1), and which resident
operators' preloads an executing plan's grid shares cores with (:func:`_sharers`, the sets the
scheduler branches on)."""

from __future__ import annotations

from collections.abc import Sequence

from elk.model import Item, Policy
from elk.suffix import _last, _resident, _State

__all__: list[str] = []  # used by elk.schedule


def _lead(
    items: Sequence[Item],
    order: Sequence[int],
    positions: Sequence[int],
    i: int,
    e: int,
    res: dict[int, tuple[int, float, int, int]],
    pol: Policy,
) -> float:
    """Cycles ``execute(i)`` (exec plan ``e``) waits behind the preloads at ``positions`` of the
    preload order, issued just before it.  ELK §4.3 estimates the contention on a link by
    dividing its total traffic by its bandwidth, and a link serves the messages sharing it one
    after another (ELK §6.1): a ``preload_async`` issued before an ``execute`` queues its pieces
    on the receiving cores' ports ahead of the execution's activations, partial sums and
    results, so an execution whose cores also receive a preload waits for that core's share of
    it (``Item.ports``).  Grids that need not share a core (:meth:`Policy.must_share`: placement
    keeps them apart) do not wait; items without ``ports`` are charged by ``Item.exec_time``.
    An execution that reads its input activation from HBM (``Item.hbm_input``) on such a core
    sends that read to the HBM channels only after the core's preload pieces, and the channels
    serve requests first come first served: it waits until the HBM has served those preloads
    (their ``hbm_time``) if that is longer (ELK §4.3, memory-access contention); one that
    stores its output to HBM (``Item.hbm_output``) queues that store behind every preload issued
    just before it, wherever placed, so it ends no sooner than the HBM has served them.
    Its input activation, pushed by the producing cores before these preloads were issued,
    is not held up: the wait counts from its first message sent during the execution
    (``Item.quiet``; an execution shorter than that wait, i.e. one without such a message,
    passes it on to the next execution, so it is charged in full).  On an all-to-all chip a
    core's port serves execute traffic ahead of queued preload pieces (``runtime.network``:
    preload reads are background traffic), so ``Item.quiet`` is every cycle of the execution
    its ports do not receive its own traffic (:func:`elk.cost._free`) and only the preload
    share beyond those cycles holds it up."""
    it = items[i]
    if not pol.contention or not it.ports:
        return 0.0
    g = it.grids[e] if it.grids else None
    shares = _shares(items, order, positions, i, e, g, res, pol)  # (consumer, port cycles)
    if pol.mesh is None:
        if pol.paced:  # (HBM cycles, port cycles here) of each preload, in issue order
            port_of = dict(shares)
            queue = [(items[order[k]].hbm_time, port_of.get(order[k], 0.0)) for k in positions]
            return _paced(it.execs[e].time, it.quiet(e), queue)
        return _spill(items, i, e, res, shares)
    tot = hbm = every = 0.0
    for j, port in shares:
        tot += port
        hbm += items[j].hbm_time
    for k in positions:
        every += items[order[k]].hbm_time
    # a core's input activation was pushed to it before these preloads were issued: the
    # queued pieces hold the execution up from its first message sent during it on
    tot = max(0.0, tot - it.quiet(e))
    if it.hbm_input:
        tot = max(tot, hbm)
    if it.hbm_output:
        tot = max(tot, every - it.execs[e].time)
    return tot


def _shares(
    items: Sequence[Item],
    order: Sequence[int],
    positions: Sequence[int],
    i: int,
    e: int,
    g: tuple[int, int] | None,
    res: dict[int, tuple[int, float, int, int]],
    pol: Policy,
) -> list[tuple[int, float]]:
    """The ``(consumer, port cycles)`` of the preloads at ``positions`` that queue on the cores
    of ``execute(i)`` with plan ``e`` (grid ``g``), in issue order (:func:`_lead`): its own,
    and those of residents whose grids share a core with ``g``.  Whether the grids are
    crowded (:func:`_crowded`) is asked only when a resident's grid is to be compared."""
    shares: list[tuple[int, float]] = []
    crowded: bool | None = None
    for k in positions:
        j = order[k]
        pj = items[j]
        ports = pj.ports
        if not ports:
            continue
        if j == i:  # its own preload's pieces queue ahead of its input on every core
            shares.append((j, ports[e]))
            continue
        r = res.get(j)
        if r is None:
            continue
        plan = r[3]
        if g is not None and pj.grids:
            if crowded is None:
                crowded = _crowded(items, g, res, pol)
            if not crowded and not pol.must_share(g, pj.grids[plan]):
                continue
        shares.append((j, ports[plan]))
    return shares


def _spill(
    items: Sequence[Item],
    i: int,
    e: int,
    res: dict[int, tuple[int, float, int, int]],
    shares: Sequence[tuple[int, float]],
) -> float:
    """:func:`_lead` on an all-to-all chip, whose ports serve execute traffic ahead of queued
    preload pieces (``runtime.network``; ELK §3.2, §4.3: preload and execute traffic share the
    bandwidth): the pieces of a preload consumed by ``execute(j)`` (port cycles ``shares``)
    pass in the free port cycles (``Item.quiet``) of ``execute(i)`` and of every execution
    before ``execute(j)``, and of ``execute(j)``'s own first ``slack`` cycles; only what does
    not fit by then holds the executions up.  Preloads are served first come first served among
    themselves, so the check runs over the consumers in order (the earliest deadline first:
    the preloads of nearer consumers must fit in fewer free cycles).  The preloads issued before
    a later execution were checked against the same free cycles earlier in the backward search
    (which decides later steps first), though the ones issued here are served before them: the
    later checks are optimistic by the free cycles these preloads take from them."""
    if not shares:
        return 0.0
    frees = _free_cycles(items, i, e, res, max(shares)[0])
    need = lead = 0.0
    for j, port in sorted(shares):
        free = frees[j - i - 1] if j > i else frees[0]
        need += port
        room = free if j == i else free + items[j].slack(res[j][3])
        if need - room > lead:
            lead = need - room
    return lead


def _free_cycles(
    items: Sequence[Item], i: int, e: int, res: dict[int, tuple[int, float, int, int]], j: int
) -> list[float]:
    """:func:`_spill`'s free port cycles before each consumer: entry ``m`` holds those of
    ``execute(i)`` (plan ``e``) and of the executions ``i+1 .. i+m`` (each with its plan in
    ``res``, else its fastest), summed in that order, up to entry ``j - i - 1`` at least.  The
    sums depend on the resident table alone (the scheduler asks for one table with every
    preload number), so they are kept per table and extended as far as asked."""
    hit = _FREE.get(id(res))
    if hit is None or hit[0] is not res or hit[1] != i or hit[2] != e:
        if len(_FREE) > 65536:
            _FREE.clear()
        hit = _FREE[id(res)] = (res, i, e, [items[i].quiet(e)])
    frees = hit[3]
    k = i + len(frees)  # the next execution to add
    while k < j:
        item = items[k]
        free = frees[-1]
        if item.execs:  # Item.quiet, inlined
            r = res.get(k)
            quiets = item.quiets
            free += quiets[r[3] if r is not None else item.fastest] if quiets else 0.0
        frees.append(free)
        k += 1
    return frees


def _paced(time: float, quiet: float, queue: Sequence[tuple[float, float]]) -> float:
    """:func:`_lead` on an all-to-all chip whose preloads arrive at HBM pace (``Policy.paced``:
    ELK §5's emulator broadcasts each preload to all cores; §3.3: a core's bandwidth demand is
    its inter-core volume over the execution time plus its HBM-to-core volume over the HBM load
    time).  The HBM serves the preloads issued before the execution one after another
    (``queue``: their HBM cycles and port cycles on its cores, in issue order), each delivering
    its port cycles evenly over its HBM cycles; what arrives during the execution's ``time``
    cycles beyond its free port cycles (``quiet``) slows it.  What arrives after it overlaps
    later executions, uncharged (a first-order estimate)."""
    t = got = 0.0
    for h, port in queue:
        if t >= time:
            break
        if port > 0.0:
            got += port * (min(h, time - t) / h if h > 0.0 else 1.0)
        t += h
    return max(0.0, got - quiet)


def _crowded(
    items: Sequence[Item],
    g: tuple[int, int],
    res: dict[int, tuple[int, float, int, int]],
    pol: Policy,
) -> bool:
    """Whether an executing grid ``g`` and the grids of all operators resident beside it
    (``res``: op -> (space, bound, preload plan, exec plan)) cannot all be apart
    (:func:`_crowd`)."""
    hit = _RESIDENT_GRIDS.get(id(res))
    if hit is None or hit[0] is not res:
        if len(_RESIDENT_GRIDS) > 65536:
            _RESIDENT_GRIDS.clear()
        grids = [items[j].grids[pj] for j, (*_, pj) in res.items() if items[j].grids]
        hit = _RESIDENT_GRIDS[id(res)] = (res, _totals(grids))
    return _crowd_with(pol, g, hit[1])


def _crowd(pol: Policy, grids: Sequence[tuple[int, int]]) -> bool:
    """Whether core ``grids`` cannot all be placed apart, even where each pair could
    (:meth:`Policy.must_share` is pairwise): on an all-to-all chip they need more cores than
    there are; on a mesh they fit neither stacked in rows nor side by side in columns."""
    if len(grids) < 3:
        return False  # a pair: Policy.must_share decides
    if pol.mesh is not None:
        return sum(r for r, _ in grids) > pol.mesh[0] and sum(c for _, c in grids) > pol.mesh[1]
    if not pol.workers:
        return False
    return sum(r * c for r, c in grids) > pol.workers


def _totals(grids: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
    """How many ``grids``, their rows, columns and cores summed (for :func:`_crowd_with`)."""
    return (
        len(grids),
        sum(r for r, _ in grids),
        sum(c for _, c in grids),
        sum(r * c for r, c in grids),
    )


def _crowd_with(pol: Policy, g: tuple[int, int], tot: tuple[int, int, int, int]) -> bool:
    """:func:`_crowd` of ``g`` beside grids whose :func:`_totals` are ``tot`` (the same answer,
    without summing the resident grids again for every candidate plan)."""
    n, rows, cols, area = tot
    if n + 1 < 3:
        return False
    if pol.mesh is not None:
        return g[0] + rows > pol.mesh[0] and g[1] + cols > pol.mesh[1]
    if not pol.workers:
        return False
    return g[0] * g[1] + area > pol.workers


def _sharers(
    items: Sequence[Item],
    order: Sequence[int],
    pos: Sequence[int],
    i: int,
    P: int,
    parent: _State | None,
    pol: Policy,
) -> list[tuple[int, ...]]:
    """Per exec plan of operator ``i`` (``P`` preloads issued, suffix ``parent``): the resident
    operators whose preloads would queue on the plan's cores (:func:`_lead`; those issued just
    before ``execute(i)`` are a subset of the residents)."""
    it = items[i]
    n = len(items)
    if parent is None or not it.grids or not it.ports:
        return [()] * len(it.execs)
    res = _resident(parent)  # op -> (space, end bound, preload plan, exec plan)
    last = _last(order, P)
    held = []
    for j in range(i + 1, min(n, last + 1)):
        if pos[j] >= P:
            continue
        it_j = items[j]
        if not it_j.ports or not it_j.grids:
            continue
        if j == i + 1:
            held.append((j, it_j.grids[parent.step.exec_plan]))
        else:
            r = res.get(j)
            if r is not None:
                held.append((j, it_j.grids[r[3]]))
    # the same residents on the same grids give the same answer (memo per schedule run)
    key = (i, tuple(held))
    hit = _SHARERS.get(key)
    if hit is not None:
        return hit
    # the resident grids beside this one (:func:`_crowded` over the held operators); the
    # answer depends only on the plan's grid, and plans often share a grid
    others = _totals([g for _, g in held])
    by_grid: dict[tuple[int, int], tuple[int, ...]] = {}
    out = []
    for e in range(len(it.execs)):
        ge = it.grids[e]
        sig = by_grid.get(ge)
        if sig is None:
            crowd = _crowd_with(pol, ge, others)
            sig = by_grid[ge] = tuple(j for j, g in held if crowd or pol.must_share(ge, g))
        out.append(sig)
    _SHARERS[key] = out
    return out


#: :func:`_sharers` answers of the running :func:`schedule` call (items and policy fixed).
_SHARERS: dict[tuple, list[tuple[int, ...]]] = {}

#: :func:`_crowded`'s totals of each resident table's grids (:func:`_totals`), per table of the
#: running :func:`schedule` call (a table is kept with its entry, so its id stays its own).
_RESIDENT_GRIDS: dict[int, tuple[dict, tuple[int, int, int, int]]] = {}

#: :func:`_free_cycles` per resident table of the running :func:`schedule` call.
_FREE: dict[int, tuple[dict, int, int, list[float]]] = {}
