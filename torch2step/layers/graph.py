"""The layer graph: values, nodes in topological order, parameters, and its printer.

A :class:`LayerGraph` is what both frontends (``torch.export`` and ONNX) produce and what the
lowering to STeP consumes.  Graph inputs are activations and run-time data (token batches, KV
caches, KV lengths); parameters (weights, constant tables) are tensors held by the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import sympy
import torch

from torch2step.errors import FrontendError
from torch2step.layers.ops import LayerOp, TensorType

__all__ = ["Node", "LayerGraph", "format_layer_graph"]

_TORCH_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The layer-graph dtype name of a torch dtype."""
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise FrontendError(
            f"dtype {dtype} is not supported; use one of {sorted(_TORCH_DTYPES.values())}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layer-graph dtype name."""
    for k, v in _TORCH_DTYPES.items():
        if v == name:
            return k
    raise FrontendError(f"unknown dtype name {name!r}")


@dataclass(frozen=True, slots=True)
class Node:
    """One operation: ``outputs = op(*inputs)``.  ``source`` is the user's source line (from
    ``node.meta["stack_trace"]`` or the ONNX node name) for error messages."""

    name: str
    op: LayerOp
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str | None = None


@dataclass
class LayerGraph:
    """A graph of layer operations.

    ``inputs``: ordered run-time input names (as the module's positional arguments);
    ``outputs``: output names; ``single_output``: the module returns one tensor, not a tuple;
    ``params``: name -> tensor; ``types``: every value's :class:`TensorType`;
    ``dims``: the dynamic dimension symbols (e.g. tokens ``T``, KV length ``L``) and, per symbol,
    where it is read from (``(input_name, axis)``); ``notes``: what the frontend chose for the
    user (a fallback), carried into the report's notes."""

    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    single_output: bool = False
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    types: dict[str, TensorType] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    dims: dict[sympy.Symbol, tuple[str, int]] = field(default_factory=dict)
    name: str = "layer"
    notes: list[str] = field(default_factory=list)

    # -- building -----------------------------------------------------------------------------
    def drop_dead(self) -> None:
        """Drop the nodes no output depends on, and the parameters and types only they used
        (a frontend emits every operation it raises; e.g. the empty pass-through slice of a
        full rotary embedding, which the concatenation after it leaves out)."""
        needed = set(self.outputs)
        keep = []
        for node in reversed(self.nodes):
            if any(o in needed for o in node.outputs):
                keep.append(node)
                needed.update(node.inputs)
        self.nodes = keep[::-1]
        for p in [p for p in self.params if p not in needed]:
            del self.params[p]
        live = set(self.inputs) | set(self.params) | {o for n in self.nodes for o in n.outputs}
        for v in [v for v in self.types if v not in live]:
            del self.types[v]

    def add_input(self, name: str, ty: TensorType) -> str:
        self._fresh(name)
        self.inputs.append(name)
        self.types[name] = ty
        for axis, d in enumerate(ty.shape):
            if isinstance(d, sympy.Symbol) and d not in self.dims:
                self.dims[d] = (name, axis)
        return name

    def add_param(self, name: str, value: torch.Tensor) -> str:
        self._fresh(name)
        self.params[name] = value
        self.types[name] = TensorType(tuple(value.shape), dtype_name(value.dtype))
        return name

    def add(
        self,
        op: LayerOp,
        inputs: Sequence[str],
        outputs: Sequence[str] | str | None = None,
        *,
        source: str | None = None,
    ) -> tuple[str, ...]:
        """Append ``op`` applied to ``inputs``; returns its output names (fresh when not given)."""
        for i in inputs:
            if i not in self.types:
                raise FrontendError(f"{type(op).__name__}: input {i!r} is not defined in the graph")
        out_types = op.infer([self.types[i] for i in inputs])
        if outputs is None:
            base = type(op).__name__.lower()
            outputs = []
            for k in range(len(out_types)):
                cand = self.fresh_name(f"{base}{k}" if len(out_types) > 1 else base)
                outputs.append(cand)
        elif isinstance(outputs, str):
            outputs = [outputs]
        if len(outputs) != len(out_types):
            raise FrontendError(
                f"{type(op).__name__} yields {len(out_types)} values, {len(outputs)} names given"
            )
        for o, t in zip(outputs, out_types):
            self._fresh(o)
            self.types[o] = t
        name = f"n{len(self.nodes)}_{type(op).__name__.lower()}"
        self.nodes.append(Node(name, op, tuple(inputs), tuple(outputs), source))
        return tuple(outputs)

    def fresh_name(self, base: str) -> str:
        """A value name starting with ``base`` not used yet."""
        name, i = base, 0
        while name in self.types:
            i += 1
            name = f"{base}_{i}"
        return name

    def _fresh(self, name: str) -> None:
        if name in self.types:
            raise FrontendError(f"value {name!r} is defined twice")

    # -- queries ------------------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        """Value name -> the node that produces it."""
        return {o: n for n in self.nodes for o in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        """Value name -> nodes reading it."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n)
        return out

    def ops(self, cls: type[LayerOp]) -> Iterator[Node]:
        """Nodes whose op is an instance of ``cls``."""
        return (n for n in self.nodes if isinstance(n.op, cls))

    def __str__(self) -> str:
        return format_layer_graph(self)


def _fmt_attrs(op: LayerOp) -> str:
    fields = [f for f in dataclasses.fields(op) if f.repr]  # type: ignore[arg-type]
    parts = [f"{f.name}={getattr(op, f.name)!r}" for f in fields]
    return f"[{', '.join(parts)}]" if parts else ""


def format_layer_graph(g: LayerGraph) -> str:
    """A deterministic, readable listing of ``g``: inputs, parameters, nodes, outputs."""
    lines = [f"layer_graph {g.name} {{"]
    for i in g.inputs:
        lines.append(f"  input {i}: {g.types[i]}")
    for p in g.params:
        lines.append(f"  param {p}: {g.types[p]}")
    for n in g.nodes:
        outs = ", ".join(f"{o}: {g.types[o]}" for o in n.outputs)
        lines.append(f"  {outs} = {type(n.op).__name__}{_fmt_attrs(n.op)}({', '.join(n.inputs)})")
        body = getattr(n.op, "body", None)
        if isinstance(body, LayerGraph):  # a repeated body, printed once
            lines += ["    " + line for line in format_layer_graph(body).splitlines()]
    lines.append(f"  return {', '.join(g.outputs)}")
    lines.append("}")
    return "\n".join(lines)
