"""Two-level inductive operator scheduling over preload numbers (ELK §4.2) on top of the
cost-aware allocation of ELK §4.3.

The model (ELK §4.5's programming model): operators execute in order, one at a time
(``execute``); preloads run one after another in a *preload order* (``preload_async``); the
preloads issued before ``execute(i)`` may overlap it, the next one waits until it ends.  ``P[i]``
is the number of preloads issued before ``execute(i)`` (non-decreasing; the preload number of
``i`` is the count of those not yet executed).  The operators preloaded but not executed while
``i`` runs are *resident*: each holds its preload-state space; ``i`` holds its execute-state
space.  Op ``i+1``'s data distribution (preload-state -> execute-state, ELK §4.3) closes step
``i``; its preload-state plan is chosen by step ``i``'s allocation.

Scheduling is backwards from the last operator (Lemma 4.1: the last preload number is 0).  For
each operator and each candidate ``P`` (Theorem 4.2) the step ends at
``min(start of step i+1, start of preload P)`` and starts its duration earlier; the preloads are
placed as late as possible.  Theorem 4.2 keeps one best suffix per operator; because ``P`` must
not decrease, one best suffix is kept per ``(operator, P)`` so a later operator's choice never
forbids an earlier one's; and since a suffix is seen by earlier steps through several numbers
(its start, the later preload starts, its resident operators' deadlines and spaces), the
non-dominated suffixes are kept (``Policy.beam`` caps them for large models).  :func:`exhaustive`
enumerates every vector ``P`` for the tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from elk.allocate import Allocation, Option, allocate
from elk.contention import (  # noqa: F401 (_crowd: re-export)
    _FREE,
    _RESIDENT_GRIDS,
    _SHARERS,
    _crowd,
    _crowd_with,
    _lead,
    _sharers,
)
from elk.errors import ElkError
from elk.model import Item, Policy, Step, Timeline
from elk.suffix import _by_load, _keep, _Kept, _keyed, _last, _plain, _resident, _State, _vector

__all__ = ["Item", "Policy", "Step", "Timeline", "schedule", "evaluate", "exhaustive"]


def _check(items: Sequence[Item], order: Sequence[int]) -> list[int]:
    n = len(items)
    if sorted(order) != list(range(n)):
        raise ElkError(f"preload order {list(order)} is not a permutation of 0..{n - 1}")
    pos = [0] * n
    for k, op in enumerate(order):
        pos[op] = k
    return pos


_Got = tuple[Step, tuple[float, ...], tuple, float]


def _step(
    items: Sequence[Item],
    order: Sequence[int],
    pos: Sequence[int],
    i: int,
    P: int,
    parent: _State | None,
    pol: Policy,
    only: int | None = None,
) -> _Got | None:
    """Step ``i`` with ``P`` issued preloads after suffix ``parent``: the step, the preload
    starts of positions ``P..``, the resident table and the gate; ``only``: the exec plan to
    use (``None``: the allocation chooses).  ``None``: does not fit."""
    pick = _stepper(items, order, pos, i, P, parent, pol)
    return None if pick is None else pick(only)


def _stepper(
    items: Sequence[Item],
    order: Sequence[int],
    pos: Sequence[int],
    i: int,
    P: int,
    parent: _State | None,
    pol: Policy,
) -> Callable[[int | None], _Got | None] | None:
    """:func:`_step` in two parts: what does not depend on the exec plan (the lead, preload
    starts, residents, their space and contention) is worked out once; the returned function
    then chooses the plan (``only``: that exec plan; ``None``: the allocation's), so
    :func:`_tries` can try several plans after one suffix.  ``None``: no plan fits."""
    n = len(items)
    item = items[i]
    if parent is None:
        nxt_start, spre_tail, tail_from = 0.0, (), n
        res_parent: dict[int, tuple[int, float, int, int]] = {}
        lead = 0.0
    else:
        spre_tail, tail_from = parent.spre, parent.step.P
        res_parent = _resident(parent)
        # the preloads issued between execute(i) and execute(i+1) delay execute(i+1)
        lead = _lead(
            items, order, range(P, tail_from), i + 1, parent.step.exec_plan, res_parent, pol
        )
        nxt_start = parent.step.start - lead
    # Preload starts of positions P .. tail_from-1 (as late as possible).
    head: list[float] = []
    later = spre_tail[0] if spre_tail else math.inf
    for k in range(tail_from - 1, P - 1, -1):
        op = order[k]
        if op == i + 1:
            assert parent is not None
            # its kernel consumes the preload piece by piece: the last piece is due ``slack``
            # cycles into the execution (ELK §4.5: a preload blocks only the reading execute)
            plan = parent.step.exec_plan
            bound = parent.step.start + items[op].slack(plan)
        else:
            r = res_parent[op]
            bound, plan = r[1], r[3]
        it_op = items[op]  # Item.load_time, inlined
        s = min(bound, later) - (it_op.loads[plan] if it_op.loads else it_op.load)
        head.append(s)
        later = s
    head.reverse()
    spre = tuple(head) + spre_tail
    gate = spre[0] if spre else math.inf
    end = min(nxt_start, gate) if parent is not None else 0.0
    last = _last(order, P)
    residents = [j for j in range(i + 1, min(n, last + 1)) if pos[j] < P]
    if pol.max_ahead is not None and sum(1 for j in residents if items[j].hbm_bytes) > (
        pol.max_ahead
    ):
        return None
    fixed = 0
    for j in residents:
        if j != i + 1:
            fixed += res_parent[j][0]
    if pol.exec_space is not None and fixed > pol.capacity - pol.exec_space:
        return None
    # Preloads of the resident operators run as late as possible, i.e. up to this step's end:
    # they overlap it for at most their total preload time (the interconnect is shared then).
    overlap = 0.0
    if pol.contention:
        for j in residents:
            plan_j = parent.step.exec_plan if j == i + 1 else res_parent[j][3]  # type: ignore[union-attr]
            it_j = items[j]  # Item.load_time, inlined
            overlap += it_j.loads[plan_j] if it_j.loads else it_j.load
    busy: float = overlap

    def cost(e: int) -> float:
        # with per-core port times, contention is charged per section (see :func:`_lead`)
        return item.execs[e].time if item.ports else item.exec_time(e, busy)

    if item.ports:  # the plans do not depend on the contention: worked out once per item
        fixed_bases = _bases(item, pol)
        if fixed_bases is None:
            return None
        every, base, in_base = fixed_bases
    else:
        every = tuple(Option(o.space, cost(e), e) for e, o in enumerate(item.execs))
        got_bases = _choose_bases(item, pol, every)
        if got_bases is None:
            return None
        base = got_bases
        in_base = {o.ref for o in base}
    held: list[tuple[tuple[int, int], float]] = []
    held_space: float = 0
    rows = cols = area = 0  # the held grids' :func:`_totals`, summed in the same pass
    if pol.core_sram is not None and item.grids and residents:
        for j in residents:
            pj = parent.step.exec_plan if j == i + 1 else res_parent[j][3]  # type: ignore[union-attr]
            it_j = items[j]
            if it_j.grids:
                gj = it_j.grids[pj]
                # Item.exec_core_space, inlined
                cs = it_j.core_spaces[pj] if it_j.core_spaces else it_j.execs[pj].space
                held.append((gj, cs))
                held_space += cs
                rows += gj[0]
                cols += gj[1]
                area += gj[0] * gj[1]
    held_grids = (len(held), rows, cols, area)
    fitted: dict[int, bool] = {}

    def fits(e: int) -> bool:
        if e in fitted:
            return fitted[e]
        own = item.exec_core_space(e)
        if own + held_space <= pol.core_sram:  # type: ignore[operator]
            ok = True  # even if every grid shared one core
        else:
            g = item.grids[e]
            if _crowd_with(pol, g, held_grids):
                ok = False  # some core may hold a tile of every grid
            else:
                shared = sum(cs for gj, cs in held if pol.must_share(g, gj))
                ok = own + shared <= pol.core_sram  # type: ignore[operator]
        fitted[e] = ok
        return ok

    nxt_res = (i + 1) in residents
    opts: tuple[Option, ...] = ()
    if nxt_res:
        assert parent is not None
        opts = _preload_opts(items[i + 1], parent.step.exec_plan, pol)
    cap = pol.capacity - fixed
    if nxt_res and pol.exec_space is not None:
        # Static: the next operator's preload space comes out of the fixed preload space
        room = pol.capacity - pol.exec_space - fixed
        opts = tuple(o for o in opts if o.space <= room)
        if not opts:
            return None
    if cap < 0:
        return None
    kept_res = {
        j: (j, *res_parent[j]) for j in residents if j != i + 1
    }  # residents other than i + 1 carry over unchanged

    def pick(only: int | None) -> _Got | None:
        execs = base
        if only is not None:
            # ``every[e]`` is plan ``e``; a Pareto plan must also be one ``base`` offers
            if only >= len(every) or (only < item.pareto and only not in in_base):
                return None
            execs = (every[only],)
        if held:
            execs = tuple([o for o in execs if fits(int(o.ref))])  # type: ignore[arg-type]
            if not execs:
                return None
        groups: list[tuple[Option, ...]] = [execs, opts] if nxt_res else [execs]
        alloc: Allocation | None = allocate(groups, cap)
        if alloc is None:
            return None
        e = int(groups[0][alloc.choice[0]].ref)  # type: ignore[arg-type]
        q = int(groups[1][alloc.choice[1]].ref) if nxt_res else -1  # type: ignore[arg-type]
        dist = groups[1][alloc.choice[1]].time if nxt_res else 0.0
        dur = alloc.time
        start = end - dur
        # HBM channels serve requests first come first served: an execution reading its input
        # from HBM (storing its output there) is served after every preload issued before it,
        # so those preloads end by its start (its end)
        hbm_due = math.inf
        if pol.contention and (item.hbm_input or item.hbm_output):
            hbm_due = start if item.hbm_input else end
        res: list[tuple[int, int, float, int, int]] = []
        for j in residents:
            if j == i + 1:
                assert parent is not None
                pe = parent.step.exec_plan
                due = end - dist if dist > 0 else parent.step.start + items[j].slack(pe)
                res.append((j, groups[1][alloc.choice[1]].space, min(due, hbm_due), q, pe))
            elif hbm_due < kept_res[j][2]:
                k = kept_res[j]
                res.append((j, k[1], hbm_due, k[3], k[4]))
            else:
                res.append(kept_res[j])
        stall = cost(e) - item.execs[e].time
        step = Step(i, P, e, q, start, end, dur, int(alloc.space + fixed), busy > 0, stall, lead)
        return step, spre, tuple(res), gate

    return pick


#: per item (and policy) the exec plans :func:`_stepper` offers an item with ``ports``
_BASES: dict[int, tuple[Item, Policy, tuple | None]] = {}


def _choose_bases(item: Item, pol: Policy, every: tuple[Option, ...]) -> tuple[Option, ...] | None:
    """The exec plans the allocation chooses from (``every``: all of them as options): the
    Pareto curve, its fastest plan (Basic), or the fastest that fits the fixed execute space
    (Static); ``None``: none fits the fixed per-core execute space."""
    base = every[: item.pareto]
    if pol.fastest_exec:
        return base[-1:]
    if pol.exec_space is not None:
        fit = tuple(
            o
            for o in base
            if (
                item.exec_core_space(int(o.ref)) <= pol.exec_core  # type: ignore[arg-type]
                if pol.exec_core is not None
                else o.space <= pol.exec_space
            )
        )
        if not fit and pol.exec_core is not None:
            return None  # no plan of this operator fits the fixed per-core execute space
        return fit[-1:] if fit else base[:1]
    return base


def _bases(item: Item, pol: Policy) -> tuple | None:
    """``(every, base, refs of base)`` of an item with ``ports`` (:func:`_choose_bases` over
    :func:`elk.suffix._plain`), kept per item and policy; ``None``: no plan fits."""
    hit = _BASES.get(id(item))
    if hit is None or hit[0] is not item or hit[1] is not pol:
        if len(_BASES) > 65536:
            _BASES.clear()
        every = _plain(item)
        base = _choose_bases(item, pol, every)
        got = None if base is None else (every, base, {o.ref for o in base})
        hit = _BASES[id(item)] = (item, pol, got)
    return hit[2]


#: per next item and exec plan the preload-state options (:func:`_preload_opts`)
_OPTS: dict[tuple[int, int], tuple[Item, Policy, tuple[Option, ...]]] = {}


def _preload_opts(nxt: Item, e: int, pol: Policy) -> tuple[Option, ...]:
    """The preload-state plans of ``nxt`` executing with plan ``e`` as allocation options
    (data distribution free under ``zero_dist``; Static's largest or smallest only), kept per
    item, plan and policy."""
    hit = _OPTS.get((id(nxt), e))
    if hit is None or hit[0] is not nxt or hit[1] is not pol:
        if len(_OPTS) > 65536:
            _OPTS.clear()
        pre = nxt.preloads[e]
        opts = tuple(
            Option(o.space, 0.0 if pol.zero_dist else o.time, k) for k, o in enumerate(pre)
        )
        if pol.preload_mode == "largest":
            opts = opts[-1:]
        elif pol.preload_mode == "smallest":
            opts = opts[:1]
        hit = _OPTS[(id(nxt), e)] = (nxt, pol, opts)
    return hit[2]


def _finish(items: Sequence[Item], order: Sequence[int], state: _State, pol: Policy) -> Timeline:
    n = len(items)
    steps: list[Step] = []
    s: _State | None = state
    while s is not None:
        steps.append(s.step)
        s = s.parent
    # preload starts of positions 0 .. P0-1, as late as possible
    first = state.step
    res = {op: (bound, e) for op, _, bound, _, e in state.res}
    lead0 = _lead(
        items,
        order,
        range(first.P),
        0,
        first.exec_plan,
        {op: (sp, b, q, e) for op, sp, b, q, e in state.res},
        pol,
    )
    # the first operator reads its input from HBM, whose channels serve requests first come
    # first served: it waits behind the preloads issued before it
    hbm0 = sum(
        items[order[k]].first_load_time(res[order[k]][1])
        for k in range(first.P)
        if pol.contention and order[k] != 0 and order[k] in res and items[order[k]].ports
    )
    start0 = first.start - max(lead0, hbm0)
    later = state.spre[0] if state.spre else math.inf
    head: list[float] = []
    for k in range(first.P - 1, -1, -1):
        op = order[k]
        if op == 0:
            bound, plan = first.start + items[0].slack(first.exec_plan), first.exec_plan
        else:
            bound, plan = res[op]
        v = min(bound, later) - items[op].first_load_time(plan)
        head.append(v)
        later = v
    head.reverse()
    spre = tuple(head) + state.spre
    pstart = [0.0] * n
    pend = [0.0] * n
    plan_of = {t.op: t.exec_plan for t in steps}
    for k, op in enumerate(order):
        pstart[op] = spre[k]
        load = items[op].first_load_time if k < first.P else items[op].load_time
        pend[op] = spre[k] + load(plan_of[op])
    begin = min(min(pstart), start0) if n else 0.0
    shift = -begin
    # the wait behind the preloads issued just before an execute belongs to that step
    leads = [first.start - start0] + [t.lead for t in steps[:-1]]
    steps_shifted = tuple(
        Step(
            t.op,
            t.P,
            t.exec_plan,
            t.next_preload,
            t.start - w + shift,
            t.end + shift,
            t.time + w,
            t.space,
            t.busy or w > 0,
            t.stall + w,
            w,
        )
        for t, w in zip(steps, leads)
    )
    preload_plan = [-1] * n
    for t in steps_shifted:
        if t.next_preload >= 0:
            preload_plan[t.op + 1] = t.next_preload
    return Timeline(
        tuple(order),
        steps_shifted,
        tuple(p + shift for p in pstart),
        tuple(p + shift for p in pend),
        shift,
        tuple(preload_plan),
    )


def _caps(items: Sequence[Item], pos: Sequence[int]) -> list[int]:
    """Most preloads that may be issued before each ``execute``: a routed operator's preload
    waits until its routing operator (``Item.after``) has executed."""
    n = len(items)
    cap = [n] * (n + 1)
    for j, it in enumerate(items):
        if it.after >= 0:
            cap[it.after] = min(cap[it.after], pos[j])
    for i in range(n - 1, -1, -1):
        cap[i] = min(cap[i], cap[i + 1])
    return cap[:n]


def _top(items: Sequence[Item], order: Sequence[int], lo: int, policy: Policy) -> int:
    """The largest preload number tried from ``lo`` on: ``policy.window`` more (K of ELK
    §4.2), or with ``policy.window_data`` as many positions as it takes to pass ``window``
    operators that preload data (operators without HBM bytes preload nothing and take no
    space, so a window counted in them reaches as far ahead as its budget of real preloads
    allows, e.g. over a MoE layer's activations between its experts)."""
    assert policy.window is not None
    if not policy.window_data:
        return min(len(order), lo + policy.window)
    k, seen = lo, 0
    while k < len(order) and seen < policy.window:
        if items[order[k]].hbm_bytes > 0:
            seen += 1
        k += 1
    return k


def _lows(pos: Sequence[int]) -> list[int]:
    lo, m = [], -1
    for p in pos:
        m = max(m, p)
        lo.append(m + 1)
    return lo


def _tries(
    items: Sequence[Item],
    order: Sequence[int],
    pos: Sequence[int],
    i: int,
    P: int,
    parent: _State | None,
    pol: Policy,
) -> list[tuple[tuple[int, ...], tuple[Step, tuple[float, ...], tuple, float]]]:
    """The steps to keep for operator ``i`` with ``P`` issued preloads after ``parent``, each
    with the residents its grid shares cores with: the allocation's choice (ELK §4.3) and,
    with ``Policy.plan_branch``, the fastest fitting plan of every other such set of
    residents (ELK §4.3 weighs execution time against interconnect contention: a plan on a
    smaller grid may run beside the preloads instead of queueing behind them)."""
    stepper = _stepper(items, order, pos, i, P, parent, pol)
    if stepper is None:
        return []
    picked: dict[int | None, _Got | None] = {}

    def pick(e: int | None) -> _Got | None:
        if e not in picked:
            picked[e] = stepper(e)
        return picked[e]

    got = pick(None)
    if not pol.plan_branch:
        return [((), got)] if got is not None else []
    sigs = _sharers(items, order, pos, i, P, parent, pol)
    out = []
    seen = set()
    if got is not None:
        seen.add(sigs[got[0].exec_plan])
        out.append((sigs[got[0].exec_plan], got))
    for e in range(items[i].fastest, -1, -1):  # fastest first
        if sigs[e] in seen:
            continue
        alt = pick(e)
        if alt is not None:
            seen.add(sigs[e])
            out.append((sigs[e], alt))
    # and per such set the plan that preloads soonest (ELK §4.2), when that is another plan
    it = items[i]
    quick: set[tuple[int, ...]] = set()
    chosen = {sig: st[0].exec_plan for sig, st in out}
    for e in _by_load(it):
        if sigs[e] in quick:
            continue
        if chosen.get(sigs[e]) == e:
            quick.add(sigs[e])
            continue
        alt = pick(e)
        if alt is not None:
            quick.add(sigs[e])
            out.append(((*sigs[e], -1), alt))
    return out


def schedule(items: Sequence[Item], policy: Policy, order: Sequence[int] | None = None) -> Timeline:
    """The inductive schedule of ``items`` under ``policy`` for preload ``order`` (default:
    execution order), ELK §4.2."""
    n = len(items)
    if n == 0:
        raise ElkError("nothing to schedule: the operator list is empty")
    order = tuple(range(n)) if order is None else tuple(order)
    pos = _check(items, order)
    lo = _lows(pos)
    cap = _caps(items, pos)
    _SHARERS.clear()
    _RESIDENT_GRIDS.clear()
    _FREE.clear()
    bad = next((i for i in range(n) if lo[i] > cap[i]), None)
    if bad is not None:
        raise ElkError(
            f"preload order puts a routed operator before the operators up to "
            f"{items[bad].name!r} that decide it; order it after its routing operator"
        )
    states: dict[int, list[_State]] = {}

    def whole(st: _State) -> tuple[float, ...]:
        return _vector(st, items, policy)

    last = _step(items, order, pos, n - 1, n, None, policy)
    if last is None:
        raise ElkError(
            f"operator {items[-1].name!r} does not fit on chip even with its smallest plan; "
            "use a chip with more on-chip memory or split the operator"
        )
    states[n] = [_State(last[0], last[1], last[2], None)]
    for i in range(n - 2, -1, -1):
        new: dict[int, list[_State]] = {}
        top = n if policy.window is None else _top(items, order, lo[i], policy)
        for P in range(lo[i], min(top, cap[i]) + 1):
            kept: dict[tuple[int, ...], list[_Kept]] = {}
            for P2, parents in states.items():
                if P2 < P:
                    continue
                for parent in parents:
                    for sig, got in _tries(items, order, pos, i, P, parent, policy):
                        st = _State(got[0], got[1], got[2], parent)
                        vec, key = _keyed(st, items, policy)
                        kept[sig] = _keep(kept.get(sig, []), vec, st, policy.beam, key, whole)
            if kept:
                new[P] = [e[-1] for group in kept.values() for e in group]
        if not new:
            raise ElkError(
                f"operator {items[i].name!r} cannot be scheduled: its smallest execute plan "
                "plus the operators that must stay resident exceed on-chip memory"
            )
        states = new
    final = [_finish(items, order, st, policy) for sts in states.values() for st in sts]
    return min(final, key=lambda t: (t.total, t.steps[0].P))


def evaluate(
    items: Sequence[Item],
    policy: Policy,
    Ps: Sequence[int],
    order: Sequence[int] | None = None,
    plans: Sequence[int] | None = None,
) -> Timeline | None:
    """The timeline of one given vector of issued-preload counts ``Ps`` (``None``: infeasible);
    ``plans``: the exec plan of every operator (default: each step's allocation chooses)."""
    n = len(items)
    order = tuple(range(n)) if order is None else tuple(order)
    pos = _check(items, order)
    lo = _lows(pos)
    if len(Ps) != n or Ps[-1] != n or any(Ps[i] < lo[i] for i in range(n)):
        return None
    cap = _caps(items, pos)
    if any(Ps[i] > cap[i] for i in range(n)):
        return None
    if any(Ps[i] > Ps[i + 1] for i in range(n - 1)):
        return None
    state: _State | None = None
    for i in range(n - 1, -1, -1):
        got = _step(items, order, pos, i, Ps[i], state, policy, None if plans is None else plans[i])
        if got is None:
            return None
        state = _State(got[0], got[1], got[2], state)
    assert state is not None
    return _finish(items, order, state, policy)


def exhaustive(
    items: Sequence[Item], policy: Policy, order: Sequence[int] | None = None
) -> Timeline | None:
    """The best timeline over every vector of preload numbers (exponential; for tests)."""
    n = len(items)
    best: Timeline | None = None
    for Ps in itertools.product(range(1, n + 1), repeat=n - 1):
        t = evaluate(items, policy, (*Ps, n), order)
        if t is not None and (best is None or t.total < best.total):
            best = t
    return best
