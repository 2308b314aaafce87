"""Raising patterns for the small layers: ``linear`` (``permute + mm`` / ``addmm``, with the
views that flatten and restore leading dims; or ``matmul(x, W)`` with a constant 2-D ``W`` =
``weight.T`` and an optional constant bias ``add``, as ONNX exports store it), ``rmsnorm``
(``pow/mean/add/rsqrt/mul``, also Qwen3's per-head q/k norm; ``rmsnorm_fused``: the fused ONNX
op), ``layernorm`` (ATen ``native_layer_norm`` / ONNX ``LayerNormalization`` over the last dim)
and ``topk_routing`` (router softmax + topk (+ renormalise))."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import fx

from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Cap, Match, NoMatch, P, Pattern, match
from torch2step.frontend.fx_view import ProgramView, is_node, op_name, strip, strip_casts
from torch2step.frontend.gnode import same_dim
from torch2step.layers import ops as L
from torch2step.layers.graph import dtype_name

__all__ = ["LAYERNORM", "LINEAR", "RMSNORM", "RMSNORM_OP", "TOPK_ROUTING", "linear_parts"]

_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})


def _transposed_weight(node: fx.Node) -> fx.Node | None:
    """``w`` when ``node`` is ``w.T`` of a 2-D ``w`` (``permute [1, 0]``, ``t``, ``transpose``)."""
    n = strip(node)
    if not isinstance(n, fx.Node):
        return None
    name = op_name(n)
    if name == "permute" and list(n.args[1]) == [1, 0]:
        return n.args[0]
    if name == "t" or (name == "transpose" and sorted(d % 2 for d in n.args[1:3]) == [0, 1]):
        return n.args[0]
    return None


def linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """``(x, w, bias)`` when ``node`` computes ``x @ w.T (+ bias)`` with one ``mm``/``addmm``."""
    name = op_name(node)
    if name == "mm":
        x, wt = node.args[:2]
        bias = None
    elif name == "addmm":
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        bias, x, wt = node.args[:3]
    else:
        return None
    w = _transposed_weight(wt)
    if w is None:
        return None
    return x, w, bias


def _match_linear(view: ProgramView, node: fx.Node) -> Match | None:
    root = node
    if op_name(node) in _VIEWS:
        inner = strip(node.args[0])
        parts = linear_parts(inner) if isinstance(inner, fx.Node) else None
        if parts is None:
            return None
        flat = strip(parts[0])
        if not isinstance(flat, fx.Node) or op_name(flat) not in _VIEWS:
            return None
        x = flat.args[0]
        xs, out, w_out = view.shape(x), view.shape(node), view.shape(parts[1])[0]
        if len(out) != len(xs) or not all(same_dim(a, b) for a, b in zip(out[:-1], xs[:-1])):
            return None
        if not same_dim(out[-1], w_out):
            return None
        _, w, bias = parts
    elif op_name(node) in ("matmul", "add"):
        return _match_weight_matmul(view, node)
    else:
        parts = linear_parts(node)
        if parts is None:
            return None
        x, w, bias = parts
    if bias is not None and view.rank(bias) != 1:
        return None
    inputs = (x, w) if bias is None else (x, w, bias)

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(root)
        return [em.emit1(L.Linear(), [em.get(i) for i in inputs])]

    return Match("linear", (root,), inputs, emit)


_WEIGHT_MATMUL = P("matmul", Cap("x"), Cap("w"), name="mm")
_BIASED_MATMUL = P("add", _WEIGHT_MATMUL, Cap("b"))


def _match_weight_matmul(view: ProgramView, root: fx.Node) -> Match | None:
    """``x @ W (+ b)`` of a run-time ``x``, a constant 2-D ``W`` and a constant vector ``b``:
    Linear with weight ``W.T`` (one parameter however many products read ``W``), named after the
    exporter's module when it records one."""
    c = match(_BIASED_MATMUL if op_name(root) == "add" else _WEIGHT_MATMUL, root)
    if c is None:
        return None
    mm, x, w, b = c["mm"], c["x"], view.const(c["w"]), view.const(c.get("b"))
    if w is None or w.dim() != 2 or view.const(x) is not None:
        return None
    if "b" in c and (len(mm.users) != 1 or b is None or b.dim() > 1 or b.numel() != w.shape[1]):
        return None
    base = getattr(mm.meta.get("onnx"), "module", None) or c["w"].name

    def emit(em: FxEmitter) -> Sequence[str]:
        key = ("linear weight", c["w"].name)
        if key not in em.memo:
            em.memo[key] = em.const(f"{base}.weight", w.T)
        ins = [em.get(x), em.memo[key]]
        if b is not None:
            ins.append(em.const(f"{base}.bias", b.reshape(-1)))
        em.at(mm)
        return [em.emit1(L.Linear(), ins, root.name)]

    return Match("linear", (root,), (x,), emit)


