"""``from_torch``: a PyTorch module to a :class:`~torch2step.layers.graph.LayerGraph`
(capture with ``torch.export``, raise by meaning, check the result's structure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torch2step.errors import FrontendError
from torch2step.frontend.capture import NOTES_KEY, capture, dim_names
from torch2step.frontend.raise_graph import raise_program
from torch2step.layers.evaluate import evaluate
from torch2step.layers.graph import LayerGraph, dtype_name

__all__ = ["from_torch", "from_exported"]


def from_torch(
    module: nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    dynamic_shapes: Any = None,
    *,
    name: str | None = None,
) -> LayerGraph:
    """Capture ``module`` on ``example_inputs`` and raise it to a layer graph.

    The graph's ``inputs`` are the module's tensor arguments in positional order, its
    ``outputs`` what ``forward`` returns (``single_output`` for one tensor, else a tuple), its
    ``dims`` the dynamic dims (``T``, ``B``, ``S``, ``L`` or the ``torch.export.Dim`` names of
    ``dynamic_shapes``; see :mod:`torch2step.frontend.capture` for the default heuristic).
    Raises :class:`~torch2step.errors.FrontendError` (capture) or
    :class:`~torch2step.errors.UnsupportedOperatorError` (every operation without a
    translation, listed at once).
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    ep = capture(module, example_inputs, dynamic_shapes)
    return from_exported(ep, module, example_inputs, dynamic_shapes, name=name)


def from_exported(
    ep: torch.export.ExportedProgram,
    module: nn.Module,
    example_inputs: Sequence[Any],
    dynamic_shapes: Any = None,
    *,
    name: str | None = None,
) -> LayerGraph:
    """The raising half of :func:`from_torch`, for a program already returned by
    :func:`~torch2step.frontend.capture.capture` on the same module and inputs."""
    example_inputs = tuple(example_inputs)
    spec = ep.module_call_graph[0].signature.out_spec
    single = spec.is_leaf()
    graph = raise_program(
        ep,
        name=name or type(module).__name__,
        dim_names=_input_dim_names(module, example_inputs, dynamic_shapes),
        single_output=single,
        rope_theta=_rope_theta(module),
    )
    if single != (len(graph.outputs) == 1) and single:
        raise FrontendError(f"{graph.name}: one output expected, raised {len(graph.outputs)}")
    _check_structure(graph, ep, [x for x in example_inputs if isinstance(x, torch.Tensor)])
    graph.notes.extend(ep.graph_module.meta.get(NOTES_KEY, ()))
    return graph


def _input_dim_names(
    module: nn.Module, example_inputs: tuple[Any, ...], dynamic_shapes: Any
) -> dict[tuple[int, int], str]:
    # dim names are keyed by tensor-input position (export drops non-tensor inputs)
    names = dim_names(module, example_inputs, dynamic_shapes)
    tensor_pos = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    remap = {old: new for new, old in enumerate(tensor_pos)}
    return {(remap[i], a): n for (i, a), n in names.items() if i in remap}


def _rope_theta(module: nn.Module) -> float | None:
    """The one RoPE base in the module's configs (``rope_theta`` / ``rope_parameters``)."""
    found = set()
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        theta = getattr(cfg, "rope_theta", None)
        params = getattr(cfg, "rope_parameters", None)
        if theta is None and isinstance(params, dict):
            theta = params.get("rope_theta")
        if isinstance(theta, (int, float)):
            found.add(float(theta))
    return found.pop() if len(found) == 1 else None


def _check_structure(
    graph: LayerGraph, ep: torch.export.ExportedProgram, inputs: list[torch.Tensor]
) -> None:
    """The graph returns what ``forward`` returns: one tensor or a tuple of tensors of the
    captured shapes and dtypes (checked on the types, and by running it on the example inputs
    unless they or the weights are shapes only)."""
    node = next(n for n in ep.graph.nodes if n.op == "output")
    want = [a.meta["val"] for a in node.args[0]]
    if len(want) != len(graph.outputs):
        raise FrontendError(
            f"{graph.name}: forward returns {len(want)} tensors, the graph {len(graph.outputs)}"
        )
    sizes = {s: int(x.shape[a]) for s, (name, a) in graph.dims.items() for x in
             [inputs[graph.inputs.index(name)]]}  # fmt: skip
    for i, (w, o) in enumerate(zip(want, graph.outputs)):
        ty = graph.types[o]
        got = [int(d.subs(sizes)) if hasattr(d, "subs") else int(d) for d in ty.shape]
        shape = [_concrete(d) for d in w.shape]
        if got != shape or ty.dtype != dtype_name(w.dtype):
            raise FrontendError(
                f"{graph.name}: output {i} is {ty} = {got} on the example inputs, forward "
                f"returns {shape} {w.dtype}"
            )
    if any(x.is_meta for x in inputs) or any(p.is_meta for p in graph.params.values()):
        return
    out = evaluate(graph, *inputs)
    got_t = (out,) if graph.single_output else out
    if not isinstance(got_t, tuple) or len(got_t) != len(want):
        raise FrontendError(f"{graph.name}: the graph does not return forward's structure")
    for i, (w, g) in enumerate(zip(want, got_t)):
        if list(g.shape) != [_concrete(d) for d in w.shape] or g.dtype != w.dtype:
            raise FrontendError(
                f"{graph.name}: output {i} is {list(g.shape)} {g.dtype} on the example inputs, "
                f"forward returns {[_concrete(d) for d in w.shape]} {w.dtype}"
            )


def _concrete(d: Any) -> int:
    if isinstance(d, int):
        return d
    env = d.node.shape_env
    return int(d.node.expr.xreplace(getattr(env, "backed_var_to_val", None) or env.var_to_val))
