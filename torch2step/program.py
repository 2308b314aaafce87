"""A compiled layer: its layer graph, its STeP program and a chip to run it on.

``Program.run`` executes the STeP program functionally with the reference interpreter and
returns what the module returns; ``Program.report`` also places the program spatially on the
chip (one unit per STeP operator, streams as bounded FIFOs: :mod:`torch2step.spatial`) and
simulates it, for this input's routing and KV lengths.

``report`` builds a spatial plan once per control signature of the run and reuses it for any
later input with the same one (:mod:`torch2step.spatial.reuse`): inputs that differ only in
floating-point data share the plan and are only re-simulated.  What still genuinely depends on
the input, so that a new signature is re-planned: each expert's token count (the expert units'
loops and buffers), each request's KV tiles (the decode-attention units after the KV-tile
addresses) and EagerMerge's order (:mod:`torch2step.spatial.plan`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import sympy as sp
import torch

from hwmodel.chip import Chip
from torch2step.errors import FrontendError, InputError, ScheduleError, Torch2StepError
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph, format_layer_graph, torch_dtype
from torch2step.lower import Lowered
from torch2step.report import PADDING_NOTE, Report
from torch2step.step import RunResult, metrics, run
from torch2step.step.printer import format_program

__all__ = ["Program"]


def _dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"float"`` or ``"int"``: an input must be of its compiled dtype's kind (a
    float input of another width is taken in the compiled one)."""
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


