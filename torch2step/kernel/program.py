"""``compile(..., execution="kernel")``: a layer run kernel by kernel on an ICCA chip.

:class:`KernelProgram` holds the layer's ELK operators, the ELK schedule (``.schedule``, printable),
the per-core programs (``.programs``) and runs them on the simulator: ``run(*inputs)`` in
functional mode returns what the module returns; ``report()`` simulates timing and reports in
ELK's terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from elk.plan import ElkSchedule, plan_model
from hwmodel.chip import Chip
from lowering.elk_placement import tile_major
from lowering.isa import ProgramSet
from torch2step.errors import LoweringError
from torch2step.kernel.build import build_programs
from torch2step.kernel.graph import GraphOps, graph_ops
from torch2step.kernel.report import KernelReport, simulate_schedule
from torch2step.layers.graph import LayerGraph

__all__ = ["KernelProgram", "output"]


def output(
    g: GraphOps, tensors: dict[str, np.ndarray], inputs: dict[str, torch.Tensor], v: str
) -> torch.Tensor:
    """Output ``v`` of a simulated run (an appended cache: the input cache and its new row)."""
    shp = dict(g.outputs)[v]
    if v in g.appends:
        cache, row, axis = g.appends[v]
        new = torch.from_numpy(np.ascontiguousarray(tensors[row]))
        base = inputs[cache]
        return torch.cat(
            [base.to(new.dtype), new.reshape(*base.shape[:axis], -1, *base.shape[axis + 1 :])], axis
        )
    return torch.from_numpy(np.ascontiguousarray(tensors[v]).reshape(shp))


class KernelProgram:
    """A layer compiled for kernel-by-kernel execution (ELK schedule + per-core programs)."""

    execution = "kernel"

    def __init__(
        self,
        layer: LayerGraph,
        chip: Chip,
        example_inputs: Sequence[torch.Tensor],
        design: str = "elk_full",
        routing: Any = None,
        search: dict[str, Any] | None = None,
    ) -> None:
        """``search``: the plan's search budget (:func:`elk.plan.plan_search`; default
        :data:`elk.plan.DEFAULT_SEARCH`)."""
        self.layer = layer
        self.chip = chip
        self.design = design
        self.example_inputs = tuple(example_inputs)
        #: ``routing``: the expert ids whose experts a shapes-only plan loads (graph_ops)
        self.graph: GraphOps = graph_ops(layer, self.example_inputs, routing)
        self.schedule: ElkSchedule = plan_model(
            self.graph.ops, chip, design, dtype=self.graph.dtype, **(search or {})
        )

    @cached_property
    def programs(self) -> ProgramSet:
        """The per-core programs of the schedule."""
        if self.graph.shapes_only:  # timing tensors (torch2step.kernel.build.bind_timing)
            return build_programs(self.schedule, self.chip)
        tensors = dict(self.graph.tensors)
        for i, wname in self.graph.weights.items():
            plan = self.schedule.plans[i]
            k, n = tensors[wname][0]
            tensors[wname] = ((k * plan.tiles[2], n // plan.tiles[2]), self.graph.dtype)
        results = self.graph.stored()
        return build_programs(self.schedule, self.chip, self.graph.ops, tensors, results)

    def _bound(self, inputs: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
        gops = graph_ops(self.layer, inputs) if inputs else self.graph
        vals = dict(gops.values)
        for i, wname in self.graph.weights.items():
            vals[wname] = tile_major(vals[wname], self.schedule.plans[i])
        for name in list(vals):
            want = self.graph.tensors.get(name)
            if want is not None and name not in self.graph.weights.values():
                vals[name] = np.ascontiguousarray(vals[name]).reshape(want[0])
        return {k: v for k, v in vals.items() if k in self.graph.tensors}

    def run(self, *inputs: torch.Tensor) -> Any:
        """Simulate functionally and return the module's outputs (torch tensors)."""
        if self.graph.shapes_only and not inputs:
            raise LoweringError(
                f"{self.layer.name}: run() needs weights and input values; this program was "
                "compiled from shapes only (a config): use report() for timing, or compile the "
                "module with its weights"
            )
        rep = simulate_schedule(
            self.schedule,
            self.chip,
            mode="functional",
            programs=self.programs,
            inputs=self._bound(inputs or self.example_inputs),
        )
        assert rep.result is not None
        ins = dict(zip(self.layer.inputs, inputs or self.example_inputs))
        outs = tuple(output(self.graph, rep.result.tensors, ins, v) for v, _ in self.graph.outputs)
        return outs[0] if self.layer.single_output else outs

    def report(self, tokens: int = 1) -> KernelReport:
        """Timing simulation of the schedule, reported in ELK's terms."""
        rep = simulate_schedule(
            self.schedule, self.chip, programs=self.programs, inputs={}, tokens=tokens
        )
        return dataclasses.replace(rep, notes=tuple(self.graph.notes))

    def __str__(self) -> str:
        return str(self.schedule)
