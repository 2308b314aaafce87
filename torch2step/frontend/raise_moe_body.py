"""What every spelling of a routed MoE block shares: the SwiGLU expert body, its weights, and
the check that a recognised region computes :class:`~torch2step.layers.ops.MoEExperts`.

An expert body is ``down(act(gate(x)) * up(x))``; each projection is spelled by the MoE variant
(``mm`` with one expert's weight in a loop, ``bmm`` with weights gathered per token in HF's
``batched_mm``, ``grouped_mm`` over tokens sorted by expert in HF's ``grouped_mm``) and gate/up
may be one fused projection split in two.  The body extractor takes the projection spelling as a
function and returns the weights in the layer op's layout (``w_gate``/``w_up`` ``[E, I, H]``,
``w_down`` ``[E, H, I]``).

A region found by its anchors is then *run* (:func:`~torch2step.frontend.fx_probe.run_slice`) on
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
from torch2step.frontend.fx_probe import run_slice, sample_tensor
from torch2step.frontend.fx_view import ProgramView, op_name, raw_shape, strip, strip_casts
from torch2step.layers import ops as L
from torch2step.layers.evaluate import EVALUATORS
from torch2step.layers.graph import dtype_name

__all__ = [
    "Proj",
    "ProjFn",
    "ExpertBody",
    "MoESpec",
    "activation",
    "expert_body",
    "moe_match",
    "weight_base",
    "weight_sources",
]

#: ``proj(view, node) -> Proj | None``: one projection of the expert body in a given spelling.
ProjFn = Callable[[ProgramView, fx.Node], "Proj | None"]


@dataclass(frozen=True, slots=True)
class Proj:
    """``out = x @ weight[..., out, in]^T``; ``key`` is the spelling's routing node (expert
    ids gathered per row, or group offsets) and ``source`` the FX node holding the weight."""

    x: fx.Node
    weight: torch.Tensor
    key: Any
    source: fx.Node


@dataclass(frozen=True, slots=True)
class ExpertBody:
    x: fx.Node
    activation: str
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    keys: tuple[Any, ...]
    sources: tuple[fx.Node, ...]


def activation(node: Any) -> tuple[str, fx.Node] | None:
    """``(name, g)`` when ``node`` is ``silu/gelu/relu(g)`` (``g * sigmoid(g)`` is silu)."""
    n = strip_casts(node)
    if not isinstance(n, fx.Node):
        return None
    name = op_name(n)
    if name in ("silu", "relu") or (
        name == "gelu" and n.kwargs.get("approximate", "none") == "none"
    ):
        return name, strip_casts(n.args[0])
    if name == "mul":
        a, b = (strip_casts(x) for x in n.args[:2])
        for g, s in ((a, b), (b, a)):
            if op_name(s) == "sigmoid" and strip_casts(s.args[0]) is g:
                return "silu", g
    return None


def _rows(view: ProgramView, node: fx.Node, proj: ProjFn) -> Proj | None:
    """A projection, or rows ``[a, b)`` of its output (fused gate/up split in two)."""
    n = strip_casts(node)
    if op_name(n) == "getitem" and op_name(n.args[0]) in ("split_with_sizes", "split"):
        split = n.args[0]
        dim = split.args[2] if len(split.args) > 2 else 0
        if dim not in (-1, view.rank(split.args[0]) - 1):
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
    return Proj(base.x, base.weight[..., lo:hi, :], base.key, base.source)


def expert_body(view: ProgramView, y: fx.Node, proj: ProjFn) -> ExpertBody | None:
    """``down(act(gate(x)) * up(x))`` ending at ``y``, each projection spelled by ``proj``."""
    down = proj(view, y)
    if down is None:
        return None
    h = strip_casts(down.x)
    if op_name(h) != "mul":
        return None
    a, b = h.args[:2]
    for act_side, up_side in ((a, b), (b, a)):
        act = activation(act_side)
        if act is None:
            continue
        gate, up = _rows(view, act[1], proj), _rows(view, up_side, proj)
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
        )
    return None


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A recognised MoE region: tokens ``x[T, H]``, routing ``weights[T, k]`` and ``ids[T, k]``
    and the experts' weights in :class:`~torch2step.layers.ops.MoEExperts` layout."""

    x: fx.Node
    weights: fx.Node
    ids: fx.Node
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    activation: str
    sources: tuple[fx.Node, ...]


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
    for trial in range(2):
        x = sample_tensor(view, spec.x, view.hints, gen)
        w = torch.rand(t, k, generator=gen).to(view.dtype(spec.weights))
        ids = _routing_sample(t, k, op.num_experts, trial == 0, gen).to(view.dtype(spec.ids))
        (got,) = run_slice(view, [root], {spec.x: x, spec.weights: w, spec.ids: ids})
        ref = EVALUATORS[L.MoEExperts](op, [x, w, ids.long(), spec.w_gate, spec.w_up, spec.w_down])[
            0
        ]
        got = torch.as_tensor(got)
        if got.shape != ref.shape or not torch.allclose(
            got.float(), ref.float(), rtol=tol, atol=tol
        ):
            raise NoMatch(
                "the region has the anchors of a routed MoE but does not compute "
                "sum_j w[t, j] * down(act(gate(x)) * up(x)) of the chosen experts"
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
    e, i, h = spec.w_gate.shape
    if spec.w_up.shape != (e, i, h) or spec.w_down.shape != (e, h, i):
        raise NoMatch(
            f"expert weights of shapes {tuple(spec.w_gate.shape)}, {tuple(spec.w_up.shape)}, "
            f"{tuple(spec.w_down.shape)} are not gate/up [E, I, H] and down [E, H, I]"
        )
    k = raw_shape(spec.ids)[-1]
    if not isinstance(k, int) or view.rank(spec.ids) != 2 or view.rank(spec.x) != 2:
        raise NoMatch("MoE routing is not ids[tokens, k] over x[tokens, hidden]")
    op = L.MoEExperts(int(e), k, spec.activation)
    if not view.meta:  # shape-only weights (meta device) cannot be run: anchors only
        _verify(view, root, spec, op)

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(root)
        weights = [
            _weight(em, spec, n, t)
            for n, t in (("w_gate", spec.w_gate), ("w_up", spec.w_up), ("w_down", spec.w_down))
        ]
        args = [em.get(spec.x), em.get(spec.weights), em.cast(em.get(spec.ids), "int64")]
        out = em.emit1(op, args + weights)
        return [em.cast(out, dtype_name(view.dtype(root)))]

    info = {"num_experts": int(e), "top_k": k, "activation": spec.activation}
    return Match(name, (root,), (spec.x, spec.weights, spec.ids), emit, info)
