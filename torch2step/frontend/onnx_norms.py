"""Raising patterns for RMSNorm and linear layers.

- ``rmsnorm``: ``w * (x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), -1) + eps)))`` as the dynamo
  exporter writes HF ``*RMSNorm`` (also ``x / Sqrt(...)``, ``Mul(x, x)``, casts around ``x``);
- ``rmsnorm_fused``: opset-23 ``RMSNormalization`` and onnxruntime's
  ``SimplifiedLayerNormalization`` over the last axis;
- ``linear``: ``MatMul(x, W)`` with a constant 2-D ``W`` (the exporter stores ``W = weight.T``)
  plus an optional constant bias ``Add``, and ``Gemm`` with constant ``B``.
"""

from __future__ import annotations

import numpy as np

from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.onnx_patterns import Match, Pattern, last_axis, strip
from torch2step.frontend.onnx_translate import TRANSLATORS
from torch2step.layers import ops as L

__all__ = ["NORM_PATTERNS", "match_rmsnorm", "match_rmsnorm_fused", "match_linear"]


def _mean_square(view: OnnxView, value: str, nodes: set[str]) -> tuple[str, float] | None:
    """``value = ReduceMean(x^2, last, keepdims) + eps`` -> ``(x, eps)``."""
    add = view.producer_of(value, "Add")
    if add is None:
        return None
    for i in (0, 1):
        eps = view.scalar(add.inputs[1 - i])
        mean = view.producer_of(add.inputs[i], "ReduceMean")
        if eps is None or mean is None or not mean.attr("keepdims", 1):
            continue
        rank = view.rank(mean.inputs[0])
        axes = view.ints(mean.inputs[1]) if len(mean.inputs) > 1 else mean.attr("axes")
        if rank is None or axes is None or [int(a) % rank for a in axes] != [rank - 1]:
            continue
        sq = view.producer.get(mean.inputs[0])
        if sq is None:
            continue
        if sq.op_type == "Pow" and view.scalar(sq.inputs[1]) == 2.0:
            x = sq.inputs[0]
        elif sq.op_type == "Mul" and sq.inputs[0] == sq.inputs[1]:
            x = sq.inputs[0]
        else:
            continue
        nodes.update({add.name, mean.name, sq.name})
        return x, float(str(np.float32(eps)))
    return None


def _inv_rms(view: OnnxView, value: str, nodes: set[str]) -> tuple[str, float] | None:
    """``value = 1 / Sqrt(mean(x^2) + eps)`` (Reciprocal or Div) -> ``(x, eps)``."""
    p = view.producer.get(value)
    if p is None:
        return None
    if p.op_type == "Reciprocal":
        sqrt = view.producer_of(p.inputs[0], "Sqrt")
    elif p.op_type == "Div" and view.scalar(p.inputs[0]) == 1.0:
        sqrt = view.producer_of(p.inputs[1], "Sqrt")
    else:
        return None
    if sqrt is None:
        return None
    found = _mean_square(view, sqrt.inputs[0], nodes)
    if found:
        nodes.update({p.name, sqrt.name})
    return found


def _normalized(view: OnnxView, value: str, nodes: set[str]) -> tuple[str, float] | None:
    """``value = x * inv_rms(x)`` or ``x / Sqrt(mean(x^2) + eps)`` -> ``(x, eps)``."""
    value = strip(view, value, nodes=nodes)
    p = view.producer.get(value)
    if p is None:
        return None
    if p.op_type == "Mul":
        for i in (0, 1):
            inner: set[str] = set()
            found = _inv_rms(view, p.inputs[1 - i], inner)
            if found and strip(view, found[0], nodes=inner) == strip(view, p.inputs[i]):
                nodes |= inner | {p.name}
                return p.inputs[i], found[1]
    if p.op_type == "Div":
        sqrt = view.producer_of(p.inputs[1], "Sqrt")
        inner = set()
        found = _mean_square(view, sqrt.inputs[0], inner) if sqrt else None
        if found and strip(view, found[0]) == strip(view, p.inputs[0]):
            nodes |= inner | {p.name, sqrt.name}  # type: ignore[union-attr]
            return p.inputs[0], found[1]
    return None


