"""Symbolic performance metrics of a STeP graph (STeP §4.1).

"Every STeP operator implements a function that returns the symbolic expression for the
off-chip traffic in bytes made by that operator" and one for its on-chip memory requirement;
the graph's totals are the sums over operators.  The expressions are sympy formulas of the
dynamic sizes (ragged sizes appear in ``Sum``/``MaxOver``); ``Metrics.evaluate(env)``
substitutes a run's values (e.g. ``RunResult.bindings``).

Per-operator rules (the methods ``offchip_read_bytes``, ``offchip_write_bytes``,
``onchip_bytes`` next to each operator's shape rule):

* off-chip operators: traffic = output (store: input) cardinality x element size;
  on-chip = ``|tile| x 2`` (double buffering), taken over the elements that exist;
* Bufferize: ``|in| + ||buffer|| x |in| x 2``;
* Accum, Scan, Expand (and Repeat): ``|output element|``;
* Map / Accum / Scan with a matrix product: ``16 x in_tile_col + |weight tile|`` more;
* everything else: 0.

With ragged shapes an operator's requirement is the largest over the elements (``MaxOver``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy as sp

from .evaluate import evaluate, evaluate_bound, normalise_env
from .graph import Program
from .node_signature import FormulaTemplate, signature, size_vs_number
from .op_base import Op
from .ops_memory import (
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipStore,
)

__all__ = [
    "Metrics",
    "metrics",
    "node_metrics",
    "offchip_traffic",
    "onchip_memory",
    "total_flops",
]


@dataclass(frozen=True)
class Metrics:
    """Symbolic metrics of a graph: totals and per node (bytes / FLOPs)."""

    offchip_read_bytes: sp.Expr
    offchip_write_bytes: sp.Expr
    onchip_bytes: sp.Expr
    flops: sp.Expr
    by_node: dict[str, dict[str, sp.Expr]]

    @property
    def offchip_bytes(self) -> sp.Expr:
        """Off-chip traffic: reads + writes."""
        return self.offchip_read_bytes + self.offchip_write_bytes

    def evaluate(self, env: Mapping[str, Any] | None = None, **values: Any) -> dict[str, Any]:
        """Numbers for one run: offchip_bytes, offchip_read/write_bytes, onchip_bytes, flops,
        and operational_intensity (FLOPs per off-chip byte; ``inf`` without traffic)."""
        full = normalise_env({**(env or {}), **values})  # once for the four formulas
        out = {
            "offchip_read_bytes": evaluate_bound(sp.sympify(self.offchip_read_bytes), full),
            "offchip_write_bytes": evaluate_bound(sp.sympify(self.offchip_write_bytes), full),
            "onchip_bytes": evaluate_bound(sp.sympify(self.onchip_bytes), full),
            "flops": evaluate_bound(sp.sympify(self.flops), full),
        }
        out["offchip_bytes"] = out["offchip_read_bytes"] + out["offchip_write_bytes"]
        out["operational_intensity"] = (
            out["flops"] / out["offchip_bytes"] if out["offchip_bytes"] else float("inf")
        )
        return out

    def evaluate_by_node(self, env: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Per node: the same quantities as numbers."""
        return {
            name: {k: evaluate(v, env or {}) for k, v in row.items()}
            for name, row in self.by_node.items()
        }


def _gate(term: sp.Expr) -> tuple[sp.Basic, sp.Expr] | None:
    """``c * Piecewise((v, cond), (0, True))`` -> ``(cond, c * v)``."""
    coeff, pieces = sp.Integer(1), []
    for f in sp.Mul.make_args(term):
        if isinstance(f, sp.Piecewise):
            pieces.append(f)
        else:
            coeff = coeff * f
    if len(pieces) != 1:
        return None
    args = pieces[0].args
    if len(args) != 2 or args[1].expr != 0 or args[1].cond is not sp.true:
        return None
    return args[0].cond, coeff * args[0].expr


