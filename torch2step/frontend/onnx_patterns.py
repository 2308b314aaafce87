"""Raising ONNX subgraphs into layer ops: patterns as data (tinygrad's ``PatternMatcher``).

A :class:`~torch2step.frontend.fx_pattern.Pattern` (the one pattern type of both frontends)
names one meaning (``attention_matmul_softmax``, ...), the ONNX op types it is anchored at and a
``match(OnnxView, OnnxNode)`` function.  ``match`` returns a :class:`Match` (the ONNX values it
reads and defines, and an ``emit`` callback that appends the layer ops), ``None`` when the anchor is not an instance of the pattern, or raises
:class:`~torch2step.frontend.onnx_emit.Unsupported` when it clearly is one but a detail has no
layer op (the reason is reported if the graph then cannot be imported).

Such patterns cover what only ONNX spells (fused ``Attention`` / ``RotaryEmbedding`` ops, the
region-based MoE recogniser); :func:`~torch2step.frontend.onnx_nodes.onnx_pattern` runs them in
the raising engine shared with the PyTorch frontend (:mod:`torch2step.frontend.engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import sympy

from torch2step.frontend.fx_pattern import Pattern
from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_graph import Dim, OnnxNode, OnnxView
from torch2step.frontend.onnx_translate import normalize_axis, onnx_reshape_target

__all__ = [
    "Match",
    "Pattern",
    "strip",
    "scalar_factor",
    "VIEW_OPS",
    "probe_chain",
]

#: Pure data-movement ops whose meaning :func:`probe_chain` computes on index tensors.
VIEW_OPS = frozenset(
    {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Identity", "Flatten"}
)


@dataclass
class Match:
    """One instance of a pattern: ``emit`` appends layer ops reading the run-time ONNX values
    ``inputs`` and binds ``outputs`` (the values it defines for others)."""

    pattern: str
    inputs: list[str]
    outputs: list[str]
    emit: Callable[[Emitter], None]
    info: dict[str, object] = field(default_factory=dict)


# -- helpers shared by the patterns --------------------------------------------------------------
def strip(view: OnnxView, value: str, ops: Iterable[str] = ("Cast", "Identity")) -> str:
    """Follow ``value`` back through single-input ``ops``."""
    kinds = set(ops)
    while True:
        p = view.producer.get(value)
        if p is None or p.op_type not in kinds:
            return value
        if p.op_type == "Cast" and view.dtypes.get(p.inputs[0]) not in ("fp32", "fp16", "bf16"):
            return value
        value = p.inputs[0]


def scalar_factor(view: OnnxView, node: OnnxNode) -> tuple[str, float] | None:
    """For ``Mul(x, c)``/``Mul(c, x)``/``Div(x, c)`` with a known scalar ``c``: ``(x, factor)``."""
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    for i in (1, 0):
        c = view.scalar(node.inputs[i])
        if c is None or node.inputs[1 - i] in view.known:
            continue
        if node.op_type == "Div":
            if i == 0 or c == 0:
                return None
            return node.inputs[0], 1.0 / c
        return node.inputs[1 - i], c
    return None


def concrete(d: Dim | None, sample: dict[sympy.Symbol, int]) -> int:
    if d is None:
        raise Unsupported("a dimension is unknown; export with shapes")
    e = sympy.sympify(d).subs(sample)
    if not e.is_Integer:
        raise Unsupported(f"dimension {d} depends on data; it cannot be probed")
    return int(e)


def probe_chain(
    view: OnnxView, base: str, chain: Sequence[OnnxNode]
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the view ops of ``chain`` to an index tensor of ``base``'s shape (dynamic dims set
    to :meth:`OnnxView.sample_dims`); returns ``(base_ids, out_ids)``: which element of ``base``
    each output element is, whatever reshapes and transposes the exporter used."""
    sample = view.sample_dims()
    shape = view.shape(base)
    if shape is None:
        raise Unsupported(f"the shape of {base!r} is unknown")
    dims = tuple(concrete(d, sample) for d in shape)
    base_ids = np.arange(int(np.prod(dims)), dtype=np.int64).reshape(dims)
    ids = base_ids
    for node in chain:
        ids = _apply_view(view, node, ids, sample)
    return base_ids, ids


def _target(view: OnnxView, node: OnnxNode, pos: int, sample: dict) -> list[int] | None:
    if len(node.inputs) <= pos or not node.inputs[pos]:
        return None
    vals = view.ints(node.inputs[pos])
    if vals is None:
        raise Unsupported(f"{node.where}: its shape operand is computed at run time")
    return [concrete(v, sample) for v in vals]


def _apply_view(view: OnnxView, node: OnnxNode, ids: np.ndarray, sample: dict) -> np.ndarray:
    op = node.op_type
    if op in ("Identity", "Cast"):
        return ids
    if op == "Transpose":
        return np.transpose(ids, node.attr("perm"))
    if op == "Reshape":
        tgt = onnx_reshape_target(
            ids.shape, _target(view, node, 1, sample) or [], bool(node.attr("allowzero", 0))
        )
        return ids.reshape([int(t) for t in tgt])
    if op == "Flatten":
        axis = normalize_axis(int(node.attr("axis", 1)), ids.ndim + 1)
        return ids.reshape(int(np.prod(ids.shape[:axis])), -1)
    if op == "Unsqueeze":
        axes = _target(view, node, 1, sample) or [int(a) for a in node.attr("axes", [])]
        rank = ids.ndim + len(axes)
        for a in sorted(x % rank for x in axes):
            ids = np.expand_dims(ids, a)
        return ids
    if op == "Squeeze":
        axes = _target(view, node, 1, sample) or node.attr("axes")
        return np.squeeze(ids, axis=None if axes is None else tuple(int(a) for a in axes))
    if op == "Expand":
        shape = _target(view, node, 1, sample) or []
        return np.broadcast_to(ids, np.broadcast_shapes(ids.shape, tuple(shape)))
    raise Unsupported(f"{node.where} is not a view op")  # pragma: no cover - guarded by VIEW_OPS


def last_axis(view: OnnxView, node: OnnxNode, key: str = "axis", default: int = -1) -> bool:
    """``node``'s ``key`` attribute names the last axis of its first input."""
    rank = view.rank(node.inputs[0])
    axis = int(node.attr(key, default))
    return axis == -1 or (rank is not None and axis == rank - 1)
