"""Appending layer ops for FX nodes: the value map from FX nodes to layer-graph values, weights
turned into graph parameters on first use, and the user's source line on every layer node."""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
from torch import fx

from torch2step.errors import FrontendError
from torch2step.frontend.fx_view import ProgramView, source_line
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph
from torch2step.layers.ops import Dim

__all__ = ["FxEmitter", "Value"]

#: A layer value name, or a tuple of them for multi-output FX nodes (``split``, ``topk``).
Value = str | tuple[str, ...]


class FxEmitter:
    """Builds a :class:`LayerGraph` from FX nodes; ``values[node]`` is the layer value of a
    translated node."""

    def __init__(self, view: ProgramView, graph: LayerGraph) -> None:
        self.view = view
        self.graph = graph
        self.values: dict[fx.Node, Value] = {}
        self.source: str | None = None
        self._views: dict[tuple[str, tuple[Dim, ...]], str] = {}
        #: values shared by several matches (e.g. the positions of q's and k's RoPE)
        self.memo: dict[object, str] = {}

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

    def const(self, name: str, value: torch.Tensor) -> str:
        """A new parameter holding ``value`` (a weight derived from the module's weights)."""
        return self.graph.add_param(self.graph.fresh_name(name), value.detach().contiguous())

    # -- ops ------------------------------------------------------------------------------------
    def emit(self, op: L.LayerOp, inputs: Sequence[str]) -> tuple[str, ...]:
        return self.graph.add(op, list(inputs), source=self.source)

    def emit1(self, op: L.LayerOp, inputs: Sequence[str]) -> str:
        return self.emit(op, inputs)[0]

    def reshape(self, value: str, shape: Sequence[Dim]) -> str:
        """``value`` viewed as ``shape`` (no node when the shape is already that)."""
        shape = tuple(shape)
        if _same_shape(self.graph.types[value].shape, shape):
            return value
        key = (value, shape)
        if key not in self._views:
            self._views[key] = self.emit1(L.Reshape(shape), [value])
        return self._views[key]

    def cast(self, value: str, dtype: str) -> str:
        if self.graph.types[value].dtype == dtype:
            return value
        return self.emit1(L.Cast(dtype), [value])

    def at(self, node: fx.Node | None) -> None:
        """Attribute the next emitted nodes to ``node``'s user source line."""
        self.source = source_line(node) if node is not None else None


def _same_shape(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    return len(a) == len(b) and all(
        sympy.expand(sympy.sympify(x) - sympy.sympify(y)) == 0 for x, y in zip(a, b)
    )
