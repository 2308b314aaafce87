"""Raising a routed Mixture-of-Experts region into one :class:`~torch2step.layers.ops.MoEExperts`
by what it computes — the MoE recogniser of both frontends, on the common view.  The MoE layer
with SwiGLU experts is the workload of STeP (arXiv 2511.07776) §5.1; per-expert routing is what
dynamic tiling (§5.2) and time-multiplexed expert regions (§5.3) schedule, so a spelling that
gathers a weight copy per token must not be lowered literally.

``moe_experts`` is anchored at the router's ``topk``:

1. the router: :data:`~torch2step.frontend.raise_basic.TOPK_ROUTING` (softmax + top-k [+
   renormalise], or top-k + softmax) gives the routing weights ``w`` and expert ids ``e``;
2. the region: everything computed from ``w`` and ``e`` up to the first ``[T, H]`` value ``y``
   through which all of it flows, plus the helpers only it uses (the token repeat of
   ``batched_mm``, a zero accumulator); it may read only ``w``, ``e``, one ``[T, H]`` token
   tensor ``x`` and constants;
3. the experts: :func:`~torch2step.frontend.raise_moe_body.expert_body` from each projection of
   the region, the projection spelled by the frontend (``projections``): one stacked MLP
   selected at run time (HF ``batched_mm`` / ``grouped_mm``), or one MLP per expert (a loop,
   each matched to its expert by the branch it lies in: the nodes computed from the
   ``eq(ids, j)`` that selects expert ``j``'s tokens and from no other expert's); an expert
   branch without a supported MLP is named with the operators it computes;
4. the meaning check: :func:`~torch2step.frontend.raise_moe_body.moe_match` runs the region on
   sample routings and compares it with ``MoEExperts`` — the sort / histogram / scatter details
   of each spelling never need matching one by one.

The match is named by the spelling: ``moe_batched_mm`` (weights gathered per token),
``moe_grouped_mm`` (tokens sorted by expert) or ``moe_loop`` (one branch per expert).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import fx

from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.fx_view import is_tensor_node, op_name, strip, tensor_args
from torch2step.frontend.gnode import arg_nodes, same_dim
from torch2step.frontend.raise_basic import TOPK_ROUTING
from torch2step.frontend.raise_moe_body import (
    ExpertBody,
    MoESpec,
    ProjFn,
    describe_ops,
    expert_body,
    expert_tensors,
    moe_match,
    weight_sources,
)

__all__ = ["moe_region_pattern", "Projections"]

#: ``projections(view, region) -> proj``: how the frontend spells one expert projection.
Projections = Callable[[Any, set[Any]], ProjFn]
_GROUPED = frozenset({"CumSum", "cumsum", "sort", "histc", "TopK", "topk"})
_EXPERT_FORMS = (
    "experts must be down(act(gate(x)) * up(x)) or down(act(up(x))) with act one of silu, "
    "gelu (exact or tanh-approximate), relu, each projection a linear map with or without a bias"
)
_SKIP = frozenset({"sym_size", "_assert_scalar", "_assert_tensor_metadata", "_assert_async"})


def _reads(n: Any) -> list[Any]:
    return tensor_args(n) if isinstance(n, fx.Node) else arg_nodes(n.args)


def _data(n: Any) -> bool:
    """A node computing tensor data (not a size, an assertion or a graph input)."""
    if n.op != "call_function" or op_name(n) in _SKIP:
        return False
    return is_tensor_node(n) if isinstance(n, fx.Node) else True


def _downstream(roots: Iterable[Any], skip: set[Any]) -> set[Any]:
    seen: set[Any] = set()
    stack = [u for r in roots for u in r.users]
    while stack:
        n = stack.pop()
        if n not in seen and n not in skip and _data(n):
            seen.add(n)
            stack.extend(n.users)
    return seen


def _upstream(node: Any, within: set[Any]) -> set[Any]:
    out: set[Any] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in within and n not in out:
            out.add(n)
            stack.extend(_reads(n))
    return out


def _router(view: Any, topk: Any) -> tuple[Any, Any, Any, set[Any]] | None:
    """``(logits, w, e, router nodes)`` of the router around ``topk``, or None."""
    m = TOPK_ROUTING.match(view, topk)
    if m is None or len(m.roots) != 2:
        return None
    (logits,) = m.inputs
    w, e = m.roots
    nodes, stack = set(), [w, e]
    while stack:  # the router's own nodes: from (w, e) back to the logits
        n = stack.pop()
        if n is not logits and n not in nodes and n.op == "call_function":
            nodes.add(n)
            stack.extend(_reads(n))
    return logits, w, e, nodes


def _region(view: Any, w: Any, e: Any, logits: Any, router: set[Any]) -> tuple[Any, set[Any]]:
    """``(y, nodes)``: the value collecting the routed computation and the region's nodes."""
    down = _downstream([w, e], router)
    tokens = view.shape(w)[0]
    hidden = _router_hidden(view, logits)
    for cand in sorted(down, key=view.index.__getitem__):
        shape = view.shape(cand) if view.rank(cand) == 2 else ()
        if len(shape) != 2 or not same_dim(shape[0], tokens):
            continue
        if hidden is not None and not same_dim(shape[1], hidden):
            continue
        inside = _upstream(cand, down)
        if down <= inside | _downstream([cand], set()):
            return cand, inside | _helpers(view, inside, router)
    raise NoMatch("no [tokens, hidden] value collects the routed computation")


