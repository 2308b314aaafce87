"""One-to-one translation of core-ATen operators into layer ops (TVM Relax's
``create_convert_map``): :data:`RULES` maps an ATen overload name to a function appending the
layer ops of one FX node; :data:`CHECKS` says why a node whose operator has a rule still cannot be
translated (e.g. ``index.Tensor`` with two index tensors).  Nodes covered by a raising pattern
never reach these rules.  The ONNX frontend uses them too for the ops it adapts to the same
spelling (elementwise arithmetic, softmax, reductions, casts, transposes; see
:data:`~torch2step.frontend.onnx_import.SHARED_RULES`), looked up by short name."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch import fx

from torch2step.frontend.fx_emit import FxEmitter, Value
from torch2step.frontend.fx_view import (
    ProgramView,
    is_node,
    is_tensor_node,
    op_name,
    raw_shape,
    strip,
    tensor_args,
)
from torch2step.frontend.gnode import GNode
from torch2step.layers import ops as L
from torch2step.layers.graph import dtype_name, torch_dtype

__all__ = ["RULES", "CHECKS", "IGNORED", "rule_for", "check_node", "gelu_fn"]

Rule = Callable[[FxEmitter, fx.Node], Value]
Check = Callable[[ProgramView, fx.Node], "str | None"]

RULES: dict[str, Rule] = {}
CHECKS: dict[str, Check] = {}

#: Operators that compute no tensor data (shape arithmetic, assertions): never translated.
IGNORED = frozenset(
    {"sym_size", "sym_numel", "sym_stride", "_assert_scalar", "_assert_tensor_metadata",
     "sym_constrain_range_for_size", "sym_constrain_range", "_assert_async"}
)  # fmt: skip


def _rule(*names: str, check: Check | None = None) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
            if check is not None:
                CHECKS[n] = check
        return fn

    return deco


def _key(node: Any) -> str:
    if isinstance(node, GNode):  # a node of the common view: short ATen name
        return _SHORT.get(node.target, node.target)
    if node.target is operator.getitem:
        return "getitem"
    return str(node.target) if node.op == "call_function" else node.op


def rule_for(node: Any) -> Rule | None:
    return RULES.get(_key(node))


def check_node(view: ProgramView, node: Any) -> str | None:
    """None when ``node`` can be translated by its rule, else the reason."""
    if rule_for(node) is None:
        return "no rule"
    chk = CHECKS.get(_key(node))
    return chk(view, node) if chk is not None else None


def _dim(node: fx.Node, d: int, view: ProgramView) -> int:
    return d % max(view.rank(node), 1)


# -- data movement ------------------------------------------------------------------------------
@_rule("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
       "aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default", "aten.unsqueeze.default",
       "aten.flatten.using_ints")  # fmt: skip
def _reshape(em: FxEmitter, node: fx.Node) -> Value:
    return em.reshape(em.get(node.args[0]), em.view.shape(node))


@_rule("aten.permute.default", "aten.transpose.int", "aten.t.default")
def _permute(em: FxEmitter, node: fx.Node) -> Value:
    x = node.args[0]
    rank = em.view.rank(x)
    if op_name(node) == "permute":
        dims = tuple(d % rank for d in node.args[1])
    else:
        a, b = (node.args[1], node.args[2]) if op_name(node) == "transpose" else (0, 1)
        perm = list(range(rank))
        perm[a % rank], perm[b % rank] = perm[b % rank], perm[a % rank]
        dims = tuple(perm)
    if dims == tuple(range(rank)):
        return em.get(x)
    return em.emit1(L.Permute(dims), [em.get(x)])


def _slice_check(view: ProgramView, node: fx.Node) -> str | None:
    step = node.args[4] if len(node.args) > 4 else 1
    return None if step in (None, 1) else f"slice with step {step}"


@_rule("aten.slice.Tensor", check=_slice_check)
def _slice(em: FxEmitter, node: fx.Node) -> Value:
    x = node.args[0]
    args = list(node.args) + [None] * 4
    dim = _dim(x, args[1] or 0, em.view)
    size = em.view.shape(x)[dim]
    start = 0 if args[2] is None else em.view.expr(args[2])
    end = size if args[3] is None else em.view.expr(args[3])
    if isinstance(end, int) and end >= 2**62:
        end = size
    if isinstance(start, int) and start < 0:
        start = size + start
    if isinstance(start, int) and isinstance(size, int):  # clamped into [0, size] as ATen does
        start = min(max(start, 0), size)
    if isinstance(end, int) and end < 0:
        end = size + end
    out_len = em.view.shape(node)[dim]
    if out_len == size and start == 0:
        return em.get(x)
    return em.emit1(L.Slice(dim, start, start + out_len), [em.get(x)])


@_rule("aten.select.int")
def _select(em: FxEmitter, node: fx.Node) -> Value:
    x, d, i = node.args
    dim = _dim(x, d, em.view)
    idx = em.view.expr(i)
    if isinstance(idx, int) and idx < 0:
        idx = em.view.shape(x)[dim] + idx
    s = em.emit1(L.Slice(dim, idx, idx + 1), [em.get(x)])
    return em.reshape(s, em.view.shape(node))


@_rule("aten.cat.default")
def _cat(em: FxEmitter, node: fx.Node) -> Value:
    parts = [p for p in node.args[0] if 0 not in raw_shape(p)]
    dim = node.args[1] if len(node.args) > 1 else 0
    if len(parts) == 1:
        return em.get(parts[0])
    return em.emit1(L.Concat(_dim(parts[0], dim, em.view)), [em.get(p) for p in parts])


@_rule("aten.split_with_sizes.default", "aten.split.Tensor")
def _split(em: FxEmitter, node: fx.Node) -> Value:
    x = node.args[0]
    dim = _dim(x, node.args[2] if len(node.args) > 2 else 0, em.view)
    outs, start = [], 0
    for piece in node.meta["val"]:
        n = em.view.expr(piece.shape[dim])
        outs.append(em.emit1(L.Slice(dim, start, start + n), [em.get(x)]))
        start = start + n
    return tuple(outs)


@_rule("getitem")
def _getitem(em: FxEmitter, node: fx.Node) -> Value:
    return em.get_multi(node.args[0])[node.args[1]]


def _expand_check(view: ProgramView, node: fx.Node) -> str | None:
    if strip(node) is not node:
        return None
    elementwise = set(_BINARY) | {"where"}
    full = raw_shape(node)
    for u in node.users:
        others = [a for a in tensor_args(u) if a is not node]
        if op_name(u) not in elementwise or not any(raw_shape(a) == full for a in others):
            return "expand feeding a non-elementwise op (no broadcast op in the layer graph)"
    return None


@_rule("aten.expand.default", check=_expand_check)
def _expand(em: FxEmitter, node: fx.Node) -> Value:
    # Every user broadcasts: the unexpanded value computes the same result.
    return em.get(node.args[0])


@_rule("aten.clone.default", "aten.alias.default", "aten.contiguous.default",
       "aten.lift_fresh_copy.default", "aten.detach.default")  # fmt: skip
def _identity(em: FxEmitter, node: fx.Node) -> Value:
    return em.get(node.args[0])


@_rule("aten._to_copy.default")
def _to_copy(em: FxEmitter, node: fx.Node) -> Value:
    return em.cast(em.get(node.args[0]), dtype_name(em.view.dtype(node)))


def _index_check(view: ProgramView, node: fx.Node) -> str | None:
    idx = [i for i in node.args[1] if i is not None]
    if len(idx) != 1 or view.rank(idx[0]) != 1:
        return "advanced indexing with several (or multi-dimensional) index tensors"
    dim = next(i for i, t in enumerate(node.args[1]) if t is not None)
    return _negative_const(view, node.args[0], dim, idx[0])


def _negative_const(view: ProgramView, x: fx.Node, dim: int, idx: fx.Node) -> str | None:
    """Why a constant index with negative entries along a leading dim of dynamic size cannot
    be translated (it could not be made ``index + size`` here), else None."""
    c = view.const(idx)
    size = sympy.sympify(view.shape(x)[dim])
    if c is None or not bool((c < 0).any()) or size.is_Integer or dim == view.rank(x) - 1:
        return None
    return (
        f"indexing dim {dim} of dynamic size {size} with negative constant indices "
        f"{c.flatten()[:4].tolist()}; make that dim static, or the indices non-negative "
        "(index + size)"
    )


def _gather(em: FxEmitter, x: fx.Node, dim: int, idx: fx.Node) -> str:
    """``Gather(dim)`` of ``x`` at ``idx``; a constant ``idx`` with negative entries (counting
    from the end) is first made ``index + size`` (the lowering addresses the rows of a leading
    dim with the index as it is)."""
    c = em.view.const(idx)
    size = sympy.sympify(em.view.shape(x)[dim])
    if c is not None and bool((c < 0).any()) and size.is_Integer:
        index = em.const(f"{idx.name}_wrapped", torch.where(c < 0, c + int(size), c))
    else:
        index = em.get(idx)
    return em.emit1(L.Gather(dim), [em.get(x), index])


@_rule("aten.index.Tensor", check=_index_check)
def _index(em: FxEmitter, node: fx.Node) -> Value:
    x, indices = node.args[0], node.args[1]
    dim = next(i for i, t in enumerate(indices) if t is not None)
    return _gather(em, x, dim, indices[dim])


def _index_select_check(view: ProgramView, node: fx.Node) -> str | None:
    x, d, idx = node.args
    return _negative_const(view, x, _dim(x, d, view), idx)


@_rule("aten.index_select.default", check=_index_select_check)
def _index_select(em: FxEmitter, node: fx.Node) -> Value:
    x, d, idx = node.args
    return _gather(em, x, _dim(x, d, em.view), idx)


@_rule("aten.embedding.default")
def _embedding(em: FxEmitter, node: fx.Node) -> Value:
    w, ids = node.args[0], node.args[1]
    n = math.prod(em.view.shape(ids)) if em.view.rank(ids) else 1
    flat = em.reshape(em.get(ids), (n,))
    rows = em.emit1(L.Gather(0), [em.get(w), flat])
    return em.reshape(rows, em.view.shape(node))


def _arange_check(view: ProgramView, node: fx.Node) -> str | None:
    args = list(node.args)
    if op_name(node) == "arange" and len(args) >= 3 and args[2] != 1:
        return "arange with a step other than 1"
    return None


@_rule("aten.arange.start_step", "aten.arange.start", "aten.arange.default", check=_arange_check)
def _arange(em: FxEmitter, node: fx.Node) -> Value:
    args = list(node.args)
    start, end = (0, args[0]) if len(args) == 1 else (args[0], args[1])
    out = em.emit1(L.Arange(em.view.expr(start), em.view.expr(end)), [])
    return em.cast(out, dtype_name(em.view.dtype(node)))


def _static_check(view: ProgramView, node: fx.Node) -> str | None:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape):
        return None
    return "a constant tensor of dynamic size"


@_rule("aten.scalar_tensor.default", "aten.full.default", "aten.zeros.default",
       "aten.ones.default", check=_static_check)  # fmt: skip
def _constant(em: FxEmitter, node: fx.Node) -> Value:
    value = node.target(*node.args, **node.kwargs)  # type: ignore[operator]
    return em.const(node.name, value)


# -- arithmetic ---------------------------------------------------------------------------------
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "maximum": "maximum",
           "rsub": "rsub"}  # fmt: skip
#: Layer-graph integer dtypes: a quotient keeps the dtype, truncated toward zero (ONNX ``Div``).
_INT_DTYPES = frozenset({"int64", "int32"})
_UNARY = {"neg": "neg", "exp": "exp", "sigmoid": "sigmoid", "relu": "relu", "rsqrt": "rsqrt",
          "sqrt": "sqrt", "silu": "silu", "reciprocal": "reciprocal", "erf": "erf",
          "tanh": "tanh"}  # fmt: skip


def _binary_check(view: ProgramView, node: fx.Node) -> str | None:
    if node.kwargs.get("rounding_mode") is not None:
        return f"division with rounding_mode={node.kwargs['rounding_mode']!r}"
    alpha = node.kwargs.get("alpha", 1)
    if not isinstance(alpha, (int, float)):
        return "symbolic alpha"
    for a in node.args[:2]:
        if is_node(a) and not is_tensor_node(a):
            return "arithmetic with a symbolic scalar"
    divisor = node.args[1]
    if (
        op_name(node) == "div"
        and isinstance(divisor, (int, float))
        and divisor == 0
        and view.dtype(node) in (torch.int64, torch.int32)
    ):
        return "integer division by the constant 0 (undefined); remove the division"
    return None


def _int_div(em: FxEmitter, x: str, s: float, reverse: bool) -> str:
    """``x / s`` (``s / x`` when ``reverse``) of an integer ``x`` truncated toward zero (ONNX
    ``Div`` of integers): a division by a one-element constant of ``x``'s dtype.  Multiplying by
    ``1/s`` instead is not exact (``49 * (1/49)`` is just below 1 and truncates to 0)."""
    dtype = em.type(x).dtype
    c = em.const(f"div_{dtype}", torch.tensor([s]).to(torch_dtype(dtype)))
    return em.emit1(L.Elementwise("div"), [c, x] if reverse else [x, c])


def _scalar_op(em: FxEmitter, fn: str, x: str, s: float, reverse: bool) -> str:
    if fn == "div" and em.type(x).dtype in _INT_DTYPES:
        return _int_div(em, x, s, reverse)
    if fn == "add":
        return em.emit1(L.Elementwise("add_scalar", s), [x])
    if fn == "mul":
        return em.emit1(L.Elementwise("mul_scalar", s), [x])
    if fn == "sub" and not reverse:
        return em.emit1(L.Elementwise("add_scalar", -s), [x])
    if fn == "sub":  # s - x
        return em.emit1(L.Elementwise("add_scalar", s), [em.emit1(L.Elementwise("neg"), [x])])
    if fn == "div" and not reverse:  # x / 0.0 is x * inf (+-inf, nan for 0), as IEEE divides
        return em.emit1(
            L.Elementwise("mul_scalar", 1.0 / s if s else math.copysign(math.inf, s)), [x]
        )
    if fn == "div":  # s / x
        return em.emit1(
            L.Elementwise("mul_scalar", s), [em.emit1(L.Elementwise("reciprocal"), [x])]
        )
    raise AssertionError(fn)


@_rule(*[f"aten.{o}.{v}" for o in ("add", "sub", "mul", "div") for v in ("Tensor", "Scalar")],
       "aten.rsub.Scalar", "aten.rsub.Tensor", "aten.maximum.default", check=_binary_check)  # fmt: skip
def _binary(em: FxEmitter, node: fx.Node) -> Value:
    fn = op_name(node)
    a, b = node.args[0], node.args[1]
    if fn == "rsub":
        fn, a, b = "sub", b, a
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1:
        if is_node(b):
            b_val = em.emit1(L.Elementwise("mul_scalar", float(alpha)), [em.get(b)])
            b = _Named(b_val)
        else:
            b = b * alpha
    ta, tb = is_node(a) or isinstance(a, _Named), is_node(b) or isinstance(b, _Named)
    out = dtype_name(em.view.dtype(node)) if fn == "div" else None
    if ta and tb:
        return em.emit1(
            L.Elementwise(fn), [_div_in(em, _get(em, a), out), _div_in(em, _get(em, b), out)]
        )
    if ta:
        return _scalar_op(em, fn, _div_in(em, _get(em, a), out), float(b), reverse=False)
    return _scalar_op(em, fn, _div_in(em, _get(em, b), out), float(a), reverse=True)


def _div_in(em: FxEmitter, x: str, out: str | None) -> str:
    """An operand of a division whose result is ``out``: an integer operand of a true
    division (PyTorch's ``int / c`` is a float) in the result's dtype, so it is not divided as
    an integer (ONNX ``Div`` of integers, which truncates, keeps an integer result)."""
    if out is None or out in _INT_DTYPES or em.type(x).dtype not in _INT_DTYPES:
        return x
    return em.cast(x, out)


class _Named:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _get(em: FxEmitter, x: Any) -> str:
    return x.name if isinstance(x, _Named) else em.get(x)


#: ``gelu``'s ``approximate`` argument -> the layer graph's elementwise function: the exact
#: (erf) form and the tanh approximation (also ONNX ``Gelu``'s ``approximate`` attribute)
_GELU = {"none": "gelu", "tanh": "gelu_tanh"}


def gelu_approximate(node: Any) -> Any:
    """The ``approximate`` argument of a ``gelu`` node (``"none"`` when absent)."""
    a = node.kwargs.get("approximate", "none")
    return a.decode() if isinstance(a, bytes) else a


def gelu_fn(node: Any) -> str | None:
    """The layer graph's elementwise function a ``gelu`` node computes (``gelu`` or
    ``gelu_tanh``), or None for an ``approximate`` it has no function for."""
    return _GELU.get(gelu_approximate(node))


def _unary_check(view: ProgramView, node: fx.Node) -> str | None:
    if op_name(node) == "gelu" and gelu_fn(node) is None:
        return (
            f"gelu with approximate={gelu_approximate(node)!r} (the layer graph has the exact "
            "form 'none' and the tanh approximation 'tanh'); use one of those"
        )
    return None


@_rule(*[f"aten.{o}.default" for o in (*_UNARY, "gelu")], check=_unary_check)
def _unary(em: FxEmitter, node: fx.Node) -> Value:
    name = op_name(node)
    fn = gelu_fn(node) if name == "gelu" else name
    return em.emit1(L.Elementwise(fn), [em.get(node.args[0])])


def _pow_check(view: ProgramView, node: fx.Node) -> str | None:
    base, exponent = node.args[0], node.args[1]
    if not is_node(base) or not isinstance(exponent, (int, float)):
        return (
            "power with a tensor exponent (the layer graph has only x ** c for a constant "
            "scalar c); make the exponent a constant scalar"
        )
    return None


@_rule("aten.pow.Tensor_Scalar", check=_pow_check)
def _pow(em: FxEmitter, node: fx.Node) -> Value:
    e = float(node.args[1])
    x = em.get(node.args[0])
    if e == 2.0:
        return em.emit1(L.Elementwise("square"), [x])
    if e == 0.5:
        return em.emit1(L.Elementwise("sqrt"), [x])
    return em.emit1(L.Elementwise("pow_scalar", e), [x])


def _where_check(view: ProgramView, node: fx.Node) -> str | None:
    if not all(is_node(a) for a in node.args[:3]):
        return "where with a Python scalar branch"
    return None


@_rule("aten.where.self", check=_where_check)
def _where(em: FxEmitter, node: fx.Node) -> Value:
    return em.emit1(L.Elementwise("where"), [em.get(a) for a in node.args[:3]])


@_rule("aten._softmax.default", "aten.softmax.int")
def _softmax(em: FxEmitter, node: fx.Node) -> Value:
    x = node.args[0]
    out = em.emit1(L.Softmax(_dim(x, node.args[1], em.view)), [em.get(x)])
    return em.cast(out, dtype_name(em.view.dtype(node)))


#: reductions that return the one value of an axis of size 1 unchanged
_UNIT_REDUCES = frozenset({"sum", "mean", "max", "min", "amax", "amin"})


def _reduce(fn: str) -> Rule:
    def rule(em: FxEmitter, node: fx.Node) -> Value:
        x = node.args[0]
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else None
        rank = em.view.rank(x)
        axes = tuple(range(rank)) if not dims else tuple(d % rank for d in dims)
        keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        shape = em.view.shape(x)
        if fn in _UNIT_REDUCES and all(str(shape[a]) == "1" for a in axes):
            # over axes of size 1 (a top-1 router's k axis) the reduction is the value itself
            out = em.reshape(em.get(x), em.view.shape(node))
        else:
            out = em.emit1(L.Reduce(fn, axes, keep), [em.get(x)])
        return em.cast(out, dtype_name(em.view.dtype(node)))

    return rule


_rule("aten.sum.dim_IntList")(_reduce("sum"))
_rule("aten.mean.dim")(_reduce("mean"))
_rule("aten.amax.default")(_reduce("max"))


# -- matrix products ----------------------------------------------------------------------------
@_rule("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def _matmul(em: FxEmitter, node: fx.Node) -> Value:
    """``a @ b``; a 1-D operand (numpy semantics) is a ``[1, K]`` row on the left or a
    ``[K, 1]`` column on the right, whose axis is then dropped from the product."""
    a, b = node.args[0], node.args[1]
    left, right = em.view.rank(a) == 1, em.view.rank(b) == 1
    xa, xb = em.get(a), em.get(b)
    if left:
        xa = em.reshape(xa, (1, *em.type(xa).shape))
    if right:
        xb = em.reshape(xb, (*em.type(xb).shape, 1))
    out = em.emit1(L.MatMul(), [xa, xb])
    if not (left or right):
        return out
    shape = list(em.type(out).shape)
    drop = {len(shape) - 2} if left else set()
    drop |= {len(shape) - 1} if right else set()
    return em.reshape(out, tuple(d for i, d in enumerate(shape) if i not in drop))


def _addmm_check(view: ProgramView, node: fx.Node) -> str | None:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "addmm with beta/alpha other than 1"
    return None


@_rule("aten.addmm.default", check=_addmm_check)
def _addmm(em: FxEmitter, node: fx.Node) -> Value:
    b, x, w = node.args[:3]
    mm = em.emit1(L.MatMul(), [em.get(x), em.get(w)])
    return em.emit1(L.Elementwise("add"), [mm, em.get(b)])


# -- graph inputs -------------------------------------------------------------------------------
@_rule("placeholder")
def _placeholder(em: FxEmitter, node: fx.Node) -> Value:
    return em.get(node)


#: short ATen name -> rule key (one overload per name serves the common view's nodes)
_SHORT = {k.split(".")[1]: k for k in reversed(list(RULES)) if k.startswith("aten.")}