def collect_gated(expr: sp.Expr) -> sp.Expr:
    """Merge the terms ``c_k * Piecewise((v_k, cond), (0, True))`` sharing a condition into one
    ``Piecewise((sum_k c_k v_k, cond), (0, True))`` (readable totals, same value)."""
    groups: dict[sp.Basic, sp.Expr] = {}
    rest = []
    for term in sp.Add.make_args(sp.expand(expr, deep=False, mul=True, multinomial=False)):
        g = _gate(term)
        if g is None:
            rest.append(term)
        else:
            groups[g[0]] = groups.get(g[0], sp.Integer(0)) + g[1]
    gated = [_gated(v, c) for c, v in groups.items()]
    return sp.Add(*rest, *gated)


def _gated(v: sp.Expr, cond: sp.Basic) -> sp.Expr:
    """``Piecewise((v, cond), (0, True))``; built without sympy's piecewise evaluation when it
    would leave it unchanged: ``cond`` compares a size with a number and ``v`` is neither 0
    nor a piecewise (nothing to collapse)."""
    if size_vs_number(cond) and v != 0 and not isinstance(v, sp.Piecewise):
        return sp.Piecewise((v, cond), (0, True), evaluate=False)
    return sp.Piecewise((v, cond), (0, True))


_ADDRESS_ONLY: dict[type, frozenset[str]] = {
    cls: frozenset({"base"})
    for cls in (LinearOffChipLoad, LinearOffChipStore, RandomOffChipLoad, RandomOffChipStore)
}
"""Fields the §4.1 formulas do not read: an off-chip operator's first tile address moves no
byte and allocates nothing (one expert's weight loads differ from another's only there)."""


def node_metrics(op: Op) -> dict[str, sp.Expr]:
    """The four §4.1 formulas of one node, computed from its rules."""
    return {
        "offchip_read_bytes": sp.sympify(op.offchip_read_bytes()),
        "offchip_write_bytes": sp.sympify(op.offchip_write_bytes()),
        "onchip_bytes": sp.sympify(op.onchip_bytes()),
        "flops": sp.sympify(op.flops()),
    }


def metrics(program: Program) -> Metrics:
    """Off-chip traffic, on-chip memory requirement and FLOPs of ``program``.

    Nodes equal up to renaming (one per expert, head...) share one computation of their
    formulas (:mod:`torch2step.step.node_signature`): the first is computed from its rules,
    the others are renamed copies, equal to computing them again.
    """
    by_node: dict[str, dict[str, sp.Expr]] = {}
    templates: dict[tuple, FormulaTemplate | None] = {}
    keys: dict = {}
    renamed: dict = {}
    for op in program.nodes:
        sig = signature(op, keys, _ADDRESS_ONLY)
        if sig is None:
            by_node[op.name] = node_metrics(op)
            continue
        if sig.key in templates:
            template = templates[sig.key]
            by_node[op.name] = (
                node_metrics(op) if template is None else template.rename(sig, renamed)
            )
            continue
        row = by_node[op.name] = node_metrics(op)
        templates[sig.key] = FormulaTemplate.of(row, sig)

    def total(key: str) -> sp.Expr:
        return collect_gated(sp.Add(*(row[key] for row in by_node.values())))

    return Metrics(
        total("offchip_read_bytes"),
        total("offchip_write_bytes"),
        total("onchip_bytes"),
        total("flops"),
        by_node,
    )


def offchip_traffic(program: Program) -> sp.Expr:
    """Total off-chip bytes (reads + writes) as a formula."""
    return metrics(program).offchip_bytes


def onchip_memory(program: Program) -> sp.Expr:
    """Total on-chip memory requirement in bytes as a formula."""
    return metrics(program).onchip_bytes


def total_flops(program: Program) -> sp.Expr:
    """Total FLOPs of the tile functions as a formula."""
    return metrics(program).flops
