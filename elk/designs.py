"""The designs compared in ELK §6.1: Basic, Static, ELK-Dyn, ELK-Full and Ideal.

* **Basic**: the fastest execute plan for every operator; the remaining space preloads the
  next operator whenever it fits (no search over preload numbers).  "The next operator" is
  the next one that preloads data: operators without HBM data (norms, residual adds, rotary)
  have nothing to preload, so while operator ``i`` executes the preloads of ``i+1`` up to the
  first following operator with data are issued (as ELK's evaluation builds Basic).
* **Static** (T10 extended, as ELK §6.1 builds it): one fixed split of every core's SRAM into
  execute and preload space for the whole model (the best of a sweep of splits in
  :data:`STATIC_STEP` steps of a core's SRAM): every
  operator runs its fastest plan whose per-core footprint fits the execute space, and the
  preloads share the preload space of all cores, whatever the executing operator leaves unused;
  all preloaded operators use either their largest or their smallest preload-state plan,
  whichever is faster.  Operators are preloaded in advance as SambaNova does, i.e. greedily:
  before each ``execute`` every next operator whose preload space still fits the reserved
  preload space is issued (the split is Static's only size; how many operators it holds follows
  from it); the preload numbers are not searched (that is ELK's inductive scheduling, §4.2).
* **ELK-Dyn**: inductive scheduling (§4.2) + cost-aware allocation (§4.3), execution order.
* **ELK-Full**: ELK-Dyn plus preload order permutation (§4.4).
* **Ideal**: separate interconnects for preload and execution (no contention), unbounded on-chip
  memory, free data distribution (ELK §6.1's roofline).  Without contention and with room for
  everything, issuing every preload as early as allowed is best for given exec plans and a
  given preload order (a later issue only gates an execution), so Ideal searches what is left:
  every operator's exec plan (a plan on more cores receives its preload through more ports,
  which may be worth a slower execution, as ELK-Full's search finds) and the preload orders
  ELK-Full tries (§4.4).  Without routed operators every preload is issued before the first
  ``execute`` and :func:`roofline_plans` finds the plans (exact without a cap on the
  combinations kept); with routed ones (a preload gated by its routing) :func:`ideal_plans`
  searches them backwards like ELK §4.2 (exact without a beam).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from elk.errors import ElkError
from elk.model import Step
from elk.reorder import best_order, candidate_orders
from elk.schedule import (
    Item,
    Policy,
    Timeline,
    _caps,
    _check,
    _finish,
    _lows,
    _stepper,
    evaluate,
    schedule,
)
from elk.suffix import _keep, _Kept, _State

__all__ = ["DESIGNS", "plan_design", "ideal", "ideal_plans"]

DESIGNS = ("basic", "static", "elk_dyn", "elk_full", "ideal")

#: Suffixes kept per operator by Ideal's plan search (:func:`ideal_plans`; ``None``: all).
IDEAL_BEAM = 8

#: Plan combinations kept per operator by :func:`roofline_plans` (``None``: all).
IDEAL_FRONT: int | None = 256

#: Step (bytes of one core's SRAM) of the execute-space sizes Static tries: ELK §6.1 finds
#: "the best static preload and execution space sizes for the entire DL model", and its
#: evaluation sweeps the execute space in 10 KB steps up to the whole core.
STATIC_STEP = 10 * 1024

#: Execute-space shares Static tries when it splits the aggregate capacity (no per-core size).
STATIC_SHARES = 64


def static_splits(core_bytes: float | None) -> tuple[float, ...]:
    """Execute-space shares of each core's SRAM Static tries (the rest is preload space):
    every :data:`STATIC_STEP` of ``core_bytes`` up to the whole core, or
    :data:`STATIC_SHARES` even shares of the aggregate capacity."""
    steps = STATIC_SHARES if not core_bytes else max(1, math.ceil(core_bytes / STATIC_STEP))
    return tuple(k / steps for k in range(1, steps + 1))


def plan_design(
    design: str,
    items: Sequence[Item],
    capacity: float,
    *,
    window: int | None = None,
    beam: int | None = None,
    max_orders: int = 16,
    core_bytes: float | None = None,
    core_sram: float | None = None,
    workers: int = 0,
    mesh: tuple[int, int] | None = None,
    paced: bool = False,
    window_data: bool = False,
) -> Timeline:
    """The timeline of ``design`` (one of :data:`DESIGNS`) for ``items`` on ``capacity`` bytes;
    ``core_bytes``: the share of ``capacity`` on one core (Static splits every core's SRAM;
    without it the split is of the aggregate capacity); ``core_sram``, ``workers``, ``mesh``:
    check plans against one core's SRAM where grids must share cores; ``paced``: preloads
    arrive at HBM pace on an all-to-all chip (see :class:`Policy`; Ideal has no contention);
    ``window_data``: ``window`` counts operators that preload data."""
    kw = {
        "core_sram": core_sram,
        "workers": workers,
        "mesh": mesh,
        "paced": paced,
        "window_data": window_data,
    }
    if design == "basic":
        pol = Policy(capacity, max_ahead=1, fastest_exec=True, beam=beam, **kw)
        t = greedy(items, pol, capacity, 1)
        return t if t is not None else schedule(items, pol)
    if design == "static":
        best: Timeline | None = None
        single = all(len(pre) <= 1 for it in items for pre in it.preloads)
        for frac in static_splits(core_bytes):
            for mode in ("largest",) if single else ("largest", "smallest"):
                pol = Policy(
                    capacity,
                    exec_space=frac * capacity,
                    exec_core=None if core_bytes is None else frac * core_bytes,
                    preload_mode=mode,
                    window=window,
                    beam=beam,
                    **kw,
                )
                t = greedy(items, pol, (1 - frac) * capacity, None)
                if t is not None and (best is None or t.total < best.total):
                    best = t
        if best is None:
            raise ElkError("Static: no fixed execute/preload split fits every operator")
        return best
    if design == "elk_dyn":
        pol = Policy(capacity, window=window, beam=beam, plan_branch=True, **kw)
        return schedule(items, pol)
    if design == "elk_full":
        pol = Policy(capacity, window=window, beam=beam, plan_branch=True, **kw)
        return best_order(items, pol, max_orders)[0]
    if design == "ideal":
        return ideal(items, beam=IDEAL_BEAM if beam is not None else None, max_orders=max_orders)
    raise ElkError(f"unknown design {design!r}; choose one of {', '.join(DESIGNS)}")


IDEAL_POLICY = Policy(math.inf, contention=False, zero_dist=True, window=1)


def ideal(
    items: Sequence[Item], *, beam: int | None = IDEAL_BEAM, max_orders: int = 16
) -> Timeline:
    """ELK §6.1's Ideal: every preload issued as early as allowed (a routed expert's once its
    routing has executed), the best of: each candidate preload order of ELK-Full (§4.4) with
    the fastest exec plans, the execution order with :func:`roofline_plans`' plans (no routed
    operator) or each order with :func:`ideal_plans`' (routed ones).  ``beam``: the beam of
    :func:`ideal_plans`; ``None`` also keeps every combination in :func:`roofline_plans`
    (exact, for small lists)."""
    n = len(items)
    routed = any(it.after >= 0 for it in items)
    got: list[Timeline | None] = []
    for order in candidate_orders(items, math.inf, max_orders):
        Ps = _caps(items, _check(items, order))
        got.append(evaluate(items, IDEAL_POLICY, Ps, order))
        if routed:  # the routings gate the preloads: search the plans with those gates
            got.append(ideal_plans(items, order, beam))
    if not routed:
        front = IDEAL_FRONT if beam is not None else None
        got.append(evaluate(items, IDEAL_POLICY, [n] * n, plans=roofline_plans(items, front)))
    best = min((t for t in got if t is not None), key=lambda t: t.total)
    return best


def roofline_plans(items: Sequence[Item], cap: int | None = IDEAL_FRONT) -> list[int] | None:
    """Ideal's exec plans when every preload is issued before the first ``execute`` in execution
    order (no routed operator; ``None`` otherwise), exactly.  Then the executions run back to
    back, ``T`` cycles in all, and the preloads one after another, each by its deadline
    (the start of its execution plus its ``slack``), so the step takes
    ``T + max(0, max_k(F_k - E_k - slack_k))`` with ``F_k`` the preload cycles of operators
    ``0..k`` and ``E_k`` the execution cycles of ``0..k-1`` (:func:`elk.schedule._finish`).  A
    forward pass over the operators keeps per choice of plans so far ``(E, F - E, M)``, ``M``
    the largest such term yet, all three the smaller the better; the non-dominated ones are
    kept (at most ``cap``, see :func:`_pareto3`; ``None``: all, exact)."""
    if any(it.after >= 0 for it in items):
        return None
    # the least execution and preload cycles of the operators from each one on
    rest = [(0.0, 0.0)]
    for it in reversed(items):
        t_min = min(o.time for o in it.execs)
        f_min = min(map(it.first_load_time, range(len(it.execs))))
        rest.append((rest[-1][0] + t_min, rest[-1][1] + f_min))
    rest.reverse()
    # (E, u = F - E, M, plans as a linked list)
    front: list[tuple[float, float, float, tuple | None]] = [(0.0, 0.0, -math.inf, None)]
    for k, it in enumerate(items):
        opts = [(o.time, it.first_load_time(e), it.slack(e), e) for e, o in enumerate(it.execs)]
        nxt = [
            (E + t, u + f - t, max(M, u + f - sl), (e, link))
            for E, u, M, link in front
            for t, f, sl, e in opts
        ]
        front = _pareto3(nxt, cap, rest[k + 1])
    E, u, M, link = min(front, key=lambda x: x[0] + max(0.0, x[2]))
    plans: list[int] = []
    while link is not None:
        plans.append(link[0])
        link = link[1]
    return plans[::-1]


def _pareto3(
    pts: list[tuple[float, float, float, tuple | None]],
    cap: int | None,
    rest: tuple[float, float],
) -> list[tuple[float, float, float, tuple | None]]:
    """The points no other is at most in all of their first three coordinates (one of equal
    ones), at most ``cap`` of them: those with the least bound on the total if the operators
    still to come (``rest``: their least execution and preload cycles) took no more."""
    pts.sort(key=lambda p: (p[0], p[1], p[2]))
    out: list[tuple[float, float, float, tuple | None]] = []
    stair: list[tuple[float, float]] = []  # (u, M) of the kept points, u ascending, M descending
    for p in pts:
        u, M = p[1], p[2]
        k = bisect.bisect_right(stair, (u, math.inf))
        if k and stair[k - 1][1] <= M:
            continue  # a kept point with no larger E has no larger u and M
        out.append(p)
        # drop the stair points the new one dominates in (u, M), keep the staircase shape
        j = k
        while j < len(stair) and stair[j][1] >= M:
            j += 1
        stair[k:j] = [(u, M)]
    if cap is not None and len(out) > cap:
        ex, pre = rest
        out.sort(key=lambda p: max(p[0] + ex + max(0.0, p[2]), p[0] + p[1] + pre))
        out = out[:cap]
    return out


def ideal_plans(
    items: Sequence[Item], order: Sequence[int], beam: int | None = IDEAL_BEAM
) -> Timeline | None:
    """The exec plans of Ideal (every preload issued as early as allowed in ``order``), searched
    backwards from the last operator like ELK §4.2's induction: per operator and kept suffix,
    every exec plan (the fastest execution is not always best: a plan on more cores receives
    its preload through more ports, ELK §3.1); the suffixes no other dominates are kept, by what
    the earlier steps see of them (:func:`_ideal_vector`), at most ``beam`` (latest start first;
    ``None``: all, so the search is exact)."""
    n = len(items)
    order = tuple(order)
    pos = _check(items, order)
    Ps = _caps(items, pos)
    if any(Ps[i] < lo for i, lo in enumerate(_lows(pos))):
        return None
    Ps[-1] = n
    before: tuple[list[float], list[float]] = ([0.0], [0.0])
    for it in items:
        before[0].append(before[0][-1] + min(o.time for o in it.execs))
        before[1].append(before[1][-1] + min(map(it.load_time, range(len(it.execs)))))
    states: list[_State | None] = [None]
    for i in range(n - 1, -1, -1):
        kept: list[_Kept] = []
        for parent in states:
            pick = _stepper(items, order, pos, i, Ps[i], parent, IDEAL_POLICY)
            if pick is None:
                continue
            for e in range(len(items[i].execs)):
                got = pick(e)
                if got is None:
                    continue
                st = _State(got[0], got[1], got[2], parent)
                kept = _keep(kept, _ideal_vector(st, items, before), st, beam)
        if not kept:
            return None
        states = [e[-1] for e in kept]
    finals = [_finish(items, order, st, IDEAL_POLICY) for st in states if st is not None]
    return min(finals, key=lambda t: t.total)


def _ideal_vector(
    st: _State, items: Sequence[Item], before: tuple[list[float], list[float]]
) -> tuple[float, ...]:
    """What the earlier steps of Ideal see of suffix ``st`` (all larger is better, each enters
    their times through ``min`` and subtraction only): its start, its own preload's deadline
    and (negated) preload times, the preload starts of the positions not yet issued, and its
    resident operators' deadlines and (negated) preload times (no contention, no capacity:
    spaces and grids do not matter)."""
    step: Step = st.step
    it = items[step.op]
    e = step.exec_plan
    res = st.res
    # first (the beam keeps the largest): the least total time of a schedule ending with this
    # suffix, with its own and its residents' preloads back to back before their deadlines
    # and the operators before it at their fastest executions and preloads (``before``: the
    # sums of both per operator); a function of the rest, so the dominance is unchanged
    later = st.spre[0] if st.spre else math.inf
    for j, _, bound, _, pj in reversed(res):
        later = min(bound, later) - items[j].load_time(pj)
    reach = min(step.start + it.slack(e), later) - it.load_time(e)
    # and the operators before it need at least their fastest executions and preloads
    i = step.op
    est = max(before[0][i] - step.start, before[1][i] - reach)
    return (
        -est,
        step.start,
        step.start + it.slack(e),
        -it.load_time(e),
        -it.first_load_time(e),
        *st.spre,
        *(bound for _, _, bound, _, _ in res),
        *(-items[j].load_time(pj) for j, _, _, _, pj in res),
        *(-items[j].first_load_time(pj) for j, _, _, _, pj in res),
    )


def _static_plan(it: Item, pol: Policy) -> int:
    """The exec plan a fixed execute space gives an operator (its fastest that fits)."""
    if pol.fastest_exec or pol.exec_space is None:
        return it.fastest
    fit = [
        e
        for e in range(it.pareto)
        if (
            it.exec_core_space(e) <= pol.exec_core
            if pol.exec_core is not None
            else it.execs[e].space <= pol.exec_space
        )
    ]
    return fit[-1] if fit else 0


def greedy(items: Sequence[Item], pol: Policy, room: float, ahead: int | None) -> Timeline | None:
    """Preloads issued greedily in execution order (ELK §6.1 Basic and Static): before each
    ``execute(i)`` the next operators are issued while their preload spaces fit ``room`` with
    those still held (at most ``ahead`` held); ``None`` when the resulting schedule does not
    fit (:func:`elk.schedule.evaluate`)."""
    n = len(items)
    pos = list(range(n))
    lo, cap = _lows(pos), _caps(items, pos)
    space = []
    for it in items:
        pre = it.preloads[_static_plan(it, pol)] if it.preloads else ()
        if not pre:
            space.append(0.0)
        elif pol.preload_mode == "smallest":
            space.append(float(pre[0].space))
        else:
            space.append(float(pre[-1].space))
    Ps: list[int] = []
    P = 0
    for i in range(n):
        P = max(P, lo[i])
        while P < min(n, cap[i]):
            held = [j for j in range(i + 1, P + 1)]
            if ahead is not None and sum(1 for j in held if items[j].hbm_bytes) > ahead:
                break
            if sum(space[j] for j in held) > room:
                break
            P += 1
        Ps.append(P)
    Ps[-1] = n
    return evaluate(items, pol, Ps)
