"""The designs compared in ELK §6.1: Basic, Static, ELK-Dyn, ELK-Full and Ideal.

* **Basic**: the fastest execute plan for every operator; the remaining space preloads the
  next operator whenever it fits (no search over preload numbers).
* **Static** (T10 extended, as ELK §6.1 builds it): one fixed split of every core's SRAM into
  execute and preload space for the whole model (the best of a sweep of splits): every
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
  memory, free data distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from elk.errors import ElkError
from elk.reorder import best_order
from elk.schedule import Item, Policy, Timeline, _caps, _lows, evaluate, schedule

__all__ = ["DESIGNS", "plan_design"]

DESIGNS = ("basic", "static", "elk_dyn", "elk_full", "ideal")

#: Execute-space shares of each core's SRAM Static tries (the rest is preload space).
STATIC_SPLITS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 0.9, 1.0)


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
) -> Timeline:
    """The timeline of ``design`` (one of :data:`DESIGNS`) for ``items`` on ``capacity`` bytes;
    ``core_bytes``: the share of ``capacity`` on one core (Static splits every core's SRAM;
    without it the split is of the aggregate capacity); ``core_sram``, ``workers``, ``mesh``:
    check plans against one core's SRAM where grids must share cores (see :class:`Policy`)."""
    kw = {"core_sram": core_sram, "workers": workers, "mesh": mesh}
    if design == "basic":
        pol = Policy(capacity, max_ahead=1, fastest_exec=True, beam=beam, **kw)
        t = greedy(items, pol, capacity, 1)
        return t if t is not None else schedule(items, pol)
    if design == "static":
        best: Timeline | None = None
        single = all(len(pre) <= 1 for it in items for pre in it.preloads)
        for frac in STATIC_SPLITS:
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
        n = len(items)
        pol = Policy(math.inf, contention=False, zero_dist=True, window=1)
        # every preload as early as allowed (a routed expert: once its routing has executed)
        t = evaluate(items, pol, _caps(items, list(range(n))))
        assert t is not None
        return t
    raise ElkError(f"unknown design {design!r}; choose one of {', '.join(DESIGNS)}")


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
            if ahead is not None and len(held) > ahead:
                break
            if sum(space[j] for j in held) > room:
                break
            P += 1
        Ps.append(P)
    Ps[-1] = n
    return evaluate(items, pol, Ps)