def _router_hidden(view: Any, logits: Any) -> Any:
    """The hidden size the router reads (``logits = x @ W``), when the logits are a matmul."""
    n = strip(logits)
    if op_name(n) in ("view", "_unsafe_view", "reshape"):
        n = strip(n.args[0])
    args = {"mm": 0, "matmul": 0, "addmm": 1, "linear": 0, "Gemm": 0}
    if op_name(n) not in args:
        return None
    d = view.shape(n.args[args[op_name(n)]])[-1]
    return d if isinstance(d, int) else None


def _helpers(view: Any, region: set[Any], router: set[Any]) -> set[Any]:
    """Data nodes outside the routed cone used only by the region (the token repeat of
    ``batched_mm``, the zero accumulator of a loop)."""
    extra: set[Any] = set()
    for n in reversed(view.nodes):
        if n in region or n in router or not _data(n) or view.is_output(n):
            continue
        users = [u for u in n.users if _data(u) or op_name(u) == "getitem"]
        if users and all(u in region or u in extra for u in users):
            extra.add(n)
    return extra


def _branches(view: Any, region: set[Any]) -> dict[int, set[Any]]:
    """A loop's per-expert branches: ``j`` -> the nodes computed from an ``eq(ids, j)`` (the
    selection of expert ``j``'s tokens) and from no other expert's selection."""
    cones: dict[int, set[Any]] = {}
    for n in region:
        if op_name(n) not in ("eq", "Equal"):
            continue
        for a in n.args[:2]:
            c = a if isinstance(a, int) else view.const(a)
            if isinstance(c, int) or (c is not None and c.numel() == 1):
                cones.setdefault(int(c), set()).update({n}, _downstream([n], set()) & region)
                break
    return {
        j: cone.difference(*(o for i, o in cones.items() if i != j)) for j, cone in cones.items()
    }


def _by_expert(
    view: Any, bodies: list[ExpertBody], n_exp: int, region: set[Any]
) -> list[ExpertBody]:
    """The per-expert bodies of a loop in expert order; an expert whose branch holds no MLP of
    the supported forms is named with what it computes."""
    branches = _branches(view, region)
    found: dict[int, ExpertBody] = {}
    for b in bodies:
        js = [j for j, br in branches.items() if b.x in br]
        if len(js) != 1 or js[0] in found:
            raise NoMatch("a per-expert branch does not select its tokens with eq(ids, j)")
        found[js[0]] = b
    bad = sorted(set(branches) - set(found))
    if bad:
        raise NoMatch(
            f"{_EXPERT_FORMS}, applied to the expert's token rows and scaled by its routing "
            f"weight; expert {bad[0]} computes {describe_ops(view, branches[bad[0]])}"
        )
    if sorted(found) != list(range(n_exp)):
        raise NoMatch(
            f"branches cover experts {sorted(found)} of {n_exp}; every expert needs one (the "
            "legacy ONNX exporter, dynamo=False, unrolls only the experts the example input "
            "reached: re-export with torch.onnx.export(..., dynamo=True))"
        )
    return [found[j] for j in range(n_exp)]


def moe_region_pattern(projections: Projections) -> Pattern:
    """The MoE recogniser with the frontend's projection spelling."""

    def match(view: Any, topk: Any) -> Match | None:
        found = _router(view, topk)
        if found is None:
            return None
        logits, w, e, router = found
        n_exp = view.shape(logits)[-1]
        if view.rank(logits) != 2 or not isinstance(n_exp, int):
            raise NoMatch("router logits must be [tokens, experts] with a static expert count")
        y, region = _region(view, w, e, logits, router)
        free = {a for n in region for a in _reads(n) if a not in region}
        free = {
            a for a in free - {w, e} if view.is_input(a) or (_data(a) and view.const(a) is None)
        }
        if len(free) != 1 or view.rank(next(iter(free))) != 2:
            names = sorted(a.name for a in free)
            raise NoMatch(f"the routed region reads {names}; expected one [tokens, hidden] input")
        proj = projections(view, region)
        bodies: dict[tuple[int, ...], ExpertBody] = {}
        for n in sorted(region, key=view.index.__getitem__):
            b = expert_body(view, n, proj)
            if b is not None:
                bodies.setdefault(tuple(id(s) for s in b.sources), b)
        found_bodies = list(bodies.values())
        stacked = [b for b in found_bodies if b.up.dim() == 3]
        if len(found_bodies) == 1 and stacked:
            grouped = any(op_name(n) in _GROUPED for n in region)
            spelling = "grouped_mm" if grouped else "batched_mm"
        elif not stacked and (found_bodies or _branches(view, region)):
            found_bodies, spelling = _by_expert(view, found_bodies, n_exp, region), "loop"
        else:
            computes = "" if found_bodies else f"; it computes {describe_ops(view, region)}"
            raise NoMatch(
                f"found {len(found_bodies)} expert MLPs in the routed region; expected one "
                f"stacked or one per expert ({_EXPERT_FORMS}){computes}"
            )
        acts = {b.activation for b in found_bodies}
        if len(acts) != 1:
            raise NoMatch(f"experts use different activations {sorted(acts)}")
        tensors = expert_tensors(found_bodies)
        sources = weight_sources(view, [s for b in found_bodies for s in b.sources])
        spec = MoESpec(free.pop(), w, e, tensors, acts.pop(), sources)
        return moe_match(view, y, f"moe_{spelling}", spec)

    return Pattern("moe_experts", frozenset({"topk"}), match, "router + routed experts")