def match_rmsnorm(view: OnnxView, node: OnnxNode) -> Match | None:
    """``Mul(w, normalized(x))`` with a constant 1-D ``w`` over x's last axis."""
    for i in (0, 1):
        w = view.const(strip(view, node.inputs[i]))
        if w is None or w.ndim != 1:
            continue
        nodes = {node.name}
        found = _normalized(view, node.inputs[1 - i], nodes)
        if found is None:
            continue
        x, eps = found
        out = node.outputs[0]
        wname = strip(view, node.inputs[i])

        def emit(
            em: Emitter, x: str = x, eps: float = eps, wname: str = wname, out: str = out
        ) -> None:
            em.emit1(L.RMSNorm(eps), [em.get(x), em.get(wname)], out, source=node.source)

        return Match("rmsnorm", node, nodes, [x], [out], emit)
    return None


def match_rmsnorm_fused(view: OnnxView, node: OnnxNode) -> Match | None:
    """``RMSNormalization(x, scale)`` (opset 23) or ``SimplifiedLayerNormalization``."""
    if node.op_type == "SimplifiedLayerNormalization" and node.domain not in ("", "com.microsoft"):
        return None
    if not last_axis(view, node):
        raise Unsupported("RMS normalisation over axes other than the last has no layer op")
    x, scale = node.inputs[:2]
    if any(o and (o in view.outputs or view.users(o)) for o in node.outputs[1:]):
        raise Unsupported("its inverse-std output is used; RMSNorm yields only the result")
    eps = float(str(np.float32(node.attr("epsilon", 1e-5))))
    out = node.outputs[0]

    def emit(em: Emitter) -> None:
        em.emit1(L.RMSNorm(eps), [em.get(x), em.get(scale)], out, source=node.source)

    return Match("rmsnorm_fused", node, {node.name}, [x, scale], [out], emit)


def match_linear(view: OnnxView, node: OnnxNode) -> Match | None:
    """``MatMul(x, W)`` with constant 2-D ``W`` (+ ``Add`` of a constant bias), or ``Gemm``."""
    if node.op_type == "Gemm":
        out = node.outputs[0]
        return Match(
            "linear",
            node,
            {node.name},
            [node.inputs[0]],
            [out],
            lambda em: TRANSLATORS["Gemm"](em, node),
        )
    x, wv = node.inputs
    w = view.const(wv)
    if w is None or w.ndim != 2 or x in view.known:
        return None
    nodes = {node.name}
    out = node.outputs[0]
    bias: np.ndarray | None = None
    users = view.users(out)
    if len(users) == 1 and users[0].op_type == "Add" and out not in view.outputs:
        add = users[0]
        b = view.const(add.inputs[1] if add.inputs[0] == out else add.inputs[0])
        if b is not None and b.size == w.shape[1] and b.ndim <= 1:
            bias, out = b.reshape(-1), add.outputs[0]
            nodes.add(add.name)

    def emit(em: Emitter) -> None:
        base = node.module or wv
        wt = em.param(np.ascontiguousarray(w.T), f"{base}.weight", key=("T", wv))
        ins = [em.get(x), wt]
        if bias is not None:
            ins.append(em.param(bias, f"{base}.bias"))
        em.emit1(L.Linear(), ins, out, source=node.source)

    return Match("linear", node, nodes, [x], [out], emit)


NORM_PATTERNS: tuple[Pattern, ...] = (
    Pattern("rmsnorm", frozenset({"Mul"}), match_rmsnorm, "decomposed RMSNorm"),
    Pattern(
        "rmsnorm_fused",
        frozenset({"RMSNormalization", "SimplifiedLayerNormalization"}),
        match_rmsnorm_fused,
        "fused RMS normalisation ops",
    ),
    Pattern("linear", frozenset({"MatMul", "Gemm"}), match_linear, "linear layers"),
)
