"""Building the layer graph from an ONNX view: the value map, parameters and materialised
constants shared by the one-to-one translators and the raising patterns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sympy
import torch

from torch2step.errors import FrontendError
from torch2step.frontend.emit import LayerEmitter, clean_name
from torch2step.frontend.fx_pattern import NoMatch as Unsupported
from torch2step.frontend.gnode import GNode
from torch2step.frontend.onnx_graph import OnnxView, same_dim
from torch2step.layers import LayerGraph, LayerOp
from torch2step.layers import ops as L

__all__ = ["Emitter", "Unsupported"]


def _tensor(value: np.ndarray) -> torch.Tensor:
    if value.dtype == np.float64:
        value = value.astype(np.float32)
    if value.dtype == np.float16 or value.dtype.kind in "fiub":
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    raise FrontendError(f"constant of numpy dtype {value.dtype} has no layer-graph dtype")


class Emitter(LayerEmitter):
    """Appends layer ops for ONNX nodes; ``env`` maps ONNX value names to layer value names.

    Values known before run time (weights, folded constants, symbolic shape tensors) are
    materialised on first use: numeric ones as graph parameters, symbolic integer ranges (decode
    positions ``[P, P + 1, ...]``) as :class:`~torch2step.layers.ops.Arange`.
    """

    def __init__(self, view: OnnxView, graph: LayerGraph) -> None:
        super().__init__(graph)
        self.view = view
        self.env: dict[str, str] = {}
        self._params: dict[object, str] = {}

    # -- values ---------------------------------------------------------------------------------
    def has(self, value: str) -> bool:
        return value in self.env or value in self.view.known

    def get(self, value: str | GNode) -> str:
        """The layer value of ONNX ``value`` (materialising a known value)."""
        if isinstance(value, GNode):
            value = value.name
        if value in self.env:
            return self.env[value]
        known = self.view.known.get(value)
        if known is None:
            raise KeyError(value)
        name = (
            self._materialize_symbolic(value, known)
            if known.dtype == object
            else self.param(known, value)
        )
        self.env[value] = name
        return name

    def param(self, value: np.ndarray | torch.Tensor, hint: str, key: object = None) -> str:
        """A graph parameter holding ``value`` (deduplicated by ``key`` when given)."""
        if key is not None and key in self._params:
            return self._params[key]
        t = value if isinstance(value, torch.Tensor) else _tensor(np.asarray(value))
        name = self.graph.fresh_name(clean_name(hint))
        self.graph.add_param(name, t.contiguous())
        if key is not None:
            self._params[key] = name
        return name

    def bind(self, onnx_value: str, layer_value: str) -> None:
        self.env[onnx_value] = layer_value

    # -- nodes ----------------------------------------------------------------------------------
    def emit(
        self,
        op: LayerOp,
        inputs: Sequence[str],
        outputs: Sequence[str] | None = None,
        *,
        source: str | None = None,
    ) -> tuple[str, ...]:
        """Add ``op`` on layer values ``inputs``; ``outputs`` are ONNX names to bind (the layer
        values reuse them when free).  Returns the layer output names."""
        outs = super().emit(op, inputs, outputs, source=source)
        for o, n in zip(outputs or (), outs):
            self.env[o] = n
        return outs

    def reshape(self, value: str, shape: Sequence[object], output: str | None = None) -> str:
        """``Reshape`` unless ``value`` already has ``shape``; binds ONNX ``output`` to it."""
        out = super().reshape(value, shape)
        if output is not None:
            self.bind(output, out)
        return out

    # -- symbolic constants ---------------------------------------------------------------------
    def _materialize_symbolic(self, value: str, arr: np.ndarray) -> str:
        """An integer tensor of sympy entries that counts up by one along its last axis and
        repeats along the others (``[[P, P+1], [P, P+1]]``) as Arange + Reshape + Concat."""
        flat = arr.reshape(-1, arr.shape[-1]) if arr.ndim else arr.reshape(1, 1)
        start = sympy.sympify(flat[0, 0])
        n = flat.shape[1]
        for row in flat:
            for j, x in enumerate(row):
                if not same_dim(x, start + j):
                    raise Unsupported(
                        f"value {value!r} = {arr.tolist()} is computed from dynamic sizes but is "
                        "not a range; only ranges (positions) are supported as run-time integers"
                    )
        node = self.view.producer.get(value)
        src = node.source if node else value
        out = self.emit1(L.Arange(start, start + n), [], source=src)
        if flat.shape[0] > 1:
            out = self.reshape(out, (1, n))
            out = self.emit1(L.Concat(0), [out] * flat.shape[0], source=src)
        return self.reshape(out, arr.shape)
