"""A compiled layer: its layer graph, its STeP program and a chip to run it on.

``Program.run`` executes the STeP program functionally with the reference interpreter and
returns what the module returns; ``Program.report`` also places the program spatially on the
chip (one unit per STeP operator, streams as bounded FIFOs: :mod:`torch2step.spatial`) and
simulates it, for this input's routing and KV lengths.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import sympy as sp
import torch

from hwmodel.chip import Chip
from torch2step.errors import FrontendError, Torch2StepError
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph, format_layer_graph
from torch2step.lower import Lowered
from torch2step.report import Report
from torch2step.step import RunResult, metrics, run
from torch2step.step.printer import format_program

__all__ = ["Program"]


class Program:
    """A layer compiled for a chip (build it with :func:`torch2step.compile`)."""

    def __init__(
        self, layer: LayerGraph, lowered: Lowered, chip: Chip, example_inputs: Sequence[Any]
    ) -> None:
        self.layer = layer
        self.lowered = lowered
        self.chip = chip
        self.example_inputs = tuple(example_inputs)
        self._last: Any = None

    # -- inspection ---------------------------------------------------------------------------
    @property
    def step(self):  # type: ignore[no-untyped-def]
        """The STeP program (:class:`torch2step.step.Program`)."""
        return self.lowered.program

    @cached_property
    def metrics(self):  # type: ignore[no-untyped-def]
        """Symbolic §4.1 metrics of the STeP program (seed 000 §4.1)."""
        return metrics(self.lowered.program)

    def __str__(self) -> str:
        return format_layer_graph(self.layer) + "\n\n" + format_program(self.lowered.program)

    def print(self) -> None:
        """Print the layer graph and the STeP graph."""
        print(self)

    # -- inputs -------------------------------------------------------------------------------
    def _check(self, inputs: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        g = self.layer
        if not inputs:
            inputs = self.example_inputs
        if len(inputs) != len(g.inputs):
            raise FrontendError(
                f"{g.name}: expected {len(g.inputs)} inputs ({', '.join(g.inputs)}), "
                f"got {len(inputs)}"
            )
        sizes: dict[sp.Symbol, int] = {}
        out = []
        for name, x in zip(g.inputs, inputs):
            ty = g.types[name]
            if not isinstance(x, torch.Tensor):
                raise FrontendError(
                    f"{g.name}: input {name} must be a torch.Tensor, got {type(x).__name__}"
                )
            want = ty.dtype
            is_int = want.startswith("int")
            if is_int != (not x.is_floating_point()):
                raise FrontendError(
                    f"{g.name}: input {name} has dtype {x.dtype}; compiled for {want}"
                )
            if x.dim() != len(ty.shape):
                raise FrontendError(
                    f"{g.name}: input {name} has shape {list(x.shape)}; expected "
                    f"{len(ty.shape)} dims {list(ty.shape)}"
                )
            for axis, (d, n) in enumerate(zip(ty.shape, x.shape)):
                e = sp.sympify(d)
                if e.is_Integer and int(e) != n:
                    raise FrontendError(
                        f"{g.name}: input {name} has size {n} on axis {axis}; the program was "
                        f"compiled for {int(e)} there (shape {list(ty.shape)})"
                    )
                if isinstance(e, sp.Symbol):
                    if sizes.setdefault(e, n) != n:
                        raise FrontendError(
                            f"{g.name}: input {name} axis {axis} is {e}={n}, but {e} is "
                            f"{sizes[e]} in another input"
                        )
            out.append(x)
        return tuple(out)

    # -- functional run -----------------------------------------------------------------------
    def _execute(
        self, inputs: Sequence[Any], routing: Any = None, *, timing_only: bool = False
    ) -> tuple[Lowered, RunResult, tuple[torch.Tensor, ...], dict[str, Any]]:
        xs = self._check(inputs)
        meta = [n for n, t in self.layer.params.items() if t.is_meta]
        if meta or any(x.is_meta for x in xs):
            what = f"parameters {', '.join(meta[:3])}" if meta else "inputs"
            raise Torch2StepError(
                f"{self.layer.name}: the {what} are on the meta device (shapes only); build the "
                "module with real weights (e.g. models.get_layer(..., device='cpu')) to run or "
                "report it"
            )
        lw, dynamic = self.lowered, {}
        overrides = self._routing_override(routing) if routing is not None else None
        tensors, env = lw.feed(xs)
        res = run(
            lw.program,
            tensors=tensors,
            env=env,
            timing_only=timing_only,
            store_overrides=overrides,
        )
        dynamic.update(env)
        experts = [n.op.num_experts for n in self.layer.ops(L.MoEExperts)]
        for n in self.layer.ops(L.TopKRouting):
            ids = res.tensors[lw.placed[n.outputs[1]].tensor.name].reshape(-1)
            e = experts[0] if experts else int(ids.max()) + 1
            dynamic["tokens_per_expert"] = np.bincount(ids, minlength=e).tolist()
        for n in self.layer.ops(L.Attention):
            if len(n.inputs) > 3 and n.inputs[3] in self.layer.inputs:
                lens = xs[self.layer.inputs.index(n.inputs[3])]
                dynamic["kv_lengths"] = [int(v) for v in lens.reshape(-1)]
        return lw, res, lw.outputs(res.tensors, xs), dynamic

    def _routing_override(self, routing: Any) -> dict[str, np.ndarray]:
        """The router's top-k ids tensor -> the trace's ids: the router still runs and is
        timed, the value it stores is the trace's (only its choice is replaced)."""
        nodes = list(self.layer.ops(L.TopKRouting))
        if len(nodes) != 1:
            raise Torch2StepError(
                f"{self.layer.name}: routing= needs exactly one MoE router; found {len(nodes)}"
            )
        ids = np.asarray(routing)
        k = nodes[0].op.k
        if ids.ndim != 2 or ids.shape[1] != k:
            raise Torch2StepError(
                f"routing must be [tokens, {k}] expert ids; got shape {list(ids.shape)}"
            )
        return {self.lowered.placed[nodes[0].outputs[1]].tensor.name: ids.astype(np.int64)}

    def run(self, *inputs: Any) -> Any:
        """Run the compiled STeP program on ``inputs`` (default: the example inputs) with the
        reference interpreter; returns what the module returns (a tensor or a tuple)."""
        _, _, outs, _ = self._execute(inputs)
        return outs[0] if self.layer.single_output else outs

    # -- simulation ---------------------------------------------------------------------------
    def report(self, *inputs: Any, routing: Any = None, trace: bool = False) -> Report:
        """Simulate the program on the chip for ``inputs`` (default: the example inputs).

        ``routing``: ``[tokens, k]`` expert ids (e.g. a real trace) replacing the router's
        top-k choice (the router still runs and is timed; its weights are kept: timing does
        not depend on them); ``trace``: keep a Chrome trace for :meth:`write_trace`.  The
        interpreter runs in timing-only mode: values that steer control are computed, matrix
        products that do not are only shaped (:mod:`torch2step.step.timing_only`)."""
        from torch2step.spatial import simulate_graph

        lw, res, _, dynamic = self._execute(inputs, routing, timing_only=True)
        t0 = time.perf_counter()
        if lw.options.attn_regions is not None and lw.options.attn_assign == "dynamic":
            from torch2step.spatial.dispatch import simulate_dispatched  # STeP §5.4

            tensors, env = lw.feed(self._check(inputs))
            d = simulate_dispatched(lw.program, self.chip, tensors, env=env)
            res, dynamic["attn_regions_of_requests"] = d.run, d.assignment
        sim = simulate_graph(lw.program, self.chip, res, trace=trace)
        sim_s = time.perf_counter() - t0
        self._last = sim
        m = self.metrics
        at = m.evaluate(res.bindings)
        return _make_report(self, lw, sim, m, at, dynamic, sim_s)

    def write_trace(self, path: str | Path) -> Path:
        """Write the Chrome trace of the last ``report(..., trace=True)``."""
        if self._last is None:
            raise Torch2StepError("no report yet: call report(..., trace=True) first")
        return self._last.write_trace(path)


