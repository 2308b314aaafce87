"""One-to-one translation of ONNX operators into layer ops: a table from op type to a small
function (as TVM Relax's ``create_convert_map``).

These cover the ONNX spellings of what is left after the raising patterns: ``Gemm`` and view
operations with ONNX semantics (``Reshape`` targets with ``0``/``-1``, multi-axis ``Slice``,
``Gather`` by a constant); the ops ATen spells the same way (elementwise arithmetic, softmax,
reductions, casts, transposes, ``MatMul``, ``Concat``) are translated by the PyTorch frontend's rules
(:data:`~torch2step.frontend.onnx_import.SHARED_RULES`).  A translator raises
:class:`~torch2step.frontend.onnx_emit.Unsupported` with a reason when the node cannot be
expressed; the importer collects every such node into one error.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy

from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_graph import Dim, OnnxNode, same_dim
from torch2step.layers import ops as L

__all__ = ["TRANSLATORS", "Translator", "onnx_reshape_target", "normalize_axis"]

Translator = Callable[[Emitter, OnnxNode], None]

_BIG = np.iinfo(np.int64).max // 2


def normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise Unsupported(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def _ints(em: Emitter, node: OnnxNode, pos: int, attr: str | None = None) -> list[Dim] | None:
    if len(node.inputs) > pos and node.inputs[pos]:
        vals = em.view.ints(node.inputs[pos])
        if vals is None:
            raise Unsupported(
                f"input {pos} ({node.inputs[pos]!r}) must be known before run time "
                "(a constant or computed from input shapes)"
            )
        return vals
    if attr is not None and node.attr(attr) is not None:
        return [int(a) for a in node.attr(attr)]
    return None


def onnx_reshape_target(shape: tuple[Dim, ...], target: list[Dim], allowzero: bool) -> list[Dim]:
    """ONNX ``Reshape`` semantics (``0`` copies, ``-1`` infers) on symbolic shapes."""
    out: list[Dim] = []
    for i, t in enumerate(target):
        out.append(shape[i] if t == 0 and not allowzero else t)
    if sum(1 for t in out if t == -1) > 1:
        raise Unsupported(f"Reshape target {target} has more than one -1")
    if -1 in out:
        total = sympy.Mul(*[sympy.sympify(d) for d in shape])
        known = sympy.Mul(*[sympy.sympify(d) for d in out if d != -1])
        inferred = sympy.cancel(total / known)
        out[out.index(-1)] = int(inferred) if inferred.is_Integer else inferred
    return out


# -- linear layers ------------------------------------------------------------------------------
def _gemm(em: Emitter, node: OnnxNode) -> None:
    a_name, b_name = node.inputs[:2]
    c_name = node.inputs[2] if len(node.inputs) > 2 else ""
    w = em.view.const(b_name)
    if node.attr("transA", 0) or w is None or w.ndim != 2:
        raise Unsupported("Gemm is supported as a linear layer: transA=0 and a constant B")
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    w = w if node.attr("transB", 0) else w.T
    key = ("gemm", b_name, node.attr("transB", 0), alpha)
    hint = f"{node.module}.weight" if node.module else b_name
    wp = em.param(np.ascontiguousarray(w * alpha if alpha != 1 else w), hint, key=key)
    ins = [em.get(a_name), wp]
    if c_name:
        bias = em.view.const(c_name)
        if bias is None or bias.size != w.shape[0] or bias.ndim > 1 and bias.shape[0] != 1:
            raise Unsupported("Gemm bias C must be a constant vector of the output size")
        hint = f"{node.module}.bias" if node.module else c_name
        ins.append(em.param(bias.reshape(-1) * beta, hint, key=("bias", c_name, beta)))
    em.emit1(L.Linear(), ins, node.outputs[0], source=node.source)


def _alias(em: Emitter, node: OnnxNode) -> None:
    em.bind(node.outputs[0], em.get(node.inputs[0]))


# -- variadic elementwise -----------------------------------------------------------------------
def _variadic(em: Emitter, node: OnnxNode) -> None:
    """``Max``/``Min``/``Sum``/``Mean`` of any number of broadcast operands, folded pairwise
    from the left (one operand: itself; ``Min`` as ``-max(-a, -b)``, ``Mean`` as the sum times
    ``1/n``)."""
    xs = [em.get(x) for x in node.inputs if x]
    if not xs:
        raise Unsupported(f"{node.op_type} without inputs")
    if node.op_type == "Min":
        xs = [em.emit1(L.Elementwise("neg"), [x], source=node.source) for x in xs]
    fn = "maximum" if node.op_type in ("Max", "Min") else "add"
    out = xs[0]
    for x in xs[1:]:
        out = em.emit1(L.Elementwise(fn), [out, x], source=node.source)
    if node.op_type == "Min":
        out = em.emit1(L.Elementwise("neg"), [out], source=node.source)
    if node.op_type == "Mean" and len(xs) > 1:
        out = em.emit1(L.Elementwise("mul_scalar", 1.0 / len(xs)), [out], source=node.source)
    em.bind(node.outputs[0], out)


# -- views --------------------------------------------------------------------------------------
def _reshape(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    target = _ints(em, node, 1)
    assert target is not None
    shape = onnx_reshape_target(em.type(x).shape, target, bool(node.attr("allowzero", 0)))
    em.reshape(x, shape, node.outputs[0])


def _unsqueeze(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    shape = list(em.type(x).shape)
    axes = _ints(em, node, 1, "axes") or []
    rank = len(shape) + len(axes)
    for a in sorted(normalize_axis(int(a), rank) for a in axes):
        shape.insert(a, 1)
    em.reshape(x, shape, node.outputs[0])


def _squeeze(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    shape = list(em.type(x).shape)
    axes = _ints(em, node, 1, "axes")
    drop = (
        {i for i, d in enumerate(shape) if d == 1}
        if axes is None
        else {normalize_axis(int(a), len(shape)) for a in axes}
    )
    em.reshape(x, [d for i, d in enumerate(shape) if i not in drop], node.outputs[0])


def _flatten(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    shape = em.type(x).shape
    axis = normalize_axis(int(node.attr("axis", 1)), len(shape) + 1)
    lead = sympy.Mul(*[sympy.sympify(d) for d in shape[:axis]])
    rest = sympy.Mul(*[sympy.sympify(d) for d in shape[axis:]])
    em.reshape(x, [lead, rest], node.outputs[0])


def _slice_bound(v: Dim, size: Dim) -> Dim:
    """A constant ``Slice`` start or end as ONNX clamps it: a negative one counts from the end,
    then it is clamped into ``[0, size]`` (``Max``/``Min`` of a symbolic ``size``); a symbolic
    bound is taken as given."""
    if not isinstance(v, int):
        return v
    if v >= _BIG:
        return size
    if v <= -_BIG:
        return 0
    if isinstance(size, int):
        return min(max(v + size if v < 0 else v, 0), size)
    if v < 0:
        return _dim(sympy.Max(sympy.sympify(size) + v, 0))
    return _dim(sympy.Min(v, size))


def _slice(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    starts, ends = _ints(em, node, 1), _ints(em, node, 2)
    assert starts is not None and ends is not None
    rank = em.type(x).rank
    axes = _ints(em, node, 3) or list(range(len(starts)))
    steps = _ints(em, node, 4) or [1] * len(starts)
    if any(s != 1 for s in steps):
        raise Unsupported(f"Slice with steps {steps}; only step 1 is supported")
    out = x
    for s, e, a in zip(starts, ends, axes):
        d = normalize_axis(int(a), rank)
        size = em.type(out).shape[d]
        lo, hi = _slice_bound(s, size), _slice_bound(e, size)
        if same_dim(lo, 0) and same_dim(hi, size):
            continue
        if same_dim(lo, hi) or isinstance(lo, int) and isinstance(hi, int) and hi < lo:
            raise Unsupported(
                f"Slice [{s}:{e}] of axis {d} (size {size}) selects no elements; the layer graph "
                "has no empty tensors"
            )
        out = em.emit1(L.Slice(d, _dim(lo), _dim(hi)), [out], source=node.source)
    em.bind(node.outputs[0], out)


def _dim(d: Dim) -> Dim:
    e = sympy.expand(sympy.sympify(d))
    return int(e) if e.is_Integer else e


def _split(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    shape = em.type(x).shape
    axis = normalize_axis(int(node.attr("axis", 0)), len(shape))
    sizes = _ints(em, node, 1, "split")
    n = len(node.outputs)
    if sizes is None:
        total = shape[axis]
        if not isinstance(total, int) or total % n:
            raise Unsupported(f"Split of size {total} into {n} equal parts")
        sizes = [total // n] * n
    start: Dim = 0
    for out, size in zip(node.outputs, sizes):
        end = _dim(sympy.sympify(start) + size)
        em.emit1(L.Slice(axis, start, end), [x], out, source=node.source)
        start = end


def _gather(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    shape = em.type(x).shape
    axis = normalize_axis(int(node.attr("axis", 0)), len(shape))
    idx_const = em.view.const(node.inputs[1])
    if idx_const is not None and idx_const.ndim == 0:
        i = int(idx_const)
        i = i + shape[axis] if i < 0 else i
        sl = em.emit1(L.Slice(axis, _dim(i), _dim(sympy.sympify(i) + 1)), [x], source=node.source)
        em.reshape(sl, [d for k, d in enumerate(shape) if k != axis], node.outputs[0])
        return
    size = shape[axis]
    if idx_const is not None and (idx_const < 0).any() and sympy.sympify(size).is_Integer:
        # a negative constant index counts from the end: index + size, fixed here (the
        # lowering addresses the rows of a leading axis with the index as it is)
        wrapped = np.where(idx_const < 0, idx_const + int(size), idx_const)
        idx = em.param(wrapped.astype(idx_const.dtype), node.inputs[1] + "_wrapped")
    elif idx_const is not None and (idx_const < 0).any() and axis != len(shape) - 1:
        raise Unsupported(
            f"Gather along axis {axis} of dynamic size {size} with negative constant "
            f"indices {idx_const.ravel()[:4].tolist()}; make that axis static, or the "
            "indices non-negative (index + size)"
        )
    else:
        idx = em.get(node.inputs[1])
    ishape = em.type(idx).shape
    flat = (
        em.reshape(idx, [sympy.Mul(*[sympy.sympify(d) for d in ishape])])
        if len(ishape) != 1
        else idx
    )
    g = em.emit1(
        L.Gather(axis), [x, flat], None if len(ishape) != 1 else node.outputs[0], source=node.source
    )
    if len(ishape) != 1:
        em.reshape(g, [*shape[:axis], *ishape, *shape[axis + 1 :]], node.outputs[0])


def _expand(em: Emitter, node: OnnxNode) -> None:
    x = em.get(node.inputs[0])
    target = _ints(em, node, 1)
    shape = em.type(x).shape
    assert target is not None
    full = [1] * (len(target) - len(shape)) + list(shape)
    if len(target) >= len(shape) and all(t == 1 or same_dim(t, f) for t, f in zip(target, full)):
        em.reshape(x, full, node.outputs[0])
        return
    raise Unsupported(
        "Expand (a broadcast copy) has no layer op; it is supported inside repeat_kv of "
        "grouped-query attention, which is raised to Attention"
    )


TRANSLATORS: dict[str, Translator] = {
    "Gemm": _gemm,
    "Dropout": _alias,
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Flatten": _flatten,
    "Slice": _slice,
    "Split": _split,
    "Gather": _gather,
    "Expand": _expand,
    "Max": _variadic,
    "Min": _variadic,
    "Sum": _variadic,
    "Mean": _variadic,
}
