"""A read-only view of a core-ATen ``ExportedProgram`` for raising into the layer graph.

It answers what the raising patterns and translation rules ask of an FX node: its operator name,
its symbolic shape in the layer graph's readable dims (``T``, ``B``, ``L`` instead of ``s47``),
the value of weights and of constant expressions of weights, the node a chain of transparent
ops (``clone``, same-dtype ``_to_copy``, full slices, ...) stands for, and the user's source line
(``node.meta["stack_trace"]``, last frame outside torch).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import sympy
import torch
from torch import fx

from torch2step.errors import FrontendError
from torch2step.frontend.gnode import GNode
from torch2step.layers.graph import dtype_name
from torch2step.layers.ops import Dim, TensorType

__all__ = [
    "ProgramView",
    "op_name",
    "overload_name",
    "strip",
    "strip_casts",
    "source_line",
    "tensor_args",
    "is_tensor_node",
    "is_node",
    "dtype_of",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')
_MAXINT = 2**62

#: Ops that only copy or re-label their first argument (never change values or shape).
_COPIES = frozenset({"clone", "alias", "contiguous", "lift_fresh_copy", "detach"})
#: Ops without side effects whose result on constant inputs is itself a constant.
_IMPURE = frozenset(
    {"empty", "empty_like", "empty_permuted", "empty_strided", "rand", "randn", "randint",
     "bernoulli", "dropout", "native_dropout", "index_put_", "copy_", "_assert_scalar",
     "_assert_tensor_metadata"}
)  # fmt: skip


def is_node(x: Any) -> bool:
    """Whether ``x`` is a graph node (FX or the common :class:`GNode`), not a literal."""
    return isinstance(x, (fx.Node, GNode))


def op_name(node: Any) -> str:
    """Short operator name: ``"mm"``, ``"_softmax"``, ``"getitem"``, or ``"<ns>.<op>"`` for
    custom ops (``"transformers.grouped_mm_fallback"``); ``node.op`` for non-calls."""
    if not is_node(node):
        return ""
    if node.op != "call_function":
        return node.op
    if isinstance(node, GNode):
        return node.target
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname if t.namespace == "aten" else f"{t.namespace}.{t._opname}"
    return getattr(t, "__name__", str(t))


def overload_name(node: fx.Node) -> str:
    """The full overload name (``"aten.mm.default"``), the key of the translation table."""
    if node.op != "call_function":
        return node.op
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor_node(node: Any) -> bool:
    """Whether ``node`` computes a tensor or a tuple of tensors (not a SymInt or None)."""
    if isinstance(node, GNode):
        return node.shape is not None and all(d is not None for d in node.shape)
    v = _val(node)
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued FX nodes ``node`` reads (SymInt nodes are shapes, not data)."""
    out: list[fx.Node] = []
    fx.node.map_arg(
        (node.args, node.kwargs), lambda n: out.append(n) if is_tensor_node(n) else None
    )
    return list(dict.fromkeys(out))


def _raw(d: Any) -> int | sympy.Expr:
    if isinstance(d, int):
        return d
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        return int(expr) if expr.is_Integer else expr
    raise FrontendError(f"unexpected size {d!r}")


def dtype_of(node: Any) -> torch.dtype | None:
    """The element type of a tensor node, else None."""
    if isinstance(node, GNode):
        return node.dtype
    return getattr(_val(node), "dtype", None)


def raw_shape(node: Any) -> tuple[int | sympy.Expr, ...]:
    """Shape of a tensor node in the exporter's own symbols (``s47``, ``u0``)."""
    if isinstance(node, GNode):
        if node.shape is None or any(d is None for d in node.shape):
            raise FrontendError(f"the shape of {node.name} is unknown")
        return node.shape
    v = _val(node)
    if not isinstance(v, torch.Tensor):
        raise FrontendError(f"node {node.name} is not a tensor")
    return tuple(_raw(d) for d in v.shape)


def _same_shape(a: Any, b: Any) -> bool:
    if not is_tensor_node(b) or not is_tensor_node(a):
        return False
    sa, sb = raw_shape(a), raw_shape(b)
    return len(sa) == len(sb) and all(sympy.expand(x - y) == 0 for x, y in zip(sa, sb))


def _full_slice(node: fx.Node) -> bool:
    args = list(node.args) + [None] * 5
    x, dim, start, end, step = args[:5]
    step = 1 if step is None else step
    start = 0 if start is None else start
    return step == 1 and start == 0 and (end is None or isinstance(end, int) and end >= _MAXINT)


