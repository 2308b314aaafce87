"""Spatial execution of STeP graphs on a chip (STeP §4.2, §5.1: the whole graph placed on the fabric at once).

Every STeP operator becomes a *unit* on its own core (:func:`place`); every stream a unit
produces becomes a channel — a bounded FIFO — to the units that read it.  From the graph and
one run of the reference interpreter (the run's stream contents: which expert each token went
to, each request's KV length, where stop tokens fall), each unit gets a per-core program
(:func:`build_plan`) whose steps follow the STeP simulator's timing model (:mod:`.timing`),
and the programs run on the event simulator (:func:`simulate_graph`)::

    from torch2step import step
    from torch2step.spatial import simulate_graph, format_placement

    res = step.run(prog, tensors={...}, streams={...})        # the functional run
    out = simulate_graph(prog, "step-sda", res, trace="moe.json")
    out.cycles, out.seconds, out.hbm_bytes, out.flops        # latency, traffic, work
    print(out.summary()); print(format_placement(out.placement))

Per-unit behaviour is one emitter per operator class (:data:`EMITTERS`); the per-element timing
rules are in the docstrings of :mod:`.emit_memory`, :mod:`.emit_compute`, :mod:`.emit_routing`
and :mod:`.emit_shape`.  Flatten, Promote, Zip and Reshape are wires by default (no unit,
:mod:`.structure`).  Sub-programs chained through off-chip tensors keep their read-after-write
order with completion tokens (:mod:`.hazards`); FIFOs that deadlock the run on reconvergent
paths are made as deep as their streams (:mod:`.fifos`).  :func:`roofline_cycles` is the
chip-level lower bound; :class:`SpatialResult` (:mod:`.result`) lists everything a report
needs.
"""

from .hazards import OffChipDep, offchip_deps
from .placement import WALKS, Placement, Unit, format_placement, place, walk_cores
from .plan import EMITTERS, SpatialPlan, UnitInfo, build_plan
from .result import CATEGORIES, SpatialResult, UnitRecord
from .simulate import roofline_cycles, simulate_graph, simulate_plan
from .structure import DEFAULT_WIRES, WIREABLE
from .timing import STEP_KERNEL, UnitConfig, simulation_chip

__all__ = [
    "CATEGORIES",
    "DEFAULT_WIRES",
    "EMITTERS",
    "STEP_KERNEL",
    "WALKS",
    "WIREABLE",
    "Placement",
    "SpatialPlan",
    "SpatialResult",
    "Unit",
    "UnitConfig",
    "UnitInfo",
    "UnitRecord",
    "build_plan",
    "OffChipDep",
    "format_placement",
    "offchip_deps",
    "place",
    "roofline_cycles",
    "simulate_graph",
    "simulate_plan",
    "simulation_chip",
    "walk_cores",
]
