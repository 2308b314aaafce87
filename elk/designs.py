"""The designs compared in ELK §6.1: Basic, Static, ELK-Dyn, ELK-Full and Ideal.

* **Basic**: the fastest execute plan for every operator; the remaining space preloads at most
  the next operator.
* **Static** (T10 extended, as ELK §6.1 builds it): one fixed split of every core's SRAM into
  execute and preload space for the whole model (the best of a sweep of splits): every
  operator runs its fastest plan whose per-core footprint fits the execute space, and the
  preloads share the preload space of all cores, whatever the executing operator leaves unused;
  all preloaded operators use either their largest or their smallest preload-state plan,
  whichever is faster.
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
from elk.schedule import Item, Policy, Timeline, schedule

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
        return schedule(items, Policy(capacity, max_ahead=1, fastest_exec=True, beam=beam, **kw))
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
                try:
                    t = schedule(items, pol)
                except ElkError:
                    continue
                if best is None or t.total < best.total:
                    best = t
        if best is None:
            raise ElkError("Static: no fixed execute/preload split fits every operator")
        return best
    if design == "elk_dyn":
        return schedule(items, Policy(capacity, window=window, beam=beam, **kw))
    if design == "elk_full":
        return best_order(items, Policy(capacity, window=window, beam=beam, **kw), max_orders)[0]
    if design == "ideal":
        n = len(items)
        pol = Policy(math.inf, contention=False, zero_dist=True, window=1)
        from elk.schedule import _caps, evaluate

        # every preload as early as allowed (a routed expert: once its routing has executed)
        t = evaluate(items, pol, _caps(items, list(range(n))))
        assert t is not None
        return t
    raise ElkError(f"unknown design {design!r}; choose one of {', '.join(DESIGNS)}")
