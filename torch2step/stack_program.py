"""A compiled stack of N identical layers: one body program, run N times in sequence
(``run`` gives each layer its own weights when the stack holds them).

A :class:`~torch2step.layers.stack.Repeat` graph is compiled by compiling its body once
(spatially: one STeP program placed on the chip; kernel by kernel: one schedule).  The layers
execute one after another, each a configuration of the same body reading its own weights and
KV cache (how a spatial accelerator runs a model layer by layer, ELK §7 on SambaNova's
layer pipelining), so the stack's latency, off-chip traffic and FLOPs are ``N`` times the
body's and its peak on-chip memory is the body's: :meth:`StackProgram.report` simulates the
body once and scales it (the layers' shapes and, in a timing run, the values steering control
are the same for every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from torch2step.errors import FrontendError, LoweringError
from torch2step.layers.graph import LayerGraph, format_layer_graph
from torch2step.layers.stack import Repeat

__all__ = ["StackProgram", "compile_stack", "stack_node"]


def stack_node(graph: LayerGraph) -> Repeat:
    """The graph's one :class:`Repeat` node, whose inputs are the graph's inputs."""
    reps = [n for n in graph.nodes if isinstance(n.op, Repeat)]
    if len(reps) != 1 or len(graph.nodes) != 1 or list(reps[0].inputs) != graph.inputs:
        raise FrontendError(
            f"{graph.name}: a stack compiles when the graph is one Repeat node over its inputs "
            f"(found {len(graph.nodes)} nodes, {len(reps)} Repeat)"
        )
    op = reps[0].op
    assert isinstance(op, Repeat)
    return op


def compile_stack(
    graph: LayerGraph,
    example_inputs: Sequence[torch.Tensor],
    chip: Any = "step-sda",
    **options: Any,
) -> Any:
    """Compile a stack graph (see the module docstring); ``options`` as for
    :func:`torch2step.compile`.  Kernel-by-kernel execution (the default on the ICCA chips)
    plans the whole step as one model instead:
    :class:`torch2step.kernel.stack.KernelStackProgram`."""
    from elk.plan import plan_search
    from torch2step.api import compile as compile_graph
    from torch2step.api import refuse_plan_options
    from torch2step.program import Program

    op = stack_node(graph)
    from torch2step.api import _resolve_chip

    target = _resolve_chip(chip)
    execution = options.get("execution") or target.execution
    if execution == "kernel":  # the whole step planned as one model (ELK §4.4)
        from torch2step.api import refuse_spatial_options
        from torch2step.kernel.stack import KernelStackProgram

        rest = {k: v for k, v in options.items() if k not in ("execution", "design", "routing")}
        if rest.get("strategy") == "default":  # no strategy search: nothing to refuse
            del rest["strategy"]
        search = plan_search(rest)
        refuse_spatial_options(rest, target)
        design = options.get("design") or "elk_full"
        return KernelStackProgram(
            graph,
            op,
            target,
            tuple(example_inputs),
            design=design,
            routing=options.get("routing"),
            search=search,
        )
    refuse_plan_options(options)
    body_inputs = _layer_inputs(op, tuple(example_inputs), 0)
    body = compile_graph(op.body, body_inputs, chip=chip, **options)
    if not isinstance(body, Program):
        raise LoweringError(f"{graph.name}: the stack's body did not compile to a STeP program")
    return StackProgram(graph, op, body, tuple(example_inputs))


def _layer_inputs(op: Repeat, inputs: tuple[torch.Tensor, ...], i: int) -> tuple:
    c, s = op.carried, op.stacked
    return (*inputs[:c], *(t[i] for t in inputs[c : c + s]), *inputs[c + s :])


class StackProgram:
    """``count`` layers compiled as one body (:func:`compile_stack`)."""

    execution = "spatial"  # (KernelStackProgram: "kernel")

    def __init__(
        self, layer: LayerGraph, op: Repeat, body: Any, example_inputs: tuple[torch.Tensor, ...]
    ) -> None:
        self.layer, self.op, self.body = layer, op, body
        self.chip = body.chip
        self.example_inputs = example_inputs

    @property
    def count(self) -> int:
        return self.op.count

    @property
    def lowered(self) -> Any:
        """The body's lowering (one layer)."""
        return self.body.lowered

    def __str__(self) -> str:
        body = str(self.body).split("\n\n", 1)
        rest = body[1] if len(body) > 1 else ""
        return format_layer_graph(self.layer) + (f"\n\n{rest}" if rest else "")

    def print(self) -> None:
        print(self)

    def run(self, *inputs: torch.Tensor) -> Any:
        """Run the layers one after the other on the body program, each with its weights."""
        ins = tuple(inputs) or self.example_inputs
        op = self.op
        carried = ins[: op.carried]
        per_layer: list[list[torch.Tensor]] = []
        for i in range(op.count):
            layer_ins = _layer_inputs(op, (*carried, *ins[op.carried :]), i)
            outs = self._layer(i).run(*layer_ins)
            outs = outs if isinstance(outs, tuple) else (outs,)
            carried = outs[: op.carried]
            per_layer.append(list(outs[op.carried :]))
        stacked = [torch.stack([p[k] for p in per_layer]) for k in range(len(per_layer[0]))]
        return (*carried, *stacked)

    def _layer(self, i: int) -> Any:
        """The body program with layer ``i``'s weights (the same STeP program)."""
        if not self.op.layer_params:
            return self.body
        from torch2step.program import Program

        params = dict(self.op.layer_params[i])
        lw = self.body.lowered
        lw = replace(lw, layer=replace(lw.layer, params=params))
        return Program(replace(self.body.layer, params=params), lw, self.chip, ())

    def write_trace(self, *args: Any, **kwargs: Any) -> Any:
        """The trace of the body's last simulated report (one layer)."""
        return self.body.write_trace(*args, **kwargs)

    def report(self, *inputs: torch.Tensor, **kwargs: Any) -> Any:
        """The body's report for layer 0's inputs, scaled to ``count`` layers in sequence."""
        if "sim_layers" in kwargs:
            raise LoweringError(
                f"{self.layer.name}: sim_layers= chooses the simulated layers of a kernel-by-"
                "kernel decode step (an ICCA chip); this spatial step simulates its one body "
                "and repeats it: call report() without it"
            )
        ins = tuple(inputs) or self.example_inputs
        rep = self.body.report(*_layer_inputs(self.op, ins, 0), **kwargs)
        n = self.count
        scaled = {
            k: getattr(rep, k) * n
            for k in (
                "latency_cycles",
                "latency_s",
                "hbm_bytes",
                "hbm_bytes_symbolic",
                "flops",
                "roofline_cycles",
                "events",
            )
        }
        return replace(
            rep,
            **scaled,
            layer=self.layer.name,
            hbm_bytes_formula=f"{n}*({rep.hbm_bytes_formula})",
            breakdown={k: v * n for k, v in rep.breakdown.items()},
            dynamic={**rep.dynamic, "layers": n},
            notes=[
                *rep.notes,
                f"{n} identical layers run in sequence, each a configuration of one body "
                f"(simulated once: latency, traffic and FLOPs x{n}; peak on-chip memory and "
                "units are one layer's)",
                *self.layer.notes,
            ],
        )
