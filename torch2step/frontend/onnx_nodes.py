"""The ONNX graph in the common view of the raising recognisers (:mod:`torch2step.frontend.gnode`).

Every value of the (constant-folded) ONNX graph becomes a :class:`~torch2step.frontend.gnode.
GNode` whose operator and arguments are spelled as core ATen spells them, so that one
recogniser serves both frontends: ``MatMul`` -> ``matmul``, ``ReduceMean(x, axes)`` ->
``mean(x, dims, keepdim)``, ``Concat`` -> ``cat([..], dim)``, ``Slice`` on one axis ->
``slice(x, dim, start, end)``, ``Cast`` -> ``_to_copy(x, dtype=...)``, ``TopK`` -> ``topk`` with
``getitem`` users; a known single-element operand becomes a Python number and a known integer
vector (axes, bounds) a list, as they are literals in ATen.  Other op types keep their ONNX
name (a fused op such as ``Attention`` or ``RotaryEmbedding``, whose recogniser reads its
attributes as ``kwargs``).  ``run`` evaluates a piece of the graph on sample values
(``onnx.reference``), as :meth:`~torch2step.frontend.fx_view.ProgramView.run` does for FX.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import sympy
import torch

from torch2step.errors import FrontendError
from torch2step.frontend.gnode import GNode, arg_nodes
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView, unknown_dims_advice
from torch2step.frontend.onnx_probe import concrete_value, run_subgraph, upstream

__all__ = ["OnnxNodeView", "TORCH_DTYPES"]

TORCH_DTYPES = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}  # fmt: skip

_SAME = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Sqrt": "sqrt",
    "Reciprocal": "reciprocal", "Neg": "neg", "Cos": "cos", "Sin": "sin", "Exp": "exp",
    "Sigmoid": "sigmoid", "Relu": "relu", "MatMul": "matmul", "Where": "where", "Expand": "expand",
    "Reshape": "view", "Identity": "alias", "Equal": "eq", "Gelu": "gelu",
    "IsNaN": "isnan", "Erf": "erf", "Tanh": "tanh",
}  # fmt: skip
#: Op types whose known single-element operands are ATen literals (numbers, axes, bounds).
_LITERAL_ARGS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "ReduceMean", "ReduceSum", "ReduceMax", "Slice",
     "Unsqueeze", "TopK", "Split"}
)  # fmt: skip
#: Of those, the arithmetic ones: a known operand of several elements stays a tensor.
_NUMBER_ARGS = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})


def _ints(a: Any) -> list[Any] | None:
    """A known integer vector operand (a one-element one is a literal number) as a list."""
    if isinstance(a, list):
        return a
    return [a] if isinstance(a, int) or isinstance(a, sympy.Expr) else None


def _axes(node: OnnxNode, args: list[Any], pos: int = 1) -> Any:
    if len(args) > pos and _ints(args[pos]) is not None:
        return _ints(args[pos])
    return node.attr("axes")


def _softmax_axis(node: OnnxNode, x: Any, opset: int) -> int | None:
    """The axis of a ``Softmax``; before opset 13 it flattens the axes from ``axis`` (default
    1) on, the same as ATen's only when ``axis`` is the last one (else None)."""
    if opset >= 13:
        return int(node.attr("axis", -1))
    axis = int(node.attr("axis", 1))
    rank = len(getattr(x, "shape", None) or ())
    return axis if rank and -rank <= axis < rank and axis % rank == rank - 1 else None


