"""An ELK schedule of an operator list on a chip: planning, the printable plan, ELK's breakdown.

``plan_model(ops, chip, design)`` runs the cost model (:mod:`elk.cost`), the design's scheduler
(:mod:`elk.designs`) and returns an :class:`ElkSchedule`: per operator its execute-state plan,
preload-state plan, preload number, execute / preload space per core, position in the preload
order and predicted times, plus the breakdown of ELK §6.2 (preload only, execute only,
overlapped, interconnect stall) and the HBM / interconnect utilisation of ELK §6.3.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elk.cost import ChipCosts, Plan, footprint, items_for
from elk.designs import DESIGNS, plan_design
from elk.errors import ElkError
from elk.ops import Operator
from elk.schedule import Item, Timeline
from hwmodel.chip import Chip

__all__ = ["ElkSchedule", "plan_model", "format_schedule", "plan_search", "PLAN_OPTIONS"]


def _measure(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(xs: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in xs)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    i = j = 0
    tot = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            tot += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return tot


@dataclass(frozen=True)
class ElkSchedule:
    """The plan of one design for one operator list on one chip (cycles at the chip's clock)."""

    design: str
    costs: ChipCosts
    ops: tuple[Operator, ...]
    items: tuple[Item, ...]
    timeline: Timeline
    plan_seconds: float
    core_peak: int | None = None
    #: the search budget it was planned with, when not :data:`DEFAULT_SEARCH` (plan_model's
    #: ``window``, ``beam``, ``max_orders``, ``window_data``), as printed
    search: tuple[tuple[str, Any], ...] = ()

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The execute-state plan of every operator."""
        return tuple(
            self.items[s.op].execs[s.exec_plan].ref
            for s in self.timeline.steps  # type: ignore[misc]
        )

    @property
    def issued(self) -> tuple[int, ...]:
        """Preloads issued before each ``execute`` (positions in the preload order)."""
        return tuple(s.P for s in self.timeline.steps)

    @property
    def order(self) -> tuple[int, ...]:
        return self.timeline.order

    @property
    def cycles(self) -> float:
        """Predicted cycles of the whole list."""
        return self.timeline.total

    @property
    def seconds(self) -> float:
        return self.cycles / (self.costs.clock_ghz * 1e9)

    def breakdown(self) -> dict[str, float]:
        """ELK §6.2's categories in cycles: ``preload`` (HBM busy, cores idle), ``execute``
        (cores busy, HBM idle), ``overlapped``, ``interconnect`` (execution slowed by preload
        traffic on the interconnect) and ``idle``."""
        t = self.timeline
        ex = _measure([(s.start, s.end) for s in t.steps])
        pr = _measure(list(zip(t.preload_start, t.preload_end)))
        both = _intersect(ex, pr)
        stall = min(sum(s.stall for s in t.steps), both)
        total = t.total
        e, p = _length(ex), _length(pr)
        return {
            "preload": p - both,
            "execute": e - both,
            "overlapped": both - stall,
            "interconnect": stall,
            "idle": max(0.0, total - (e + p - both)),
        }

    def hbm_utilisation(self, cycles: float | None = None) -> float:
        """Bytes preloaded over what the HBM could deliver in ``cycles`` (default: the
        predicted time)."""
        t = self.cycles if cycles is None else cycles
        tot = sum(op.hbm_bytes for op in self.ops)
        return tot / (self.costs.hbm_peak * t) if t else 0.0

    def noc_utilisation(self, cycles: float | None = None) -> float:
        """Interconnect utilisation as ELK §6.3-§6.4 plots it (Fig. 18 (c), Fig. 21): the
        cycles the interconnect is busy over the step's cycles, busy being the cycles each
        preload's HBM delivery occupies it (:meth:`noc_busy`) plus each execution's exchange
        (its bytes over the cores' aggregate port bandwidth, the time every core spends
        sending its share).  ELK's simulator records per preload the interconnect cycles it
        takes and per execution its data-shift cycles and plots their sum over the total
        cycles, for both topologies; a mesh is busier because a delivery from the edge
        controllers takes "multiple hops" (ELK §6.4): its bottleneck links carry every byte
        the grid receives.  On an all-to-all chip this is the bytes crossing the core ports
        over the ports' capacity.  ``cycles``: the step's time (default: the predicted)."""
        c = self.costs
        t = self.cycles if cycles is None else cycles
        if not t:
            return 0.0
        busy = sum(p.xbytes for p in self.plans) / (c.cores * c.port)
        busy += sum(self.noc_busy(k) for k in range(len(self.ops)))
        return busy / t

    def noc_busy(self, k: int) -> float:
        """Cycles operator ``k``'s HBM delivery occupies the interconnect: all-to-all, its
        bytes over the worker cores' aggregate port bandwidth (ELK §2.1: controllers are
        nodes of the exchange); mesh fed from edge controllers, the bytes the busiest link of
        the dimension-order routes to its grid carries over the link bandwidth
        (:meth:`elk.meshlinks.MeshLinks.hbm_pairs`; ELK §4.3: a link's time is its traffic
        over its bandwidth); a mesh without placed controllers, its bytes over the links
        into the grid's cores."""
        c = self.costs
        nbytes = self.ops[k].hbm_bytes
        if c.mesh is None or not nbytes:
            return nbytes / (c.cores * c.port)
        h, w = footprint(self.plans[k], c.mesh)
        one = nbytes / (h * w) / c.port
        if c.links is not None and c.links.attach:
            return one * max(1.0, c.links.hbm_pairs(h, w))
        return one

    def flop_utilisation(self, cycles: float | None = None) -> float:
        """FLOPs of the operators over what the worker cores could compute in ``cycles``
        (default: the predicted time) at their matmul rate (ELK §6.3 Fig. 18 (d))."""
        t = self.cycles if cycles is None else cycles
        cap = self.costs.cores * self.costs.flops * t
        return sum(op.flops for op in self.ops) / cap if cap else 0.0

    def ideal(self) -> ElkSchedule:
        """The Ideal design (ELK §6.1) of the same operators on the same chip."""
        if self.design == "ideal":
            return self
        return plan_model(self.ops, self.costs, "ideal")

    def preload_number(self, i: int) -> int:
        return self.timeline.preload_number(i)

    def __str__(self) -> str:
        return format_schedule(self)


