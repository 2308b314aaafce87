"""``compile(..., execution="kernel")``: a layer run kernel by kernel on an ICCA chip.

:class:`KernelProgram` holds the layer's ELK operators, the ELK schedule (``.schedule``, printable),
the per-core programs (``.programs``) and runs them on the simulator: ``run(*inputs)`` in
functional mode returns what the module returns; ``report()`` simulates timing and reports in
ELK's terms.  The schedule and the programs are made for the example inputs' sizes: ``run`` and
``report`` take inputs of those sizes only (:meth:`KernelProgram.check_inputs`).  The layer-graph
nodes the programs evaluate (``layer_node`` kernels) are the program's own
(:func:`lowering.elk_kernels.register_node`): compiling or running another program leaves them
as they are.
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
from torch2step.errors import FrontendError, LoweringError
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
        self.routing = routing
        #: the tokens of the batch (a decode step's requests), for the time per token; None:
        #: not known (report(tokens=...) gives it)
        self.tokens: int | None = None
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

    def check_inputs(self, inputs: Sequence[Any], call: str = "run") -> tuple[torch.Tensor, ...]:
        """``inputs`` of ``call`` checked against the example inputs (:func:`check_inputs`)."""
        return check_inputs(self.layer, self.example_inputs, inputs, call)

    def run(self, *inputs: torch.Tensor) -> Any:
        """Simulate functionally and return the module's outputs (torch tensors); ``inputs``
        (default: the example inputs) of the sizes the program was compiled for."""
        if self.graph.shapes_only:
            raise LoweringError(
                f"{self.layer.name}: run() needs weights and input values; this program was "
                "compiled from shapes only (a config): use report() for timing, or compile the "
                "module with its weights"
            )
        xs = self.check_inputs(inputs, "run")
        rep = simulate_schedule(
            self.schedule,
            self.chip,
            mode="functional",
            programs=self.programs,
            inputs=self._bound(xs),
        )
        assert rep.result is not None
        ins = dict(zip(self.layer.inputs, xs))
        outs = tuple(output(self.graph, rep.result.tensors, ins, v) for v, _ in self.graph.outputs)
        return outs[0] if self.layer.single_output else outs

    def report(self, *inputs: Any, tokens: int | None = None, routing: Any = None) -> KernelReport:
        """Timing simulation of the schedule, reported in ELK's terms.

        ``inputs`` (default: the example inputs) are checked as :meth:`run` checks them; the
        timing depends on their sizes only, which the program was compiled for (every expert
        of a MoE layer with weights is loaded, whatever its router chooses).  ``tokens``: the
        tokens of the batch, for the time per token (default: :attr:`tokens`, else 1).  ``routing``: the expert ids of a
        shapes-only MoE layer, which the plan decides at compile time: only the ids the
        program was compiled with are taken."""
        self.check_inputs(inputs, "report")
        if routing is not None:
            self._check_routing(routing)
        rep = simulate_schedule(
            self.schedule,
            self.chip,
            programs=self.programs,
            inputs={},
            tokens=tokens or self.tokens or 1,
        )
        return dataclasses.replace(rep, notes=tuple(self.graph.notes))

    def _check_routing(self, routing: Any) -> None:
        """Refuse a ``report(routing=...)`` the compiled plan does not time."""
        name = self.layer.name
        if not self.graph.moe:
            raise LoweringError(f"{name}: routing= times a MoE layer; this layer has no experts")
        if not self.graph.shapes_only:
            raise LoweringError(
                f"{name}: routing= times a layer compiled from shapes only (a config); this "
                "program has the module's weights and loads every expert (its router's choice "
                "weighs them), so its timing does not depend on a routing: call report() "
                "without routing="
            )
        try:
            same = self.routing is not None and np.array_equal(
                np.asarray(routing), np.asarray(self.routing)
            )
        except (TypeError, ValueError, RuntimeError):
            same = False
        if not same:
            was = "other expert ids" if self.routing is not None else "no routing="
            raise LoweringError(
                f"{name}: routing= is a compile option of kernel execution (the ELK plan "
                f"decides which experts it loads) and this program was compiled with {was}: "
                "compile again with torch2step.compile_config(..., routing=ids) and call "
                "report() without routing="
            )

    def __str__(self) -> str:
        return str(self.schedule)


def check_inputs(
    layer: LayerGraph,
    example_inputs: Sequence[torch.Tensor],
    inputs: Sequence[Any],
    call: str = "run",
) -> tuple[torch.Tensor, ...]:
    """``inputs`` of ``call`` (``run`` / ``report``; none: the example inputs) checked
    against the example inputs a kernel program was compiled for: as many, tensors, integer
    where those are integer, and of the same shapes (the ELK schedule and the per-core
    programs are made for static sizes).  Raises :class:`FrontendError` naming the input,
    what was expected and what to do."""
    if not inputs:
        return tuple(example_inputs)
    names = list(layer.inputs)
    if len(inputs) != len(names):
        one = len(names) == 1
        raise FrontendError(
            f"{layer.name}: {call}() takes {len(names)} input{'' if one else 's'} "
            f"({', '.join(names)}), as the program was compiled with; got {len(inputs)}: "
            f"pass {'it' if one else 'them in that order'}, or none to use the example "
            f"input{'' if one else 's'}"
        )
    for name, x, ex in zip(names, inputs, example_inputs):
        if not isinstance(x, torch.Tensor):
            hint = (
                f"; the batch's token count is a keyword: report(tokens={x})"
                if call == "report" and isinstance(x, int) and not isinstance(x, bool)
                else ""
            )
            raise FrontendError(
                f"{layer.name}: {call}() input {name!r} must be a torch.Tensor, got "
                f"{type(x).__name__}{hint}"
            )
        if x.is_floating_point() != ex.is_floating_point():
            kind = "float" if ex.is_floating_point() else "integer"
            raise FrontendError(
                f"{layer.name}: {call}() input {name!r} has dtype {x.dtype}, but the program "
                f"was compiled for {ex.dtype}: pass {kind} values"
            )
        if tuple(x.shape) != tuple(ex.shape):
            raise FrontendError(
                f"{layer.name}: {call}() input {name!r} has shape {list(x.shape)}, but the "
                f"program was compiled for shape {list(ex.shape)} "
                f"({_differ(x.shape, ex.shape)}): kernel execution plans static sizes (the "
                "ELK schedule and the per-core programs are made for the example inputs), "
                "so compile again with inputs of this shape (torch2step.compile(module, "
                f"inputs, chip=...)) or pass an input of shape {list(ex.shape)}"
            )
        if call == "run" and x.is_meta:
            raise FrontendError(
                f"{layer.name}: run() input {name!r} is on the meta device (a shape, no "
                "values): run() computes values; pass a tensor with values, or use "
                "report() for timing"
            )
    return tuple(inputs)


def _differ(got: Sequence[int], want: Sequence[int]) -> str:
    """How shape ``got`` differs from the compiled shape ``want``: dims, or the first axis."""
    if len(got) != len(want):
        return f"{len(want)} dims, not {len(got)}"
    axis = next(a for a, (g, w) in enumerate(zip(got, want)) if g != w)
    if axis == 0 and len(want) == 2:
        return f"{want[0]} rows, not {got[0]}"
    return f"size {want[axis]} on axis {axis}, not {got[axis]}"