def _make_report(
    prog: Program, lw: Lowered, sim: Any, m: Any, at: dict, dynamic: dict, sim_s: float
) -> Report:
    units = [asdict(u) for u in sim.units]
    breakdown = {k: int(v) for k, v in sim.breakdown.items()}
    for kind, row in sim.by_kind.items():
        breakdown[f"busy:{kind}"] = int(row["busy"])
    util = {k: float(v) for k, v in sim.utilisation.items()}
    return Report(
        layer=prog.layer.name,
        chip=prog.chip.name,
        latency_cycles=int(sim.cycles),
        latency_s=float(sim.seconds),
        hbm_bytes=int(sim.hbm_bytes),
        hbm_bytes_symbolic=int(at["offchip_bytes"]),
        hbm_bytes_formula=str(m.offchip_bytes),
        peak_onchip_bytes=int(at["onchip_bytes"]),
        onchip_formula=str(m.onchip_bytes),
        flops=int(sim.flops),
        roofline_cycles=int(sim.roofline),
        roofline_fraction=float(sim.roofline_fraction),
        breakdown=breakdown,
        utilisation=util,
        units=units,
        dynamic={k: v for k, v in dynamic.items() if v is not None},
        events=int(sim.events),
        simulation_s=round(sim_s, 3),
        dtype=_layer_dtype(prog.layer),
        simulated_onchip_bytes=sum(int(u.sram_bytes) + int(u.fifo_bytes) for u in sim.units),
    )


def _layer_dtype(layer: LayerGraph) -> str:
    """The floating-point element type of the layer's inputs (what it is timed in)."""
    kinds = {layer.types[n].dtype for n in layer.inputs}
    floats = sorted(k for k in kinds if not k.startswith("int") and k != "bool")
    return floats[0] if len(floats) == 1 else ",".join(floats) or "int"
