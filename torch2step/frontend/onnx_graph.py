"""A read-only view of an ONNX graph for raising: nodes in topological order, producers and
consumers, symbolic shapes (sympy) and the values known before run time.

Known values are what :mod:`torch2step.frontend.onnx_fold` computes without inputs: weights and
constant expressions of them (numpy arrays), and the small integer "shape tensors" the exporters
build from ``Shape`` of dynamic inputs (numpy ``object`` arrays of sympy expressions such as
``[L + 1, 16]``).  Raising patterns and translators read the graph only through this view.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

from torch2step.errors import FrontendError
from torch2step.frontend.gnode import same_dim

__all__ = [
    "OnnxNode",
    "OnnxView",
    "Dim",
    "parse_dim",
    "same_dim",
    "unknown_dims_advice",
    "ONNX_DTYPES",
]

Dim = int | sympy.Expr

#: ONNX ``TensorProto`` element type -> layer-graph dtype name.
ONNX_DTYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "fp32",
    onnx.TensorProto.FLOAT16: "fp16",
    onnx.TensorProto.BFLOAT16: "bf16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.DOUBLE: "fp64",
}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXPR = re.compile(r"^[A-Za-z0-9_\s+\-*/()]+$")


def _symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


def parse_dim(text: str) -> sympy.Expr:
    """A ``dim_param`` as a sympy expression: ``"L"`` -> ``L``, ``"L + 1"`` -> ``L + 1``;
    anything else becomes one symbol with a sanitised name."""
    text = text.strip()
    if _EXPR.match(text):
        names = {tok: _symbol(tok) for tok in _IDENT.findall(text)}
        try:
            expr = sympy.sympify(text, locals=names)
        except (sympy.SympifyError, SyntaxError, TypeError):
            expr = None
        if isinstance(expr, sympy.Expr) and expr.free_symbols <= set(names.values()):
            return expr
    return _symbol(_sanitize(text))


def unknown_dims_advice(names: Iterable[str]) -> str:
    """Why the dims ``names`` are unknown and what to do (for messages)."""
    names = sorted(set(names))
    legacy = (
        " (the legacy TorchScript exporter, torch.onnx.export(..., dynamo=False), leaves such "
        "unk__ dims)"
        if any(n.startswith("unk__") for n in names)
        else ""
    )
    return (
        f"ONNX shape inference left dims unknown ({', '.join(names)}){legacy}; re-export with "
        "torch.onnx.export(..., dynamo=True), which records every shape in terms of the "
        "inputs' dims"
    )


def _sanitize(text: str) -> str:
    """``text`` as an identifier: runs of other characters become ``_`` (``"2*N"`` -> ``d_2_N``)."""
    name = re.sub(r"\W+", "_", text).strip("_") or "dim"
    return name if name.isidentifier() else f"d_{name}"


@dataclass(eq=False)
class OnnxNode:
    """One ONNX node; ``index`` is its position in topological order, ``inputs`` keep ``""`` for
    omitted optional inputs."""

    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    meta: dict[str, str] = field(default_factory=dict)
    proto: onnx.NodeProto | None = None

    @property
    def where(self) -> str:
        """``"name (OpType)"`` for messages."""
        return f"{self.name} ({self.op_type})"

    @property
    def module(self) -> str:
        """The PyTorch module path the exporter recorded for this node (``"attn.q_proj"``), or
        ``""``."""
        scopes = self.meta.get("pkg.torch.onnx.name_scopes", "")
        parts = [p.strip(" '\"") for p in scopes.strip("[]").split(",")]
        mods = [p for p in parts[:-1] if p and not p.startswith("_")]
        return mods[-1] if mods else ""

    @property
    def source(self) -> str:
        """The node and, when the exporter recorded it, the user's source line."""
        trace = self.meta.get("pkg.torch.onnx.stack_trace", "").strip().splitlines()
        if len(trace) >= 2:
            loc = trace[-2].strip().replace('File "', "").replace('", line ', ":")
            return f"{self.where} from {loc}: {trace[-1].strip()}"
        return self.where

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