class Program:
    """A layer compiled for a chip (build it with :func:`torch2step.compile`)."""

    execution = "spatial"  # a STeP program placed on the chip (KernelProgram: "kernel")

    def __init__(
        self, layer: LayerGraph, lowered: Lowered, chip: Chip, example_inputs: Sequence[Any]
    ) -> None:
        self.layer = layer
        self.lowered = lowered
        self.chip = chip
        self.example_inputs = tuple(example_inputs)
        self._last: Any = None
        # a report split into sequential configurations: (start cycle, label, simulation)
        self._split_parts: list[tuple[int, str, Any]] = []
        self.trace_stats: dict[str, int] = {}
        self.split = True  # report: a layer that does not fit runs as sequential configurations
        self.strategy_table: str = ""  # the candidates strategy="auto" tried (torch2step.auto)
        self.strategy_options: dict[str, Any] = {}
        self._plans: Any = None  # report's spatial plans by control signature (PlanCache)
        self._cast: set[tuple[str, Any]] = set()  # (input, dtype) cast to the compiled dtype

    # -- inspection ---------------------------------------------------------------------------
    @property
    def step(self):  # type: ignore[no-untyped-def]
        """The STeP program (:class:`torch2step.step.Program`)."""
        return self.lowered.program

    @cached_property
    def metrics(self):  # type: ignore[no-untyped-def]
        """Symbolic §4.1 metrics of the STeP program (STeP §4.1)."""
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
            if _dtype_kind(x.dtype) != _dtype_kind(torch_dtype(want)):
                raise FrontendError(
                    f"{g.name}: input {name} has dtype {x.dtype}; compiled for {want} (pass "
                    f"x.to({torch_dtype(want)}), or compile with inputs of this dtype)"
                )
            is_float = x.is_floating_point()
            if is_float and x.dtype != torch_dtype(want) and (name, x.dtype) not in self._cast:
                self._cast.add((name, x.dtype))  # said once per input and dtype
                warnings.warn(
                    f"{g.name}: input {name} has dtype {x.dtype}; the program was compiled for "
                    f"{want} and takes its values in {want} (pass x.to({torch_dtype(want)}) to "
                    "say so, or compile with inputs of this dtype)",
                    stacklevel=4,
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
                    if n < 1:
                        raise FrontendError(
                            f"{g.name}: input {name} has size 0 on axis {axis} ({e}); give at "
                            f"least one {e} (shape {list(x.shape)})"
                        )
                    if sizes.setdefault(e, n) != n:
                        raise FrontendError(
                            f"{g.name}: input {name} axis {axis} is {e}={n}, but {e} is "
                            f"{sizes[e]} in another input"
                        )
            out.append(x)
        return tuple(out)

    # -- functional run -----------------------------------------------------------------------
    def _execute(
        self,
        inputs: Sequence[Any],
        routing: Any = None,
        *,
        timing_only: bool = False,
        standins: bool = False,
    ) -> tuple[Lowered, RunResult, tuple[torch.Tensor, ...], dict[str, Any]]:
        xs = self._check(inputs)
        meta = [n for n, t in self.layer.params.items() if t.is_meta]
        shapes_only = bool(meta) or any(x.is_meta for x in xs)
        if shapes_only and not standins:
            what = f"parameters {', '.join(meta[:3])}" if meta else "inputs"
            raise Torch2StepError(
                f"{self.layer.name}: the {what} are on the meta device (shapes only): run() "
                "needs weights; build the module with real weights (e.g. "
                "models.get_layer(..., device='cpu')) to run it (report() times it as it is)"
            )
        lw, dynamic = self.lowered, {}
        overrides = self._routing_override(routing) if routing is not None else None
        if shapes_only:  # timing from stand-in values (torch2step.layers.standins)
            from torch2step.layers.standins import standin_inputs, standin_params

            lw = copy.copy(lw)
            lw.layer = dataclasses.replace(lw.layer, params=standin_params(lw.layer.params))
            xs = standin_inputs(xs)
        inert: frozenset[str] = frozenset()
        if timing_only:  # tensors whose values steer nothing are neither converted nor held
            from torch2step.step.timing_only import inert_tensors

            inert = inert_tensors(lw.program)
        tensors, env = lw.feed(xs, placeholders=inert)
        # a timing run of the compiled (verified) program does not re-check every stream
        # against its shape rule: only streams with sizes still to learn are walked, which
        # gives the same bindings (torch2step.step.interpreter.run)
        res = run(
            lw.program,
            tensors=tensors,
            env=env,
            check=not timing_only,
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
        outs = () if timing_only else lw.outputs(res.tensors, xs)  # a timing run has no values
        return lw, res, outs, dynamic

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
        experts = [n.op.num_experts for n in self.layer.ops(L.MoEExperts)]
        if ids.ndim != 2 or ids.shape[1] != k:
            raise Torch2StepError(
                f"routing must be [tokens, {k}] expert ids; got shape {list(ids.shape)}"
            )
        if ids.dtype.kind == "f" and np.all(np.isfinite(ids)) and np.all(ids == np.round(ids)):
            ids = ids.astype(np.int64)
        if ids.dtype.kind not in "iu":
            raise Torch2StepError(
                f"routing must hold integer expert ids; got {ids.dtype} values such as "
                f"{ids.ravel()[:3].tolist()}"
            )
        high = experts[0] if experts else None
        bad = (ids < 0) | (ids >= high) if high is not None else ids < 0
        if bad.any():
            t, j = (int(v) for v in np.argwhere(bad)[0])
            raise Torch2StepError(
                f"routing: token {t} choice {j} is expert {int(ids[t, j])}; the layer has "
                f"experts 0..{(high or 1) - 1}"
            )
        srt = np.sort(ids, axis=1)
        twice = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
        if twice.size:
            raise Torch2StepError(
                f"routing: token {int(twice[0])} chooses an expert twice "
                f"({ids[twice[0]].tolist()}); each token's {k} experts must be distinct"
            )
        return {self.lowered.placed[nodes[0].outputs[1]].tensor.name: ids.astype(np.int64)}

    def run(self, *inputs: Any) -> Any:
        """Run the compiled STeP program on ``inputs`` (default: the example inputs) with the
        reference interpreter; returns what the module returns (a tensor or a tuple)."""
        _, _, outs, _ = self._execute(inputs)
        return outs[0] if self.layer.single_output else outs

    # -- simulation ---------------------------------------------------------------------------
    def report(
        self, *inputs: Any, routing: Any = None, trace: bool = False, notes: Sequence[str] = ()
    ) -> Report:
        """Simulate the program on the chip for ``inputs`` (default: the example inputs).

        ``routing``: ``[tokens, k]`` expert ids (e.g. a real trace) replacing the router's
        top-k choice (the router still runs and is timed; its weights are kept: timing does
        not depend on them); ``trace``: keep a Chrome trace for :meth:`write_trace`.  The
        interpreter runs in timing-only mode: values that steer control are computed, matrix
        products that do not are only shaped (:mod:`torch2step.step.timing_only`).  ``notes``:
        choices made for the user, carried into the report's text."""
        from torch2step.spatial.reuse import PlanCache

        if routing is None and not any(n.startswith("routing:") for n in notes):
            notes = (*notes, *self._standin_routing(inputs))
        if self.split and len(self.layer.nodes) >= 2 and not self._units_fit():
            # placement would fail (one core per unit at least): split at once, without the
            # whole layer's interpreter run and plan that the split configurations redo
            from torch2step.configurations import split_report

            self._check(inputs)
            return split_report(self, inputs, routing=routing, trace=trace, notes=notes)
        lw, res, _, dynamic = self._execute(inputs, routing, timing_only=True, standins=True)
        t0 = time.perf_counter()
        if lw.options.attn_regions is not None and lw.options.attn_assign == "dynamic":
            from torch2step.spatial.dispatch import simulate_dispatched  # STeP §5.4

            tensors, env = lw.feed(self._check(inputs))
            d = simulate_dispatched(lw.program, self.chip, tensors, env=env)
            res, dynamic["attn_regions_of_requests"] = d.run, d.assignment
        if self._plans is None:
            self._plans = PlanCache()
        # the §4.1 formulas and their values need only the program and the run's sizes: they
        # are computed on an idle CPU while the plan and the simulation take this one
        formulas = self._formulas_beside(res.bindings)
        try:
            sim = self._plans.simulate(lw.program, self.chip, res, trace=trace)
        except ScheduleError as err:
            formulas.cancel()
            if not self.split or len(self.layer.nodes) < 2:
                raise
            from torch2step.configurations import split_report

            return split_report(self, inputs, err, routing=routing, trace=trace, notes=notes)
        except BaseException:
            formulas.cancel()
            raise
        sim_s = time.perf_counter() - t0
        self._last, self._split_parts = sim, []
        rep = _make_report(self, lw, sim, formulas.result(), dynamic, sim_s)
        spans = list(sim.memory_notes)  # units whose bytes exceed one core's SRAM
        if len(spans) > 3:
            spans = spans[:3] + [f"{len(spans) - 3} more units span several cores' SRAM"]
        notes = (*notes, *spans)
        if self.strategy_table:
            notes = (*notes, self.strategy_table)
        return _with_context(self, lw, rep, sim, routing is not None, notes)

    def _standin_routing(self, inputs: Sequence[Any]) -> tuple[str, ...]:
        """The note of a MoE router that chooses on stand-in values: a layer with shapes
        only (a config, ``meta`` weights) is timed on random stand-ins
        (:mod:`torch2step.layers.standins`), so its router's choice is random."""
        if not any(True for _ in self.layer.ops(L.TopKRouting)):
            return ()
        xs = tuple(inputs) or self.example_inputs
        if not any(t.is_meta for t in self.layer.params.values()) and not any(
            getattr(x, "is_meta", False) for x in xs
        ):
            return ()
        return (
            "routing: the router's choice on stand-in values (the layer is shapes only, so "
            "its router weighs random stand-in weights); report(..., routing=ids) routes by "
            "a trace",
        )

    def _formulas_beside(self, bindings: Any) -> Any:
        """What a report prints of the §4.1 metrics (STeP arXiv 2511.07776 §4.1) for a run
        of sizes ``bindings`` — the off-chip traffic and on-chip memory formulas and their
        values — computed in a forked child beside this process's work
        (:func:`torch2step.background.beside`; the same values as computed here)."""
        from torch2step.background import beside

        def formulas() -> _Formulas:
            m = self.metrics
            at = m.evaluate(bindings)
            return _Formulas(
                str(m.offchip_bytes),
                int(at["offchip_bytes"]),
                str(m.onchip_bytes),
                int(at["onchip_bytes"]),
            )

        return beside(formulas)

    def _units_fit(self) -> bool:
        """Whether the chip has a core for every spatial unit of the program (the placement's
        first condition, :func:`torch2step.spatial.placement.place_structure`)."""
        from torch2step.spatial.structure import DEFAULT_WIRES, analyse

        return len(analyse(self.lowered.program, DEFAULT_WIRES).units) <= self.chip.num_cores

    @property
    def has_trace(self) -> bool:
        """Whether the last report recorded a trace (``report(..., trace=True)``) that
        :meth:`write_trace` can write."""
        parts = self._split_parts or ([(0, "", self._last)] if self._last is not None else [])
        return bool(parts) and all(
            last is not None and last.sim.trace_events for _, _, last in parts
        )

    def write_trace(
        self,
        path: str | Path,
        *,
        window: tuple[float, float] | None = None,
        units: int | None = None,
    ) -> Path:
        """Write the Chrome / Perfetto trace of the last ``report(..., trace=True)``, event by
        event (:func:`runtime.trace.write_trace_json`, strict JSON).

        ``window``: only ``[start, end)`` cycles, spans clipped to it (``end`` may be ``inf``:
        to the run's end; a window past the run's end is logged as a warning); ``units``: only
        the core tracks of the ``units`` busiest units (all NoC / HBM / utilisation tracks are
        kept).  Core tracks are named after the units on them.

        A layer split into sequential configurations is one timeline, the configurations one
        after another on the same cores: each track is named once, a core after its unit in
        each configuration that used it (``core 0 (r0c0): 1: LinearOffChipLoad %load0 | 2:
        ...``); ``units`` keeps the busiest units of all configurations together, each unit's
        spans only in its own configuration's time range."""
        import logging

        from runtime.trace import write_trace_json

        if not self.has_trace:
            raise Torch2StepError("no trace recorded: call report(..., trace=True) first")
        check_trace_limits(window, units)
        parts = self._split_parts or [(0, "", self._last)]
        total = parts[-1][0] + parts[-1][2].cycles
        keep: list[set[int]] | None = None  # per configuration: the cores whose spans are kept
        if units is not None:
            ranked = sorted(
                (
                    (r.busy, k, r.name, r.cores)
                    for k, (*_, last) in enumerate(parts)
                    for r in last.units
                ),
                key=lambda x: (-x[0], x[1], x[2]),
            )[:units]
            keep = [set() for _ in parts]
            for _, k, _, cores in ranked:
                keep[k] |= set(cores)

        def roles(last: Any) -> dict[int, str]:  # core -> what its unit runs
            out = {}
            for u in last.placement.units:
                for c in u.cores:
                    out[c] = (
                        " ".join(f"{k} %{n}" for n, k in zip(u.ops, u.kinds))
                        if c == u.core
                        else f"memory of %{u.name}"
                    )
            return out

        # metadata: once per (kind, process, track); a track's names in every configuration
        meta: dict[tuple[Any, ...], dict[str, Any]] = {}
        names: dict[tuple[Any, ...], list[tuple[int, str, str | None]]] = {}
        for k, (*_, last) in enumerate(parts):
            role = roles(last)
            for ev in last.sim.trace_events:
                if ev.get("ph") != "M":
                    break  # build_trace writes the metadata first
                key = (ev["name"], ev["pid"], ev.get("tid"))
                meta.setdefault(key, ev)
                if ev["name"] == "thread_name":
                    r = role.get(ev["tid"]) if ev["pid"] == 1 else None
                    if r is not None and keep is not None and ev["tid"] not in keep[k]:
                        r = None  # its spans of this configuration are left out
                    names.setdefault(key, []).append((k + 1, ev["args"]["name"], r))
        split = len(parts) > 1
        for key, seen in names.items():
            base = seen[0][1]
            if key[1] == 1:
                rs = [f"{k}: {r}" if split else r for k, _, r in seen if r is not None]
                name = f"{base}: {' | '.join(rs)}" if rs else base
            elif len({n for _, n, _ in seen}) == 1:
                name = base
            else:
                name = " | ".join(f"{k}: {n}" for k, n, _ in seen)
            meta[key] = {**meta[key], "args": {**meta[key]["args"], "name": name}}

        dropped = 0

        def events():  # type: ignore[no-untyped-def]
            nonlocal dropped
            yield from meta.values()
            for k, (offset, _, last) in enumerate(parts):  # configurations one after another
                cores = keep[k] if keep is not None else None
                for ev in last.sim.trace_events:
                    if ev.get("ph") == "M":
                        continue
                    if cores is not None and ev.get("pid") == 1 and ev.get("tid") not in cores:
                        dropped += 1
                        continue
                    if offset and "ts" in ev:
                        ev = {**ev, "ts": ev["ts"] + offset}
                    yield ev

        def whole(x: float) -> float | int | None:
            return None if math.isinf(x) else int(x) if float(x).is_integer() else x

        first, last = parts[0][2], parts[-1][2]
        other = {
            "graph": first.graph if not split else self.layer.name,
            "chip": first.chip,
            "clock_ghz": first.sim.clock_ghz,
            "time_unit": "1 trace microsecond = 1 cycle",
            "cycles": total,
            "configurations": len(parts) if split else None,
            "window_cycles": [whole(x) for x in window] if window else None,
            "units_kept": units,
        }
        if window is not None and window[0] >= total:
            logging.getLogger("torch2step").warning(
                "trace window %s..%s cycles starts after the run, which is %s cycles long: "
                "trace.json holds no spans",
                whole(window[0]),
                "end" if math.isinf(window[1]) else whole(window[1]),
                f"{total:,}",
            )
        cores = set().union(*keep) if keep is not None else None
        self.trace_stats = write_trace_json(
            path, events(), other, window=window, cores=cores, cycles=total
        )
        self.trace_stats["dropped"] += dropped
        return Path(path)


def check_trace_limits(
    window: tuple[float, float] | None,
    units: int | None,
    names: tuple[str, str] = ("window", "units"),
) -> None:
    """Refuse a trace window that is not ``0 <= start < end`` cycles (``end`` may be ``inf``;
    NaN anywhere) and fewer than one unit kept: an :class:`InputError` naming the argument
    (``names``: how the caller spells window and units, e.g. the CLI's flags)."""
    if units is not None and units < 1:
        raise InputError(f"{names[1]} {units}: keep the core tracks of N >= 1 busiest units")
    if window is not None:
        lo, hi = (float(x) for x in window)
        if math.isnan(lo) or math.isnan(hi) or math.isinf(lo) or lo < 0 or hi <= lo:
            raise InputError(
                f"{names[0]} {window}: give START:END cycles with 0 <= START < END "
                "(END may be left out or inf: to the run's end)"
            )


@dataclasses.dataclass(frozen=True)
class _Formulas:
    """The §4.1 formulas a report prints and their values for its run."""

    offchip: str
    offchip_bytes: int
    onchip: str
    onchip_bytes: int


def _make_report(
    prog: Program, lw: Lowered, sim: Any, f: _Formulas, dynamic: dict, sim_s: float
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
        hbm_bytes_symbolic=f.offchip_bytes,
        hbm_bytes_formula=f.offchip,
        peak_onchip_bytes=f.onchip_bytes,
        onchip_formula=f.onchip,
        flops=int(sim.flops),
        roofline_cycles=int(sim.roofline),
        roofline_fraction=float(sim.roofline_fraction),
        breakdown=breakdown,
        utilisation=util,
        units=units,
        dynamic={k: v for k, v in dynamic.items() if v is not None},
        events=int(sim.events),
        simulation_s=round(sim_s, 3),
        dtype=layer_dtype(prog.layer),
        simulated_onchip_bytes=sum(int(u.sram_bytes) + int(u.fifo_bytes) for u in sim.units),
    )


def layer_dtype(layer: LayerGraph) -> str:
    """The floating-point element type of the layer's inputs (what it is timed in)."""
    kinds = {layer.types[n].dtype for n in layer.inputs}
    floats = sorted(k for k in kinds if not k.startswith("int") and k != "bool")
    return floats[0] if len(floats) == 1 else ",".join(floats) or "int"


def dtype_rate_note(chip: Chip, dtype: str) -> str:
    """The note of a layer timed in an element type ``dtype`` the chip lists no compute rate
    for (its tiles are timed at the cores' 16-bit rate); empty when the chip lists one."""
    from torch2step.spatial.timing import TimingModel

    tm = TimingModel(chip)
    if dtype in tm.rates:
        return ""
    return (
        f"{dtype} tiles are timed at the cores' 16-bit rate ({tm.default_rate:,} FLOPs/cycle "
        f"per core): the chip lists no {dtype} rate"
    )


def padding_note(layer: LayerGraph, sizes: dict[str, Any], tile_rows: int) -> str:
    """The note of a run whose Linear rows, a dynamic size, fill their last ``tile_rows``-row
    block only in part: one program serves every size, so it computes whole blocks (the
    padding counts in the cycles and FLOPs); empty when no Linear pads."""
    syms = {str(sym): sym for sym in layer.dims}
    env = {syms[k]: v for k, v in sizes.items() if k in syms and isinstance(v, int)}
    worst = None
    for n in layer.nodes:
        if not isinstance(n.op, L.Linear):
            continue
        rows = sp.sympify(sp.prod(layer.types[n.inputs[0]].shape[:-1]))
        if rows.is_Integer or not env:
            continue
        r = rows.subs(env)
        if not r.is_Integer or int(r) < 1:
            continue
        r = int(r)
        padded = -(-r // tile_rows) * tile_rows
        if padded > r and (worst is None or (padded - r) / padded > worst[1]):
            worst = (n.name, (padded - r) / padded, r, padded)
    if worst is None:
        return ""
    name, share, r, padded = worst
    return (
        f"{PADDING_NOTE} {tile_rows} (tile_rows): {name}'s "
        f"{r} rows take {padded}, {share:.0%} of them padding, which the cycles and FLOPs "
        f"count; to time these sizes alone, compile with static shapes or tile_rows={r} "
        f"(--option tile_rows={r})"
    )


def _timeline(sim: Any) -> dict[str, Any]:
    """Utilisation counters of the trace (``runtime.trace``) as ``{edges, compute, hbm, noc}``."""
    out: dict[str, list[float]] = {"edges": [], "compute": [], "hbm": [], "noc": []}
    for ev in sim.sim.trace_events:
        if ev.get("ph") == "C":
            kind = ev["name"].split()[0]
            if kind == "compute":
                out["edges"].append(ev["ts"])
            out[kind].append(ev["args"]["busy"])
    if out["edges"]:
        out["edges"].append(sim.cycles)
    return out if out["compute"] else {}


def _with_context(
    prog: Program, lw: Lowered, rep: Report, sim: Any, traced_routing: bool, notes: Sequence[str]
) -> Report:
    """``rep`` with the chip, element type, options, notes of this run and the user's
    operator each unit came from (``origin``)."""
    from dataclasses import replace

    from hwmodel import to_dict
    from torch2step.origins import step_origins
    from torch2step.spatial.timing import TimingModel

    dtype = rep.dtype or layer_dtype(prog.layer)
    tm = TimingModel(prog.chip)
    all_notes = [*prog.layer.notes, *notes]
    rate_note = dtype_rate_note(prog.chip, dtype)
    if rate_note:
        all_notes.append(rate_note)
    pad = padding_note(prog.layer, rep.dynamic, prog.lowered.options.tile_rows)
    if pad:
        all_notes.append(pad)
    options = {k: v for k, v in asdict(prog.lowered.options).items() if v is not None}
    options["routing"] = "trace" if traced_routing else "router"
    origins = step_origins(lw)
    units = [{**u, "origin": origins.get(u["ops"][0], "")} for u in rep.units]
    return replace(
        rep,
        units=units,
        chip_spec=to_dict(prog.chip),
        peak_flops_per_cycle=prog.chip.num_cores * tm.default_rate,
        options=options,
        notes=all_notes,
        timeline=_timeline(sim) if sim.sim.trace_events else {},
    )
