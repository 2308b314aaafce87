"""What every spelling of a routed MoE block shares: the expert body, its weights, and the
check that a recognised region computes :class:`~torch2step.layers.ops.MoEExperts`.

An expert body is gated, ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU, ReGLU), or a plain
two-matrix MLP ``down(act(up(x)))``, ``act`` one of SiLU, GELU (exact or tanh-approximate),
ReLU — named, or written out elementwise and recognised by running it — each projection with or
without a bias (``addmm`` or ``mm + b``); each projection is spelled by the MoE variant
(``mm`` with one expert's weight in a loop, ``bmm`` with weights gathered per token in HF's
``batched_mm``, ``grouped_mm`` over tokens sorted by expert in HF's ``grouped_mm``) and gate/up
may be one fused projection split in two.  The body extractor takes the projection spelling as a
function and returns the weights in the layer op's layout (``w_gate``/``w_up`` ``[E, I, H]``,
``w_down`` ``[E, H, I]``).

A region found by its anchors is then *run* (``view.run``, on either frontend's graph) on
random tokens, routing weights and expert choices (one probe leaves an expert without tokens) and
compared with the op's definition: the MoE is raised by what it computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Match, NoMatch
from torch2step.frontend.fx_probe import sample_tensor
from torch2step.frontend.fx_view import (
    ProgramView,
    is_node,
    op_name,
    raw_shape,
    strip,
    strip_casts,
)
from torch2step.frontend.raise_rules import gelu_fn
from torch2step.layers import ops as L
from torch2step.layers.evaluate import ACTIVATIONS, EVALUATORS
from torch2step.layers.graph import dtype_name

__all__ = [
    "Proj",
    "ProjFn",
    "ExpertBody",
    "MoESpec",
    "activation",
    "describe_ops",
    "expert_tensors",
    "with_bias",
    "expert_body",
    "moe_match",
    "weight_base",
    "weight_sources",
]

#: ``proj(view, node) -> Proj | None``: one projection of the expert body in a given spelling.
ProjFn = Callable[[ProgramView, fx.Node], "Proj | None"]


@dataclass(frozen=True, slots=True)
class Proj:
    """``out = x @ weight[..., out, in]^T (+ bias[..., out])``; ``key`` is the spelling's
    routing node (expert ids gathered per row, or group offsets) and ``source`` the FX node
    holding the weight."""

    x: fx.Node
    weight: torch.Tensor
    key: Any
    source: fx.Node
    bias: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ExpertBody:
    x: fx.Node
    activation: str
    gate: torch.Tensor | None
    up: torch.Tensor
    down: torch.Tensor
    keys: tuple[Any, ...]
    sources: tuple[fx.Node, ...]
    biases: tuple[torch.Tensor | None, ...] = (None, None, None)

    @property
    def gated(self) -> bool:
        return self.gate is not None


#: ops an activation written out elementwise may use (``gelu_new``'s tanh formula, ``x *
#: sigmoid(x)``, ``x / (1 + exp(-x))``...): followed back to the one tensor they act on
_POINTWISE = frozenset(
    {"add", "sub", "rsub", "mul", "div", "pow", "neg", "exp", "tanh", "erf", "sigmoid", "sqrt",
     "rsqrt", "reciprocal", "square", "relu", "silu", "gelu", "maximum", "clamp", "clamp_min",
     "_to_copy", "to", "type_as"}
)  # fmt: skip
_MAX_POINTWISE = 32


def activation(node: Any, view: ProgramView | None = None) -> tuple[str, fx.Node] | None:
    """``(name, g)`` when ``node`` is ``act(g)``, ``name`` one of
    :data:`~torch2step.layers.evaluate.ACTIVATIONS`: ``silu/relu(g)``, ``gelu(g)`` (``gelu`` or,
    ``approximate="tanh"``, ``gelu_tanh``), ``g * sigmoid(g)`` (silu), or — given the ``view``
    — elementwise operations on one tensor ``g`` that compute one of them on sample values
    (HF's ``gelu_new``: ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``)."""
    n = strip_casts(node)
    if not is_node(n):
        return None
    name = op_name(n)
    if name in ("silu", "relu"):
        return name, strip_casts(n.args[0])
    if name == "gelu":
        fn = gelu_fn(n)
        return None if fn is None else (fn, strip_casts(n.args[0]))
    if name == "mul":
        a, b = (strip_casts(x) for x in n.args[:2])
        for g, s in ((a, b), (b, a)):
            if op_name(s) == "sigmoid" and strip_casts(s.args[0]) is g:
                return "silu", g
    return None if view is None else _pointwise_activation(view, n)


def _pointwise_activation(view: ProgramView, n: fx.Node) -> tuple[str, fx.Node] | None:
    """The activation the elementwise operations ending at ``n`` compute, by running them on
    sample values, when they read one non-constant tensor (see :func:`activation`)."""
    if op_name(n) not in _POINTWISE:
        return None
    leaves: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    todo = [n]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if len(seen) > _MAX_POINTWISE:
            return None
        for a in (*m.args, *m.kwargs.values()):
            if not is_node(a):
                continue
            if op_name(a) in _POINTWISE and a is not n:
                todo.append(a)
            elif view.const(a) is None:
                leaves.add(a)
    if len(leaves) != 1:
        return None
    (g,) = leaves
    sample = torch.linspace(-5.0, 5.0, 101)
    dtype = view.dtype(g)
    if not dtype.is_floating_point:
        return None
    try:
        (y,) = view.run([n], {g: sample.to(dtype)})
    except Exception:  # noqa: BLE001 - a failing probe means "not an activation"
        return None
    if not isinstance(y, torch.Tensor) or y.shape != sample.shape:
        return None
    want = {a: f(sample) for a, f in ACTIVATIONS.items()}
    err = {a: (y.float() - w).abs().max().item() for a, w in want.items()}
    best = min(err, key=err.__getitem__)
    return (best, strip_casts(g)) if err[best] <= 1e-4 else None


def _rows(view: ProgramView, node: fx.Node, proj: ProjFn) -> Proj | None:
    """A projection, or rows ``[a, b)`` of its output (fused gate/up split in two)."""
    n = strip_casts(node)
    if op_name(n) == "getitem" and op_name(n.args[0]) in ("split_with_sizes", "split"):
        split = n.args[0]
        dim = split.args[2] if len(split.args) > 2 else 0
        if dim not in (-1, view.rank(split.args[0]) - 1):
            return None
        sizes = split.args[1]  # split_with_sizes; split(x, size) says it in its value's shapes
        if not isinstance(sizes, (list, tuple)):
            if not isinstance(split.meta.get("val"), (list, tuple)):
                return None
            sizes = [int(t.shape[-1]) for t in split.meta["val"]]
        start = sum(sizes[: n.args[1]])
        lo, hi = start, start + sizes[n.args[1]]
        base = proj(view, split.args[0])
    elif op_name(n) == "slice" and n.args[1] in (-1, view.rank(n) - 1):
        lo, hi = n.args[2], n.args[3]
        base = proj(view, n.args[0])
    else:
        return proj(view, n)
    if base is None or not isinstance(lo, int) or not isinstance(hi, int):
        return None
    hi = min(hi, base.weight.shape[-2])
    bias = None if base.bias is None else base.bias[..., lo:hi]
    return Proj(base.x, base.weight[..., lo:hi, :], base.key, base.source, bias)


def with_bias(view: ProgramView, node: fx.Node, proj: ProjFn) -> Proj | None:
    """``proj`` at ``node``, or at ``p`` when ``node`` is ``p + b`` with a constant bias ``b``
    (a broadcast row per output feature)."""
    n = strip_casts(node)
    if op_name(n) == "add" and len(n.args) >= 2 and n.kwargs.get("alpha", 1) == 1:
        for p, b in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            bias = view.const(b) if is_node(b) else None
            if bias is None or not is_node(p):
                continue
            base = proj(view, p)
            if base is None or base.bias is not None:
                continue
            out = base.weight.shape[-2]
            if bias.shape[-1:] != (out,) or bias.numel() != out:
                continue
            return Proj(base.x, base.weight, base.key, base.source, bias.reshape(out))
    return proj(view, n)


def expert_body(view: ProgramView, y: fx.Node, proj: ProjFn) -> ExpertBody | None:
    """``down(act(gate(x)) * up(x))`` or ``down(act(up(x)))`` ending at ``y``, each projection
    spelled by ``proj`` and optionally followed by a bias."""

    def pj(v: ProgramView, n: fx.Node) -> Proj | None:
        return with_bias(v, n, proj)

    down = pj(view, y)
    if down is None:
        return None
    h = strip_casts(down.x)
    if op_name(h) == "mul":
        a, b = h.args[:2]
        for act_side, up_side in ((a, b), (b, a)):
            act = activation(act_side, view)
            if act is None:
                continue
            gate, up = _rows(view, act[1], pj), _rows(view, up_side, pj)
            if gate is None or up is None or strip(gate.x) is not strip(up.x):
                continue
            return ExpertBody(
                strip(gate.x),
                act[0],
                gate.weight,
                up.weight,
                down.weight,
                (gate.key, up.key, down.key),
                (gate.source, up.source, down.source),
                (gate.bias, up.bias, down.bias),
            )
    act = activation(h, view)
    if act is None:
        return None
    up = _rows(view, act[1], pj)
    if up is None:
        return None
    return ExpertBody(
        strip(up.x),
        act[0],
        None,
        up.weight,
        down.weight,
        (up.key, down.key),
        (up.source, down.source),
        (None, up.bias, down.bias),
    )


def describe_ops(view: ProgramView, nodes: set[Any], limit: int = 12) -> str:
    """The operators of ``nodes`` in graph order (views and sizes left out), for an error naming
    what an unrecognised expert computes."""
    skip = {"getitem", "_to_copy", "clone", "alias", "select", "slice", "squeeze", "unsqueeze",
            "view", "_unsafe_view", "expand", "nonzero", "sym_size", "permute", "t", "eq",
            "Equal", "Squeeze", "Unsqueeze", "Reshape", "Cast", "Identity", "NonZero",
            "Transpose", "Shape"}  # fmt: skip
    names = [op_name(n) for n in sorted(nodes, key=view.index.__getitem__)]
    names = [n for n in names if n not in skip]
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A recognised MoE region: tokens ``x[T, H]``, routing ``weights[T, k]`` and ``ids[T, k]``
    and the experts' tensors by role (``w_gate``, ``w_up``, ``w_down``, ``b_*``) in
    :class:`~torch2step.layers.ops.MoEExperts` layout."""

    x: fx.Node
    weights: fx.Node
    ids: fx.Node
    tensors: dict[str, torch.Tensor]
    activation: str
    sources: tuple[fx.Node, ...]

    @property
    def gated(self) -> bool:
        return "w_gate" in self.tensors

    @property
    def bias(self) -> bool:
        return "b_up" in self.tensors


def expert_tensors(bodies: Sequence[ExpertBody]) -> dict[str, torch.Tensor]:
    """The experts' tensors by role, stacked over the experts when the bodies are per expert
    (2-D weights) and as they are when one body holds every expert (3-D weights)."""
    gated = {b.gated for b in bodies}
    biased = {tuple(x is not None for x in b.biases[1:]) for b in bodies}
    if len(gated) != 1 or len(biased) != 1:
        raise NoMatch(
            "experts must all have the same form; these mix gated and plain MLPs or "
            "projections with and without biases"
        )
    (g,) = gated
    (bb,) = biased
    if bb not in ((False, False), (True, True)) or (
        g and any((b.biases[0] is None) != (b.biases[1] is None) for b in bodies)
    ):
        raise NoMatch(
            "experts must have biases on every projection or on none; these have them on "
            "some projections only"
        )
    parts: dict[str, list[torch.Tensor]] = {}
    for b in bodies:
        for role, t in (("w_gate", b.gate), ("w_up", b.up), ("w_down", b.down),
                        ("b_gate", b.biases[0]), ("b_up", b.biases[1]), ("b_down", b.biases[2])):  # fmt: skip
            if t is not None:
                parts.setdefault(role, []).append(t)
    if len(bodies) == 1:
        return {r: ts[0] for r, ts in parts.items()}
    return {r: torch.stack(ts) for r, ts in parts.items()}


def weight_sources(view: ProgramView, nodes: Sequence[fx.Node]) -> tuple[fx.Node, ...]:
    """The weight placeholders (parameters, buffers) the ``nodes`` are computed from."""
    found: list[fx.Node] = []
    stack, seen = list(nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if view.weight_name(n) is not None:
            found.append(n)
        fx.node.map_arg((n.args, n.kwargs), stack.append)
    return tuple(sorted(found, key=view.index.__getitem__))


def weight_base(view: ProgramView, placeholders: Sequence[fx.Node]) -> str:
    """The common module path of the weights (``"experts"``), for naming the raised weights."""
    names = [view.weight_name(n) or "" for n in placeholders]
    if not names:
        return "experts"
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or "experts"


def _routing_sample(
    t: int, k: int, e: int, exclude_last: bool, gen: torch.Generator
) -> torch.Tensor:
    pool = e - 1 if exclude_last and e - 1 >= k else e
    return torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(t)])


def _verify(view: ProgramView, root: fx.Node, spec: MoESpec, op: L.MoEExperts) -> None:
    gen = torch.Generator().manual_seed(0)
    t, k = (view.concrete(d) for d in raw_shape(spec.ids))
    tol = 1e-4 if view.dtype(spec.x) == torch.float32 else 3e-2
    tensors = [spec.tensors[r] for r in op.roles()[3:]]
    for trial in range(2):
        x = sample_tensor(view, spec.x, view.hints, gen)
        w = torch.rand(t, k, generator=gen).to(view.dtype(spec.weights))
        ids = _routing_sample(t, k, op.num_experts, trial == 0, gen).to(view.dtype(spec.ids))
        (got,) = view.run([root], {spec.x: x, spec.weights: w, spec.ids: ids})
        ref = EVALUATORS[L.MoEExperts](op, [x, w, ids.long(), *tensors])[0]
        got = torch.as_tensor(got)
        if got.shape != ref.shape or not torch.allclose(
            got.float(), ref.float(), rtol=tol, atol=tol
        ):
            raise NoMatch(
                "the region has the anchors of a routed MoE but does not compute "
                "sum_j w[t, j] * expert(x[t]) of the chosen experts"
            )


def _weight(em: FxEmitter, spec: MoESpec, role: str, value: torch.Tensor) -> str:
    """The module's own parameter when it already has the layer op's layout, else a new one."""
    for p in spec.sources:
        w = em.view.weight_value(p)
        if w.is_meta or value.is_meta:  # no values to compare: a new (shape-only) weight
            break
        if w.shape == value.shape and w.dtype == value.dtype and torch.equal(w, value):
            return em.get(p)
    return em.const(f"{weight_base(em.view, spec.sources)}.{role}", value)


def moe_match(view: ProgramView, root: fx.Node, name: str, spec: MoESpec) -> Match:
    """Check ``spec`` by running the region and build the match emitting one MoEExperts."""
    t = spec.tensors
    e, i, h = t["w_up"].shape
    want = {"w_gate": (e, i, h), "w_up": (e, i, h), "w_down": (e, h, i), "b_gate": (e, i),
            "b_up": (e, i), "b_down": (e, h)}  # fmt: skip
    bad = {r: tuple(v.shape) for r, v in t.items() if tuple(v.shape) != want[r]}
    if bad:
        raise NoMatch(
            f"expert tensors {bad} are not gate/up [E, I, H], down [E, H, I] and biases "
            "[E, I] / [E, H]"
        )
    k = raw_shape(spec.ids)[-1]
    if not isinstance(k, int) or view.rank(spec.ids) != 2 or view.rank(spec.x) != 2:
        raise NoMatch("MoE routing is not ids[tokens, k] over x[tokens, hidden]")
    op = L.MoEExperts(int(e), k, spec.activation, gated=spec.gated, bias=spec.bias)
    if not view.meta:  # shape-only weights (meta device) cannot be run: anchors only
        _verify(view, root, spec, op)

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(root)
        weights = [_weight(em, spec, r, t[r]) for r in op.roles()[3:]]
        args = [em.get(spec.x), em.get(spec.weights), em.cast(em.get(spec.ids), "int64")]
        out = em.emit1(op, args + weights)
        return [em.cast(out, dtype_name(view.dtype(root)))]

    info = {"num_experts": int(e), "top_k": k, "activation": spec.activation}
    if not spec.gated:
        info["gated"] = False
    if spec.bias:
        info["bias"] = True
    info["verified"] = not view.meta  # shape-only weights: anchors only
    return Match(name, (root,), (spec.x, spec.weights, spec.ids), emit, info)
