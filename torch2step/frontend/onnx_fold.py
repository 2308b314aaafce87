"""Constant folding for ONNX graphs, with symbolic shape tensors.

Exporters compute reshape targets, slice bounds and positions from ``Shape`` of dynamic inputs
(``Shape -> Gather -> Concat -> Reshape``).  Folding evaluates every node whose inputs are known
before run time: weights and their constant expressions become numpy arrays, and integer tensors
derived from dynamic dims become numpy ``object`` arrays of sympy expressions (``[B*S, 64]``), so
the raised layer graph carries exact symbolic shapes instead of shape arithmetic.

The table maps an ONNX op type to a small numpy function (one place per meaning, as the reference
interpreters of tinygrad and JAX do); a node missing from it is simply not folded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import sympy

from torch2step.frontend.onnx_graph import OnnxNode, OnnxView

__all__ = ["fold_constants", "FOLDERS", "symbolic_ints"]

#: Largest symbolic integer tensor folded (elements) and largest tensor created from nothing by
#: ``Expand``/``ConstantOfShape``/``Range``/``Tile``.
MAX_SYMBOLIC = 4096
MAX_CREATED = 1 << 22

Arr = np.ndarray
Folder = Callable[[OnnxView, OnnxNode, list[Any]], list[Arr] | None]


def symbolic_ints(a: Arr) -> Arr:
    """``a`` as int64 if every entry is a plain integer, else as an object array."""
    if not isinstance(a, np.ndarray):
        a = np.asarray(a, dtype=object)
    if a.dtype != object:
        return a
    flat = [sympy.sympify(x) for x in a.reshape(-1).tolist()]
    if all(x.is_Integer for x in flat):
        return np.array([int(x) for x in flat], dtype=np.int64).reshape(a.shape)
    out = np.empty(len(flat), dtype=object)
    out[:] = [sympy.expand(x) if not x.is_Integer else int(x) for x in flat]
    return out.reshape(a.shape)


def _is_sym(a: Arr) -> bool:
    return a.dtype == object


def _np_dtype(onnx_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))


def _axes(node: OnnxNode, ins: list[Any], pos: int) -> list[int] | None:
    if len(ins) > pos and ins[pos] is not None:
        return [int(a) for a in np.asarray(ins[pos]).reshape(-1)]
    attr = node.attr("axes")
    return None if attr is None else [int(a) for a in attr]


def _constant(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    for key, dtype in (
        ("value", None),
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
    ):
        if key in node.attrs:
            v = node.attrs[key]
            return [np.asarray(v) if dtype is None else np.asarray(v, dtype=dtype)]
    return None


def _shape(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    shape = view.shape(node.inputs[0])
    if shape is None or not all(view.is_graph_dim(d) for d in shape):
        return None
    start, end = node.attr("start", 0), node.attr("end", len(shape))
    out = np.empty(len(shape[start:end]), dtype=object)
    out[:] = list(shape[start:end])
    return [symbolic_ints(out)]


def _cast(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    to = _np_dtype(int(node.attr("to")))
    if _is_sym(ins[0]):
        return [ins[0]] if np.issubdtype(to, np.integer) else None
    return [ins[0].astype(to)]


def _reshape(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    data, target = ins
    if _is_sym(target):
        return None
    shape = [int(s) for s in target.reshape(-1)]
    if not node.attr("allowzero", 0):
        shape = [data.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [data.reshape(shape)]


def _unsqueeze(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    axes = _axes(node, ins, 1)
    out = ins[0]
    rank = out.ndim + len(axes or [])
    for a in sorted(x % rank for x in axes or []):
        out = np.expand_dims(out, a)
    return [out]


def _squeeze(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    axes = _axes(node, ins, 1)
    return [np.squeeze(ins[0], axis=None if axes is None else tuple(axes))]


def _slice(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    data = ins[0]
    if any(x is not None and _is_sym(x) for x in ins[1:]):
        return None
    starts, ends = ins[1].reshape(-1), ins[2].reshape(-1)
    axes = ins[3].reshape(-1) if len(ins) > 3 and ins[3] is not None else range(len(starts))
    steps = ins[4].reshape(-1) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        big = np.iinfo(np.int64).max // 2
        e = None if e >= big or e <= -big else int(e)
        index[int(a)] = slice(int(s), e, int(st))
    return [data[tuple(index)]]


def _concat(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    if any(_is_sym(x) for x in ins):
        ins = [x.astype(object) for x in ins]
    return [symbolic_ints(np.concatenate(ins, axis=int(node.attr("axis"))))]


def _gather(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    data, idx = ins
    if _is_sym(idx):
        return None
    return [np.take(data, idx.astype(np.int64), axis=int(node.attr("axis", 0)))]


def _binary(fn: Callable[[Arr, Arr], Arr], symbolic: bool = True) -> Folder:
    def fold(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
        a, b = ins
        if _is_sym(a) or _is_sym(b):
            if not symbolic:
                return None
            return [symbolic_ints(fn(a.astype(object), b.astype(object)))]
        out = fn(a, b)
        return [np.asarray(out).astype(np.result_type(a, b), copy=False)]

    return fold


def _variadic(fn: Callable[[Arr, Arr], Arr], symbolic: bool = True, mean: bool = False) -> Folder:
    """``Max``/``Min``/``Sum``/``Mean`` of any number of operands, folded pairwise."""
    pair = _binary(fn, symbolic)

    def fold(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
        xs = [x for x in ins if x is not None]
        if not xs or (mean and any(_is_sym(x) for x in xs)):
            return None
        out = xs[0]
        for x in xs[1:]:
            got = pair(view, node, [out, x])
            if got is None:
                return None
            out = got[0]
        return [(out / len(xs)).astype(out.dtype) if mean else out]

    return fold


def _div(a: Arr, b: Arr) -> Arr:
    if a.dtype == object or b.dtype == object:
        return np.vectorize(lambda x, y: sympy.floor(sympy.sympify(x) / y), otypes=[object])(a, b)
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)
    return a / b


def _unary(fn: Callable[[Arr], Arr]) -> Folder:
    def fold(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
        if _is_sym(ins[0]):
            return None
        return [np.asarray(fn(ins[0])).astype(ins[0].dtype, copy=False)]

    return fold


def _compare(fn: Callable[[Arr, Arr], Arr]) -> Folder:
    def fold(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
        if any(_is_sym(x) for x in ins):
            return None
        return [np.asarray(fn(*ins))]

    return fold


def _where(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    if any(_is_sym(x) for x in ins):
        return None
    return [np.where(*ins)]


def _range(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    start, limit, delta = (x.reshape(()) for x in ins)
    if not any(_is_sym(x) for x in ins):
        return [np.arange(start, limit, delta).astype(np.result_type(start, limit, delta))]
    n = sympy.cancel((sympy.sympify(limit.item()) - start.item()) / delta.item())
    if not n.is_Integer or int(n) > MAX_SYMBOLIC:
        return None
    out = np.empty(int(n), dtype=object)
    out[:] = [sympy.sympify(start.item()) + i * delta.item() for i in range(int(n))]
    return [symbolic_ints(out)]


def _expand(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    data, shape = ins
    if _is_sym(shape):
        return None
    out_shape = np.broadcast_shapes(data.shape, tuple(int(s) for s in shape.reshape(-1)))
    if int(np.prod(out_shape)) > (MAX_SYMBOLIC if _is_sym(data) else MAX_CREATED):
        return None
    return [np.broadcast_to(data, out_shape).copy()]


def _constant_of_shape(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    if _is_sym(ins[0]):
        return None
    shape = tuple(int(s) for s in ins[0].reshape(-1))
    if int(np.prod(shape)) > MAX_CREATED:
        return None
    value = node.attr("value")
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    return [np.full(shape, fill[0], dtype=fill.dtype)]


def _reduce(fn: Callable[..., Arr]) -> Folder:
    def fold(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
        if _is_sym(ins[0]):
            return None
        axes = _axes(node, ins, 1) or None  # absent or empty: every axis, or none
        if axes is None and node.attr("noop_with_empty_axes", 0):
            return [ins[0]]
        keep = bool(node.attr("keepdims", 1))
        ax = None if axes is None else tuple(axes)
        return [np.asarray(fn(ins[0], axis=ax, keepdims=keep)).astype(ins[0].dtype)]

    return fold


def _transpose(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    perm = node.attr("perm")
    return [np.transpose(ins[0], perm)]


def _split(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    data, axis = ins[0], int(node.attr("axis", 0))
    if len(ins) > 1 and ins[1] is not None:
        sizes = [int(s) for s in ins[1].reshape(-1)]
    elif node.attr("split") is not None:
        sizes = [int(s) for s in node.attr("split")]
    else:
        n = len(node.outputs)
        total = data.shape[axis]
        step = -(-total // n)
        sizes = [min(step, total - i * step) for i in range(n)]
    return list(np.split(data, np.cumsum(sizes)[:-1], axis=axis))


def _flatten(view: OnnxView, node: OnnxNode, ins: list[Any]) -> list[Arr] | None:
    a = ins[0]
    axis = int(node.attr("axis", 1)) % (a.ndim + 1) if a.ndim else 0
    return [a.reshape(int(np.prod(a.shape[:axis])), -1)]


FOLDERS: dict[str, Folder] = {
    "Constant": _constant,
    "Identity": lambda v, n, x: [x[0]],
    "Shape": _shape,
    "Cast": _cast,
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Flatten": _flatten,
    "Slice": _slice,
    "Concat": _concat,
    "Gather": _gather,
    "Transpose": _transpose,
    "Split": _split,
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _binary(_div),
    "Max": _variadic(np.maximum, symbolic=False),
    "Min": _variadic(np.minimum, symbolic=False),
    "Sum": _variadic(np.add),
    "Mean": _variadic(np.add, symbolic=False, mean=True),
    "Mod": _binary(np.mod, symbolic=False),
    "Pow": _binary(np.power, symbolic=False),
    "Neg": _unary(np.negative),
    "Abs": _unary(np.abs),
    "Sqrt": _unary(np.sqrt),
    "Reciprocal": _unary(np.reciprocal),
    "Exp": _unary(np.exp),
    "Cos": _unary(np.cos),
    "Sin": _unary(np.sin),
    "Equal": _compare(np.equal),
    "Less": _compare(np.less),
    "LessOrEqual": _compare(np.less_equal),
    "Greater": _compare(np.greater),
    "GreaterOrEqual": _compare(np.greater_equal),
    "And": _compare(np.logical_and),
    "Or": _compare(np.logical_or),
    "Not": _unary(np.logical_not),
    "Where": _where,
    "Range": _range,
    "Expand": _expand,
    "ConstantOfShape": _constant_of_shape,
    "ReduceSum": _reduce(np.sum),
    "ReduceProd": _reduce(np.prod),
    "ReduceMax": _reduce(np.max),
    "ReduceMin": _reduce(np.min),
    "ReduceMean": _reduce(np.mean),
    "CumSum": lambda v, n, x: (
        None if x[0].dtype == object else [np.cumsum(x[0], axis=int(np.asarray(x[1]).reshape(())))]
    ),
}


def fold_constants(view: OnnxView) -> set[str]:
    """Fold every foldable node of ``view`` in topological order, recording the results in
    ``view.known``; returns the names of the folded nodes (also kept in ``view.folded``)."""
    folded = view.folded
    for node in view.nodes:
        fn = FOLDERS.get(node.op_type) if node.domain == "" else None
        if fn is None:
            continue
        needed = node.inputs[:1] if node.op_type == "Shape" else node.inputs
        if node.op_type != "Shape" and not all(not x or x in view.known for x in needed):
            continue
        ins = [view.known.get(x) if x else None for x in node.inputs]
        try:
            outs = fn(view, node, ins)
        except (ValueError, TypeError, IndexError, ZeroDivisionError, AttributeError):
            outs = None
        if outs is None or len(outs) != len(node.outputs):
            continue
        outs = [
            o if isinstance(o, np.ndarray) and o.dtype != object else symbolic_ints(o) for o in outs
        ]
        if any(o.dtype == object and o.size > MAX_SYMBOLIC for o in outs):
            continue
        for name, value in zip(node.outputs, outs):
            view.known[name] = value
        folded.add(node.name)
    return folded
