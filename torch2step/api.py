"""The public entry points: :func:`compile`, :func:`import_onnx`, :func:`example_inputs_for`.

``compile`` is the whole pipeline (README, "The pipeline"): capture (``torch.export``) or ONNX import ->
layer graph (raising by meaning) -> STeP program (:mod:`torch2step.lower`) -> a
:class:`~torch2step.program.Program` bound to a chip, whose ``run`` executes the STeP program
and whose ``report`` simulates it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import sympy as sp
import torch

from elk.plan import PLAN_OPTIONS, plan_search
from hwmodel.chip import Chip
from hwmodel.errors import ChipConfigError
from hwmodel.presets import list_presets, load_chip
from torch2step.errors import FrontendError, LoweringError
from torch2step.layers.graph import LayerGraph, torch_dtype
from torch2step.lower import LowerOptions, lower
from torch2step.lower.linear import LINEAR_K_LANES, LINEAR_LANES
from torch2step.program import Program

__all__ = ["compile", "example_inputs_for", "import_onnx"]

LINEAR_LANES_MIN_CORES = 256
"""Chips with at least this many cores split each Linear over ``LINEAR_LANES`` parallel lanes
unless ``linear_lanes`` is given (STeP (arXiv 2511.07776) §5); smaller chips keep one lane, and
one decode-attention pipeline unless ``attn_lanes`` is given."""
_OPTIONS = tuple(f.name for f in dataclasses.fields(LowerOptions))


def import_onnx(path_or_model: Any, *, name: str | None = None) -> LayerGraph:
    """Read an ONNX file (or ``onnx.ModelProto``) into a layer graph; ``compile`` accepts it."""
    from torch2step.frontend.onnx_import import import_onnx as _imp

    return _imp(path_or_model, name=name)


def _inputs_by_name(layer: LayerGraph, inputs: Mapping[str, Any]) -> tuple[Any, ...]:
    """``inputs`` given by the graph's input names, in the graph's input order."""
    missing = [n for n in layer.inputs if n not in inputs]
    unknown = sorted(str(n) for n in inputs if n not in layer.inputs)
    if missing or unknown:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise FrontendError(
            f"compile: example_inputs by name must name each input of {layer.name} "
            f"({', '.join(layer.inputs)}); {'; '.join(problems)}"
        )
    return tuple(inputs[n] for n in layer.inputs)


def _resolve_chip(chip: Chip | str | os.PathLike[str]) -> Chip:
    if isinstance(chip, Chip):
        return chip
    if not isinstance(chip, (str, os.PathLike)):
        raise ChipConfigError(
            f"chip={chip!r}: give a preset name ({', '.join(list_presets())}), the path of a "
            "chip YAML file or a hwmodel.Chip"
        )
    return load_chip(chip)


def refuse_plan_options(options: dict[str, Any]) -> None:
    """The options of an ELK plan's search given to a spatial compile (a STeP program, which
    has no ELK plan): refused, all named at once, rather than ignored."""
    given = sorted(k for k in options if k in PLAN_OPTIONS)
    if given:
        raise LoweringError(
            f"compile option(s) {', '.join(given)} set the search of an ELK plan (kernel-by-kernel "
            "execution); a spatial compile places a STeP program and plans no ELK schedule: drop "
            "them, or compile for an ICCA chip (execution='kernel')"
        )


def refuse_spatial_options(options: dict[str, Any], chip: Chip) -> None:
    """Kernel-by-kernel execution plans with ELK and lowers no STeP program, so the options of
    a STeP program (tiling, STeP §5 strategies and their search) would be ignored: they are
    refused, all named at once, rather than dropped."""
    given = sorted(k for k, v in options.items() if v is not None)
    if given:
        raise LoweringError(
            f"compile option(s) {', '.join(given)} shape a STeP program (spatial execution); "
            f"kernel-by-kernel execution on {chip.name} plans with ELK and does not use them: "
            "drop them, or pass execution='spatial' to place the STeP program on this chip"
        )


def _is_onnx(obj: Any) -> bool:
    if isinstance(obj, (str, os.PathLike)):
        return True
    return type(obj).__name__ == "ModelProto"


def compile(  # noqa: A001  (the public name the users asked for)
    module_or_onnx: Any,
    example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor | None = None,
    chip: Chip | str = "step-sda",
    dynamic_shapes: Any = None,
    execution: str | None = None,
    **options: Any,
) -> Any:
    """Compile a module, an ONNX file/model or a layer graph for ``chip``.

    ``example_inputs``: the module's positional tensors (required for a module; for an ONNX
    model or layer graph, also a mapping by input name, and by default
    :func:`example_inputs_for`); ``dynamic_shapes`` as in
    ``torch.export`` (default: tokens / batch / KV-length dims are dynamic, see
    :mod:`torch2step.frontend.capture`); ``options``: tiling options of
    :class:`~torch2step.lower.LowerOptions` (``tile_rows``, ``tile_cols``, ``tile_kv``, ...).
    Strategies of STeP (arXiv 2511.07776) §5: ``moe_static_tile=N`` tiles each expert's tokens
    statically in tiles of ``N`` rows (default: dynamic tiling, §5.2); ``moe_lanes=R`` shares
    ``R`` expert regions among ``E/R`` consecutive experts each (§5.3; each region's EagerMerge
    order is decided in simulated time by :func:`torch2step.spatial.dynamic.simulate_decided`);
    ``attn_regions=R`` spreads decode attention's requests over ``R`` parallel regions (§5.4)
    by ``attn_assign="coarse"`` (``attn_coarse_chunk`` consecutive requests per region),
    ``"interleave"`` (round-robin, the default) or ``"dynamic"`` (each request to the first
    free region; ``report`` decides it in simulated time with
    :func:`torch2step.spatial.dispatch.simulate_dispatched`).
    Compile for ``chip="step-paper"`` to reproduce the paper's simulator set-up.
    ``strategy="auto"`` searches those strategies (MoE tiling and regions, attention regions
    and assignment) under ``onchip_budget`` bytes (§4.1) and ``compute_budget`` FLOPs/cycle,
    pruning with the §4.1 formulas and deciding with the simulator
    (:mod:`torch2step.auto`); it prints the candidates tried, kept as
    ``Program.strategy_table``.
    ``execution``: ``"spatial"`` (a STeP program) or ``"kernel"`` (kernel by kernel: an ELK
    schedule and per-core programs, :class:`torch2step.kernel.program.KernelProgram`, whose
    option ``design`` picks one of ``elk.designs.DESIGNS`` and ``plan_window``, ``plan_beam``,
    ``plan_orders``, ``plan_window_data`` its plan's search budget, :func:`elk.plan.plan_search`;
    the options of a STeP program are refused there); default: what the chip's
    description says (``Chip.execution``: ``"kernel"`` on the ICCA presets ``ipu-hbm`` and
    ``mesh``).  ``routing`` (kernel execution of a layer compiled from shapes only, e.g. a
    config): ``[tokens, k]`` expert ids whose experts the plan loads (default: the number
    expected under uniform routing); the spatial execution takes it at ``report`` time.
    """
    design_given = "design" in options
    design = options.pop("design", "elk_full")
    routing = options.pop("routing", None)
    given_plan = {k: options.pop(k) for k in PLAN_OPTIONS if k in options}
    strategy = options.pop("strategy", None)
    onchip_budget = options.pop("onchip_budget", None)
    compute_budget = options.pop("compute_budget", None)
    if strategy not in (None, "auto", "default"):
        raise LoweringError(f"option strategy={strategy!r}: use 'auto' or leave it out")
    bad = sorted(set(options) - set(_OPTIONS))
    if bad:
        raise LoweringError(
            f"unknown compile option(s) {', '.join(bad)}; valid options: {', '.join(_OPTIONS)}"
        )
    target = _resolve_chip(chip)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping) and isinstance(module_or_onnx, torch.nn.Module):
        raise FrontendError(
            "compile(module, example_inputs): a module's example inputs are its positional "
            "tensors, a tuple; inputs by name are for an ONNX model or a layer graph"
        )
    if isinstance(module_or_onnx, LayerGraph):
        layer = module_or_onnx
    elif _is_onnx(module_or_onnx):
        layer = import_onnx(module_or_onnx)
    elif isinstance(module_or_onnx, torch.nn.Module):
        if example_inputs is None:
            raise FrontendError("compile(module, example_inputs): example inputs are required")
        from torch2step.frontend import from_torch

        layer = from_torch(module_or_onnx, tuple(example_inputs), dynamic_shapes)
    else:
        raise FrontendError(
            f"compile: expected an nn.Module, an ONNX path or ModelProto, or a LayerGraph; "
            f"got {type(module_or_onnx).__name__}"
        )
    if example_inputs is None:
        example_inputs = example_inputs_for(layer)
    elif isinstance(example_inputs, Mapping):
        example_inputs = _inputs_by_name(layer, example_inputs)
    from torch2step.layers.stack import Repeat

    if any(isinstance(n.op, Repeat) for n in layer.nodes):  # N identical layers, one body
        from torch2step.stack_program import compile_stack

        opts = {**options, **given_plan, "execution": execution}
        if design_given:  # a spatial stack's body refuses it as a spatial compile does
            opts["design"] = design
        if routing is not None:
            opts["routing"] = routing
        budgets = {"onchip_budget": onchip_budget, "compute_budget": compute_budget}
        for k, v in {"strategy": strategy, **budgets}.items():
            if v is not None:  # the body's STeP strategies (a kernel step refuses them)
                opts[k] = v
        return compile_stack(layer, tuple(example_inputs), chip=target, **opts)
    if execution is None:
        execution = target.execution  # what the chip's description says
    if execution == "kernel":
        from torch2step.kernel.program import KernelProgram

        refuse_spatial_options(
            {
                **options,
                "strategy": None if strategy == "default" else strategy,
                "onchip_budget": onchip_budget,
                "compute_budget": compute_budget,
            },
            target,
        )

        return KernelProgram(
            layer,
            target,
            tuple(example_inputs),
            design=design,
            routing=routing,
            search=plan_search(given_plan),
        )
    if execution != "spatial":
        raise LoweringError(f"execution must be 'spatial' or 'kernel', got {execution!r}")
    refuse_plan_options(given_plan)
    if design_given:
        raise LoweringError(
            f"compile option design={design!r} picks an ELK design (kernel-by-kernel execution, "
            "ELK §6.1); a spatial compile places a STeP program: drop it, or compile with "
            "execution='kernel' (the default on the ICCA chips ipu-hbm and mesh)"
        )
    if routing is not None:
        raise LoweringError(
            "routing= is a compile option of kernel execution (ELK plans the experts it "
            "loads); a spatial program takes it in report(..., routing=ids)"
        )
    _refuse_unused_options(layer, options)
    if options.get("linear_lanes") is None and target.num_cores >= LINEAR_LANES_MIN_CORES:
        options["linear_lanes"] = LINEAR_LANES  # a large chip runs each large Linear on lanes
        options["linear_lanes_auto"] = True
    if options.get("linear_k_lanes") is None and target.num_cores >= LINEAR_LANES_MIN_CORES:
        options["linear_k_lanes"] = LINEAR_K_LANES  # and splits large Linears over K
        options["linear_lanes_auto"] = True
    if options.get("attn_lanes") is None and target.num_cores < LINEAR_LANES_MIN_CORES:
        options["attn_lanes"] = 1  # a small chip keeps one attention pipeline (it fits)
    if strategy == "auto":  # STeP §5 strategies searched under the budgets
        from torch2step.auto import search

        prog = search(
            layer,
            target,
            tuple(example_inputs),
            options,
            onchip_budget=None if onchip_budget is None else int(onchip_budget),
            compute_budget=None if compute_budget is None else int(compute_budget),
        )
        prog._check(tuple(example_inputs))
        return prog
    lowered = lower(layer, LowerOptions(**options))
    prog = Program(layer, lowered, target, tuple(example_inputs))
    prog._check(tuple(example_inputs))
    return prog


#: the options that shape a MoE layer's or an attention's lowering (STeP §5.2-§5.4)
_MOE_OPTIONS = ("moe_tile_h", "moe_tile_i", "moe_lanes", "moe_static_tile", "moe_lane_assign")
_ATTN_OPTIONS = ("tile_kv", "attn_regions", "attn_assign", "attn_coarse_chunk", "attn_lanes")


def _refuse_unused_options(layer: LayerGraph, options: dict[str, Any]) -> None:
    """Options of the MoE or attention lowering given for a layer without that operator:
    refused, all named, rather than ignored."""
    from torch2step.layers import ops as L

    kinds = {type(n.op) for n in layer.nodes}
    unused = [
        f"{k} (for {what})"
        for names, op, what in (
            (_MOE_OPTIONS, L.MoEExperts, "MoE experts"),
            (_ATTN_OPTIONS, L.Attention, "attention"),
        )
        if op not in kinds
        for k in names
        if k in options
    ]
    if unused:
        have = ", ".join(sorted({k.__name__ for k in kinds}))
        raise LoweringError(
            f"{layer.name}: compile option(s) {', '.join(unused)}: the layer has no such "
            f"operator (its operators: {have}), so they would change nothing; drop them"
        )
    lanes = options.get("moe_lanes")
    experts = [n.op.num_experts for n in layer.nodes if isinstance(n.op, L.MoEExperts)]
    if lanes is not None and experts and lanes > min(experts):
        e = min(experts)
        raise LoweringError(
            f"{layer.name}: moe_lanes={lanes} is more expert lanes than the layer's {e} "
            f"experts (STeP §5.3: a lane serves E/R experts); give at most {e} ({e} or 0: one "
            "branch per expert)"
        )


def example_inputs_for(
    graph: LayerGraph, size: int = 8, *, seed: int = 0, sizes: dict[str, int] | None = None
) -> tuple[torch.Tensor, ...]:
    """Random inputs for ``graph``: every dynamic dimension ``size`` (or ``sizes[name]``);
    integer inputs (e.g. KV lengths) drawn in ``[1, size]``, bool inputs true or false."""
    gen = torch.Generator().manual_seed(seed)
    given = sizes or {}
    out = []
    for name in graph.inputs:
        ty = graph.types[name]
        shape = []
        for d in ty.shape:
            e = sp.sympify(d)
            if e.free_symbols:
                e = e.subs({s: given.get(str(s), size) for s in e.free_symbols})
            shape.append(int(e))
        dt = torch_dtype(ty.dtype)
        if dt.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dt))
        elif dt == torch.bool:  # a condition (Where): true and false alike
            out.append(torch.rand(shape, generator=gen) < 0.5)
        else:
            out.append(torch.randint(1, max(size, 1) + 1, shape, generator=gen, dtype=dt))
    return tuple(out)