LINEAR = Pattern(
    "linear",
    frozenset({"mm", "addmm", "matmul", "add", *_VIEWS}),
    _match_linear,
    "x @ w.T (+ b) as permute+mm / addmm, with the views flattening leading dims -> Linear",
)


_MEAN_SQ = [
    P("add", P("mean", P(op, *src, casts=True), Cap("dims"), True, casts=True), Cap("eps"))
    for op, src in (("pow", (Cap("x"), 2)), ("mul", (Cap("x"), Cap("x"))), ("square", (Cap("x"),)))
]
#: x / rms(x) as ATen (``x * rsqrt(ms)``) and ONNX exporters (``x * Reciprocal(Sqrt(ms))``,
#: ``x / Sqrt(ms)``) write it
_NORMED = [
    form
    for ms in _MEAN_SQ
    for form in (
        P("mul", Cap("x"), P("rsqrt", ms), casts=True),
        P("mul", Cap("x"), P("reciprocal", P("sqrt", ms)), casts=True),
        P("mul", Cap("x"), P("div", 1.0, P("sqrt", ms)), casts=True),
        P("div", Cap("x"), P("sqrt", ms), casts=True),
    )
]
_RMS = [P("mul", Cap("w"), normed) for normed in _NORMED]


def _match_rmsnorm(view: ProgramView, node: fx.Node) -> Match | None:
    caps = next((c for c in (match(p, node) for p in _RMS) if c is not None), None)
    if caps is None:
        return None
    x, w, eps, dims = caps["x"], caps["w"], caps["eps"], caps["dims"]
    if not is_node(x) or not is_node(w) or is_node(eps):
        return None
    rank = view.rank(x)
    if list(dims) not in ([-1], [rank - 1]) or view.rank(w) != 1:
        return None
    if not same_dim(view.shape(w)[0], view.shape(x)[-1]):
        return None
    src = strip_casts(x)

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(node)
        out = em.emit1(L.RMSNorm(float(eps)), [em.get(src), em.get(w)])
        return [em.cast(out, dtype_name(view.dtype(node)))]

    return Match("rmsnorm", (node,), (src, w), emit, {"eps": float(eps)})


RMSNORM = Pattern(
    "rmsnorm",
    frozenset({"mul"}),
    _match_rmsnorm,
    "w * (x * rsqrt(mean(x^2, -1) + eps)) (fp32 inside; also x / sqrt(..)) -> RMSNorm",
)


def _match_rmsnorm_op(view: ProgramView, node: fx.Node) -> Match | None:
    x, w = node.args[:2]
    if node.kwargs.get("axis", -1) not in (-1, view.rank(x) - 1):
        raise NoMatch("RMS normalisation over axes other than the last has no layer op")
    items = _getitems(node)
    if any(i > 0 and u.users for i, u in items.items()):
        raise NoMatch("its inverse-std output is used; RMSNorm yields only the result")
    eps = float(str(np.float32(node.kwargs.get("epsilon", 1e-5))))

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(node)
        return [em.emit1(L.RMSNorm(eps), [em.get(x), em.get(w)])]

    return Match("rmsnorm_fused", (items.get(0, node),), (x, w), emit, {"eps": eps})


RMSNORM_OP = Pattern(
    "rmsnorm_fused",
    frozenset({"RMSNormalization", "SimplifiedLayerNormalization"}),
    _match_rmsnorm_op,
    "the fused RMSNormalization (ONNX opset 23) / SimplifiedLayerNormalization op -> RMSNorm",
)


