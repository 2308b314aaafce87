"""On-chip memory counted as the STeP paper's published figures count it (STeP, arXiv
2511.07776, §4.1 and the figures of §5.2-§5.3).

:func:`torch2step.step.metrics.metrics` implements the §4.1 *text*: an off-chip operator
holds two tiles (double buffering) and a Map / Accum with a matrix product also holds
``16 x in_tile_col`` input elements and its weight tile.  The paper's figures were produced by
its artifact with the operators' default accounting, which differs in three places:

* an off-chip load or store holds **one** staging tile (its double-buffered mode is not used);
* a Map (also one with a matrix product) holds nothing: only stateful operators count;
* on-chip tiles of computed values are held at 4 bytes per element (the artifact's tiles of
  activations are ``Float32`` while the weights it streams are bf16).

Everything else is the §4.1 rule: an Accum / Scan holds its output element (the state), a
Repeat / Expand its element (a Repeat of count 1 only renames a dim and holds nothing), a
Bufferize ``|tile| + 2 ||buffer||``, a Streamify ``||buffer|| + |tile|``.  As in §4.1 with
ragged shapes, an operator's requirement is its largest over the elements that exist, so an
expert without tokens holds nothing (the artifact subtracts such experts' units explicitly).

Used by ``benchmarks/step_figures.py`` to compare on-chip ratios with the paper's figures;
reports keep the §4.1 text accounting and the simulated peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy as sp

from .evaluate import evaluate
from .graph import Program
from .op_base import Op
from .ops_compute import Accum, Scan
from .ops_memory import (
    Bufferize,
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipStore,
    Streamify,
)
from .ops_shape import Expand, Repeat
from .types import BufferType, DataType, TileType, TupleType

__all__ = ["onchip_bytes_artifact", "onchip_rule_artifact"]

_FLOATS = frozenset({"fp32", "bf16", "fp16", "fp8"})


def _held(t: DataType, compute_itemsize: int) -> sp.Expr:
    """Bytes of one on-chip element: float tiles at ``compute_itemsize`` bytes per value."""
    if isinstance(t, TileType):
        size = compute_itemsize if t.dtype in _FLOATS else t.itemsize
        return t.shape[0] * t.shape[1] * size
    if isinstance(t, TupleType):
        return sp.Add(*(_held(e, compute_itemsize) for e in t.elems))
    return t.nbytes()


def onchip_rule_artifact(op: Op, compute_itemsize: int = 4) -> sp.Expr:
    """The on-chip bytes of one operator as the paper's figures count them (module doc)."""
    if isinstance(op, (LinearOffChipLoad, RandomOffChipLoad)):
        return op.out_types()[0].peak(op.tile.nbytes())
    if isinstance(op, (LinearOffChipStore, RandomOffChipStore)):
        t = op.input.type if isinstance(op, LinearOffChipStore) else op.wdata.type
        return t.peak(t.dtype.nbytes())
    if isinstance(op, (Accum, Scan, Expand)):
        out = op.out_types()[0]
        return out.peak(_held(out.dtype, compute_itemsize))
    if isinstance(op, Repeat):
        if sp.sympify(op.count) == 1:
            return sp.Integer(0)
        out = op.out_types()[0]
        return out.peak(_held(out.dtype, compute_itemsize))
    if isinstance(op, Bufferize):
        return op.onchip_bytes()
    if isinstance(op, Streamify):
        buf = op.input.type.dtype
        assert isinstance(buf, BufferType)
        out = op.out_types()[0]
        return op.input.type.peak(buf.buffer_bytes()) + out.peak(out.dtype.nbytes())
    return sp.Integer(0)


def onchip_bytes_artifact(
    program: Program, env: Mapping[str, Any] | None = None, *, compute_itemsize: int = 4
) -> int:
    """Total on-chip bytes of ``program`` for one run's sizes ``env`` (e.g.
    ``RunResult.bindings``), counted as the paper's figures count them."""
    total = 0
    cache: dict[sp.Expr, int] = {}
    for op in program.nodes:
        expr = onchip_rule_artifact(op, compute_itemsize)
        if expr == 0:
            continue
        if expr not in cache:
            cache[expr] = int(evaluate(expr, env or {}))
        total += cache[expr]
    return total
