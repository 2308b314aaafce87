"""Raising Mixture-of-Experts blocks: the router to ``TopKRouting``, the routed experts (whatever
their spelling) to one ``MoEExperts``.  The MoE layer with SwiGLU experts is the workload of
STeP §5.1; per-expert routing is what dynamic tiling (§5.2) and time-multiplexed expert
regions (§5.3) schedule, so a spelling that gathers a weight copy per token must not be lowered
literally.

``moe_experts`` is anchored at the router's ``TopK``:

1. the router: ``TopK(Softmax(logits))`` [+ ``ReduceSum``/``Div`` renormalisation] or
   ``Softmax(TopK(logits).values)``;
2. the region: everything computed from the routing weights ``w`` and expert ids ``e`` up to the
   first ``[T, H]`` value ``y`` through which all of it flows, plus the helpers only it uses
   (``repeat_interleave`` of the tokens, the zero accumulator); it may read only ``w``, ``e``,
   one ``[T, H]`` token tensor ``x`` and constants;
3. the experts: :func:`~torch2step.frontend.onnx_moe_experts.read_mlps` (one stacked MLP selected
   at run time for HF ``batched_mm``/``grouped_mm``, one MLP per expert for a loop, matched to its
   expert by the ``Equal(e, j)`` that selects its tokens);
4. the meaning check: :func:`~torch2step.frontend.onnx_moe_experts.verify_moe` runs the region
   on sample routings and compares with ``MoEExperts`` — the sort / histogram / scatter details of
   each spelling never need matching one by one.

The spelling is reported in ``Match.info["spelling"]``: ``batched`` (weights gathered per
token), ``grouped`` (tokens sorted by expert) or ``loop`` (one branch per expert).
``topk_routing`` (the router recogniser shared with the PyTorch frontend) raises a router whose
experts are not recognised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
import torch

from torch2step.frontend.fx_pattern import Pattern as CommonPattern
from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView, same_dim
from torch2step.frontend.onnx_moe_experts import MLP, expert_matmuls, read_mlps, verify_moe
from torch2step.frontend.onnx_nodes import onnx_pattern
from torch2step.frontend.onnx_patterns import Match, Pattern
from torch2step.frontend.raise_basic import TOPK_ROUTING
from torch2step.layers import ops as L

__all__ = ["MOE_PATTERNS", "Router", "find_router", "match_moe_experts"]


@dataclass
class Router:
    """A recognised router: ``TopKRouting(k, softmax_first, normalize)(logits) -> (w, e)``."""

    logits: str
    w: str
    e: str
    op: L.TopKRouting
    nodes: set[str]
    num_experts: int


def find_router(view: OnnxView, topk: OnnxNode) -> Router | None:
    """The router around ``topk`` (the one top-k routing recogniser of both frontends,
    :data:`~torch2step.frontend.raise_basic.TOPK_ROUTING`), or ``None``."""
    nv = view.node_view()
    item = nv.value.get(topk.outputs[0])
    m = TOPK_ROUTING.match(nv, item.args[0]) if item is not None else None
    if m is None or len(m.roots) != 2:
        return None
    (logits,) = m.inputs
    shape = view.shape(logits.name)
    if shape is None or len(shape) != 2 or not isinstance(shape[1], int):
        raise Unsupported("router logits must be [tokens, experts] with a static expert count")
    w, e = (r.name for r in m.roots)
    nodes, stack = set(), [w, e]
    while stack:  # the router's own nodes: from (w, e) back to the logits
        p = view.producer.get(stack.pop())
        if p is not None and p.name not in nodes and logits.name not in p.outputs:
            nodes.add(p.name)
            stack.extend(i for i in p.inputs if i and i not in view.known)
    return Router(logits.name, w, e, m.info["router"], nodes, shape[1])


def _emit_router(em: Emitter, r: Router, node: OnnxNode) -> tuple[str, str]:
    w, e = em.emit(r.op, [em.get(r.logits)], [r.w, r.e], source=node.source)
    return w, e


# -- the experts region ----------------------------------------------------------------------
def _downstream(view: OnnxView, values: list[str], skip: set[str]) -> list[OnnxNode]:
    seen: dict[str, OnnxNode] = {}
    stack = [u for v in values for u in view.users(v)]
    while stack:
        n = stack.pop()
        if n.name in seen or n.name in skip:
            continue
        seen[n.name] = n
        stack.extend(u for o in n.outputs for u in view.users(o))
    return sorted(seen.values(), key=lambda n: n.index)


def _ancestors(view: OnnxView, node: OnnxNode, within: set[str]) -> set[str]:
    out: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.name in out or n.name not in within:
            continue
        out.add(n.name)
        stack.extend(p for i in n.inputs if i and (p := view.producer.get(i)) is not None)
    return out


def _region(view: OnnxView, r: Router, folded: set[str]) -> tuple[str, set[str]]:
    """``(y, nodes)``: the output of the experts region and its nodes (see module docstring)."""
    down = [n for n in _downstream(view, [r.w, r.e], r.nodes) if n.name not in folded]
    names = {n.name for n in down}
    tokens = (view.shape(r.w) or (None,))[0]
    hidden = _router_hidden(view, r)
    for cand in down:
        y = cand.outputs[0]
        shape = view.shape(y)
        if shape is None or len(shape) != 2 or tokens is None:
            continue
        if not same_dim(shape[0], tokens) or (hidden is not None and shape[1] != hidden):
            continue
        inside = _ancestors(view, cand, names)
        after = {n.name for n in _downstream(view, [y], set())}
        if all(n in inside or n in after for n in names):
            return y, inside | _helpers(view, inside, r, folded)
    raise Unsupported("no [tokens, hidden] value collects the routed computation")


def _router_hidden(view: OnnxView, r: Router) -> int | None:
    """The hidden size the router reads (``logits = x @ W``), if the logits come from a matmul."""
    p = view.producer_of(r.logits, ("Gemm", "MatMul"))
    shape = view.shape(p.inputs[0]) if p is not None else None
    return shape[-1] if shape and isinstance(shape[-1], int) else None


def _helpers(view: OnnxView, region: set[str], r: Router, folded: set[str]) -> set[str]:
    """Run-time nodes outside the routed cone used only by the region (e.g. the token repeat of
    ``batched_mm``, the zero accumulator of a loop)."""
    extra: set[str] = set()
    for node in reversed(view.nodes):
        if node.name in region or node.name in folded or node.name in r.nodes:
            continue
        uses = [u for o in node.outputs for u in view.users(o) if u.name not in folded]
        if not uses or any(o in view.outputs for o in node.outputs):
            continue
        if all(u.name in region or u.name in extra for u in uses):
            extra.add(node.name)
    return extra


def _stack_loop(
    view: OnnxView, mlps: list[MLP], r: Router, region: set[str]
) -> tuple[np.ndarray, ...]:
    by_expert: dict[int, MLP] = {}
    for m in mlps:
        j = _branch_expert(view, m.x_in, region)
        if j is None or j in by_expert:
            raise Unsupported("a per-expert branch does not select its tokens with Equal(ids, j)")
        by_expert[j] = m
    if sorted(by_expert) != list(range(r.num_experts)):
        raise Unsupported(
            f"branches cover experts {sorted(by_expert)} of {r.num_experts}; every expert needs "
            "one (the legacy exporter, dynamo=False, unrolls only the experts the example input "
            "reached: re-export with torch.onnx.export(..., dynamo=True))"
        )
    order = [by_expert[j] for j in range(r.num_experts)]
    return tuple(np.stack([getattr(m, a) for m in order]) for a in ("gate", "up", "down"))


def _branch_expert(view: OnnxView, value: str, region: set[str]) -> int | None:
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        p = view.producer.get(v)
        if p is None or p.name in seen or p.name not in region:
            continue
        seen.add(p.name)
        if p.op_type == "Equal":
            consts = [view.scalar(i) for i in p.inputs]
            j = next((c for c in consts if c is not None), None)
            if j is not None:
                return int(j)
        stack.extend(i for i in p.inputs if i and i not in view.known)
    return None


def match_moe_experts(view: OnnxView, node: OnnxNode) -> Match | None:
    """Router + routed experts anchored at ``node`` (a TopK); see the module docstring."""
    r = find_router(view, node)
    if r is None:
        return None
    y, region = _region(view, r, view.folded)
    produced = {o for n in region for o in view.by_name[n].outputs}
    free = sorted(
        {
            i
            for n in region
            for i in view.by_name[n].inputs
            if i and i not in produced and i not in view.known
        }
        - {r.w, r.e}
    )
    tokens = (view.shape(r.w) or (None,))[0]
    if len(free) != 1 or view.rank(free[0]) != 2:
        raise Unsupported(f"the routed region reads {free}; expected one [tokens, hidden] input")
    x = free[0]
    mlps = read_mlps(view, expert_matmuls(view, region))
    if len(mlps) == 1 and mlps[0].dynamic:
        gate, up, down = mlps[0].gate, mlps[0].up, mlps[0].down
        ops = {view.by_name[n].op_type for n in region}
        spelling = "grouped" if ops & {"CumSum", "TopK"} else "batched"
    elif mlps and not any(m.dynamic for m in mlps):
        gate, up, down = _stack_loop(view, mlps, r, region)
        spelling = "loop"
    else:
        raise Unsupported(
            f"found {len(mlps)} gated expert MLPs in the routed region; expected one stacked or one per expert"
        )
    if gate.ndim != 3 or gate.shape[0] != r.num_experts:
        raise Unsupported(f"expert weights {gate.shape} do not match {r.num_experts} experts")
    acts = {m.activation for m in mlps}
    if len(acts) != 1:
        raise Unsupported(f"experts use different activations {sorted(acts)}")
    op = L.MoEExperts(r.num_experts, r.op.k, acts.pop())
    weights = tuple(torch.from_numpy(np.array(a, dtype=np.float32)) for a in (gate, up, down))
    ordered = sorted((view.by_name[n] for n in region), key=lambda n: n.index)
    sample_tokens = int(sympy.sympify(tokens).subs(view.sample_dims()))
    verified = verify_moe(view, ordered, x, r.w, r.e, y, op, weights, sample_tokens)  # type: ignore[arg-type]
    scope = next((m for m in (view.by_name[n].module for n in sorted(region)) if m), "moe")
    outputs = [y] + [
        v
        for v in (r.w, r.e)
        if v in view.outputs or any(u.name not in region for u in view.users(v))
    ]

    def emit(em: Emitter) -> None:
        w, e = _emit_router(em, r, node)
        params = [
            em.param(t, f"{scope}.{n}") for t, n in zip(weights, ("w_gate", "w_up", "w_down"))
        ]
        em.emit1(op, [em.get(x), w, e, *params], y, source=node.source)

    info = {"spelling": spelling, "router": r.op, "experts": op, "verified": verified}
    return Match(f"moe_experts_{spelling}", [r.logits, x], outputs, emit, info)


MOE_PATTERNS: tuple[CommonPattern, ...] = (
    onnx_pattern(
        Pattern("moe_experts", frozenset({"TopK"}), match_moe_experts, "router + routed experts")
    ),
    TOPK_ROUTING,
)