def format_schedule(s: ElkSchedule, limit: int | None = 40) -> str:
    """The plan, one line per operator (at most ``limit`` lines of operators): ``exec us`` is
    the operator's execution span, ``stall us`` the part of it its cores wait for the
    interconnect, busy with preload traffic (ELK §3.3 interconnect contention, Fig. 18 (a) ④)."""
    t = s.timeline
    pos = {op: k for k, op in enumerate(t.order)}
    clk = s.costs.clock_ghz * 1e3  # cycles per microsecond
    lines = [
        f"ELK schedule ({s.design}) of {len(s.ops)} operators on {s.costs.name} "
        f"({s.costs.cores} worker cores, {s.costs.capacity / 2**20:.0f} MiB on chip): "
        f"{s.cycles:.0f} cycles = {s.seconds * 1e6:.1f} us, planned in {s.plan_seconds:.2f} s"
        + (f" (search {search_label(dict(s.search))})" if s.search else ""),
        f"{'operator':24} {'kind':9} {'exec plan':14} {'cores':>5} {'pre#':>4} {'order':>5} "
        f"{'exec KiB/core':>13} {'pre KiB/core':>12} {'preload us':>10} {'exec us':>8} "
        f"{'stall us':>8} {'start us':>9}",
    ]
    shown = t.steps if limit is None else t.steps[:limit]
    for st in shown:
        op, it = s.ops[st.op], s.items[st.op]
        plan: Plan = it.execs[st.exec_plan].ref  # type: ignore[assignment]
        pre_core = plan.preload_space / max(1, plan.cores) / 1024
        lines.append(
            f"{op.name:24} {op.kind:9} {plan.label():14} {plan.cores:5d} "
            f"{t.preload_number(st.op):4d} {pos[st.op]:5d} {plan.core_space / 1024:13.1f} "
            f"{pre_core:12.1f} {(t.preload_end[st.op] - t.preload_start[st.op]) / clk:10.2f} "
            f"{st.time / clk:8.2f} {st.stall / clk:8.2f} {st.start / clk:9.2f}"
        )
    if limit is not None and len(t.steps) > limit:
        lines.append(f"... {len(t.steps) - limit} more operators")
    b = s.breakdown()
    tot = max(s.cycles, 1e-9)
    lines.append(
        "breakdown: "
        + ", ".join(f"{k} {v / tot:.1%}" for k, v in b.items())
        + f"; HBM utilisation {s.hbm_utilisation():.1%}, interconnect {s.noc_utilisation():.1%}"
        f", FLOP {s.flop_utilisation():.2%}"
    )
    return "\n".join(lines)


#: Re-plans with a smaller aggregate capacity when a core's SRAM overflows before giving up.
SRAM_RETRIES = 4


#: plan_model's search budget by default: ELK §4.2's preload numbers tried per operator
#: (``window``, counted in operator positions unless ``window_data``), the suffixes kept per
#: preload number (``beam``) and ELK §4.4's candidate preload orders (``max_orders``)
DEFAULT_SEARCH: dict[str, Any] = {"window": 16, "beam": 4, "max_orders": 8, "window_data": False}


