"""Appending layer ops for FX nodes: the value map from FX nodes to layer-graph values, weights
turned into graph parameters on first use, and the user's source line on every layer node."""

from __future__ import annotations

from torch import fx

from torch2step.errors import FrontendError
from torch2step.frontend.emit import LayerEmitter
from torch2step.frontend.fx_view import ProgramView
from torch2step.layers.graph import LayerGraph

__all__ = ["FxEmitter", "Value"]

#: A layer value name, or a tuple of them for multi-output FX nodes (``split``, ``topk``).
Value = str | tuple[str, ...]


class FxEmitter(LayerEmitter):
    """Builds a :class:`LayerGraph` from FX nodes; ``values[node]`` is the layer value of a
    translated node."""

    def __init__(self, view: ProgramView, graph: LayerGraph) -> None:
        super().__init__(graph)
        self.view = view
        self.values: dict[fx.Node, Value] = {}

    # -- values ---------------------------------------------------------------------------------
    def get(self, node: fx.Node) -> str:
        """The layer value of an FX node (weights become parameters on first use)."""
        if node not in self.values and self.view.weight_name(node) is not None:
            self.values[node] = self.param(self.view.weight_name(node) or node.name, node)
        v = self.values.get(node)
        if v is None:
            raise FrontendError(f"internal: FX node {node.name} used before it was translated")
        if isinstance(v, tuple):
            raise FrontendError(f"internal: FX node {node.name} has several values")
        return v

    def get_multi(self, node: fx.Node) -> tuple[str, ...]:
        v = self.values[node]
        return v if isinstance(v, tuple) else (v,)

    def param(self, name: str, node: fx.Node) -> str:
        return self.graph.add_param(self.graph.fresh_name(name), self.view.weight_value(node))
