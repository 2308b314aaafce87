"""Raising Mixture-of-Experts blocks: the router to ``TopKRouting``, the routed experts (whatever
their spelling) to one ``MoEExperts``.  The MoE layer with SwiGLU experts is the workload of
STeP §5.1; per-expert routing is what dynamic tiling (§5.2) and time-multiplexed expert
regions (§5.3) schedule, so a spelling that gathers a weight copy per token must not be lowered
literally.

``moe_experts`` is anchored at the router's ``TopK`` (read in the common view,
:mod:`torch2step.frontend.onnx_nodes`):

1. the router: ``TopK(Softmax(logits))`` [+ ``ReduceSum``/``Div`` renormalisation] or
   ``Softmax(TopK(logits).values)``;
2. the region: everything computed from the routing weights ``w`` and expert ids ``e`` up to the
   first ``[T, H]`` value ``y`` through which all of it flows, plus the helpers only it uses
   (``repeat_interleave`` of the tokens, the zero accumulator); it may read only ``w``, ``e``,
   one ``[T, H]`` token tensor ``x`` and constants;
3. the experts: :func:`~torch2step.frontend.onnx_moe_experts.read_bodies` (one stacked MLP selected
   at run time for HF ``batched_mm``/``grouped_mm``, one MLP per expert for a loop, matched to its
   expert by the ``Equal(e, j)`` that selects its tokens);
4. the meaning check and the emitted op are those of the PyTorch frontend
   (:func:`~torch2step.frontend.raise_moe_body.moe_match`): the region is run on sample routings
   and compared with ``MoEExperts`` — the sort / histogram / scatter details of each spelling
   never need matching one by one.

The spelling is reported in ``Match.info["spelling"]``: ``batched`` (weights gathered per
token), ``grouped`` (tokens sorted by expert) or ``loop`` (one branch per expert).
The router itself is raised by ``topk_routing``, the router recogniser of both frontends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.gnode import GNode
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView, same_dim
from torch2step.frontend.onnx_moe_experts import expert_matmuls, read_bodies
from torch2step.frontend.onnx_nodes import OnnxNodeView
from torch2step.frontend.raise_basic import TOPK_ROUTING
from torch2step.frontend.raise_moe_body import ExpertBody, MoESpec, expert_tensors, moe_match
from torch2step.layers import ops as L

__all__ = ["MOE_PATTERNS", "Router", "find_router"]


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
        raise NoMatch("router logits must be [tokens, experts] with a static expert count")
    w, e = (r.name for r in m.roots)
    nodes, stack = set(), [w, e]
    while stack:  # the router's own nodes: from (w, e) back to the logits
        p = view.producer.get(stack.pop())
        if p is not None and p.name not in nodes and logits.name not in p.outputs:
            nodes.add(p.name)
            stack.extend(i for i in p.inputs if i and i not in view.known)
    return Router(logits.name, w, e, m.info["router"], nodes, shape[1])


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
    raise NoMatch("no [tokens, hidden] value collects the routed computation")


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


def _by_expert(
    view: OnnxView, bodies: list[ExpertBody], r: Router, region: set[str]
) -> list[ExpertBody]:
    """The per-expert bodies of a loop in expert order (each selects its tokens by
    ``Equal(ids, j)``)."""
    by_expert: dict[int, ExpertBody] = {}
    for b in bodies:
        j = _branch_expert(view, b.x.name, region)
        if j is None or j in by_expert:
            raise NoMatch("a per-expert branch does not select its tokens with Equal(ids, j)")
        by_expert[j] = b
    if sorted(by_expert) != list(range(r.num_experts)):
        raise NoMatch(
            f"branches cover experts {sorted(by_expert)} of {r.num_experts}; every expert needs "
            "one (the legacy exporter, dynamo=False, unrolls only the experts the example input "
            "reached: re-export with torch.onnx.export(..., dynamo=True))"
        )
    return [by_expert[j] for j in range(r.num_experts)]


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


def _match_moe(nv: OnnxNodeView, g: GNode) -> Match | None:
    """The routed experts after the router at ``g`` (a TopK); see the module docstring."""
    node, view = g.meta.get("onnx"), nv.onnx
    if node is None or node.op_type != "TopK" or (r := find_router(view, node)) is None:
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
    if len(free) != 1 or view.rank(free[0]) != 2:
        raise NoMatch(f"the routed region reads {free}; expected one [tokens, hidden] input")
    bodies = read_bodies(nv, expert_matmuls(view, region))
    stacked = [b for b in bodies if b.up.dim() == 3]
    if len(bodies) == 1 and stacked:
        ops = {view.by_name[n].op_type for n in region}
        spelling = "grouped" if ops & {"CumSum", "TopK"} else "batched"
    elif bodies and not stacked:
        bodies, spelling = _by_expert(view, bodies, r, region), "loop"
    else:
        raise NoMatch(
            f"found {len(bodies)} expert MLPs in the routed region; expected one stacked or "
            "one per expert"
        )
    acts = {b.activation for b in bodies}
    if len(acts) != 1:
        raise NoMatch(f"experts use different activations {sorted(acts)}")
    tensors = expert_tensors(bodies)
    if tensors["w_up"].shape[0] != r.num_experts:
        raise NoMatch(
            f"expert weights {tuple(tensors['w_up'].shape)} do not match {r.num_experts} experts"
        )
    spec = MoESpec(nv.node(free[0]), nv.node(r.w), nv.node(r.e), tensors, acts.pop(), ())
    m = moe_match(nv, nv.node(y), f"moe_experts_{spelling}", spec)
    return replace(m, info={**m.info, "spelling": spelling, "router": r.op})


MOE_PATTERNS: tuple[Pattern, ...] = (
    Pattern("moe_experts", frozenset({"topk"}), _match_moe, "router + routed experts"),
    TOPK_ROUTING,
)