def plan_model(
    ops: Sequence[Operator],
    chip: Chip | ChipCosts,
    design: str = "elk_full",
    *,
    dtype: str = "bf16",
    window: int | None = DEFAULT_SEARCH["window"],
    beam: int | None = DEFAULT_SEARCH["beam"],
    max_orders: int = DEFAULT_SEARCH["max_orders"],
    paced: bool = False,
    window_data: bool = DEFAULT_SEARCH["window_data"],
) -> ElkSchedule:
    """Plan ``ops`` on ``chip`` with ``design`` (one of :data:`elk.designs.DESIGNS`).

    The scheduler budgets the aggregate on-chip memory; with a :class:`Chip` the plan is then
    placed tile by tile and every core's peak SRAM checked (``core_peak``).  A plan that
    overflows a core is made again with the aggregate budget cut by the overflow (at most
    :data:`SRAM_RETRIES` times; the per-core budget of the plans' grids is cut by it as well,
    since output tiles held for the next operator also occupy cores).  Ideal assumes unbounded
    memory and is not checked.  ``paced``: preloads arrive at HBM pace on an all-to-all chip
    (ELK §5's emulator, :class:`elk.model.Policy`) instead of yielding to execute traffic;
    ``window_data``: ``window`` counts operators that preload data (:func:`elk.schedule._top`)."""
    if design not in DESIGNS:
        raise ElkError(f"unknown design {design!r}; choose one of {', '.join(DESIGNS)}")
    costs = chip if isinstance(chip, ChipCosts) else ChipCosts.from_chip(chip, dtype)
    t0 = time.perf_counter()
    items = items_for(costs, list(ops))
    capacity = float(costs.capacity)
    core = float(costs.sram)
    peak = 0
    for _ in range(SRAM_RETRIES + 1):
        tl = plan_design(
            design,
            items,
            capacity,
            window=window,
            beam=beam,
            max_orders=max_orders,
            core_bytes=core,
            core_sram=core,
            workers=costs.cores,
            mesh=costs.mesh,
            paced=paced,
            window_data=window_data,
        )
        sched = ElkSchedule(design, costs, tuple(ops), tuple(items), tl, 0.0)
        if isinstance(chip, ChipCosts) or design == "ideal":
            break
        peak = _core_peak(sched, chip)
        if peak <= costs.sram:
            break
        capacity *= 0.98 * costs.sram / peak
        # what one core holds beside the plans (output tiles awaiting their consumer) comes
        # out of every core's budget too
        core -= peak - costs.sram
    else:
        raise ElkError(
            f"{design} plan of {len(ops)} operators on {costs.name}: a core needs {peak} bytes of "
            f"SRAM (it has {costs.sram}) even with the on-chip budget cut to "
            f"{capacity / 2**20:.0f} MiB; use a chip with more cores or SRAM, or fewer layers"
        )
    given = {"window": window, "beam": beam, "max_orders": max_orders, "window_data": window_data}
    search = tuple((k, v) for k, v in given.items() if v != DEFAULT_SEARCH[k])
    return dataclasses.replace(
        sched, plan_seconds=time.perf_counter() - t0, core_peak=peak or None, search=search
    )


#: compile options of a kernel-by-kernel plan's search -> plan_model's keywords
PLAN_OPTIONS = {
    "plan_window": "window",
    "plan_beam": "beam",
    "plan_orders": "max_orders",
    "plan_window_data": "window_data",
}


def plan_search(options: dict[str, Any]) -> dict[str, Any]:
    """Take the plan-search compile options (:data:`PLAN_OPTIONS`) out of ``options`` and
    return them as :func:`plan_model` keywords, checked: a smaller ``plan_window``,
    ``plan_beam`` or ``plan_orders`` plans a long step faster and may find a slower plan
    (``benchmarks/elk_figures.py`` plans with 8, 2 and 4 and ``plan_window_data=True``)."""
    out: dict[str, Any] = {}
    for name, key in PLAN_OPTIONS.items():
        if name not in options:
            continue
        v = options.pop(name)
        if key == "window_data":
            if not isinstance(v, bool):
                raise ElkError(f"{name}={v!r}: give True or False")
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ElkError(f"{name}={v!r}: give a positive integer")
        out[key] = v
    return out


def search_label(search: dict[str, Any]) -> str:
    """``search`` (plan_model keywords) as the compile options that give it."""
    names = {v: k for k, v in PLAN_OPTIONS.items()}
    return ", ".join(f"{names[k]}={v}" for k, v in search.items())


def _core_peak(s: ElkSchedule, chip: Chip) -> int:
    """Most bytes any core holds at once when ``s`` is placed on ``chip``."""
    from lowering.elk_placement import core_peaks  # lowering builds on elk: import when used

    n = len(s.ops)
    peaks = core_peaks(chip, s.ops, s.plans, s.order, s.issued)
    return int(peaks.max()) if n and peaks.size else 0