def _canonical(
    node: OnnxNode, args: list[Any], opset: int
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """``(ATen name, args, kwargs)`` of an ONNX node (see the module docstring)."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return op, tuple(args), dict(node.attrs)
    if op in _SAME:
        return _SAME[op], tuple(args), dict(node.attrs)
    if op in ("ReduceMean", "ReduceSum", "ReduceMax"):
        if len(args) > 1 and isinstance(args[1], GNode):  # axes computed at run time
            return op, tuple(args), dict(node.attrs)
        axes = _axes(node, args) or None  # absent or empty: every axis ...
        if axes is None and node.attr("noop_with_empty_axes", 0):  # ... or none (identity)
            return "alias", (args[0],), {}
        name = {"ReduceMax": "amax"}.get(op, op[6:].lower())
        return name, (args[0], axes, bool(node.attr("keepdims", 1))), {}
    if op == "Softmax" and (axis := _softmax_axis(node, args[0], opset)) is not None:
        return "_softmax", (args[0], axis, False), {}
    if op == "Concat":
        return "cat", ([a for a in args if a is not None], int(node.attr("axis"))), {}
    if op == "Unsqueeze":
        axes = _axes(node, args)
        if axes is not None and len(axes) == 1:
            return "unsqueeze", (args[0], int(axes[0])), {}
    if op == "Slice" and len(args) >= 3:
        bounds = [_ints(args[i] if i < len(args) else None) for i in range(1, 5)]
        axes, steps = bounds[2] or [0], bounds[3] or [1]
        if all(isinstance(a, list) and len(a) == 1 for a in (bounds[0], bounds[1], axes, steps)):
            if steps == [1]:
                end = bounds[1][0]
                end = 2**63 - 1 if isinstance(end, int) and end >= 2**62 else end
                return "slice", (args[0], int(axes[0]), bounds[0][0], end), {}
    if op == "Cast":
        from torch2step.frontend.onnx_graph import ONNX_DTYPES

        return (
            "_to_copy",
            (args[0],),
            {"dtype": TORCH_DTYPES.get(ONNX_DTYPES.get(node.attr("to"), ""))},
        )
    if op == "TopK":
        return (
            "topk",
            (args[0], args[1], int(node.attr("axis", -1)), bool(node.attr("largest", 1))),
            {},
        )
    if op == "Split":
        sizes = _ints(args[1]) if len(args) > 1 else node.attr("split")
        return "split_with_sizes", (args[0], sizes, int(node.attr("axis", 0))), {}
    if op == "Transpose":
        perm = node.attr("perm")
        if perm is None:  # ONNX default: the axes reversed
            shape = getattr(args[0], "shape", None)
            if shape is None:
                return op, tuple(args), dict(node.attrs)
            perm = range(len(shape) - 1, -1, -1)
        return "permute", (args[0], list(perm)), {}
    return op, tuple(args), dict(node.attrs)


def _literal(value: np.ndarray) -> Any:
    """A known value as an ATen literal: a number (single element) or a list (integer vector)."""
    if value.dtype == object:
        flat = [sympy.sympify(x) for x in value.reshape(-1).tolist()]
        if value.ndim == 1:
            return [int(x) if x.is_Integer else x for x in flat]
        return None
    if value.size == 1 and value.ndim <= 1:
        x = value.reshape(()).item()
        if value.dtype == np.float32:
            return float(str(np.float32(x)))
        return x
    if value.ndim == 1 and np.issubdtype(value.dtype, np.integer) and value.size <= 16:
        return [int(x) for x in value.tolist()]
    return None


class OnnxNodeView:
    """What a recogniser asks of a graph (as :class:`~torch2step.frontend.fx_view.ProgramView`
    answers it for FX), for an ONNX graph after constant folding.  ``value`` maps each ONNX value
    name to its node; ``meta["onnx"]`` of a node is the ONNX node it stands for."""

    rope_theta: float | None = None
    meta = False

    def __init__(self, view: OnnxView) -> None:
        self.onnx = view
        self.value: dict[str, GNode] = {}
        self.nodes: list[GNode] = []
        self.index: dict[GNode, int] = {}
        self.hints = view.sample_dims()
        for name in view.inputs:
            self._leaf(name)
        for node in view.nodes:
            if node.name not in view.folded:
                self._add(node)

    def _add(self, node: OnnxNode) -> None:
        lit = node.op_type in _LITERAL_ARGS
        numbers = node.op_type in _NUMBER_ARGS
        args = [self._arg(x, lit, numbers) if x else None for x in node.inputs]
        target, cargs, kwargs = _canonical(node, args, self.onnx.opset)
        if target == "split_with_sizes" and cargs[1] is None:  # equal parts: the outputs say
            shapes = [self.onnx.shape(o) or () for o in node.outputs]
            cargs = (cargs[0], [s[cargs[2]] if s else None for s in shapes], cargs[2])
        outs = [o for o in node.outputs if o]
        multi = len(node.outputs) > 1
        g = GNode(node.name if multi else outs[0], target, cargs, kwargs, index=node.index,
                  source=node.source, meta={"onnx": node})  # fmt: skip
        self._append(g)
        for a in arg_nodes(cargs):
            a.users[g] = None
        if not multi:
            self._typed(g, outs[0])
            self.value[outs[0]] = g
            return
        for i, o in enumerate(node.outputs):
            if o:
                item = GNode(o, "getitem", (g, i), index=node.index, source=node.source,
                             meta={"onnx": node})  # fmt: skip
                g.users[item] = None
                self._typed(item, o)
                self.value[o] = item
                self._append(item)

    def _typed(self, g: GNode, value: str) -> None:
        g.shape = self.onnx.shape(value)
        g.dtype = TORCH_DTYPES.get(self.onnx.dtypes.get(value, ""))

    def _leaf(self, name: str) -> GNode:
        g = self.value.get(name)
        if g is None:
            g = GNode(name, "placeholder", op="placeholder", index=-1)
            self._typed(g, name)
            self.value[name] = g
            self._append(g)
        return g

    def _append(self, g: GNode) -> None:
        self.index[g] = len(self.nodes)
        self.nodes.append(g)

    def _arg(self, name: str, literal: bool, numbers_only: bool = False) -> Any:
        """The operand ``name``: a literal when ``literal`` and it is known (only a number when
        ``numbers_only``: a constant vector of an arithmetic op is a tensor), else its node."""
        known = self.onnx.known.get(name) if literal else None
        if known is not None:
            lit = _literal(known)
            if lit is not None and not (numbers_only and isinstance(lit, list)):
                return lit
            return self._leaf(name)
        return self.value.get(name) or self._leaf(name)

    def expr(self, d: Any) -> Any:
        return d

    def node(self, value: str) -> GNode:
        """The node of ONNX value ``value`` (a leaf for inputs and known values)."""
        return self.value.get(value) or self._leaf(value)

    # -- the recogniser-facing queries of ProgramView -------------------------------------------
    def rank(self, node: Any) -> int:
        shape = getattr(node, "shape", None)
        return -1 if shape is None else len(shape)

    def shape(self, node: GNode) -> tuple[Any, ...]:
        return tuple(node.shape or ())

    def dtype(self, node: GNode) -> torch.dtype:
        return node.dtype or torch.float32

    def const(self, node: Any) -> torch.Tensor | None:
        if not isinstance(node, GNode) or node.op != "placeholder":
            return None
        v = self.onnx.const(node.name)
        return None if v is None else torch.from_numpy(np.array(v))

    def weight_name(self, node: Any) -> str | None:
        return None

    def is_output(self, node: Any) -> bool:
        return node.name in self.onnx.outputs

    def is_input(self, node: Any) -> bool:
        return node.op == "placeholder" and node.name in self.onnx.inputs

    def pinned(self, sym: sympy.Symbol) -> bool:
        return False

    def concrete(self, expr: Any, binding: dict[sympy.Symbol, int] | None = None) -> int:
        """``expr`` at the sample dims (or ``binding``); a FrontendError when it depends on a
        dim that is not an input's (a dim ONNX shape inference left unknown)."""
        value = sympy.sympify(expr).subs(self.hints if binding is None else binding)
        if not value.is_Integer:
            unknown = [str(s) for s in value.free_symbols]
            raise FrontendError(f"the size {expr} is not known: {unknown_dims_advice(unknown)}")
        return int(value)

    def run(
        self,
        outputs: list[GNode],
        feeds: dict[GNode, Any],
        binding: dict[sympy.Symbol, int] | None = None,
    ) -> list[torch.Tensor]:
        """Evaluate ``outputs`` from ``feeds`` with ``onnx.reference`` (other values read must
        be known; symbolic ones are taken at ``binding``, the sample dims by default)."""
        binding = self.hints if binding is None else binding
        names = {g.name: np.asarray(v) for g, v in feeds.items()}
        want = [o.name for o in outputs if o.name not in self.onnx.known]
        nodes = upstream(self.onnx, want, set(names))
        got = dict(zip(want, run_subgraph(self.onnx, nodes, names, want, binding) if want else []))
        for o in outputs:
            if o.name in self.onnx.known:
                got[o.name] = concrete_value(self.onnx.known[o.name], binding)
        return [torch.from_numpy(np.array(got[o.name])) for o in outputs]
