"""The raising engine shared by the PyTorch and ONNX frontends.

A frontend adapts its graph to the common view (:mod:`torch2step.frontend.gnode`) and says how
to translate one node (a :class:`Frontend`); the engine is one function of named steps
(:func:`raise_graph`):

1. ``find_matches``: try the raising patterns in order (larger meanings first), each over the
   nodes from the last to the first, so the largest instance claims its root first;
2. ``plan``: from the outputs back, pick each needed node's translation (the pattern match
   rooted at it, or the frontend's one-to-one translation);
3. ``check``: every needed node without a translation is collected, as is every translation
   that fails while emitting (nodes downstream of a problem are skipped), into ONE
   :class:`~torch2step.errors.UnsupportedOperatorError` listing each op with its node and source
   line (TVM Relax's ``_check_unsupported_func_type``);
4. ``emit``: translate in dependency order (Kahn's algorithm, ties by graph position).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch2step.errors import FrontendError, UnsupportedOperatorError
from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.fx_view import is_node, op_name, source_line

__all__ = ["Frontend", "Plan", "find_matches", "format_matches", "plan", "raise_graph"]


class Frontend(Protocol):
    """What the engine asks of one frontend (``view``: its graph in the common view)."""

    view: Any
    #: the closing "What to do" advice of the unsupported-operator error
    advice: str

    def outputs(self) -> list[Any]: ...

    def reads(self, node: Any) -> list[Any]:
        """The nodes whose values ``node``'s translation reads."""
        ...

    def check(self, node: Any) -> str | None:
        """None when ``node`` has a translation, else why not."""
        ...

    def describe(self, node: Any) -> str:
        """``node``, its operator and its source line, for the error."""
        ...

    def translate(self, em: Any, node: Any) -> None:
        """Emit ``node``'s layer ops and bind its value(s)."""
        ...

    def bind(self, em: Any, root: Any, value: str) -> None: ...

    def has(self, em: Any, node: Any) -> bool:
        """Whether ``node``'s value is available to later translations."""
        ...


def find_matches(view: Any, patterns: Sequence[Pattern]) -> tuple[dict[Any, Match], dict[Any, str]]:
    """``(root -> match, node -> why a pattern rejected it)``."""
    matches: dict[Any, Match] = {}
    notes: dict[Any, str] = {}
    for pattern in patterns:
        for node in reversed(view.nodes):
            if node.op != "call_function" or node in matches:
                continue
            if op_name(node) not in pattern.anchors:
                continue
            try:
                m = pattern.match(view, node)
            except NoMatch as exc:
                notes.setdefault(node, f"{pattern.name}: {exc.reason}")
                continue
            except FrontendError as exc:  # the graph cannot be read there: say where
                where = source_line(node) or node.name
                raise FrontendError(f"{where}: trying pattern {pattern.name}: {exc}") from exc
            if m is None or any(r in matches for r in m.roots):
                continue
            for r in m.roots:
                matches[r] = m
    return matches, notes


def format_matches(view: Any, matches: Mapping[Any, Match], notes: Mapping[Any, str]) -> str:
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
        info = ", ".join(f"{k}={v}" for k, v in m.info.items() if not is_node(v))
        lines.append(f"{m.pattern:15} {roots} <- ({reads})  {info}".rstrip())
        lines.append(f"{'':15} at {source_line(root) or '(no source line)'}")
    for node in sorted(notes, key=view.index.__getitem__):
        lines.append(f"{'not applied':15} {node.name}: {notes[node]}")
    return "\n".join(lines)


@dataclass
class Plan:
    """The needed nodes, each translated by a match or a rule, in dependency order."""

    units: list[Any] = field(default_factory=list)
    problems: list[tuple[Any, str]] = field(default_factory=list)
    needed: set[Any] = field(default_factory=set)


def _deps(front: Frontend, unit: Any) -> list[Any]:
    return list(unit.inputs) if isinstance(unit, Match) else front.reads(unit)


def plan(front: Frontend, matches: Mapping[Any, Match]) -> Plan:
    """Walk back from the outputs choosing each needed node's translation."""
    out = Plan()
    index = front.view.index
    unit_of: dict[Any, Any] = {}
    stack = [n for n in front.outputs() if is_node(n)]
    while stack:
        n = stack.pop()
        if n in unit_of:
            continue
        unit = matches.get(n, n)
        unit_of[n] = unit
        if isinstance(unit, Match):
            for r in unit.roots:
                unit_of[r] = unit
        elif n.op == "placeholder":
            continue
        else:
            why = front.check(n)
            if why is not None:
                out.problems.append((n, why))
        stack.extend(_deps(front, unit))
    out.needed = set(unit_of)
    units = list({id(u): u for u in unit_of.values()}.values())
    pos = {id(u): min(index[r] for r in (u.roots if isinstance(u, Match) else (u,))) for u in units}
    deps = {
        id(u): {id(unit_of[d]) for d in _deps(front, u) if d in unit_of} - {id(u)} for u in units
    }
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


def _message(
    front: Frontend,
    name: str,
    problems: Sequence[tuple[Any, str]],
    notes: Mapping[Any, str],
    needed: set[Any],
) -> str:
    """One message listing every operation without a translation, in graph order."""
    index = front.view.index
    lines = [f"{name}: {len(problems)} operation(s) have no translation to the layer graph:"]
    for node, why in sorted(problems, key=lambda p: index[p[0]]):
        lines.append(f"  - {front.describe(node)}")
        lines.append(f"      why: {why}")
        if node in notes:
            lines.append(f"      pattern tried: {notes[node]}")
    listed = {n for n, _ in problems}
    near = sorted(
        (
            n
            for n in notes
            if n not in listed and (n in needed or any(u in needed for u in n.users))
        ),
        key=index.__getitem__,
    )
    if near:
        lines.append("  Patterns that nearly applied (their nodes are translated one by one):")
        lines += [f"  - {front.describe(node)}: {notes[node]}" for node in near]
    lines.append(f"What to do: {front.advice}")
    return "\n".join(lines)


def raise_graph(front: Frontend, patterns: Sequence[Pattern], em: Any, name: str) -> None:
    """Raise the graph of ``front`` into ``em``'s layer graph (see the module docstring)."""
    matches, notes = find_matches(front.view, patterns)
    p = plan(front, matches)
    problems = list(p.problems)
    skip = {id(n) for n, _ in problems}
    for unit in p.units:
        if id(unit) in skip or not all(front.has(em, d) for d in _deps(front, unit)):
            continue  # no translation, or downstream of a problem
        root = unit.roots[0] if isinstance(unit, Match) else unit
        try:
            if isinstance(unit, Match):
                for r, v in zip(unit.roots, unit.emit(em)):
                    front.bind(em, r, v)
            elif unit.op != "placeholder":
                front.translate(em, unit)
        except NoMatch as exc:
            where = f"{unit.pattern}: " if isinstance(unit, Match) else ""
            problems.append((root, where + exc.reason))
        except FrontendError as exc:
            if isinstance(unit, Match):
                raise
            problems.append((root, str(exc)))
    if problems:
        raise UnsupportedOperatorError(_message(front, name, problems, notes, p.needed))
