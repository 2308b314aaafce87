"""Simulate a STeP graph spatially on a chip and report the result.

``simulate_graph(graph, chip, run)`` builds the spatial plan (:mod:`.plan`) for the run ``run``
of the reference interpreter, checks the programs once (``lowering.validate_programs``), runs
them on the event simulator (``runtime.Simulator``, timing mode; FIFOs whose bounded depth would
deadlock the run are found on an untimed replay and deepened first, so the timed run runs once,
:mod:`.fifos`) and returns a :class:`SpatialResult`.

``roofline_cycles`` is the chip-level roofline bound: no schedule of the graph's work on the
chip can take fewer cycles than ``max(FLOPs / (cores x per-core FLOPs/cycle), HBM bytes / HBM
bytes per cycle)`` — every FLOP runs on some core at no more than its peak rate (the 16-bit rate,
as :meth:`TimingModel.rate`), and every off-chip byte crosses the HBM interface.  It ignores
latency and on-chip transfers, so it is a lower bound, not a prediction (as long as no
:class:`UnitConfig` allocates a unit more than the core's peak FLOPs/cycle).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hwmodel.chip import Chip
from hwmodel.presets import load_chip
from lowering.validate import validate_programs
from runtime.engine import gc_paused
from runtime.errors import SimulationError
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult
from torch2step.step.metrics import metrics

from .fifos import deepen, run_deepening
from .plan import SpatialPlan, build_plan
from .result import SpatialResult, UnitRecord
from .sram import check_sram
from .structure import DEFAULT_WIRES
from .timing import TimingModel, UnitConfig

__all__ = ["simulate_graph", "simulate_plan", "roofline_cycles"]


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
    return _bound(c, flops, nbytes)


def _bound(chip: Chip, flops: int, nbytes: int) -> int:
    peak = chip.num_cores * TimingModel(chip).default_rate
    return max(math.ceil(flops / peak), math.ceil(nbytes / chip.hbm.bytes_per_cycle))


def simulate_plan(
    plan: SpatialPlan,
    *,
    trace: bool | str | Path | None = None,
    check: bool = True,
    max_cycles: int | None = None,
    plan_s: float = 0.0,
    watch: dict[str, int] | None = None,
) -> SpatialResult:
    """Run a :class:`SpatialPlan` on the simulator (``check``: validate the programs first;
    ``plan_s``: the seconds it took to build ``plan``, carried into the result)."""
    t0 = time.perf_counter()
    with gc_paused():  # validation allocates many small acyclic objects (as plan building does)
        if check:
            validate_programs(plan.programs, plan.sim_chip)
        sim, ran, deep = run_deepening(
            plan.programs,
            plan.sim_chip,
            plan.messages,
            trace=bool(trace),
            max_cycles=max_cycles,
            watch=watch,
            checked=check,
            inputs=plan.inputs,
        )
    unit_at = {c: k for k, u in enumerate(plan.placement.units) for c in u.cores}
    fifo_bytes = [0] * len(plan.units)
    for ch in ran.channels:
        if ch.name in deep:
            for d in ch.dsts:
                fifo_bytes[unit_at[d]] += plan.message_bytes.get(ch.name, 0)
    by_core = {c.core: c for c in sim.stats.cores}
    records = []
    for k, (u, info) in enumerate(zip(plan.placement.units, plan.units)):
        cs = by_core[u.core]
        records.append(
            UnitRecord(
                u.name,
                u.ops,
                u.kinds,
                u.cores,
                cs.busy,
                cs.stall_recv,
                cs.stall_send,
                cs.stall_mem + cs.stall_barrier,  # a storing unit's fence waits for its writes
                cs.idle,
                cs.finish,
                info.flops,
                cs.sram_peak_bytes,  # what the run held (Alloc.held: not a buffer's bound)
                fifo_bytes[k],
                info.received,
                info.sent,
            )
        )
    moved = dict(sim.stats.bytes_moved)
    chip = plan.chip
    peak = TimingModel(chip).default_rate
    rd, wr = moved.get("hbm_read", 0), moved.get("hbm_write", 0)
    bound = _bound(chip, plan.flops, rd + wr)
    result = SpatialResult(
        plan.graph.name,
        chip.name,
        sim.cycles,
        chip.cycles_to_seconds(sim.cycles),
        rd,
        wr,
        moved.get("noc_messages", 0),
        plan.flops,
        bound,
        peak,
        tuple(records),
        sim.stats,
        sim.stats.events.events,
        plan_s,
        time.perf_counter() - t0,
        plan.placement,
        sim,
        dataclasses.replace(plan, programs=ran),
        deep,
        check_sram(tuple(records), chip),
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
    watch: dict[str, Any] | None = None,
    depths: Mapping[str, int] | None = None,
) -> SpatialResult:
    """Place ``graph`` spatially on ``chip`` (a :class:`Chip` or preset name), generate the unit
    programs from ``run`` (the reference interpreter's :class:`RunResult` on the real inputs)
    and simulate them.  ``trace``: ``True`` records a Chrome trace, a path also writes it;
    ``configs``: per-node :class:`UnitConfig`; ``walk``: placement order; ``wires``: operator
    classes that occupy no unit; ``fifo_depth``: channel depth (default the core's; channels
    that deadlock the run are deepened, ``SpatialResult.deep_channels``); ``watch``: channel
    names -> ``-1``, filled with each channel's first-message cycle (a list: every message's);
    ``depths``: stream name -> FIFO depth of its channel (e.g. a region's request queue).  Raises
    :class:`~torch2step.errors.ScheduleError` when the chip has fewer cores than units and
    :class:`~runtime.DeadlockError` when no FIFO depth can make the run complete."""
    t0 = time.perf_counter()
    plan = build_plan(
        graph, chip, run, configs=configs, walk=walk, wires=wires, fifo_depth=fifo_depth
    )
    if depths:
        plan = dataclasses.replace(plan, programs=deepen(plan.programs, depths))
    plan_s = time.perf_counter() - t0
    return simulate_plan(
        plan, trace=trace, check=check, max_cycles=max_cycles, plan_s=plan_s, watch=watch
    )
