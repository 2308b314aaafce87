"""Simulate a STeP graph spatially on a chip and report the result.

``simulate_graph(graph, chip, run)`` builds the spatial plan (:mod:`.plan`) for the run ``run``
of the reference interpreter, checks the programs (``lowering.validate_programs``), runs them on
the event simulator (``runtime.simulate``, timing mode) and returns a :class:`SpatialResult`.

``roofline_cycles`` is the chip-level roofline bound: no schedule of the graph's work on the
chip can take fewer cycles than ``max(FLOPs / (cores x per-core FLOPs/cycle), HBM bytes / HBM
bytes per cycle)`` — every FLOP runs on some core at no more than its peak rate (the 16-bit rate,
as :meth:`TimingModel.rate`), and every off-chip byte crosses the HBM interface.  It ignores
latency and on-chip transfers, so it is a lower bound, not a prediction.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hwmodel.chip import Chip
from hwmodel.presets import load_chip
from lowering.validate import validate_programs
from runtime import SimResult, SimStats, simulate
from runtime.errors import SimulationError
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult
from torch2step.step.metrics import metrics

from .placement import Placement
from .plan import SpatialPlan, build_plan
from .structure import DEFAULT_WIRES
from .timing import TimingModel, UnitConfig

__all__ = ["UnitRecord", "SpatialResult", "simulate_graph", "simulate_plan", "roofline_cycles"]


@dataclass(frozen=True, slots=True)
class UnitRecord:
    """One unit after the run: its operators, cores, cycle breakdown (``busy`` + stalls +
    ``idle`` = total cycles), FLOPs, buffer bytes and elements received / sent."""

    name: str
    kinds: tuple[str, ...]
    cores: tuple[int, ...]
    busy: int
    stall_recv: int
    stall_send: int
    stall_mem: int
    idle: int
    finish: int
    flops: int
    sram_bytes: int
    received: int
    sent: int


@dataclass(frozen=True)
class SpatialResult:
    """Outcome of :func:`simulate_graph`.

    ``cycles`` / ``seconds``: latency of the graph; ``hbm_bytes``: bytes the simulator moved to
    and from HBM; ``flops``: FLOPs of all tile functions; ``units``: per-unit records;
    ``stats``: the simulator's statistics; ``events``: events the simulator processed;
    ``wall_s``: wall-clock seconds of program generation and simulation; ``roofline``: the
    chip-level bound (:func:`roofline_cycles`)."""

    graph: str
    chip: str
    cycles: int
    seconds: float
    hbm_bytes: int
    flops: int
    roofline: int
    units: tuple[UnitRecord, ...]
    stats: SimStats
    events: int
    wall_s: float
    placement: Placement
    sim: SimResult = field(repr=False, compare=False)
    plan: SpatialPlan = field(repr=False, compare=False)

    def unit(self, name: str) -> UnitRecord:
        """The record of the unit executing node ``name``."""
        return self.units[self.placement.units.index(self.placement.unit(name))]

    @property
    def roofline_fraction(self) -> float:
        """``roofline / cycles``: how close the run is to the chip-level bound."""
        return self.roofline / self.cycles if self.cycles else 0.0

    def trace_json(self) -> str:
        """Chrome trace JSON of the run (needs ``simulate_graph(..., trace=True)``); core tracks
        are named after the units on them."""
        if not self.sim.trace_events:
            raise SimulationError(
                "no trace was recorded; run simulate_graph(..., trace=True) or give a path"
            )
        names = {c: u for u in self.placement.units for c in u.cores}
        events = []
        for ev in self.sim.trace_events:
            if ev.get("ph") == "M" and ev.get("name") == "thread_name" and ev.get("pid") == 1:
                u = names.get(ev["tid"])
                if u is not None:
                    role = " ".join(f"{k} %{n}" for n, k in zip(u.ops, u.kinds))
                    if ev["tid"] != u.core:
                        role = f"memory of %{u.name}"
                    ev = {**ev, "args": {"name": f"{ev['args']['name']}: {role}"}}
            events.append(ev)
        doc = {
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {
                "graph": self.graph,
                "chip": self.chip,
                "time_unit": "1 trace microsecond = 1 cycle",
                "cycles": self.cycles,
            },
        }
        return json.dumps(doc, separators=(",", ":"))

    def write_trace(self, path: str | Path) -> Path:
        """Write :meth:`trace_json` to ``path``."""
        p = Path(path)
        p.write_text(self.trace_json())
        return p

    def summary(self) -> str:
        """A printable report: latency, traffic, roofline, and the busiest units."""
        lines = [
            f"graph {self.graph} on {self.chip}: {self.cycles} cycles ({self.seconds * 1e6:.3f} us), "
            f"{len(self.units)} units on {self.placement.cores_used} cores",
            f"HBM traffic {self.hbm_bytes} bytes, {self.flops} FLOPs, roofline {self.roofline} "
            f"cycles ({self.roofline_fraction:.1%} of it reached)",
            f"simulated {self.events} events in {self.wall_s:.2f} s",
            f"  {'unit':<24} {'busy':>10} {'recv':>10} {'send':>10} {'mem':>10}  operators",
        ]
        for u in sorted(self.units, key=lambda u: (-u.busy, u.name))[:12]:
            lines.append(
                f"  {u.name:<24} {u.busy:>10} {u.stall_recv:>10} {u.stall_send:>10} "
                f"{u.stall_mem:>10}  {', '.join(u.kinds)}"
            )
        return "\n".join(lines)


def roofline_cycles(
    graph_or_result: SpatialResult | Program, chip: Chip | str, run: RunResult | None = None
) -> int:
    """The chip-level roofline bound in cycles (module docstring) of a :class:`SpatialResult`,
    or of a graph and its ``run`` (FLOPs from the §4.1 formulas, bytes measured by the run)."""
    c = load_chip(chip)
    if isinstance(graph_or_result, SpatialResult):
        flops, nbytes = graph_or_result.flops, graph_or_result.hbm_bytes
    else:
        if run is None:
            raise SimulationError("roofline_cycles of a graph needs its run (RunResult)")
        flops = int(metrics(graph_or_result).evaluate(run.bindings)["flops"])
        nbytes = run.offchip_bytes
    peak = c.num_cores * TimingModel(c).default_rate
    return max(math.ceil(flops / peak), math.ceil(nbytes / c.hbm.bytes_per_cycle))


def simulate_plan(
    plan: SpatialPlan,
    *,
    trace: bool | str | Path | None = None,
    check: bool = True,
    max_cycles: int | None = None,
    started: float | None = None,
) -> SpatialResult:
    """Run a :class:`SpatialPlan` on the simulator (``check``: validate the programs first)."""
    t0 = time.perf_counter() if started is None else started
    if check:
        validate_programs(plan.programs, plan.sim_chip)
    sim = simulate(plan.programs, plan.sim_chip, trace=bool(trace), max_cycles=max_cycles)
    by_core = {c.core: c for c in sim.stats.cores}
    records = []
    for u, info in zip(plan.placement.units, plan.units):
        cs = by_core[u.core]
        records.append(
            UnitRecord(
                u.name,
                u.kinds,
                u.cores,
                cs.busy,
                cs.stall_recv,
                cs.stall_send,
                cs.stall_mem,
                cs.idle,
                cs.finish,
                info.flops,
                info.sram_bytes,
                info.received,
                info.sent,
            )
        )
    moved = dict(sim.stats.bytes_moved)
    hbm = moved.get("hbm_read", 0) + moved.get("hbm_write", 0)
    chip = plan.chip
    bound = max(
        math.ceil(plan.flops / (chip.num_cores * TimingModel(chip).default_rate)),
        math.ceil(hbm / chip.hbm.bytes_per_cycle),
    )
    result = SpatialResult(
        plan.graph.name,
        chip.name,
        sim.cycles,
        chip.cycles_to_seconds(sim.cycles),
        hbm,
        plan.flops,
        bound,
        tuple(records),
        sim.stats,
        sim.stats.events.events,
        time.perf_counter() - t0,
        plan.placement,
        sim,
        plan,
    )
    if isinstance(trace, (str, Path)):
        result.write_trace(trace)
    return result


def simulate_graph(
    graph: Program,
    chip: Chip | str,
    run: RunResult,
    *,
    trace: bool | str | Path | None = None,
    configs: Mapping[str, UnitConfig] | None = None,
    walk: str = "hilbert",
    wires: Iterable[str] = DEFAULT_WIRES,
    fifo_depth: int | None = None,
    check: bool = True,
    max_cycles: int | None = None,
) -> SpatialResult:
    """Place ``graph`` spatially on ``chip`` (a :class:`Chip` or preset name), generate the unit
    programs from ``run`` (the reference interpreter's :class:`RunResult` on the real inputs)
    and simulate them.  ``trace``: ``True`` records a Chrome trace, a path also writes it;
    ``configs``: per-node :class:`UnitConfig`; ``walk``: placement order; ``wires``: operator
    classes that occupy no unit; ``fifo_depth``: channel depth (default the core's)."""
    t0 = time.perf_counter()
    plan = build_plan(
        graph, chip, run, configs=configs, walk=walk, wires=wires, fifo_depth=fifo_depth
    )
    return simulate_plan(plan, trace=trace, check=check, max_cycles=max_cycles, started=t0)
