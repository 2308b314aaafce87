"""A whole decode step of ``N`` identical layers run kernel by kernel (ELK §4.4).

The body's ELK operators (:func:`torch2step.kernel.graph.graph_ops`) are repeated ``N`` times,
each copy reading its own weights and KV cache and the previous layer's output, and the
``N x ops`` list is planned as one model by :func:`elk.plan.plan_model`: preloads of the next
layer overlap the current one, and the preload order permutation found on the first layer is
applied to every identical layer (:mod:`elk.reorder`, ELK §4.4: ``layer`` / ``slot`` of each
operator).  ``report(sim_layers=k)`` with ``k`` below 5 simulates the per-core programs of the
first ``k`` layers of that plan (the plan cut after layer ``k``: the same execute plans, preload
order and issue points, without the preloads of later layers) and adds the plan's prediction
for the rest; from 5 it simulates a ``k``-layer step planned on its own and times the layers in
between by its steady period (:mod:`torch2step.kernel.steady`) when it shows one.  The step's
plan is made when first needed (:attr:`KernelStackProgram.schedule`), so such a report plans the
``k``-layer step, starts building and simulating it in a worker process
(:func:`torch2step.config_jobs.started`) and plans the ``N``-layer step meanwhile, its
processes yielding the worker its CPU (:func:`elk.reorder.yielding`): the two independent
halves of the report on two CPUs, with the result of making them one after the other (with
one worker, ``TORCH2STEP_JOBS=1``, they are).  Where the two plans differ in the
layers a period shows in, the worker is stopped and the step's own first layers are simulated
instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from elk.plan import ElkSchedule, plan_model
from elk.reorder import yielding
from hwmodel.chip import Chip
from lowering.elk_placement import tile_major
from lowering.elk_programs import elk_programs
from lowering.isa import ProgramSet
from runtime import gc_paused
from torch2step.config_jobs import Started, started
from torch2step.errors import LoweringError
from torch2step.kernel.build import bind_timing, timing_links
from torch2step.kernel.graph import GraphOps, graph_ops
from torch2step.kernel.program import check_inputs, output
from torch2step.kernel.report import KernelReport, per_token, simulate_schedule
from torch2step.kernel.steady import (
    MIN_LAYERS,
    Steady,
    layers_differ,
    plans_differ,
    steady_period,
)
from torch2step.layers.graph import LayerGraph, format_layer_graph
from torch2step.layers.stack import Repeat

__all__ = ["KernelStackProgram", "KernelStackReport", "stack_graph_ops"]


def _layer_inputs(op: Repeat, inputs: Sequence[torch.Tensor], i: int) -> tuple:
    c, s = op.carried, op.stacked
    return (*inputs[:c], *(t[i] for t in inputs[c : c + s]), *inputs[c + s :])


def stack_graph_ops(body: GraphOps, layer: LayerGraph, op: Repeat) -> GraphOps:
    """``op.count`` copies of ``body``'s operators: copy ``l``'s tensors are prefixed ``L<l>.``,
    its carried inputs are copy ``l-1``'s carried outputs, ``Operator.layer`` is ``l`` and the
    slots are the body's (identical layers for ELK §4.4)."""
    g = op.body
    out = GraphOps(dtype=body.dtype)
    n = len(body.ops)
    carried_in, carried_out = g.inputs[: op.carried], g.outputs[: op.carried]
    for li in range(op.count):

        def ren(t: str, li: int = li) -> str:
            if li and t in carried_in:
                return f"L{li - 1}.{carried_out[carried_in.index(t)]}"
            return f"L{li}.{t}"

        for t, decl in body.tensors.items():
            out.tensors.setdefault(ren(t), decl)
        for o in body.ops:
            out.ops.append(
                dataclasses.replace(
                    o,
                    name=f"L{li}.{o.name}",
                    layer=li,
                    tensors=tuple((r, ren(t)) for r, t in o.tensors),
                    routed_by=None if o.routed_by is None else f"L{li}.{o.routed_by}",
                )
            )
        for i, w in body.weights.items():
            out.weights[li * n + i] = ren(w)
        for v, (cache, row, axis) in body.appends.items():
            out.appends[ren(v)] = (ren(cache), ren(row), axis)
    last = op.count - 1
    out.outputs = [(f"L{last}.{v}", shp) for v, shp in body.outputs[: op.carried]]
    out.outputs += [
        (f"L{li}.{v}", shp) for v, shp in body.outputs[op.carried :] for li in range(op.count)
    ]
    out.shapes_only = body.shapes_only
    out.notes = [f"each layer's {n}" for n in body.notes]
    return out


