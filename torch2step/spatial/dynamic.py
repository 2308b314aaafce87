"""Timing-dependent decisions made in simulated time (STeP, arXiv 2511.07776, §5.3, §5.4).

An EagerMerge forwards "whichever input is ready first": which one that is depends on the
simulated timing of its producers, not on data.  An expert region's merge, with static or
dynamic tiling, with the routing weights applied after the regions or in them (each row zipped
with its token's expert ids and weights, the default layer), makes that choice in the
simulation itself (:mod:`.merge_any`: a ``WaitAny`` over its inputs' channels, the first
arrival taken), and its region's units read what it chose at run time, so one simulation
decides and runs the order: :func:`simulate_decided` records the merge's choices
(``runtime.ops_select.watch_key``), re-runs the reference interpreter with the chunks in that
order (the run whose streams the plan's bookkeeping and the functional result follow) and, when
that run's plan is the simulated one (every unit's program independent of the order, as the
regions' are), returns without simulating again.  The FIFOs that run deepens are those the
order its merges took needs (:mod:`.fifos`: the untimed replay follows the timed run's order).

A merge whose program follows the run's order (its units unrolled over its chunks in that
order: a merge outside an expert region, e.g. of two producers' streams) still needs the
search over rounds: simulate with an order, read from the simulation the cycle at which every
merge input sent its first element, re-run the interpreter with the chunks ordered by those
cycles (ties by input index) and simulate again, until the order the programs follow is the
order the simulation produces (a fixed point) or ``max_rounds`` is reached (the result says
which).  Either way the decisions follow simulated time: a slower HBM or a slower unit
upstream of a merge changes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hwmodel.chip import Chip
from runtime.ops_select import watch_key
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult, run
from torch2step.step.ops_routing import EagerMerge
from torch2step.step.ops_shape import Flatten, Promote

from .merge_any import pick
from .plan import build_plan
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
        watch: dict[str, Any] = {src.get(v.name, v.name): -1 for op in merges for v in op.ins}
        watch.update({watch_key(pick(op)): [] for op in merges})
        sim = simulate_graph(graph, chip, res, configs=configs, watch=watch or None)
        new = {op.name: _decided(op, res, watch, src) for op in merges}
        if not merges or new == _current(merges, res, arrival):
            return Decided(sim, res, new, k, True)
        arrival = new
        res = run(
            graph, tensors=tensors, env=env, check=False, timing_only=timing_only, arrival=arrival
        )
        if all(watch[watch_key(pick(op))] for op in merges) and _same_plan(sim, res, configs):
            # every merge decided in the simulation and no program follows the order: the
            # simulation already ran the decided order
            return Decided(sim, res, new, k, True)
    return Decided(sim, res, arrival, max_rounds, False)


def _decided(
    op: EagerMerge, res: RunResult, watch: Mapping[str, Any], src: Mapping[str, str]
) -> list[int]:
    """The input of each chunk merge ``op`` took: its ``WaitAny``'s choices when it made them
    in the simulation (an input's choices past its chunks took its stop token alone), else
    the inputs ordered by the cycle their first element was sent (:func:`_order`)."""
    chose = watch.get(watch_key(pick(op)))
    if not chose:
        return _order(op, res, watch, src)
    left = [_chunks(res, v.name) for v in op.ins]
    out = []
    for i in chose:
        if left[i]:
            left[i] -= 1
            out.append(i)
    return out


def _same_plan(
    sim: SpatialResult, res: RunResult, configs: Mapping[str, UnitConfig] | None
) -> bool:
    """Whether run ``res``'s plan has the programs and bookkeeping ``sim`` simulated."""
    plan = sim.plan
    again = build_plan(plan.graph, plan.chip, res, configs=configs)
    a, b = again.programs, plan.programs
    return (
        again.units == plan.units
        and a.programs == b.programs
        and (a.tensors, a.barriers) == (b.tensors, b.barriers)
        and _routes(a.channels) == _routes(b.channels)
    )


def _routes(channels: Any) -> set[tuple[str, int, tuple[int, ...]]]:
    """The channels as declared, in any order and at any depth (the simulation deepens the
    channels that deadlock it, :mod:`.fifos`)."""
    return {(c.name, c.src, c.dsts) for c in channels}


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
