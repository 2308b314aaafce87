"""Row movement: permutations, slices and concatenations along leading dimensions.

A layer value is a row-major matrix of rows (:mod:`.context`).  Moving data between leading
dimensions moves whole rows, so these operators lower to a ``RandomOffChipLoad`` (gather:
the output's rows in order, each read at the source row an index tensor names) or a
``RandomOffChipStore`` (scatter: each source row written at its output row) — the
dynamic-address off-chip operators of STeP §3.2.1.  The row indices are pure functions of
the run's sizes, so the host computes them at launch (:class:`~.context.HostIndex`).

A concatenation whose first operand is a module input and whose result is a module output is
a KV-cache append: the cache is resident in HBM, so the host places the first operand in the
result's storage and the program writes only the new rows (what vLLM's ``slot_mapping``
write does).  Every other concatenation copies all operands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import sympy as sp

from torch2step.layers import ops as L
from torch2step.layers.graph import Node

from .context import LowerCtx, Placed

__all__ = ["lower_arange", "lower_concat", "lower_permute", "lower_slice"]


def concrete(exprs: Sequence[Any], bindings: dict[str, int]) -> list[int]:
    """Evaluate sizes under the run's ``bindings`` (symbol name -> value)."""
    out = []
    for e in exprs:
        e = sp.sympify(e)
        if e.free_symbols:
            e = e.subs({s: bindings[str(s)] for s in e.free_symbols})
        out.append(int(e))
    return out


def _row_ids(shape: list[int]) -> np.ndarray:
    """Row numbers of a value of ``shape`` laid out by leading index."""
    lead = shape[:-1]
    return np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)


def _addr_stream(ctx: LowerCtx, base: str, shape: tuple, compute: Callable) -> Any:
    """Declare a host index tensor ``[n, 1]`` and stream its addresses ``[1, n]``."""
    n = sp.Integer(1)
    for d in shape[:-1]:
        n = n * d
    t = ctx.host_index(base, (n, 1), lambda b: compute(b).reshape(-1, 1))
    return ctx.flat(ctx.graph.linear_load(t, (1, 1)))


def _gather_rows(ctx: LowerCtx, n: Node, compute: Callable[[dict[str, int]], np.ndarray]) -> None:
    """Output rows in order, row ``r`` read from source row ``compute(b)[r]``."""
    src, out = n.inputs[0], n.outputs[0]
    p = ctx.placed[src]
    if sp.simplify(sp.Mod(p.tensor.shape[-1], p.cols)) != 0:
        raise ctx.fail(f"{src} is a view merging rows of {p.tensor.name}; cannot move its rows")
    addr = _addr_stream(ctx, ctx.prefix() + "_rows", ctx.shape(out), compute)
    rows = ctx.graph.random_load(addr, p.tensor, (1, int(p.cols)))
    ctx.store_rows(rows, out)


def lower_permute(ctx: LowerCtx, n: Node) -> None:
    """A permutation of the leading dimensions (the last stays last)."""
    op = n.op
    assert isinstance(op, L.Permute)
    rank = len(op.dims)
    if op.dims[-1] != rank - 1:
        raise ctx.fail(
            f"permutation {op.dims} moves the last dimension (a transpose of rows and "
            "columns); only permutations of leading dimensions are supported"
        )
    in_shape = ctx.shape(n.inputs[0])

    def compute(b: dict[str, int]) -> np.ndarray:
        ids = _row_ids(concrete(in_shape, b))
        return np.ascontiguousarray(ids.transpose(op.dims[:-1])).reshape(-1)

    src = ctx.placed[n.inputs[0]]
    if sp.simplify(src.tensor.shape[-1] - src.cols) == 0:
        _gather_rows(ctx, n, compute)
        return
    # the source is a view splitting wider rows (e.g. heads of a projection): read it in
    # order and scatter each row to its place, so run-time addresses name whole output rows
    rows = ctx.load_rows(n.inputs[0])
    addr = _addr_stream(ctx, ctx.prefix() + "_rows", in_shape, lambda b: np.argsort(compute(b)))
    ctx.graph.random_store(addr, rows, ctx.declare(n.outputs[0]))


def lower_slice(ctx: LowerCtx, n: Node) -> None:
    """``x[.., start:end, ..]``: columns by a ``Map(slice_cols)``, rows by a gather."""
    op = n.op
    assert isinstance(op, L.Slice)
    shape = ctx.shape(n.inputs[0])
    d = op.dim % len(shape)
    start, end = ctx.sym(op.start), ctx.sym(op.end)
    if d == len(shape) - 1:
        if not (start.is_Integer and end.is_Integer):
            raise ctx.fail("a column slice needs static bounds")
        rows = ctx.load_rows(n.inputs[0])
        f = ctx.graph.map
        from torch2step.step import fn

        ctx.store_rows(f(fn("slice_cols", start=int(start), end=int(end)), rows), n.outputs[0])
        return

    def compute(b: dict[str, int]) -> np.ndarray:
        ids = _row_ids(concrete(shape, b))
        lo, hi = concrete([start, end], b)
        return np.take(ids, np.arange(lo, hi), axis=d).reshape(-1)

    _gather_rows(ctx, n, compute)


def lower_arange(ctx: LowerCtx, n: Node) -> None:
    """``arange(start, end)``: positions the host computes (``position_ids``)."""
    op = n.op
    assert isinstance(op, L.Arange)
    start, end = ctx.sym(op.start), ctx.sym(op.end)
    size = sp.simplify(end - start)

    def compute(b: dict[str, int]) -> np.ndarray:
        lo, hi = concrete([start, end], b)
        return np.arange(lo, hi, dtype=np.int64).reshape(1, -1)

    t = ctx.host_index(n.outputs[0], (1, size), compute)
    ctx.placed[n.outputs[0]] = Placed(t, sp.Integer(1), size)


def lower_concat(ctx: LowerCtx, n: Node) -> None:
    """Concatenation along a leading dimension (scatter of each operand's rows)."""
    op = n.op
    assert isinstance(op, L.Concat)
    out = n.outputs[0]
    oshape = ctx.shape(out)
    d = op.dim % len(oshape)
    if d == len(oshape) - 1:
        raise ctx.fail("concatenation along the last dimension is not supported")
    t = ctx.declare(out)
    offsets: list[sp.Expr] = [sp.Integer(0)]
    for v in n.inputs:
        offsets.append(offsets[-1] + ctx.shape(v)[d])

    def rows_for(i: int) -> Callable[[dict[str, int]], np.ndarray]:
        def compute(b: dict[str, int]) -> np.ndarray:
            ids = _row_ids(concrete(oshape, b))
            lo, hi = concrete([offsets[i], offsets[i + 1]], b)
            return np.take(ids, np.arange(lo, hi), axis=d).reshape(-1)

        return compute

    in_place = n.inputs[0] in ctx.layer.inputs and out in ctx.layer.outputs
    for i, v in enumerate(n.inputs):
        if i == 0 and in_place:
            ctx.prefill[t.name] = (v, rows_for(0))
            continue
        rows = ctx.load_rows(v)
        addr = _addr_stream(ctx, f"{ctx.prefix()}_rows{i}", ctx.shape(v), rows_for(i))
        ctx.graph.random_store(addr, rows, t)
