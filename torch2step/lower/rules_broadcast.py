"""Elementwise operators with any broadcast (STeP (arXiv 2511.07776) §3.2.4 ``Map`` over row
tiles, §3.2.1 off-chip loads).

Operands are aligned to the output's shape from the right, as in PyTorch.  Each operand's
row stream follows the output's rows:

* its leading dims equal the output's: its own rows (one LinearOffChipLoad);
* its leading dims are all 1: its single row, loaded once and repeated on chip (Expand);
* otherwise (a broadcast along an inner leading dim, e.g. ``[B, 1, D] + [S, D]``): a
  RandomOffChipLoad of its row ``idx[r]`` for output row ``r``, the indices a host-computed
  tensor (the broadcast of the operand's row numbers to the output's leading shape), so each
  row read is counted in the §4.1 off-chip traffic.

The last dim is either equal or 1 (a per-row scalar, broadcast inside the tile function).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import sympy as sp

from torch2step.layers import ops as L
from torch2step.layers.graph import Node
from torch2step.step import fn

from .context import LowerCtx
from .rules_index import _addr_stream, concrete

__all__ = ["lower_elementwise"]

_SCALAR_FNS = {"add_scalar", "mul_scalar", "pow_scalar"}


def _eq(a: Any, b: Any) -> bool:
    return sp.simplify(sp.sympify(a) - sp.sympify(b)) == 0


def _aligned(ctx: LowerCtx, v: str, rank: int, unit: bool) -> tuple[sp.Expr, ...]:
    shape = ctx.shape(v)
    if len(shape) > rank:
        raise ctx.fail(f"{v} {list(shape)} has more dims than the output")
    return (*(sp.Integer(1),) * (rank - len(shape)), *shape, *((sp.Integer(1),) if unit else ()))


def _gather(ctx: LowerCtx, v: str, lead_v: tuple, lead_o: tuple, oshape: tuple, unit: bool) -> Any:
    """Rows of ``v`` in output-row order through host-computed addresses."""
    p = ctx.placed[v]
    tensor = p.tensor
    if not unit and not (_eq(tensor.shape[-1], p.cols) and p.cols.is_Integer):
        tensor = ctx.tensor_as(v, ctx.rc(v))

    def compute(b: dict[str, int]) -> np.ndarray:
        src = concrete(lead_v, b)
        ids = np.arange(int(np.prod(src, dtype=np.int64)), dtype=np.int64).reshape(src)
        return np.broadcast_to(ids, concrete(lead_o, b)).reshape(-1)

    addr = _addr_stream(ctx, ctx.prefix() + "_bcast", oshape, compute)
    return ctx.graph.random_load(addr, tensor, (1, 1 if unit else int(p.cols)))


def _own(ctx: LowerCtx, v: str, unit: bool) -> Any:
    if not unit:
        return ctx.load_rows(v)
    return ctx.flat(ctx.graph.linear_load(ctx.placed[v].tensor, (1, 1)))


def lower_elementwise(ctx: LowerCtx, n: Node) -> None:
    """``out = fn(*inputs)`` with broadcasting (see the module docstring).  An output whose
    last dim is dynamic is streamed element by element (``[1, 1]`` tiles: an off-chip tile
    is statically sized)."""
    op = n.op
    assert isinstance(op, L.Elementwise)
    out = n.outputs[0]
    oshape = ctx.shape(out) or (sp.Integer(1),)
    unit = not sp.sympify(oshape[-1]).is_Integer
    if unit:
        oshape = (*oshape, sp.Integer(1))
    rank = len(oshape)
    lead_o = oshape[:-1]
    shapes = {v: _aligned(ctx, v, rank - unit, unit) for v in n.inputs}
    for v, s in shapes.items():
        if not (_eq(s[-1], oshape[-1]) or _eq(s[-1], 1)):
            raise ctx.fail(f"{v} {list(ctx.shape(v))} does not broadcast to {list(oshape)}")
    own = [v for v in n.inputs if all(_eq(a, b) for a, b in zip(shapes[v][:-1], lead_o))]
    one = [v for v in n.inputs if v not in own and all(_eq(a, 1) for a in shapes[v][:-1])]
    # One stream per distinct operand, fanned out to each position that reads it (``x * x``):
    # loading a value once per position would leave all but the last load unconsumed.
    streams: dict[str, Any] = {}
    for v in dict.fromkeys(n.inputs):
        if v in own:
            streams[v] = _own(ctx, v, unit)
        elif v not in one:
            streams[v] = _gather(ctx, v, shapes[v][:-1], lead_o, oshape, unit)
    if not streams:  # every operand is one row: the output has one row too
        streams[n.inputs[0]] = _own(ctx, n.inputs[0], unit)
    ref = next(iter(streams.values()))
    for v in one:
        if v not in streams:
            streams[v] = ctx.graph.expand(_own(ctx, v, unit), ref, 0)
    f = fn(op.fn, value=op.scalar) if op.fn in _SCALAR_FNS else fn(op.fn)
    y = ctx.graph.map(f, *(streams[v] for v in n.inputs))
    if unit:
        ctx.graph.linear_store(y, ctx.declare(out))
    else:
        ctx.store_rows(y, out)
