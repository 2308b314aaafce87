"""Positions computed from sizes alone, recognised by their values.

A decode or prefill step computes its RoPE positions from the cache length ``P`` in many
spellings — ``torch.arange(P, P + S)``, ``torch.arange(S) + P``, ``torch.full((B, 1), P)``,
``torch.zeros(B, 1) + P``, ``torch.arange(P + S)[-S:]`` ... — all of them the same tensor:
``start + j`` along the last axis (the same for every row), ``start`` a function of the sizes.
Such a node reads no run-time tensor, so it is *run* (:func:`~torch2step.frontend.fx_probe.
run_slice`) at the example sizes and at shifted sizes, ``start`` is fitted as an affine function
of the sizes and checked at a third binding; the positions are then one
:class:`~torch2step.layers.ops.Arange` whatever arithmetic produced them.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from torch2step.frontend.fx_pattern import NoMatch
from torch2step.frontend.fx_probe import run_slice, upstream
from torch2step.frontend.fx_view import ProgramView, raw_shape
from torch2step.layers.ops import Dim

__all__ = ["symbolic_positions"]


def _start(view: ProgramView, node: fx.Node, binding: dict[sympy.Symbol, int]) -> int | None:
    """``start`` when ``node`` evaluates to ``start + j`` along its last axis at ``binding``."""
    try:
        (v,) = run_slice(view, [node], {}, binding)
    except NoMatch:
        return None
    if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dim() == 0:
        return None
    rows = v.reshape(-1, v.shape[-1]).long()
    if rows.numel() == 0:
        return None
    want = rows[0, 0] + torch.arange(rows.shape[1])
    if not bool((rows == want).all()):
        return None
    return int(rows[0, 0])


def symbolic_positions(view: ProgramView, node: fx.Node) -> tuple[Dim, Dim] | None:
    """``(start, length)`` in the layer graph's dims when ``node`` holds the positions
    ``start + j`` (``j < length``, the last axis) computed from sizes only; else None."""
    base = dict(view.hints)
    nodes = upstream(view, [node], [], base)
    if any(n.op == "placeholder" for n in nodes):
        return None  # reads a run-time tensor (e.g. kv_lengths): not a function of sizes
    syms: set[sympy.Symbol] = set()
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt):
            syms |= v.node.expr.free_symbols
        elif isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt):
                    syms |= d.node.expr.free_symbols
    syms = {s for s in syms if s in base}
    s0 = _start(view, node, base)
    if s0 is None:
        return None
    expr: sympy.Expr = sympy.Integer(s0)
    for s in sorted(syms, key=str):
        shifted = _start(view, node, {**base, s: base[s] + 1})
        if shifted is None:
            return None
        expr += (shifted - s0) * (s - base[s])
    check = {s: base[s] + 3 for s in syms}
    if syms and _start(view, node, {**base, **check}) != int(expr.subs({**base, **check})):
        return None  # not affine in the sizes
    start = view.expr(sympy.expand(expr))
    return start, view.expr(raw_shape(node)[-1])
