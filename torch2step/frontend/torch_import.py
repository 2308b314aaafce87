"""``from_torch``: a PyTorch module to a :class:`~torch2step.layers.graph.LayerGraph`
(capture with ``torch.export``, raise by meaning, check the result's structure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torch2step.errors import FrontendError
from torch2step.frontend.capture import capture, dim_names
from torch2step.frontend.raise_graph import raise_program
from torch2step.layers.evaluate import evaluate
from torch2step.layers.graph import LayerGraph

__all__ = ["from_torch"]


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
    spec = ep.module_call_graph[0].signature.out_spec
    single = spec.is_leaf()
    graph = raise_program(
        ep,
        name=name or type(module).__name__,
        dim_names=_input_dim_names(module, example_inputs, dynamic_shapes),
        single_output=single,
    )
    if single != (len(graph.outputs) == 1) and single:
        raise FrontendError(f"{graph.name}: one output expected, raised {len(graph.outputs)}")
    _check_structure(graph, ep, [x for x in example_inputs if isinstance(x, torch.Tensor)])
    return graph


def _input_dim_names(
    module: nn.Module, example_inputs: tuple[Any, ...], dynamic_shapes: Any
) -> dict[tuple[int, int], str]:
    # dim names are keyed by tensor-input position (export drops non-tensor inputs)
    names = dim_names(module, example_inputs, dynamic_shapes)
    tensor_pos = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    remap = {old: new for new, old in enumerate(tensor_pos)}
    return {(remap[i], a): n for (i, a), n in names.items() if i in remap}


def _check_structure(
    graph: LayerGraph, ep: torch.export.ExportedProgram, inputs: list[torch.Tensor]
) -> None:
    """The graph runs on the example inputs and returns what ``forward`` returns: one tensor or
    a tuple of tensors of the captured shapes and dtypes."""
    out = evaluate(graph, *inputs)
    got = (out,) if graph.single_output else out
    if graph.single_output and not isinstance(out, torch.Tensor):
        raise FrontendError(f"{graph.name}: forward returns one tensor, the graph a tuple")
    if not graph.single_output and not isinstance(out, tuple):
        raise FrontendError(f"{graph.name}: forward returns a tuple, the graph one tensor")
    node = next(n for n in ep.graph.nodes if n.op == "output")
    want = [a.meta["val"] for a in node.args[0]]
    if len(want) != len(got):
        raise FrontendError(f"{graph.name}: forward returns {len(want)} tensors, the graph {len(got)}")
    for i, (w, g) in enumerate(zip(want, got)):
        shape = [_concrete(d) for d in w.shape]
        if list(g.shape) != shape or g.dtype != w.dtype:
            raise FrontendError(
                f"{graph.name}: output {i} is {list(g.shape)} {g.dtype} on the example inputs, "
                f"forward returns {shape} {w.dtype}"
            )


def _concrete(d: Any) -> int:
    if isinstance(d, int):
        return d
    env = d.node.shape_env
    return int(d.node.expr.xreplace(getattr(env, "backed_var_to_val", None) or env.var_to_val))
