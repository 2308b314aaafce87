"""Reusing a spatial plan across runs whose control values agree.

The per-unit programs of a plan read routing selectors, expert ids and KV lengths at run time
where their units decide from data (:mod:`.plan`), but the units after a Partition and the
decode-attention units after the KV-tile addresses are still specialised to one run's control
values (each expert's token count, each request's KV tiles), EagerMerge to one order.  So a plan
is reusable exactly for the runs that give every stream the same structure and control values:
its :func:`control_signature` — per stream, the nesting (where each dimension's stop tokens
fall) and the messages of every element (data tiles by dtype and size, control values by
value), the run's symbol bindings and the shapes of the off-chip tensors.  Floating-point
data (activations, weights) never enters a program, so runs that differ only in it — the
same layer reported again, another batch of embeddings with the same routing — share one plan:
:class:`PlanCache` builds a plan once per signature and rebinds the new run's integer tensors
(the control data the programs read, ``SpatialPlan.inputs``).

A run with a new signature gets a new plan, assembled unit by unit: :class:`PlanCache` keeps a
:class:`~.unit_reuse.UnitCache` per graph and chip, so the new plan takes the programs of the
units the new run does not change (the same instruction tuples) and emits only the others
(:mod:`.unit_reuse`); the plan so assembled is the one :func:`~.plan.build_plan` gives.  This
is the fallback for what the units are still specialised to (:mod:`.plan`): once a unit reads
its trip counts from the stop tokens it receives, its recorded run holds no count, and every
routing takes its program as it is.

A cached plan is the one before FIFO deepening (:mod:`.fifos`): a reused run deepens the same
channels again, so it reports the same deepened channels and FIFO bytes as a fresh plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import OrderedDict
from collections.abc import Hashable
from pathlib import Path

from hwmodel.chip import Chip
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult

from .context import int_contents, tensor_layouts
from .plan import SpatialPlan, build_plan
from .result import SpatialResult
from .simulate import simulate_plan
from .streams import element_parts, iter_nodes
from .unit_reuse import UnitCache, nesting

__all__ = ["control_signature", "PlanCache"]


def control_signature(graph: Program, run: RunResult) -> str:
    """A digest of everything of ``run`` the unit programs of ``graph`` are specialised to
    (module docstring): two runs with the same signature have the same plan."""
    h = hashlib.blake2b(digest_size=16)
    h.update(graph.name.encode())
    types = {v.name: v.type.dtype for v in graph.inputs}
    for outs in graph.node_outputs:
        for v in outs:
            types[v.name] = v.type.dtype
    for name in sorted(run.values):
        s = run.values[name]
        t = types.get(name)
        h.update(f"|{name}:{s.rank}:{nesting(s.data, s.rank)}".encode())
        if t is None:
            continue
        parts = [element_parts(x, t, k) for k, x in enumerate(iter_nodes(s.data, s.rank + 1))]
        h.update(repr(parts).encode())
    h.update(repr(sorted((str(k), str(v)) for k, v in run.bindings.items())).encode())
    shapes = sorted((n, tuple(a.shape), str(a.dtype)) for n, a in run.tensors.items())
    h.update(repr(shapes).encode())
    return h.hexdigest()


class PlanCache:
    """Plans of one graph by :func:`control_signature` of their run (at most ``size``, the
    least recently used dropped first); ``built`` / ``reused`` count the plans built and taken
    as they were, :meth:`units` the unit programs a new plan takes from earlier ones.

    The first plan of a graph and chip is kept unsigned, with its run: a single report never
    needs a signature (nothing to compare it with), so the digest of every stream's elements
    is computed only when a second run of the same graph and chip asks for a plan."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.plans: OrderedDict[Hashable, SpatialPlan] = OrderedDict()
        self.built = 0
        self.reused = 0
        # (graph id, chip id) -> (run, key) of the first plan, stored under a key not yet signed
        self._unsigned: dict[tuple[int, int], tuple[RunResult, Hashable]] = {}
        self._units: dict[tuple[int, int], UnitCache] = {}

    def _sign_first(self, graph: Program, base: tuple[int, int]) -> None:
        """Key the first plan of ``base`` by its run's signature (a second run has come)."""
        first = self._unsigned.pop(base, None)
        if first is None:
            return
        run, token = first
        plan = self.plans.pop(token, None)
        if plan is not None:  # not dropped meanwhile
            self.plans[(*base, control_signature(graph, run))] = plan

    def plan_for(self, graph: Program, chip: Chip, run: RunResult) -> tuple[SpatialPlan, bool]:
        """The plan of ``run``'s signature and whether it was reused: built the first time,
        after that the same programs with ``run``'s integer tensors."""
        base = (id(graph), id(chip))
        if not any(k[:2] == base for k in self.plans):  # the first run of graph on chip
            self._unsigned.pop(base, None)
            key: Hashable = (*base, object())  # signed when a second run comes
            self._unsigned[base] = (run, key)
            return self._build(key, graph, chip, run), False
        self._sign_first(graph, base)
        key = (*base, control_signature(graph, run))
        plan = self.plans.get(key)
        if plan is None:
            return self._build(key, graph, chip, run), False
        self.plans.move_to_end(key)
        self.reused += 1
        inputs = int_contents(tensor_layouts(graph, run), run.tensors)
        return dataclasses.replace(plan, inputs=inputs), True

    def units(self, graph: Program, chip: Chip) -> UnitCache:
        """The unit programs kept for ``graph`` on ``chip`` (:mod:`.unit_reuse`)."""
        base = (id(graph), id(chip))
        cache = self._units.get(base)
        if cache is None:
            cache = self._units[base] = UnitCache()
        return cache

    def _build(self, key: Hashable, graph: Program, chip: Chip, run: RunResult) -> SpatialPlan:
        plan = self.plans[key] = build_plan(graph, chip, run, units=self.units(graph, chip))
        self.built += 1
        while len(self.plans) > self.size:
            dropped, _ = self.plans.popitem(last=False)
            self._unsigned = {b: f for b, f in self._unsigned.items() if f[1] != dropped}
        live = {k[:2] for k in self.plans}  # the unit programs of graphs no plan is kept for go
        self._units = {b: u for b, u in self._units.items() if b in live}
        return plan

    def simulate(
        self,
        graph: Program,
        chip: Chip,
        run: RunResult,
        *,
        trace: bool | str | Path | None = None,
    ) -> SpatialResult:
        """Simulate ``graph`` on ``chip`` for ``run`` with the plan of its signature (its
        programs checked when built).  The plan kept is the one before FIFO deepening, so a
        reused run reports the same deepened channels (and their bytes) as the first."""
        t0 = time.perf_counter()
        plan, reused = self.plan_for(graph, chip, run)
        return simulate_plan(plan, trace=trace, check=not reused, plan_s=time.perf_counter() - t0)
