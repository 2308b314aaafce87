"""From a core-ATen ``ExportedProgram`` to a :class:`~torch2step.layers.graph.LayerGraph`.

The pipeline is one function of named steps (:func:`raise_program`):

1. ``find_matches``: try the raising patterns (:data:`PATTERNS`, in order; per pattern over the
   nodes from the last to the first, so the largest instance claims its root first);
2. ``plan``: from the outputs back, pick each needed node's translation (the pattern match
   rooted at it, or its one-to-one rule in :data:`~torch2step.frontend.raise_rules.RULES`);
3. ``check``: collect every needed operation without a translation and raise ONE
   :class:`~torch2step.errors.UnsupportedOperatorError` listing all of them (FX node, ATen op,
   user source line, why, what to do) before anything is translated (TVM Relax's
   ``_check_unsupported_func_type``);
4. ``emit``: translate in dependency order.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from torch2step.errors import FrontendError, UnsupportedOperatorError
from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.fx_view import (
    ProgramView,
    is_tensor_node,
    op_name,
    overload_name,
    source_line,
    tensor_args,
)
from torch2step.frontend.raise_attention import ATTENTION_EAGER, ATTENTION_SDPA
from torch2step.frontend.raise_basic import LINEAR, RMSNORM, TOPK_ROUTING
from torch2step.frontend.raise_moe import MOE_BATCHED_MM, MOE_GROUPED_MM
from torch2step.frontend.raise_moe_loop import MOE_LOOP
from torch2step.frontend.raise_rotary import ROTARY
from torch2step.frontend.raise_rules import IGNORED, check_node, rule_for
from torch2step.layers.graph import LayerGraph

__all__ = ["PATTERNS", "raise_program", "find_matches", "Plan", "plan", "format_matches"]

#: The raising patterns, tried in this order (larger meanings first).
PATTERNS: tuple[Pattern, ...] = (
    MOE_LOOP,
    MOE_BATCHED_MM,
    MOE_GROUPED_MM,
    ATTENTION_SDPA,
    ATTENTION_EAGER,
    ROTARY,
    RMSNORM,
    TOPK_ROUTING,
    LINEAR,
)

_HINTS = {
    "scaled_dot_product_attention": "attention with this mask/dropout has no Attention op",
    "topk": "topk is supported as an MoE router: softmax -> topk (-> renormalise) over [T, E]",
    "nonzero": "data-dependent indexing is supported inside an MoE loop over experts",
    "index_put": "index_put is supported inside an MoE loop (index_add_ over expert tokens)",
    "index_add": "index_add_ is supported inside an MoE loop (accumulating each expert's rows)",
    "scatter_add": "scatter_add_ is supported inside an MoE loop (accumulating each expert's rows)",
    "index_select": "index_select on a data-dependent index is supported inside an MoE loop",
    "gather": "gather is supported inside an MoE loop (gathering each expert's token rows)",
    "cos": "cos/sin are supported inside default rotate-half RoPE",
    "sin": "cos/sin are supported inside default rotate-half RoPE",
}


def find_matches(
    view: ProgramView, patterns: Sequence[Pattern] = PATTERNS
) -> tuple[dict[fx.Node, Match], dict[fx.Node, str]]:
    """``(root -> match, node -> why a pattern rejected it)``."""
    matches: dict[fx.Node, Match] = {}
    notes: dict[fx.Node, str] = {}
    for pattern in patterns:
        for node in reversed(view.nodes):
            if node.op != "call_function" or node in matches:
                continue
            if op_name(node) not in pattern.anchors:
                continue
            try:
                m = pattern.match(view, node)
            except NoMatch as exc:
                notes.setdefault(node, f"{pattern.name}: {exc}")
                continue
            if m is None or any(r in matches for r in m.roots):
                continue
            for r in m.roots:
                matches[r] = m
    return matches, notes


def format_matches(
    view: ProgramView, matches: Mapping[fx.Node, Match], notes: Mapping[fx.Node, str]
) -> str:
    """A readable listing of the pattern instances (root, pattern, source line, what was read)
    and of the patterns that were tried but did not apply."""
    lines = []
    seen: set[int] = set()
    for root in sorted(matches, key=view.index.__getitem__):
        m = matches[root]
        if id(m) in seen:
            continue
        seen.add(id(m))
        roots = ", ".join(r.name for r in m.roots)
        reads = ", ".join(i.name for i in m.inputs)
        info = ", ".join(f"{k}={v}" for k, v in m.info.items() if not isinstance(v, fx.Node))
        lines.append(f"{m.pattern:15} {roots} <- ({reads})  {info}".rstrip())
        lines.append(f"{'':15} at {source_line(root) or '(no source line)'}")
    for node in sorted(notes, key=view.index.__getitem__):
        lines.append(f"{'not applied':15} {node.name}: {notes[node]}")
    return "\n".join(lines)


@dataclass
class Plan:
    """The needed nodes, each translated by a match or a rule, in dependency order."""

    units: list[Match | fx.Node] = field(default_factory=list)
    problems: list[tuple[fx.Node, str]] = field(default_factory=list)
    needed: set[fx.Node] = field(default_factory=set)


def _deps(unit: Match | fx.Node) -> list[fx.Node]:
    if isinstance(unit, Match):
        return list(unit.inputs)
    return tensor_args(unit)


def plan(view: ProgramView, matches: Mapping[fx.Node, Match]) -> Plan:
    """Walk back from the outputs choosing each needed node's translation."""
    out = Plan()
    unit_of: dict[fx.Node, Match | fx.Node] = {}
    stack = [n for n in _outputs(view) if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n in unit_of:
            continue
        unit: Match | fx.Node = matches.get(n, n)
        unit_of[n] = unit
        if isinstance(unit, Match):
            for r in unit.roots:
                unit_of[r] = unit
        elif n.op == "placeholder":
            continue
        elif op_name(n) in IGNORED or not is_tensor_node(n):
            out.problems.append((n, "computes no tensor"))
            continue
        else:
            why = check_node(view, n)
            if why is not None:
                out.problems.append((n, why))
        stack.extend(_deps(unit))
    out.needed = set(unit_of)
    # order units: Kahn's algorithm, ties broken by graph position
    units = list({id(u): u for u in unit_of.values()}.values())
    pos = {
        id(u): min(view.index[r] for r in (u.roots if isinstance(u, Match) else (u,)))
        for u in units
    }
    deps = {id(u): {id(unit_of[d]) for d in _deps(u) if d in unit_of} - {id(u)} for u in units}
    users: dict[int, list[int]] = {}
    for u, ds in deps.items():
        for d in ds:
            users.setdefault(d, []).append(u)
    by_id = {id(u): u for u in units}
    waiting = {u: len(ds) for u, ds in deps.items()}
    ready = [(pos[u], u) for u, c in waiting.items() if c == 0]
    heapq.heapify(ready)
    while ready:
        _, u = heapq.heappop(ready)
        out.units.append(by_id[u])
        for v in users.get(u, []):
            waiting[v] -= 1
            if waiting[v] == 0:
                heapq.heappush(ready, (pos[v], v))
    if len(out.units) != len(units):
        raise FrontendError("internal: the raised matches form a cycle")
    return out


def _outputs(view: ProgramView) -> list[object]:
    args = view.output_node.args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]