def _attr_value(a: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


@dataclass
class OnnxView:
    """The graph of one ONNX model, prepared for raising (see the module docstring)."""

    model: onnx.ModelProto
    nodes: list[OnnxNode] = field(default_factory=list)
    producer: dict[str, OnnxNode] = field(default_factory=dict)
    by_name: dict[str, OnnxNode] = field(default_factory=dict)
    consumers: dict[str, list[OnnxNode]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[Dim | None, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    known: dict[str, np.ndarray] = field(default_factory=dict)
    folded: set[str] = field(default_factory=set)
    dims: dict[sympy.Symbol, tuple[str, int]] = field(default_factory=dict)
    #: the graph inputs' ``dim_param`` texts and what they stand for (see ``_name_input_dims``)
    dim_names: dict[str, Dim] = field(default_factory=dict)
    opset: int = 0
    _node_view: Any = None

    def node_view(self) -> Any:
        """The graph in the recognisers' common view (built once, after constant folding)."""
        if self._node_view is None:
            from torch2step.frontend.onnx_nodes import OnnxNodeView

            self._node_view = OnnxNodeView(self)
        return self._node_view

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(cls, model: onnx.ModelProto) -> OnnxView:
        """Index ``model``'s main graph (nodes are re-sorted topologically)."""
        g = model.graph
        view = cls(model)
        view.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        for init in g.initializer:
            view.known[init.name] = numpy_helper.to_array(init)
            view.dtypes[init.name] = ONNX_DTYPES.get(init.data_type, f"onnx{init.data_type}")
        view.inputs = [i.name for i in g.input if i.name not in view.known]
        view.outputs = [o.name for o in g.output]
        view._name_input_dims(g)
        for vi in [*g.input, *g.value_info, *g.output]:
            view._record_type(vi)
        view._register_input_dims(g)
        view._sort_nodes(g)
        return view

    def _name_input_dims(self, g: onnx.GraphProto) -> None:
        """What the graph inputs' ``dim_param`` texts stand for.  A name (``"batch"``,
        ``"batch size"``) is a symbol; an integer expression of those names (a derived dim such
        as ``"L + 1"``, as torch.export writes it) is that expression; any other text
        (``"batch-size"``, ``"2*N"`` alone, ``"N/A"``) is an opaque label, as ONNX defines a
        dim_param: one fresh symbol per distinct text, named after it (``batch_size``)."""
        inputs = set(self.inputs)
        texts = [
            d.dim_param
            for vi in g.input
            if vi.name in inputs and vi.type.HasField("tensor_type")
            for d in vi.type.tensor_type.shape.dim
            if d.HasField("dim_param")
        ]
        parsed = {t: parse_dim(t) for t in texts}
        names = {e for e in parsed.values() if isinstance(e, sympy.Symbol)}
        taken = {str(s) for s in names}
        for text, expr in parsed.items():
            if not isinstance(expr, sympy.Symbol) and not (
                expr.free_symbols <= names and expr.is_integer
            ):
                name = _sanitize(text)
                while name in taken:
                    name += "_"
                taken.add(name)
                expr = _symbol(name)
            self.dim_names[text] = expr

    def _record_type(self, vi: onnx.ValueInfoProto) -> None:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            return
        self.dtypes.setdefault(vi.name, ONNX_DTYPES.get(tt.elem_type, f"onnx{tt.elem_type}"))
        if tt.HasField("shape"):
            dims: list[Dim | None] = []
            for d in tt.shape.dim:
                if d.HasField("dim_value"):
                    dims.append(int(d.dim_value))
                elif d.HasField("dim_param"):
                    dims.append(self.dim_names.get(d.dim_param, parse_dim(d.dim_param)))
                else:
                    dims.append(None)
            self.shapes.setdefault(vi.name, tuple(dims))

    def _register_input_dims(self, g: onnx.GraphProto) -> None:
        for name in self.inputs:
            shape = self.shapes.get(name)
            if shape is None:
                raise FrontendError(
                    f"ONNX graph input {name!r} has no shape; re-export with shapes "
                    "(torch.onnx.export(..., dynamo=True) records them)"
                )
            fixed: list[Dim | None] = []
            for axis, d in enumerate(shape):
                if d is None:
                    d = _symbol(f"{_sanitize(name)}_{axis}")
                if isinstance(d, sympy.Symbol) and d not in self.dims:
                    self.dims[d] = (name, axis)
                fixed.append(d)
            self.shapes[name] = tuple(fixed)

    def _sort_nodes(self, g: onnx.GraphProto) -> None:
        raw = list(g.node)
        available = set(self.known) | set(self.inputs) | {""}
        pending = list(range(len(raw)))
        order: list[int] = []
        while pending:
            rest = []
            for i in pending:
                if all(x in available for x in raw[i].input):
                    order.append(i)
                    available.update(raw[i].output)
                else:
                    rest.append(i)
            if len(rest) == len(pending):
                missing = sorted(
                    {x for i in rest for x in raw[i].input if x not in available}
                    - {o for i in rest for o in raw[i].output}
                )
                raise FrontendError(
                    f"ONNX graph is not a DAG or reads undefined values {missing[:5]}; "
                    "check the file with onnx.checker.check_model"
                )
            pending = rest
        used: set[str] = set()
        for k, i in enumerate(order):
            p = raw[i]
            name = p.name or f"{p.op_type}_{k}"
            while name in used:
                name += "_"
            used.add(name)
            node = OnnxNode(
                k,
                name,
                p.op_type,
                p.domain if p.domain != "ai.onnx" else "",
                tuple(p.input),
                tuple(p.output),
                {a.name: _attr_value(a) for a in p.attribute},
                {m.key: m.value for m in p.metadata_props},
                p,
            )
            self.nodes.append(node)
            self.by_name[name] = node
            for o in node.outputs:
                if o:
                    self.producer[o] = node
            for x in node.inputs:
                if x:
                    self.consumers.setdefault(x, []).append(node)

    # -- queries --------------------------------------------------------------------------------
    def shape(self, value: str) -> tuple[Dim | None, ...] | None:
        """The symbolic shape of ``value`` (``None`` entries are unknown), or ``None``."""
        if value in self.known:
            return tuple(int(s) for s in self.known[value].shape)
        return self.shapes.get(value)

    def rank(self, value: str) -> int | None:
        s = self.shape(value)
        return None if s is None else len(s)

    def const(self, value: str) -> np.ndarray | None:
        """The numeric value of ``value`` if it is known before run time (not symbolic)."""
        v = self.known.get(value)
        if v is None or v.dtype == object:
            return None
        return v

    def scalar(self, value: str) -> float | None:
        """A known numeric value with one element, as a Python float."""
        v = self.const(value)
        if v is None or v.size != 1:
            return None
        return float(v.reshape(()))

    def ints(self, value: str) -> list[Dim] | None:
        """A known integer vector (numeric or symbolic) as a list of ``int | sympy.Expr``."""
        v = self.known.get(value)
        if v is None or not (v.dtype == object or np.issubdtype(v.dtype, np.integer)):
            return None
        return [_to_dim(x) for x in v.reshape(-1).tolist()]

    def producer_of(
        self, value: str, op_type: str | Iterable[str] | None = None
    ) -> OnnxNode | None:
        """The node producing ``value`` (if it is an ``op_type`` node, when given)."""
        node = self.producer.get(value)
        if node is None or op_type is None:
            return node
        types = {op_type} if isinstance(op_type, str) else set(op_type)
        return node if node.op_type in types else None

    def users(self, value: str) -> list[OnnxNode]:
        return self.consumers.get(value, [])

    def is_graph_dim(self, d: Dim | None) -> bool:
        """``d`` is an integer or an expression of the graph inputs' dynamic dims only."""
        if d is None:
            return False
        if isinstance(d, int):
            return True
        return sympy.sympify(d).free_symbols <= set(self.dims)

    def sample_dims(self) -> dict[sympy.Symbol, int]:
        """Distinct, unusual sizes (primes from 11) for the dynamic dims, for probing."""
        primes = [11, 13, 17, 19, 23, 29, 31, 37, 41, 43]
        syms = sorted(self.dims, key=str)
        return {s: primes[i % len(primes)] + 40 * (i // len(primes)) for i, s in enumerate(syms)}


def _to_dim(x: Any) -> Dim:
    if isinstance(x, sympy.Expr):
        return int(x) if x.is_Integer else x
    return int(x)
