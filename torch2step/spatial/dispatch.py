"""Dynamic parallelization decided in simulated time (STeP, arXiv 2511.07776, §5.4).

Dynamic parallelization sends the first ``R`` requests of a batch round-robin to the ``R``
regions, then "dispatches work to idle parallel regions in a greedy manner": request ``R + j``
goes to the region that signals the ``j``-th completion (an EagerMerge over the regions'
completion signals feeds the Partition that routes the requests).  Which region that is depends
on the simulated timing of the regions, not on data.

The graph of :mod:`torch2step.lower.blocks.gqa_regions` routes requests by a ``region`` tensor;
:func:`simulate_dispatched` decides it: starting from the round-robin assignment it simulates,
reads from the simulation the cycle at which each region emitted each request's last result
(every message of the regions' result streams is watched), lists these completions in
simulated-time order (ties by region index), assigns request ``R + j`` to the region of the
``j``-th completion, and simulates again, until the assignment the run used is the one its own
timing produces (a fixed point).  Near-tied completions can make two assignments produce
each other (a region that prefetches its next request slows the other one down); then, or
after ``max_rounds``, the fastest assignment simulated is returned with ``converged=False``.  A slower
region (or HBM) upstream changes the completions and therefore the assignment.

Difference from the paper's feedback loop: with the assignment fixed for a run, a region may
start loading its next request's KV rows before it has finished the current one (its FIFOs
prefetch), while the paper's region receives a request only after signalling completion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hwmodel.chip import Chip
from torch2step.errors import ScheduleError
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult, run
from torch2step.step.ops_routing import Partition

from .result import SpatialResult
from .simulate import simulate_graph
from .timing import UnitConfig

__all__ = ["Dispatched", "greedy_assignment", "list_schedule", "simulate_dispatched"]


@dataclass(frozen=True)
class Dispatched:
    """The simulation whose assignment is its own (``converged``), the run it used, the
    assignment (request -> region), each region's completion cycles and the rounds taken."""

    result: SpatialResult
    run: RunResult
    assignment: list[int]
    completions: dict[int, list[int]]
    rounds: int
    converged: bool


def greedy_assignment(batch: int, regions: int, completions: Mapping[int, list[int]]) -> list[int]:
    """Requests ``0..R-1`` round-robin; request ``R + j`` to the region of the ``j``-th
    completion in ``completions`` (region -> completion cycles), ordered by cycle then region."""
    events = sorted((t, r) for r, ts in completions.items() for t in ts)
    out = [i % regions for i in range(min(batch, regions))]
    for _, r in events[: max(batch - regions, 0)]:
        out.append(r)
    if len(out) < batch:
        raise ScheduleError(
            f"dynamic dispatch: {len(events)} completions for {batch} requests over {regions} "
            "regions; every request must signal its completion"
        )
    return out


def list_schedule(work: Sequence[float], regions: int) -> list[int]:
    """The greedy assignment for per-request ``work`` estimates (e.g. KV rows): requests
    ``0..R-1`` round-robin, then each to the region whose queued work ends first (ties by
    region index) — a starting point for :func:`simulate_dispatched`, not its decision."""
    free = [0.0] * regions
    out = []
    for i, w in enumerate(work):
        r = i if i < regions else min(range(regions), key=lambda j: (free[j], j))
        free[r] += float(w)
        out.append(r)
    return out


def _layout(graph: Program, prefix: str | None) -> tuple[str, str, int, int]:
    """(prefix, region tensor name, regions, results per request) of the region-parallel
    attention in ``graph`` (found by its request-routing Partition)."""
    routes = [
        op
        for op in graph.nodes
        if isinstance(op, Partition)
        and op.name.endswith("_route_cursor")
        and (prefix is None or op.name == f"{prefix}_route_cursor")
    ]
    if len(routes) != 1:
        raise ScheduleError(
            f"dynamic dispatch: graph {graph.name} has {len(routes)} region-parallel attention "
            f"layers{'' if prefix is None else f' named {prefix!r}'}; build one with "
            "add_gqa_decode(..., regions=R) (compile option attn_regions) or pass its prefix"
        )
    op = routes[0]
    p = op.name.removesuffix("_route_cursor")
    load = graph.node(f"{p}_region")
    heads = int(op.out_types()[0].shape[1])
    return p, load.tensor.name, op.num_consumers, heads  # type: ignore[attr-defined]


def simulate_dispatched(
    graph: Program,
    chip: Chip | str,
    tensors: Mapping[str, Any],
    *,
    prefix: str | None = None,
    env: Mapping[str, Any] | None = None,
    configs: Mapping[str, UnitConfig] | None = None,
    timing_only: bool = True,
    max_rounds: int = 8,
    start: Sequence[int] | None = None,
    depths: Mapping[str, int] | None = None,
) -> Dispatched:
    """Simulate the region-parallel attention ``graph`` (built by ``add_gqa_decode`` with
    ``regions``; ``prefix`` names it when the graph has several) with its region tensor
    decided in simulated time (module docstring).  ``start``: the first assignment tried
    (default round-robin; :func:`list_schedule` of the KV lengths usually needs fewer
    rounds); ``depths``: FIFO depths by stream name (:func:`simulate_graph`)."""
    prefix, rname, regions, heads = _layout(graph, prefix)
    lens = graph.node(f"{prefix}_len").tensor.name  # type: ignore[attr-defined]
    if lens not in tensors:
        raise ScheduleError(f"dynamic dispatch: tensors has no KV-length tensor {lens!r}")
    B = int(np.asarray(tensors[lens]).shape[0])
    assign = [i % regions for i in range(B)] if start is None else [int(r) for r in start]
    if len(assign) != B or not all(0 <= r < regions for r in assign):
        raise ScheduleError(
            f"dynamic dispatch: start {assign} is not {B} regions in 0..{regions - 1}"
        )
    tried: list[tuple[list[int], SpatialResult, RunResult, dict[int, list[int]]]] = []
    for k in range(1, max_rounds + 1):
        ts = dict(tensors)
        ts[rname] = torch.as_tensor(np.asarray(assign, dtype=np.int64).reshape(B, 1))
        res = run(graph, tensors=ts, env=env, check=False, timing_only=timing_only)
        watch: dict[str, Any] = {f"{prefix}_r{r}_o": [] for r in range(regions)}
        sim = simulate_graph(graph, chip, res, configs=configs, watch=watch, depths=depths)
        done = {r: watch[f"{prefix}_r{r}_o"][heads - 1 :: heads] for r in range(regions)}
        got = sum(len(v) for v in done.values())
        if got != B:
            raise ScheduleError(
                f"dynamic dispatch: watched {got} request completions of {B} on the streams "
                f"{', '.join(watch)}; build the graph with prefix={prefix!r}, heads={heads}"
            )
        new = greedy_assignment(B, regions, done)
        if new == assign:
            return Dispatched(sim, res, assign, done, k, True)
        tried.append((assign, sim, res, done))
        hit = [j for j, (a, *_) in enumerate(tried) if a == new]
        if hit:  # a cycle: near-tied completions that swap with the assignment
            tried = tried[hit[0] :]  # (prefetching regions); no assignment is its own
            break
        assign = new
    else:
        tried = tried[1:] or tried  # the greedy assignments (not the start)
    a, sim, res, done = min(tried, key=lambda x: (x[1].cycles, x[0]))
    return Dispatched(sim, res, a, done, len(tried), False)