def _transparent(node: fx.Node, casts: bool) -> fx.Node | None:
    name = op_name(node)
    if name in _COPIES:
        return node.args[0]
    if name == "_to_copy":
        src = node.args[0]
        dt = node.kwargs.get("dtype")
        if casts or dt is None or dtype_of(src) == dt:
            return src
    if name == "slice" and _full_slice(node):
        return node.args[0]
    if name in ("view", "_unsafe_view", "reshape", "expand") and _same_shape(node, node.args[0]):
        return node.args[0]
    return None


def strip(node: Any, casts: bool = False) -> Any:
    """Follow transparent ops (copies, same-dtype casts, full slices, same-shape views) back to
    the node whose value they carry; with ``casts`` also dtype casts."""
    while is_node(node) and node.op == "call_function":
        nxt = _transparent(node, casts)
        if nxt is None:
            break
        node = nxt
    return node


def strip_casts(node: Any) -> Any:
    """:func:`strip` including dtype casts (for ops computed in fp32 whatever the input dtype)."""
    return strip(node, casts=True)


def source_line(node: Any) -> str | None:
    """``file:line in func: code`` of the last user frame in ``node.meta["stack_trace"]``."""
    if not isinstance(node, fx.Node):  # a common-view or ONNX node names its own source
        return getattr(node, "source", None)
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = _FRAME.findall(trace)
    if not frames:
        return None
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    path, line, func, code = (user or frames)[-1]
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line} in {func}: {code.strip()}"


