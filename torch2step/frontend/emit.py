"""Appending layer ops, shared by the PyTorch and ONNX emitters: each op carries the source line
of the node being translated, reshapes and casts are added only when the value needs them (one
node per distinct view; a reshape of a reshape is one reshape), derived weights become graph
parameters, and ``memo`` holds values shared by several matches (e.g. the positions of q's and
k's RoPE)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch

from torch2step.frontend.fx_view import source_line
from torch2step.frontend.gnode import same_dim
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph, TensorType

__all__ = ["LayerEmitter", "clean_name"]


def clean_name(name: str) -> str:
    """``name`` as a layer value name (runs of other characters than word and ``.`` -> ``_``)."""
    return re.sub(r"[^\w.]+", "_", name).strip("_") or "v"


class LayerEmitter:
    """Builds a :class:`LayerGraph`; a frontend's emitter adds its value map on top."""

    def __init__(self, graph: LayerGraph) -> None:
        self.graph = graph
        self.source: str | None = None
        self.memo: dict[object, str] = {}
        self._reshapes: dict[tuple[str, tuple[object, ...]], str] = {}
        self._reshape_src: dict[str, str] = {}

    def at(self, node: object) -> None:
        """Attribute the next emitted nodes to ``node``'s user source line."""
        self.source = source_line(node) if node is not None else None

    def type(self, value: str) -> TensorType:
        return self.graph.types[value]

    def const(self, hint: str, value: torch.Tensor) -> str:
        """A new parameter holding ``value`` (a weight derived from the model's weights)."""
        return self.graph.add_param(
            self.graph.fresh_name(clean_name(hint)), value.detach().contiguous()
        )

    def emit(
        self,
        op: L.LayerOp,
        inputs: Sequence[str],
        names: Sequence[str] | None = None,
        *,
        source: str | None = None,
    ) -> tuple[str, ...]:
        """Add ``op`` on layer values ``inputs``; its outputs take fresh names after ``names``
        when given.  Returns the layer output names."""
        if names is not None:
            names = [self.graph.fresh_name(clean_name(n)) for n in names]
        return self.graph.add(op, list(inputs), names, source=source or self.source)

    def emit1(
        self, op: L.LayerOp, inputs: Sequence[str], name: str | None = None, **kw: object
    ) -> str:
        return self.emit(op, inputs, None if name is None else [name], **kw)[0]  # type: ignore[arg-type]

    def reshape(self, value: str, shape: Sequence[object]) -> str:
        """``value`` viewed as ``shape`` (``value`` itself when it already has that shape)."""
        shape = tuple(int(d) if isinstance(d, (int, np.integer)) else d for d in shape)
        value = self._reshape_src.get(value, value)
        if len(self.type(value).shape) == len(shape) and all(
            same_dim(a, b) for a, b in zip(self.type(value).shape, shape)
        ):
            return value
        if (value, shape) not in self._reshapes:
            out = self.emit1(L.Reshape(shape), [value])
            self._reshapes[(value, shape)] = out
            self._reshape_src[out] = value
        return self._reshapes[(value, shape)]

    def cast(self, value: str, dtype: str) -> str:
        if self.type(value).dtype == dtype:
            return value
        return self.emit1(L.Cast(dtype), [value])
