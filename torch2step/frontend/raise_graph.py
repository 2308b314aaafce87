"""From a core-ATen ``ExportedProgram`` to a :class:`~torch2step.layers.graph.LayerGraph`: the
PyTorch frontend of the raising engine (:mod:`torch2step.frontend.engine`).

The FX graph already is the engine's common view (core-ATen op names, literal arguments);
:class:`FxFrontend` adds the one-to-one translations
(:data:`~torch2step.frontend.raise_rules.RULES`) and what the unsupported-operator error says
about an FX node (its ATen overload and the user's source line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from torch2step.errors import FrontendError
from torch2step.frontend import engine
from torch2step.frontend.engine import format_matches
from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Match, Pattern
from torch2step.frontend.fx_view import (
    ProgramView,
    is_tensor_node,
    op_name,
    overload_name,
    source_line,
    tensor_args,
)
from torch2step.frontend.raise_attention import ATTENTION_MATMUL, ATTENTION_SDPA
from torch2step.frontend.raise_basic import LAYERNORM, LINEAR, RMSNORM, TOPK_ROUTING
from torch2step.frontend.raise_moe import MOE_EXPERTS
from torch2step.frontend.raise_rotary import ROTARY
from torch2step.frontend.raise_rules import IGNORED, check_node, rule_for
from torch2step.layers.graph import LayerGraph

__all__ = ["PATTERNS", "raise_program", "find_matches", "format_matches", "FxFrontend"]

#: The raising patterns, tried in this order (larger meanings first).
PATTERNS: tuple[Pattern, ...] = (
    MOE_EXPERTS,
    ATTENTION_SDPA,
    ATTENTION_MATMUL,
    ROTARY,
    RMSNORM,
    LAYERNORM,
    TOPK_ROUTING,
    LINEAR,
)

_HINTS = {
    "scaled_dot_product_attention": "attention with this mask/dropout has no Attention op",
    "topk": "topk is supported as an MoE router: softmax -> topk (-> renormalise) over [T, E]",
    "nonzero": "data-dependent indexing is supported inside an MoE loop over experts",
    "index_put": "index_put is supported inside an MoE loop (index_add_ over expert tokens)",
    "index_add": "index_add_ is supported inside an MoE loop (accumulating each expert's rows)",
    "scatter_add": "scatter_add_ is supported inside an MoE loop (accumulating each expert's rows)",
    "index_select": "index_select on a data-dependent index is supported inside an MoE loop",
    "gather": "gather is supported inside an MoE loop (gathering each expert's token rows)",
    "cos": "cos/sin are supported inside default rotate-half RoPE",
    "sin": "cos/sin are supported inside default rotate-half RoPE",
}


def find_matches(
    view: ProgramView, patterns: Sequence[Pattern] = PATTERNS
) -> tuple[dict[fx.Node, Match], dict[fx.Node, str]]:
    """``(root -> match, node -> why a pattern rejected it)`` (:func:`engine.find_matches`)."""
    return engine.find_matches(view, patterns)


class FxFrontend:
    """The PyTorch frontend's side of :class:`~torch2step.frontend.engine.Frontend`."""

    advice = (
        "express these with supported operations (linear/matmul, elementwise, RMSNorm, "
        "LayerNorm, softmax, RoPE, top-k routing, MoE experts, attention, cat/gather/views), or "
        "add a rule to torch2step.frontend.raise_rules.RULES or a pattern to "
        "torch2step.frontend.raise_graph.PATTERNS."
    )

    def __init__(self, view: ProgramView) -> None:
        self.view = view

    def outputs(self) -> list[Any]:
        args = self.view.output_node.args[0]
        return list(args) if isinstance(args, (list, tuple)) else [args]

    def reads(self, node: fx.Node) -> list[fx.Node]:
        return tensor_args(node)

    def check(self, node: fx.Node) -> str | None:
        if op_name(node) in IGNORED or not is_tensor_node(node):
            return "computes no tensor"
        why = check_node(self.view, node)
        if why == "no rule":
            return _HINTS.get(op_name(node), "no rule for this op")
        return why

    def describe(self, node: fx.Node) -> str:
        return f"{node.name}: {overload_name(node)} at {source_line(node) or '(no source line)'}"

    def translate(self, em: FxEmitter, node: fx.Node) -> None:
        em.at(node)
        rule = rule_for(node)
        assert rule is not None
        em.values[node] = rule(em, node)

    def bind(self, em: FxEmitter, root: fx.Node, value: str) -> None:
        em.values[root] = value

    def has(self, em: FxEmitter, node: fx.Node) -> bool:
        return node in em.values or self.view.weight_name(node) is not None


def raise_program(
    ep: torch.export.ExportedProgram,
    *,
    name: str = "layer",
    dim_names: Mapping[tuple[int, int], str] | None = None,
    single_output: bool | None = None,
    rope_theta: float | None = None,
) -> LayerGraph:
    """Raise a decomposed ``ExportedProgram`` (see :func:`~torch2step.frontend.capture.capture`)
    to a layer graph whose inputs are the module's tensor arguments in order.

    ``dim_names``: ``(tensor input index, axis) -> name`` of the dynamic dims; ``rope_theta``:
    the RoPE base when the frequency table has no values (a ``meta``-device module)."""
    view = ProgramView(ep, dim_names, rope_theta)
    front = FxFrontend(view)
    graph = LayerGraph(name=name)
    em = FxEmitter(view, graph)
    for ph in view.user_inputs:
        if not isinstance(ph.meta.get("val"), torch.Tensor):
            raise FrontendError(f"{name}: input {ph.name!r} is not a tensor; pass tensors only")
        em.values[ph] = graph.add_input(ph.name, view.ttype(ph))
    engine.raise_graph(front, PATTERNS, em, name)
    for o in front.outputs():
        if not isinstance(o, fx.Node) or not is_tensor_node(o):
            raise FrontendError(f"{name}: output {o!r} is not a tensor; return tensors only")
        graph.outputs.append(em.get(o))
    graph.single_output = len(graph.outputs) == 1 if single_output is None else single_output
    graph.drop_dead()
    return graph
