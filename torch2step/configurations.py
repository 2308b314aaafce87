"""A layer too large for the chip, run as sequential spatial configurations.

On a spatial accelerator a layer is placed whole when its STeP units fit the chip's cores
(STeP (arXiv 2511.07776) §4.2: one unit per operator).  When they do not, the layer is cut, in
the order of its layer operators, into consecutive groups that each fit — *configurations* the
chip loads one after another, as SambaNova runs a model that does not fit as a sequence of
on-chip configurations (ELK §7).  Layer operators already communicate through off-chip memory
(:mod:`torch2step.lower.context`), so a cut adds no traffic: each configuration reads its
inputs from HBM where the previous one stored them.

:func:`split_report` groups greedily by the units each layer operator's STeP subgraph needs
(a configuration that still does not fit once its buffers are counted is halved), compiles
each group as its own program, simulates them in order on the values the layer computes
(only those that steer a configuration's control are evaluated: :class:`_Values`), and
returns one report: latency, traffic and FLOPs summed, peak on-chip memory the largest, the
split printed in the notes.  The configurations run one after another on the chip, but their
reports are independent, so they are made in worker processes side by side where the machine
has the CPUs (:mod:`torch2step.config_jobs`; the same reports as made one after another).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from torch2step.errors import ScheduleError, Torch2StepError
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph, Node
from torch2step.layers.standins import (
    concat_zeros,
    is_zero_standin,
    standin_inputs,
    standin_params,
)

__all__ = ["cores_by_operator", "split_layer", "split_report", "subgraph"]

_SUMMED = ("latency_cycles", "latency_s", "hbm_bytes", "hbm_bytes_symbolic", "flops",
           "roofline_cycles", "events", "simulation_s")  # fmt: skip


def subgraph(layer: LayerGraph, nodes: Sequence[Node], name: str) -> LayerGraph:
    """The layer operators ``nodes`` (consecutive in ``layer``) as a graph: inputs are the
    values they read from earlier operators or the layer's inputs (the inputs that define the
    dynamic sizes first, so the sizes keep their names), outputs those read later."""
    g = LayerGraph(name=name)
    produced = {o for n in nodes for o in n.outputs}
    needed = [src for src, _ in layer.dims.values()]
    needed += [i for n in nodes for i in n.inputs if i not in produced]
    for v in dict.fromkeys(needed):
        if v in layer.params:
            g.add_param(v, layer.params[v])
        else:
            g.add_input(v, layer.types[v])
    for n in nodes:
        for o in n.outputs:
            g.types[o] = layer.types[o]
        g.nodes.append(n)
    later = set(layer.outputs)
    after = False
    for n in layer.nodes:
        if n is nodes[-1]:
            after = True
        elif after:
            later.update(n.inputs)
    g.outputs = [o for n in nodes for o in n.outputs if o in later]
    return g


#: units of a one-operator subgraph, by its structure (:func:`_shape_key`)
_UNITS: dict[str, int] = {}


def _shape_key(g: LayerGraph, options: Any) -> str:
    """``g`` (one operator) with its value names replaced by their positions: two operators
    that differ only in names (a layer's key and value projections, its two norms) lower to
    the same STeP units (STeP §4.2: one unit per operator, sized by shapes alone)."""
    (node,) = g.nodes
    pos = {v: i for i, v in enumerate([*g.inputs, *g.params, *node.outputs])}
    ins = [(pos[v], v in g.params, repr(g.types[v])) for v in [*g.inputs, *g.params]]
    outs = [(repr(g.types[o]), o in g.outputs) for o in node.outputs]
    dims = [(str(d), pos[v], axis) for d, (v, axis) in g.dims.items()]
    return repr((ins, [pos[v] for v in node.inputs], outs, node.op, dims, options))


def _units(layer: LayerGraph, node: Node, options: Any) -> int:
    from torch2step.lower import lower
    from torch2step.spatial.structure import analyse

    g = subgraph(layer, [node], "probe")
    key = _shape_key(g, options)
    if key not in _UNITS:
        _UNITS[key] = len(analyse(lower(g, options).program).units)
    return _UNITS[key]


def cores_by_operator(lowered: Any, cores: Mapping[str, int]) -> dict[str, int]:
    """The cores each layer operator's units took in a placement of the whole layer that did
    not fit (``cores``: unit name -> cores, :class:`~torch2step.spatial.placement.PlacementError`;
    ``lowered.made_by`` names the operator that made each STeP node)."""
    out: dict[str, int] = {}
    for unit, k in cores.items():
        op = lowered.made_by.get(unit)
        if op is not None:
            out[op] = out.get(op, 0) + k
    return out


def split_layer(layer: LayerGraph, cores: int, options: Any) -> list[list[Node]]:
    """Consecutive groups of ``layer``'s operators whose units fit ``cores`` each."""
    groups: list[list[Node]] = [[]]
    used = 0
    for n in layer.nodes:
        need = _units(layer, n, options)
        if need > cores:
            err = ScheduleError(
                f"{layer.name}: layer operator {n.name} ({type(n.op).__name__}) alone needs "
                f"{need} units but the chip has {cores} cores; use a chip with more cores or "
                "coarser tiles"
            )
            err.operators = (type(n.op).__name__,)  # (torch2step.named.fit_suggestions)
            raise err
        if groups[-1] and used + need > cores:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += need
    return groups


def _oversized(prog: Any, failed: ScheduleError) -> list[Node]:
    """The layer operators that took more cores than the chip has in the whole layer's failed
    placement ``failed``: halving the layer ends with such an operator alone (or with
    operators that add no unit), which does not fit either."""
    from torch2step.spatial.placement import PlacementError

    if not isinstance(failed, PlacementError):
        return []
    need = cores_by_operator(prog.lowered, failed.cores)
    return [n for n in prog.layer.nodes if need.get(n.name, 0) > prog.chip.num_cores]


class _Values:
    """The values of ``layer`` on stand-ins (for ``meta`` weights and inputs), each computed on
    first request with what it depends on, and kept.

    A configuration's timing run reads only the inputs that steer its control (the router's
    logits, the KV lengths: :func:`torch2step.step.timing_only.inert_tensors`); the others are
    fed as zero-stride placeholders whatever they hold, so :meth:`inputs` gives those a
    ``meta`` tensor of their shape and the layer operators that only they depend on (the
    experts, most matrix products) are never evaluated — a timing report computes values
    only where they steer control."""

    def __init__(
        self, layer: LayerGraph, inputs: Sequence[torch.Tensor], routing: Any = None
    ) -> None:
        from torch2step.layers.evaluate import dim_sizes

        self.layer = layer
        #: ``[tokens, k]`` expert ids replacing the router's choice (``Program.report``'s
        #: ``routing``): what every configuration after the router reads as its experts
        self.routing = routing
        self.env: dict[str, torch.Tensor] = standin_params(layer.params)
        self.env.update(zip(layer.inputs, standin_inputs(inputs)))
        # the values that are all zeros: large stand-ins, and concatenations of only those
        self.zero = {n for n, t in layer.params.items() if is_zero_standin(t)}
        self.zero.update(n for n, t in zip(layer.inputs, inputs) if is_zero_standin(t))
        self.dims = dim_sizes(layer, self.env)
        self.producer = {o: n for n in layer.nodes for o in n.outputs}

    def value(self, name: str) -> torch.Tensor:
        """The value ``name``, evaluating the operators it depends on that are not yet."""
        from torch2step.layers.evaluate import evaluate_node

        todo = [name]
        while todo:  # depth first, without recursion
            v = todo[-1]
            if v in self.env:
                todo.pop()
                continue
            node = self.producer[v]
            missing = [i for i in node.inputs if i not in self.env]
            if missing:
                todo.extend(missing)
                continue
            args = [self.env[i] for i in node.inputs]
            zero = [i in self.zero for i in node.inputs]
            if isinstance(node.op, L.Concat) and any(zero):  # a KV cache and its new rows
                outs: Sequence[torch.Tensor] = (concat_zeros(args, zero, node.op.dim),)
                if all(zero):
                    self.zero.add(node.outputs[0])
            else:
                outs = evaluate_node(node, args, self.dims)
                if self.routing is not None and isinstance(node.op, L.TopKRouting):
                    outs = (outs[0], self._traced(node, outs[1]))
            self.env.update(zip(node.outputs, outs))
        return self.env[name]

    def _traced(self, node: Node, ids: torch.Tensor) -> torch.Tensor:
        """The routing's expert ids in place of the router's ``ids`` (same shape)."""
        traced = torch.as_tensor(np.asarray(self.routing, dtype=np.int64))
        if tuple(traced.shape) != tuple(ids.shape):
            raise Torch2StepError(
                f"{node.name}: routing has shape {list(traced.shape)}; the router chooses "
                f"{list(ids.shape)} (tokens, k) here"
            )
        return traced.to(ids.dtype)

    def tokens_per_expert(self) -> list[int] | None:
        """Tokens each expert receives, from the ids the MoE operator reads (None: no MoE)."""
        routers = list(self.layer.ops(L.TopKRouting))
        experts = [n.op.num_experts for n in self.layer.ops(L.MoEExperts)]
        if len(routers) != 1 or not experts:
            return None
        ids = self.value(routers[0].outputs[1]).reshape(-1).to(torch.int64).numpy()
        return np.bincount(ids, minlength=experts[0]).tolist()

    def shaped(self, name: str) -> torch.Tensor:
        """A ``meta`` tensor of the shape and element type of ``name`` (no values)."""
        from torch2step.layers.evaluate import _concrete
        from torch2step.layers.graph import torch_dtype

        ty = self.layer.types[name]
        return torch.empty(
            _concrete(ty.shape, self.dims), dtype=torch_dtype(ty.dtype), device="meta"
        )

    def inputs(self, sub: LayerGraph, lowered: Any) -> tuple[torch.Tensor, ...]:
        """``sub``'s inputs for its timing run: values where they steer control (or may be read
        outside the off-chip tensors, e.g. the KV lengths of the report's notes), ``meta``
        tensors for the inputs whose off-chip tensors are inert."""
        from torch2step.step.timing_only import inert_tensors

        opts = lowered.options
        if opts.attn_regions is not None and opts.attn_assign == "dynamic":
            inert: frozenset[str] = frozenset()  # the dispatcher reads the inputs themselves
        else:
            inert = inert_tensors(lowered.program)
        read = {n.inputs[3] for n in sub.ops(L.Attention) if len(n.inputs) > 3}
        out = []
        for v in sub.inputs:
            p = lowered.placed.get(v)
            steers = v in self.env or v in read or p is None or p.tensor.name not in inert
            out.append(self.value(v) if steers else self.shaped(v))
        return tuple(out)


def split_report(
    prog: Any,
    inputs: Sequence[torch.Tensor],
    failed: ScheduleError | None = None,
    **kwargs: Any,
) -> Any:
    """Report ``prog`` (a :class:`~torch2step.program.Program` that does not fit its chip)
    as sequential configurations (see the module docstring).  ``failed``: the error of the
    whole layer's placement, when it was tried: the whole layer is not tried again, and an
    operator that took more cores than the chip has is tried alone first, so a layer that
    cannot be split to fit reports that operator's error after one more plan, not after
    every halving."""
    from torch2step.config_jobs import jobs_for, run_groups
    from torch2step.lower import lower
    from torch2step.program import Program, dtype_rate_note, layer_dtype

    layer, chip = prog.layer, prog.chip
    opts = prog.lowered.options
    inputs = tuple(inputs) or prog.example_inputs
    routing = kwargs.get("routing")
    if routing is not None:
        prog._routing_override(routing)  # checked as an unsplit layer's report checks it
    values = _Values(layer, inputs, routing)
    pending = split_layer(layer, chip.num_cores, opts)

    def report_part(group: Sequence[Node], name: str) -> tuple[Any, Any]:
        sub = subgraph(layer, group, name)
        lowered = lower(sub, opts)
        part = Program(sub, lowered, chip, values.inputs(sub, lowered))
        part.split = False  # a part that does not fit is halved, not split again
        args = dict(kwargs)
        if not any(isinstance(n.op, L.TopKRouting) for n in group):
            args.pop("routing", None)
        try:
            return part.report(**args), part
        except ScheduleError as e:  # the operators that did not fit (fit_suggestions)
            if getattr(e, "operators", None) is None:
                e.operators = tuple(dict.fromkeys(type(n.op).__name__ for n in group))
            raise

    if failed is not None and len(pending) == 1:  # the whole layer, which did not fit
        for n in _oversized(prog, failed):  # alone it does not fit either: its error first
            report_part([n], f"{layer.name}_{n.name}")  # raises (or fits: halving decides)
        group = pending.pop()  # halved at once (it is not tried again)
        pending = [group[: len(group) // 2], group[len(group) // 2 :]]
    position = {id(n): i for i, n in enumerate(layer.nodes)}

    def run(at: tuple[int, ...], k: int) -> tuple[Any, Any]:
        rep, part = report_part([layer.nodes[i] for i in at], f"{layer.name}_config{k}")
        # what write_trace reads of the run (the per-core programs that ran stay behind);
        # nothing without a trace, for which write_trace has nothing to write
        return rep, replace(part._last, plan=None) if kwargs.get("trace") else None

    groups = [tuple(position[id(n)] for n in g) for g in pending]
    done = run_groups(run, groups, jobs_for(len(groups)))
    reports, lines, parts = [], [], []
    for k, (at, rep, last) in enumerate(done, 1):
        group = [layer.nodes[i] for i in at]
        start = sum(r.latency_cycles for r in reports)
        parts.append((start, f"configuration {k}: ", last))
        reports.append(rep)
        kinds = ", ".join(dict.fromkeys(type(n.op).__name__ for n in group))
        lines.append(
            f"configuration {k}: {group[0].name} .. {group[-1].name} ({len(group)} "
            f"operator{'s' if len(group) > 1 else ''}: {kinds}), {len(rep.units)} units, "
            f"{rep.latency_cycles:,} cycles"
        )
    prog._last, prog._split_parts = None, parts  # write_trace: one timeline, in order
    first = reports[0]
    summed = {f: sum(getattr(r, f) for r in reports) for f in _SUMMED}
    breakdown: dict[str, int] = {}
    for r in reports:
        for key, v in r.breakdown.items():
            breakdown[key] = breakdown.get(key, 0) + v
    total = max(1, summed["latency_cycles"])
    util = {
        key: sum(r.utilisation.get(key, 0.0) * r.latency_cycles for r in reports) / total
        for key in first.utilisation
    }
    units = [{**u, "configuration": i + 1} for i, r in enumerate(reports) for u in r.units]
    note = (
        f"{layer.name} needs more cores than {chip.name}'s {chip.num_cores}: split into "
        f"{len(reports)} sequential configurations (each reads its inputs from HBM)"
    )
    dynamic = {**first.dynamic, "configurations": len(reports)}
    dynamic.pop("tokens_per_expert", None)
    for at, rep, _ in done:  # the routing the experts' configuration ran
        group = [layer.nodes[i] for i in at]
        if any(isinstance(n.op, L.MoEExperts) for n in group):
            if any(isinstance(n.op, L.TopKRouting) for n in group):  # its own run routed
                spread = rep.dynamic.get("tokens_per_expert")
            else:  # the ids it read (the router's part stores them; they steer nothing there)
                spread = values.tokens_per_expert()
            if spread is not None:
                dynamic["tokens_per_expert"] = spread
    # the whole layer's element type: each configuration notes an untimed one in its own
    # report; the layer's report says it once; so the padding of its dynamic Linear rows
    from torch2step.program import padding_note

    rate_note = [n for n in [dtype_rate_note(chip, layer_dtype(layer))] if n]
    pad = padding_note(layer, first.dynamic, prog.lowered.options.tile_rows)
    rate_note += [pad] if pad else []
    return replace(
        first,
        **summed,
        layer=layer.name,
        hbm_bytes_formula=" + ".join(f"({r.hbm_bytes_formula})" for r in reports),
        peak_onchip_bytes=max(r.peak_onchip_bytes for r in reports),
        onchip_formula=f"max of {len(reports)} configurations",
        roofline_fraction=summed["roofline_cycles"] / max(1, summed["latency_cycles"]),
        breakdown=breakdown,
        utilisation=util,
        timeline=_joined_timeline(reports),
        units=units,
        simulated_onchip_bytes=max(r.simulated_onchip_bytes for r in reports),
        dynamic=dynamic,
        notes=[*layer.notes, *kwargs.get("notes", ()), note, *lines, *rate_note],
    )


def _joined_timeline(reports: Sequence[Any]) -> dict[str, list[float]]:
    """The configurations' utilisation timelines one after another, as they run (each
    ``edges`` shifted by the cycles before it; :func:`torch2step.program._timeline`); empty
    when a configuration recorded none (no trace)."""
    if not reports or not all(r.timeline.get("edges") for r in reports):
        return {}
    out: dict[str, list[float]] = {k: [] for k in reports[0].timeline}
    start = 0
    for r in reports:
        for k, v in r.timeline.items():
            if k == "edges":
                out[k] += [start + e for e in v[:-1]]
            else:
                out.setdefault(k, []).extend(v)
        start += r.latency_cycles
    out["edges"].append(start)
    return out