def _match_layernorm(view: ProgramView, node: fx.Node) -> Match | None:
    """ATen ``native_layer_norm(x, shape, w, b, eps)`` / ``layer_norm(...)`` and ONNX
    ``LayerNormalization(x, scale[, b], axis, epsilon)`` over the last dimension."""
    x = node.args[0]
    rank = view.rank(x)
    rest = list(node.args[1:]) + [None] * 4
    if op_name(node) == "LayerNormalization":
        w, b = rest[0], rest[1]
        axis = node.kwargs.get("axis", -1)
        if axis not in (-1, rank - 1):
            raise NoMatch(
                f"LayerNormalization over axes {axis}.. of a rank-{rank} input: only over the "
                "last axis (axis=-1) is a layer op; normalise the last axis only"
            )
        eps = float(str(np.float32(node.kwargs.get("epsilon", 1e-5))))
    else:
        shape, w, b, eps = rest[0], rest[1], rest[2], rest[3]
        shape = list(shape) if isinstance(shape, (list, tuple)) else [shape]
        if len(shape) != 1 or not same_dim(view.expr(shape[0]), view.shape(x)[-1]):
            raise NoMatch(
                f"layer_norm over the last {len(shape)} dims (normalized_shape {shape}): only "
                "over the last dimension is a layer op; normalise the last dim only (reshape the "
                "normalised dims into one first)"
            )
        eps = 1e-5 if eps is None else float(eps)
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and (not is_node(t) or view.rank(t) != 1):
            raise NoMatch(f"its {name} is not a 1-D tensor of the normalised dim")
    items = _getitems(node)
    if any(i > 0 and u.users for i, u in items.items()):
        raise NoMatch("its mean or inverse-std output is used; LayerNorm yields only the result")
    op = L.LayerNorm(eps, w is not None, b is not None)
    params = [t for t in (w, b) if t is not None]

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(node)
        return [em.emit1(op, [em.get(x), *(em.get(t) for t in params)])]

    root = items.get(0, node)
    return Match("layernorm", (root,), (x, *params), emit, {"eps": eps})


LAYERNORM = Pattern(
    "layernorm",
    frozenset({"native_layer_norm", "layer_norm", "LayerNormalization"}),
    _match_layernorm,
    "native_layer_norm / layer_norm / ONNX LayerNormalization over the last dim -> LayerNorm",
)


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if op_name(u) == "getitem"}


def _renormalised(values: fx.Node) -> fx.Node | None:
    """The ``div(v, sum(v, -1, keepdim))`` consuming ``values``, if that is all it feeds."""
    users = list(values.users)
    sums = [u for u in users if op_name(u) == "sum" and list(u.args[1]) in ([-1], [1])]
    for s in sums:
        divs = [d for d in s.users if op_name(d) == "div" and strip(d.args[0]) is values]
        if divs and set(users) <= {s, *divs}:
            return divs[0]
    return None


def _match_topk(view: ProgramView, node: fx.Node) -> Match | None:
    args = list(node.args) + [None] * 4
    scores, k, dim, largest = args[0], args[1], args[2], args[3]
    if largest is False or dim not in (None, -1, view.rank(scores) - 1):
        return None
    items = _getitems(node)
    if 0 not in items:
        return None
    s = strip_casts(scores)
    weights: fx.Node = items[0]
    if op_name(s) in ("_softmax", "softmax") and s.args[1] in (-1, view.rank(s) - 1):
        logits, softmax_first = s.args[0], True
    else:
        sm = [u for u in weights.users if op_name(strip_casts(u)) in ("_softmax", "softmax")]
        if len(sm) != 1 or len(weights.users) != 1 or sm[0].args[1] not in (-1, 1):
            return None
        logits, softmax_first, weights = scores, False, sm[0]
    div = _renormalised(weights)
    normalize = div is not None
    if div is not None:
        weights = div
    logits = strip_casts(logits)
    if view.rank(logits) != 2:
        raise NoMatch(f"router logits must be [tokens, experts], got rank {view.rank(logits)}")
    roots = (weights, items[1]) if 1 in items else (weights,)
    op = L.TopKRouting(int(k), softmax_first, normalize)

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(node)
        w, e = em.emit(op, [em.get(logits)])
        w = em.cast(w, dtype_name(view.dtype(roots[0])))
        return [w, e][: len(roots)]

    return Match("topk_routing", roots, (logits,), emit, {"k": int(k), "router": op})


TOPK_ROUTING = Pattern(
    "topk_routing",
    frozenset({"topk"}),
    _match_topk,
    "router softmax -> topk (-> w / w.sum(-1)) or topk -> softmax -> TopKRouting",
)
