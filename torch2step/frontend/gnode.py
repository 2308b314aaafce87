"""The common view of a graph node that the raising recognisers read.

A recogniser (RMSNorm, top-k routing, rotary embedding, ...) is written once against this
interface: a node has a ``name``, an ``op`` kind (``"call_function"`` or ``"placeholder"``), an
operator name in core-ATen spelling (``"mul"``, ``"mean"``, ``"cat"``, ``"topk"``,
``"getitem"``), positional ``args`` (nodes or Python literals: ``1e-6``, ``[-1]``, ``True``)
and ``users``.  A ``torch.fx.Node`` of a core-ATen ``ExportedProgram`` already is such a node;
the ONNX frontend builds :class:`GNode` objects from its graph
(:mod:`torch2step.frontend.onnx_nodes`), normalising op types and attributes to the ATen
spelling (``MatMul`` -> ``matmul``, ``ReduceMean(x, axes, keepdims)`` -> ``mean(x, dims,
keepdim)``, a known scalar operand -> a Python number).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

__all__ = ["GNode", "arg_nodes", "same_dim"]


@dataclass(eq=False)
class GNode:
    """One value of a non-FX graph in the common view (see the module docstring).

    ``target`` is the ATen-spelled operator name; ``shape`` holds ints and sympy expressions
    (``None`` entries when unknown); ``source`` names the original node and source line."""

    name: str
    target: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    shape: tuple[Any, ...] | None = None
    dtype: torch.dtype | None = None
    source: str | None = None
    index: int = 0
    op: str = "call_function"
    users: dict[GNode, None] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"GNode({self.name}: {self.target})"


def same_dim(a: object, b: object) -> bool:
    """``a == b`` for ints and sympy expressions (cheap: expand, no simplify)."""
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def arg_nodes(args: Any) -> list[GNode]:
    """The :class:`GNode` values among ``args`` (nested lists and tuples), once each, in order."""
    out: dict[GNode, None] = {}
    for a in args:
        if isinstance(a, (list, tuple)):
            out.update(dict.fromkeys(arg_nodes(a)))
        elif isinstance(a, GNode):
            out[a] = None
    return list(out)