def _simulated(
    src: KernelStackProgram, layers: int, tokens: int, copy_starts: bool
) -> tuple[KernelReport, float]:
    """The timing report of ``src``'s first ``layers`` layers and the seconds building their
    per-core programs took."""
    # one collector pause across building, compiling and running (runtime.gc_paused): with
    # the collector back on between them, the first allocations after the build walk every
    # instruction of it
    with gc_paused():
        t0 = time.perf_counter()
        ps = src.programs(layers)
        build = time.perf_counter() - t0
        rep = simulate_schedule(
            src.schedule, src.chip, programs=ps, inputs={}, tokens=tokens, copy_starts=copy_starts
        )
    return rep, build


class KernelStackProgram:
    """``count`` identical layers planned as one model and lowered to per-core programs."""

    execution = "kernel"

    def __init__(
        self,
        layer: LayerGraph,
        op: Repeat,
        chip: Chip,
        example_inputs: Sequence[torch.Tensor],
        design: str = "elk_full",
        routing: Any = None,
        body_ops: GraphOps | None = None,
        search: dict[str, Any] | None = None,
    ) -> None:
        """``body_ops``: the body's operators when already made (:meth:`shorter`);
        ``search``: the plan's search budget (:func:`elk.plan.plan_search`)."""
        self.layer, self.op, self.chip, self.design = layer, op, chip, design
        self.search = dict(search or {})
        #: the tokens of the batch (the step's requests), for the time per token; None: not
        #: known (report(tokens=...) gives it)
        self.tokens: int | None = None
        self.example_inputs = tuple(example_inputs)
        if body_ops is None:
            # ``routing``: every layer's experts are those its ids select (a shapes-only body)
            body_ops = graph_ops(op.body, _layer_inputs(op, self.example_inputs, 0), routing)
        self.body_ops: GraphOps = body_ops
        self.graph: GraphOps = stack_graph_ops(self.body_ops, layer, op)
        self._schedule: ElkSchedule | None = None

    @property
    def schedule(self) -> ElkSchedule:
        """The step's plan (ELK §4.4), made when first asked for: :meth:`report` of a steady
        period simulates a shorter step beside it."""
        if self._schedule is None:
            self._schedule = plan_model(
                self.graph.ops, self.chip, self.design, dtype=self.graph.dtype, **self.search
            )
        return self._schedule

    @property
    def count(self) -> int:
        return self.op.count

    def _tensors(self, ops: int) -> dict[str, tuple[tuple[int, ...], str]]:
        tensors = dict(self.graph.tensors)
        for i, wname in self.graph.weights.items():
            if i < ops:
                k, n = tensors[wname][0]
                t = self.schedule.plans[i].tiles[2]
                tensors[wname] = ((k * t, n // t), self.graph.dtype)
        return tensors

    def programs(self, layers: int | None = None) -> ProgramSet:
        """Per-core programs of the first ``layers`` layers of the plan (default: all)."""
        k = self.count if layers is None else layers
        if not 1 <= k <= self.count:
            raise LoweringError(f"{self.layer.name}: simulate 1..{self.count} layers, not {k}")
        n = k * len(self.body_ops.ops)
        s = self.schedule
        order = [o for o in s.order if o < n]
        issued = [sum(1 for o in s.order[:p] if o < n) for p in s.issued[:n]]
        mine = {f"L{li}" for li in range(k)}
        results = [t for t in self.graph.stored() if t.split(".", 1)[0] in mine]
        results += [f"L{k - 1}.{v}" for v in self.body_ops.stored()[: self.op.carried]]
        ops, tensors, links = self.graph.ops[:n], self._tensors(n), {}
        if self.graph.shapes_only:  # timing tensors, activations core to core
            ops, tensors = bind_timing(ops, s.plans[:n])
            links, results = timing_links(ops, tensors), []
        with gc_paused():  # millions of acyclic instructions on a large chip
            return elk_programs(
                self.chip,
                ops,
                s.plans[:n],
                order,
                issued,
                tensors,
                name=f"elk_{s.design}_x{k}",
                links=links,
                results=sorted(set(results)),
            )

    def predicted_cycles(self, layers: int) -> float:
        """The plan's predicted end of layer ``layers``'s last operator."""
        return self.schedule.timeline.steps[layers * len(self.body_ops.ops) - 1].end

    def _bound(self, inputs: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
        op, n = self.op, len(self.body_ops.ops)
        vals: dict[str, np.ndarray] = {}
        for li in range(op.count):
            body = op.body
            if op.layer_params:
                body = dataclasses.replace(body, params=dict(op.layer_params[li]))
            g = graph_ops(body, _layer_inputs(op, inputs, li))
            for i, w in g.weights.items():
                g.values[w] = tile_major(g.values[w], self.schedule.plans[li * n + i])
            for name, v in g.values.items():
                want = self.graph.tensors.get(f"L{li}.{name}")
                if want is None or (li and name in body.inputs[: op.carried]):
                    continue  # not read, or the previous layer's output
                if name not in g.weights.values():
                    v = np.ascontiguousarray(v).reshape(want[0])
                vals[f"L{li}.{name}"] = v
        return vals

    def run(self, *inputs: torch.Tensor) -> Any:
        """Simulate all layers functionally; returns what the stack returns."""
        if self.graph.shapes_only:
            raise LoweringError(
                f"{self.layer.name}: run() needs weights and input values; this stack was "
                "compiled from shapes only (a config): use report() for timing"
            )
        ins = check_inputs(self.layer, self.example_inputs, inputs, "run")
        rep = simulate_schedule(
            self.schedule,
            self.chip,
            mode="functional",
            programs=self.programs(),
            inputs=self._bound(ins),
        )
        assert rep.result is not None
        res = rep.result.tensors
        op = self.op
        named = {
            f"L{li}.{name}": t
            for li in range(op.count)
            for name, t in zip(op.body.inputs, _layer_inputs(op, ins, li))
        }
        c = op.carried
        outs = [output(self.graph, res, named, v) for v, _ in self.graph.outputs[:c]]
        per = self.graph.outputs[c:]
        for k in range(len(self.body_ops.outputs) - c):
            layers = per[k * op.count : (k + 1) * op.count]
            outs.append(torch.stack([output(self.graph, res, named, v) for v, _ in layers]))
        return tuple(outs)

    def shorter(self, layers: int) -> KernelStackProgram:
        """The same step with its first ``layers`` layers, planned as a model of its own."""
        if not 1 <= layers <= self.count:
            raise LoweringError(f"{self.layer.name}: 1..{self.count} layers, not {layers}")
        op = dataclasses.replace(self.op, count=layers, layer_params=self.op.layer_params[:layers])
        return KernelStackProgram(
            self.layer,
            op,
            self.chip,
            self.example_inputs,
            self.design,
            body_ops=self.body_ops,
            search=self.search,
        )

    def report(self, sim_layers: int | None = None, tokens: int | None = None) -> KernelStackReport:
        """Simulate ``sim_layers`` layers in timing mode (default ``min(N, MIN_LAYERS)``: every
        layer of a short step, else a step timed by its steady period) and time the rest
        (:class:`KernelStackReport`): with at least :data:`~torch2step.kernel.steady.MIN_LAYERS`
        of them (and fewer than the step's), a ``sim_layers``-layer step planned as a model of
        its own (:meth:`shorter`: its end is planned as this step's end is) whose steady
        period times the layers in between, provided its plan decides the layers a period can
        show in as this plan does; if it does not, the first ``sim_layers`` layers of this plan,
        whose steady period times the rest, their last layers standing for the step's (an
        estimate: they lack the later layers' preloads); with fewer layers, or no period, the
        first ``sim_layers`` layers of this plan and the plan's prediction for the rest (an
        estimate a few percent off: the simulated layers run without the next layers'
        preloads, which the prediction for the rest counts as already overlapped)."""
        if sim_layers is None:
            sim_layers = min(self.count, MIN_LAYERS)
        if not 1 <= sim_layers <= self.count:
            raise LoweringError(
                f"{self.layer.name}: simulate 1..{self.count} layers, not {sim_layers}"
            )
        tokens = tokens or self.tokens or 1
        per_layer = len(self.body_ops.ops)
        rest = MIN_LAYERS <= sim_layers < self.count  # timed by a steady period if one shows
        src, cut = self, ""
        job: Started | None = None
        if rest:
            short = self.shorter(sim_layers)
            if self._schedule is None:
                # the shorter step is planned, then built and simulated in a worker while
                # this step is planned here (config_jobs.started: two CPUs, the same result)
                short.schedule  # noqa: B018 - planned before the worker is forked
                job = started(partial(_simulated, short, sim_layers, tokens, True))
            # a period shows first from layer 3 on (torch2step.kernel.steady)
            with _beside(job):
                differ = plans_differ(self.schedule, short.schedule, 3 * per_layer)
            if differ:
                cut = f"a {sim_layers}-layer step is planned otherwise ({differ})"
                if job is not None:
                    job.cancel()
                    job = None
            else:
                src = short
        own = src is not self
        with _beside(job):
            ideal = self.schedule.ideal().cycles  # (beside the worker's simulation, if any)
        rep, build = job() if job is not None else _simulated(src, sim_layers, tokens, rest)
        steady = None
        if rest:
            res = rep.result
            steady = steady_period(res.copy_starts, per_layer, sim_layers, res.copy_marks)
            if cut:
                steady = dataclasses.replace(steady, cut=cut)
            elif steady.period is not None:
                differ = plans_differ(
                    self.schedule, src.schedule, steady.first * per_layer
                ) or layers_differ(
                    self.schedule, src.schedule, per_layer, steady.first, steady.last
                )
                if differ:
                    steady = Steady(None, why=f"the {sim_layers}-layer plan differs: {differ}")
        rep = dataclasses.replace(rep, notes=tuple(self.graph.notes))
        return KernelStackReport(
            rep,
            self.count,
            sim_layers,
            src.schedule.cycles if own else self.predicted_cycles(sim_layers),
            build,
            ideal,
            steady,
            self.schedule if own else None,
        )

    def __str__(self) -> str:
        return f"{format_layer_graph(self.layer)}\n\n{self.schedule}"

    def print(self) -> None:
        print(self)


def _beside(job: Started | None) -> AbstractContextManager:
    """Plans made while ``job`` runs in a worker yield to it (:func:`elk.reorder.yielding`: the
    plan's processes at a lower priority), so the worker's simulation keeps a CPU and the plan
    takes the CPU time left: three processes on two CPUs, whichever half takes longer."""
    return yielding() if job is not None and job.in_worker else nullcontext()


@dataclass(frozen=True)
class KernelStackReport:
    """A plan of ``layers`` layers, its first ``sim_layers`` simulated (ELK §6.2-§6.3 terms).

    ``cycles`` (the whole step) adds to the simulated cycles of the first ``sim_layers`` those
    of the layers not simulated: the simulated steady period per layer when the simulated
    layers showed one (``steady``, :mod:`torch2step.kernel.steady`), else the plan's
    prediction for them; ``sim.cycles`` alone is simulated."""

    sim: KernelReport
    layers: int
    sim_layers: int
    sim_predicted: float
    build_seconds: float
    ideal: float  # the Ideal design's predicted cycles for the whole step (ELK §6.1)
    steady: Steady | None = None  # the simulated layers' steady period (None: all simulated)
    #: the step's plan when the simulated layers were planned on their own (``sim.schedule``)
    plan: ElkSchedule | None = None

    @property
    def by_period(self) -> bool:
        """The layers not simulated are timed by the simulated steady period."""
        return self.steady is not None and self.steady.period is not None

    @property
    def schedule(self) -> ElkSchedule:
        """The whole step's plan."""
        return self.plan if self.plan is not None else self.sim.schedule

    @property
    def predicted(self) -> float:
        return self.schedule.cycles

    @property
    def cycles(self) -> int:
        """Simulated cycles of the first layers plus the rest's: their steady period, else
        the plan's prediction for them."""
        if self.by_period:
            assert self.steady is not None and self.steady.period is not None
            return self.sim.cycles + (self.layers - self.sim_layers) * self.steady.period
        return round(self.sim.cycles + (self.predicted - self.sim_predicted))

    def to_dict(self) -> dict[str, Any]:
        s, r = self.schedule, self.sim
        us = self.cycles / (s.costs.clock_ghz * 1e3)
        tot = max(s.cycles, 1e-9)
        return {
            "execution": "kernel",
            "design": s.design,
            "chip": s.costs.name,
            "layers": self.layers,
            "operators": len(s.ops),
            "simulated_layers": self.sim_layers,
            **self._rest_fields(),
            "cycles": self.cycles,
            # the spatial report's names for the same figures (torch2step.report.Report)
            "latency_cycles": self.cycles,
            "latency_s": self.cycles / (s.costs.clock_ghz * 1e9),
            "cycles_simulated": r.cycles,
            "predicted_cycles": round(self.predicted),
            "predicted_cycles_simulated_layers": round(self.sim_predicted),
            "latency_us": round(us, 3),
            "latency_us_per_token": round(us / max(1, r.tokens), 4),
            # the step's bytes and interconnect busy cycles over its reported cycles; the
            # plan's figures over its predicted ones; the simulated layers' as measured
            "hbm_util": round(s.hbm_utilisation(self.cycles), 4),
            "noc_util": round(s.noc_utilisation(self.cycles), 4),
            "flop_util": round(s.flop_utilisation(self.cycles), 5),
            "hbm_util_plan": round(s.hbm_utilisation(), 4),
            "noc_util_plan": round(s.noc_utilisation(), 4),
            "hbm_util_simulated": round(r.hbm_util, 4),
            "noc_util_simulated": round(r.noc_util, 4),
            "ideal_cycles": round(self.ideal),
            "of_ideal": round(self.ideal / self.cycles, 4) if self.cycles else None,
            "plan_s": round(s.plan_seconds, 3),
            **(
                {"plan_s_simulated": round(r.schedule.plan_seconds, 3)}
                if self.plan is not None
                else {}
            ),
            "build_s": round(self.build_seconds, 3),
            "sim_s": round(r.sim_seconds, 3),
            "breakdown": {k: round(v / tot, 4) for k, v in s.breakdown().items()},
            **({"notes": list(r.notes)} if r.notes else {}),
        }

    def _rest_fields(self) -> dict[str, Any]:
        """How the layers not simulated are timed, for :meth:`to_dict` (none: all simulated)."""
        st = self.steady
        if st is None:
            return {}
        if st.period is None:
            out: dict[str, Any] = {"rest": "plan", "steady_period": None, "steady_layers": None}
            out["no_period"] = st.why
        else:
            out = {
                "rest": "steady_period_of_cut" if st.cut else "steady_period",
                "steady_period": st.period,
                "steady_layers": [st.first, st.last],
            }
        if st.cut:
            out["own_plan_differs"] = st.cut
        return out

    def _short_plan(self) -> str:
        if self.plan is None:
            return ""
        return f" (the {self.sim_layers}-layer step's {self.sim.schedule.plan_seconds:.2f} s)"

    def _simulated(self) -> str:
        """What was simulated."""
        if self.plan is None:
            return f"layers 1-{self.sim_layers} simulated"
        return f"a {self.sim_layers}-layer step planned as a model of its own simulated"

    def _rest(self) -> str:
        """How the layers not simulated are timed, and why."""
        st = self.steady
        if st is None:
            return (
                "the plan's prediction, an estimate a few percent off: it counts their preloads "
                "as overlapping the simulated layers, which ran without them (simulate at "
                f"least {MIN_LAYERS} layers to time them by the simulated steady period)"
            )
        if st.period is None:
            return f"the plan's prediction ({st})"
        if st.cut:
            return (
                f"at the simulated {st} — this plan's first {self.sim_layers} layers, as {st.cut}: "
                f"an estimate, their last layers, which lack the later layers' preloads, standing "
                "for the step's"
            )
        return f"at the simulated {st}"

    def __str__(self) -> str:
        s, r = self.schedule, self.sim
        ghz = s.costs.clock_ghz
        tot = max(s.cycles, 1e-9)
        b = s.breakdown()
        us = self.cycles / (ghz * 1e3)
        err = self.sim_predicted / r.cycles - 1 if r.cycles else 0.0
        ideal = self.ideal
        return "\n".join(
            [
                f"kernel-by-kernel ({s.design}) on {s.costs.name}: {self.layers} layers, "
                f"{len(s.ops)} operators planned as one model",
                f"decode step: {self.cycles} cycles = {us:.1f} us "
                f"per step{per_token(us, r.tokens)} — {self._simulated()} "
                f"({r.cycles} cycles; plan predicted {self.sim_predicted:.0f}, "
                f"{err:+.1%}), layers {self.sim_layers + 1}-{self.layers} {self._rest()}"
                if self.sim_layers < self.layers
                else f"decode step: {self.cycles} cycles = {us:.1f} us "
                f"per step{per_token(us, r.tokens)}, all {self.layers} layers "
                f"simulated; plan predicted {s.cycles:.0f} ({err:+.1%})",
                "ELK breakdown (plan, whole step): "
                + ", ".join(f"{k} {v / tot:.1%}" for k, v in b.items()),
                f"over the step's {self.cycles} cycles: HBM utilisation "
                f"{s.hbm_utilisation(self.cycles):.1%}, interconnect "
                f"{s.noc_utilisation(self.cycles):.1%}, FLOP {s.flop_utilisation(self.cycles):.2%}"
                f"  (plan: HBM {s.hbm_utilisation():.1%}, interconnect {s.noc_utilisation():.1%};"
                f" simulated layers: HBM {r.hbm_util:.1%}, interconnect {r.noc_util:.1%})",
                f"Ideal (ELK §6.1) predicts {ideal:.0f} cycles: step at {ideal / max(1, self.cycles):.1%}"
                f" of Ideal (plan {ideal / tot:.1%})",
                f"plan {s.plan_seconds:.2f} s{self._short_plan()}  programs {self.build_seconds:.2f} s  "
                f"simulation {r.sim_seconds:.2f} s",
                *(f"note: {n}" for n in r.notes),
            ]
        )
