"""Raising patterns for RMSNorm and linear layers.

- ``rmsnorm``: the one RMSNorm recogniser of both frontends
  (:data:`~torch2step.frontend.raise_basic.RMSNORM`), e.g. ``w * (x * Reciprocal(Sqrt(
  ReduceMean(Pow(x, 2), -1) + eps)))`` as the dynamo exporter writes HF ``*RMSNorm``;
- ``rmsnorm_fused``: opset-23 ``RMSNormalization`` and onnxruntime's
  ``SimplifiedLayerNormalization`` (:data:`~torch2step.frontend.raise_basic.RMSNORM_OP`);
- ``linear``: ``MatMul(x, W)`` with a constant 2-D ``W`` (the exporter stores ``W = weight.T``)
  plus an optional constant bias ``Add``, and ``Gemm`` with constant ``B``.
"""

from __future__ import annotations

import numpy as np

from torch2step.frontend.fx_pattern import Pattern as CommonPattern
from torch2step.frontend.onnx_emit import Emitter
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.onnx_nodes import onnx_pattern
from torch2step.frontend.onnx_patterns import Match, Pattern
from torch2step.frontend.onnx_translate import TRANSLATORS
from torch2step.frontend.raise_basic import RMSNORM, RMSNORM_OP
from torch2step.layers import ops as L

__all__ = ["NORM_PATTERNS", "match_linear"]


def match_linear(view: OnnxView, node: OnnxNode) -> Match | None:
    """``MatMul(x, W)`` with constant 2-D ``W`` (+ ``Add`` of a constant bias), or ``Gemm``."""
    if node.op_type == "Gemm":
        out = node.outputs[0]
        return Match("linear", [node.inputs[0]], [out], lambda em: TRANSLATORS["Gemm"](em, node))
    x, wv = node.inputs
    w = view.const(wv)
    if w is None or w.ndim != 2 or x in view.known:
        return None
    out = node.outputs[0]
    bias: np.ndarray | None = None
    users = view.users(out)
    if len(users) == 1 and users[0].op_type == "Add" and out not in view.outputs:
        add = users[0]
        b = view.const(add.inputs[1] if add.inputs[0] == out else add.inputs[0])
        if b is not None and b.size == w.shape[1] and b.ndim <= 1:
            bias, out = b.reshape(-1), add.outputs[0]

    def emit(em: Emitter) -> None:
        base = node.module or wv
        wt = em.param(np.ascontiguousarray(w.T), f"{base}.weight", key=("T", wv))
        ins = [em.get(x), wt]
        if bias is not None:
            ins.append(em.param(bias, f"{base}.bias"))
        em.emit1(L.Linear(), ins, out, source=node.source)

    return Match("linear", [x], [out], emit)


NORM_PATTERNS: tuple[CommonPattern, ...] = (
    RMSNORM,
    RMSNORM_OP,
    onnx_pattern(Pattern("linear", frozenset({"MatMul", "Gemm"}), match_linear, "linear layers")),
)
