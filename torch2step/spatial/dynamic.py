"""Timing-dependent decisions made in simulated time (STeP, arXiv 2511.07776, §5.3, §5.4).

An EagerMerge forwards "whichever input is ready first": which one that is depends on the
simulated timing of its producers, not on data.  The unit programs of a spatial plan are
specialised to one run of the reference interpreter, whose ``arrival`` parameter fixes each
merge's order.  :func:`simulate_decided` closes the loop: it simulates with an order, reads
from the simulation the cycle at which every merge input sent its first element, re-runs the
interpreter with the chunks ordered by those cycles (ties by input index) and simulates again,
until the order the programs follow is the order the simulation produces (a fixed point) or
``max_rounds`` is reached (the result says which).  The decisions therefore follow simulated
time: a slower HBM or a slower unit upstream of a merge changes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hwmodel.chip import Chip
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult, run
from torch2step.step.ops_routing import EagerMerge
from torch2step.step.ops_shape import Flatten, Promote

from .result import SpatialResult
from .simulate import simulate_graph
from .timing import UnitConfig

__all__ = ["Decided", "simulate_decided"]


@dataclass(frozen=True)
class Decided:
    """The simulation whose merge orders are its own (``converged``), the run it used, the
    orders (merge node -> input index per chunk) and the rounds it took."""

    result: SpatialResult
    run: RunResult
    arrival: dict[str, list[int]]
    rounds: int
    converged: bool


def _chunks(res: RunResult, name: str) -> int:
    data = res.values[name].data
    return len(data) if isinstance(data, list) else 0


def _sources(graph: Program) -> dict[str, str]:
    """Stream name -> the stream of the unit that produces it (through wires such as
    Promote and Flatten, which occupy no unit and carry their input's messages)."""
    producer = {o.name: op for op, outs in zip(graph.nodes, graph.node_outputs) for o in outs}
    out = {}
    for name in producer:
        cur = name
        while isinstance(producer.get(cur), (Promote, Flatten)):
            cur = producer[cur].input.name
        out[name] = cur
    return out


def _order(
    op: EagerMerge, res: RunResult, first: Mapping[str, int], src: Mapping[str, str]
) -> list[int]:
    keyed = []
    for i, v in enumerate(op.ins):
        n = _chunks(res, v.name)
        if n:
            t = first.get(src.get(v.name, v.name), -1)
            keyed.append((t if t >= 0 else 1 << 62, i, n))
    out: list[int] = []
    for _, i, n in sorted(keyed):
        out.extend([i] * n)
    return out


def simulate_decided(
    graph: Program,
    chip: Chip | str,
    tensors: Mapping[str, Any],
    *,
    env: Mapping[str, Any] | None = None,
    configs: Mapping[str, UnitConfig] | None = None,
    timing_only: bool = True,
    max_rounds: int = 6,
) -> Decided:
    """Simulate ``graph`` on ``tensors`` with every EagerMerge's order decided in simulated
    time (module docstring)."""
    merges = [op for op in graph.nodes if isinstance(op, EagerMerge)]
    src = _sources(graph)
    arrival: dict[str, list[int]] = {}
    res = run(graph, tensors=tensors, env=env, check=False, timing_only=timing_only)
    for k in range(1, max_rounds + 1):
        watch = {src.get(v.name, v.name): -1 for op in merges for v in op.ins}
        sim = simulate_graph(graph, chip, res, configs=configs, watch=watch or None)
        new = {op.name: _order(op, res, watch, src) for op in merges}
        if not merges or new == _current(merges, res, arrival):
            return Decided(sim, res, new, k, True)
        arrival = new
        res = run(
            graph, tensors=tensors, env=env, check=False, timing_only=timing_only, arrival=arrival
        )
    return Decided(sim, res, arrival, max_rounds, False)


def _current(merges: list[EagerMerge], res: RunResult, arrival: dict[str, list[int]]) -> dict:
    """The order each merge followed in ``res`` (given, or the interpreter's default)."""
    out = {}
    for op in merges:
        if op.name in arrival:
            out[op.name] = arrival[op.name]
            continue
        sel = res.values[op.out_names()[1]]
        out[op.name] = [s.indices[0] for s in _flat(sel.data)]
    return out


def _flat(data: Any) -> list:
    if isinstance(data, list):
        return [x for d in data for x in _flat(d)]
    return [data]