class ProgramView:
    """What raising reads from an exported program.

    ``dim_names`` maps ``(user input index, axis)`` to the readable name of the dynamic dim there
    (from the user's ``torch.export.Dim`` names or the capture heuristic); the exporter's symbols
    (``s47``) become ``sympy.Symbol(name, integer=True, positive=True)``.
    """

    def __init__(
        self,
        ep: torch.export.ExportedProgram,
        dim_names: Mapping[tuple[int, int], str] | None = None,
        rope_theta: float | None = None,
    ) -> None:
        self.ep = ep
        #: RoPE base read from the module's config, for frequency tables without values (meta)
        self.rope_theta = rope_theta
        self.graph: fx.Graph = ep.graph
        self.nodes: list[fx.Node] = list(ep.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        sig = ep.graph_signature
        self._weights: dict[str, str] = {
            **sig.inputs_to_parameters,
            **sig.inputs_to_buffers,
            **sig.inputs_to_lifted_tensor_constants,
        }
        self.user_inputs: list[fx.Node] = [
            n for n in self.nodes if n.op == "placeholder" and n.name in set(sig.user_inputs)
        ]
        self.output_node: fx.Node = next(n for n in self.nodes if n.op == "output")
        self.hints: dict[sympy.Symbol, int] = {}
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}
        self._const_cache: dict[fx.Node, torch.Tensor | None] = {}
        self._name_symbols(dim_names or {})

    # -- symbols --------------------------------------------------------------------------------
    def _name_symbols(self, dim_names: Mapping[tuple[int, int], str]) -> None:
        for n in self.nodes:
            v = _val(n)
            if isinstance(v, torch.Tensor):
                env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
                if env is not None:
                    # torch >= 2.10 names the map backed_var_to_val (var_to_val warns); it is
                    # empty when every dim is static
                    vals = getattr(env, "backed_var_to_val", None)
                    if vals is None:
                        vals = env.var_to_val
                    self.hints = {k: int(x) for k, x in vals.items()}
                    break
        # a dim the module pins to one value (a deferred runtime assert) is static
        for sym, vr in self.ep.range_constraints.items():
            lo, hi = vr.lower, vr.upper
            if isinstance(sym, sympy.Symbol) and lo == hi and getattr(lo, "is_Integer", False):
                self.symbols[sym] = sympy.Integer(int(lo))
        taken: set[str] = set()
        for i, ph in enumerate(self.user_inputs):
            v = _val(ph)
            if not isinstance(v, torch.Tensor):
                continue
            for axis, d in enumerate(raw_shape(ph)):
                if not isinstance(d, sympy.Symbol) or d in self.symbols:
                    continue
                base = dim_names.get((i, axis)) or f"{ph.name}_{axis}"
                name, k = base, 1
                while name in taken:
                    name, k = f"{base}{k}", k + 1
                taken.add(name)
                self.symbols[d] = sympy.Symbol(name, integer=True, positive=True)

    def pinned(self, sym: sympy.Symbol) -> bool:
        """Whether the exporter's symbol ``sym`` is fixed to one value by the module."""
        return isinstance(self.symbols.get(sym), sympy.Integer)

    def expr(self, x: Any) -> Dim:
        """A size (int, SymInt, SymInt-valued node or exporter expression) in readable dims."""
        if isinstance(x, fx.Node):
            x = _val(x)
        if isinstance(x, bool):
            raise FrontendError(f"expected a size, got {x!r}")
        if isinstance(x, int):
            return x
        if isinstance(x, torch.SymInt):
            x = x.node.expr
        if isinstance(x, sympy.Expr):
            e = x.xreplace(self.symbols)
            return int(e) if e.is_Integer else e
        raise FrontendError(f"expected a size, got {x!r}")

    def shape(self, node: fx.Node) -> tuple[Dim, ...]:
        """Shape of a tensor node in readable dims."""
        return tuple(self.expr(d) for d in raw_shape(node))

    def dtype(self, node: fx.Node) -> torch.dtype:
        v = _val(node)
        if not isinstance(v, torch.Tensor):
            raise FrontendError(f"node {node.name} is not a tensor")
        return v.dtype

    def ttype(self, node: fx.Node) -> TensorType:
        return TensorType(self.shape(node), dtype_name(self.dtype(node)))

    def rank(self, node: Any) -> int:
        v = _val(node)
        return v.dim() if isinstance(v, torch.Tensor) else -1

    def concrete(self, expr: Any, binding: Mapping[sympy.Symbol, int] | None = None) -> int:
        """An exporter expression (or SymInt) at the example sizes (or ``binding``)."""
        if isinstance(expr, torch.SymInt):
            expr = expr.node.expr
        if isinstance(expr, int):
            return expr
        return int(sympy.sympify(expr).subs(binding if binding is not None else self.hints))

    # -- graph queries --------------------------------------------------------------------------
    def users(self, node: fx.Node) -> list[fx.Node]:
        return list(node.users)

    def is_output(self, node: Any) -> bool:
        return node in self.output_node.all_input_nodes

    def is_input(self, node: Any) -> bool:
        """Whether ``node`` is a run-time input of the module (not a weight)."""
        return node in self.user_inputs

    def run(
        self,
        outputs: list[fx.Node],
        feeds: Mapping[fx.Node, Any],
        binding: Mapping[sympy.Symbol, int] | None = None,
    ) -> list[Any]:
        """Evaluate ``outputs`` from ``feeds`` (:func:`~torch2step.frontend.fx_probe.run_slice`)."""
        from torch2step.frontend.fx_probe import run_slice

        return run_slice(self, outputs, feeds, binding)

    def weight_name(self, node: fx.Node) -> str | None:
        """The state-dict name of a parameter / buffer / constant placeholder, else None."""
        return self._weights.get(node.name) if node.op == "placeholder" else None

    def weight_value(self, node: fx.Node) -> torch.Tensor:
        target = self._weights[node.name]
        if target in self.ep.state_dict:
            return self.ep.state_dict[target].detach()
        return self.ep.constants[target].detach()

    @property
    def meta(self) -> bool:
        """Whether the weights are shapes only (``meta`` device): nothing can be run."""
        return any(
            isinstance(t, torch.Tensor) and t.is_meta
            for t in (*self.ep.state_dict.values(), *self.ep.constants.values())
        )

    def const(self, node: Any) -> torch.Tensor | None:
        """The value of ``node`` when it depends only on weights (evaluated once), else None."""
        if not isinstance(node, fx.Node):
            return None
        if node in self._const_cache:
            return self._const_cache[node]
        self._const_cache[node] = None
        value: torch.Tensor | None = None
        if node.op == "placeholder" and node.name in self._weights:
            value = self.weight_value(node)
        elif node.op == "call_function" and op_name(node) not in _IMPURE:
            value = self._fold(node)
        self._const_cache[node] = value
        return value

    def _fold(self, node: fx.Node) -> Any:
        ok = True

        def arg(a: fx.Node) -> Any:
            nonlocal ok
            if is_tensor_node(a):
                c = self.const(a)
                if c is None:
                    ok = False
                return c
            v = _val(a)
            if isinstance(v, torch.SymInt) and not v.node.expr.is_Integer:
                ok = False
            return int(v) if isinstance(v, torch.SymInt) and ok else v

        has_tensor = bool(tensor_args(node))
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
        if not ok or not has_tensor:
            return None
        if any(isinstance(x, torch.SymInt) for x in _flatten((node.args, node.kwargs))):
            return None
        out = node.target(*args, **kwargs)  # type: ignore[operator]
        return out.detach() if isinstance(out, torch.Tensor) else out

    def walk(self) -> Iterator[fx.Node]:
        return iter(self.nodes)


def _flatten(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x