def unsupported_message(
    view: ProgramView,
    name: str,
    problems: Sequence[tuple[fx.Node, str]],
    notes: Mapping[fx.Node, str],
    needed: set[fx.Node] | frozenset[fx.Node] = frozenset(),
) -> str:
    """One message listing every operation without a translation, in graph order."""
    lines = [
        f"{name}: {len(problems)} operation(s) have no translation to the layer graph:",
    ]
    for node, why in sorted(problems, key=lambda p: view.index[p[0]]):
        src = source_line(node) or "(no source line)"
        lines.append(f"  - {node.name}: {overload_name(node)} at {src}")
        detail = why if why != "no rule" else _HINTS.get(op_name(node), "no rule for this op")
        lines.append(f"      why: {detail}")
        if node in notes:
            lines.append(f"      pattern tried: {notes[node]}")
    listed = {n for n, _ in problems}
    near = sorted((n for n in notes if n in needed and n not in listed), key=view.index.__getitem__)
    if near:
        lines.append("  Patterns that nearly applied (their nodes are translated one by one):")
        for node in near:
            src = source_line(node) or "(no source line)"
            lines.append(f"  - {node.name} at {src}: {notes[node]}")
    lines.append(
        "What to do: express these with supported operations (linear/matmul, elementwise, "
        "RMSNorm, softmax, RoPE, top-k routing, MoE experts, attention, cat/gather/views), or "
        "add a rule to torch2step.frontend.raise_rules.RULES or a pattern to "
        "torch2step.frontend.raise_graph.PATTERNS."
    )
    return "\n".join(lines)


def raise_program(
    ep: torch.export.ExportedProgram,
    *,
    name: str = "layer",
    dim_names: Mapping[tuple[int, int], str] | None = None,
    single_output: bool | None = None,
    rope_theta: float | None = None,
) -> LayerGraph:
    """Raise a decomposed ``ExportedProgram`` (see :func:`~torch2step.frontend.capture.capture`)
    to a layer graph whose inputs are the module's tensor arguments in order.

    ``dim_names``: ``(tensor input index, axis) -> name`` of the dynamic dims; ``rope_theta``:
    the RoPE base when the frequency table has no values (a ``meta``-device module)."""
    view = ProgramView(ep, dim_names, rope_theta)
    matches, notes = find_matches(view)
    p = plan(view, matches)
    if p.problems:
        raise UnsupportedOperatorError(unsupported_message(view, name, p.problems, notes, p.needed))
    graph = LayerGraph(name=name)
    em = FxEmitter(view, graph)
    for ph in view.user_inputs:
        if not isinstance(ph.meta.get("val"), torch.Tensor):
            raise FrontendError(f"{name}: input {ph.name!r} is not a tensor; pass tensors only")
        em.values[ph] = graph.add_input(ph.name, view.ttype(ph))
    for unit in p.units:
        if isinstance(unit, Match):
            vals = unit.emit(em)
            for r, v in zip(unit.roots, vals):
                em.values[r] = v
        elif unit.op == "placeholder":
            em.get(unit)
        else:
            em.at(unit)
            rule = rule_for(unit)
            assert rule is not None
            em.values[unit] = rule(em, unit)
    for o in _outputs(view):
        if not isinstance(o, fx.Node) or not is_tensor_node(o):
            raise FrontendError(f"{name}: output {o!r} is not a tensor; return tensors only")
        graph.outputs.append(em.get(o))
    graph.single_output = len(graph.outputs) == 1 if single_output is None else single_output
    return graph
