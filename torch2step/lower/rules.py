"""One lowering rule per layer operator (STYLE.md: a table from class to function).

Each rule reads its inputs' row streams from HBM (:mod:`.context`), applies STeP operators and
stores its outputs.  Row-wise operators (RMSNorm, LayerNorm, Rotary, Softmax, elementwise,
reductions) are ``Map`` s over row tiles (STeP §3.2.4); Linear is :mod:`.linear`; the router is a
``Map(topk_route)`` per token; the routed experts and decode attention are the STeP example
graphs of :mod:`torch2step.lower.blocks` (STeP §5: dynamic tiling of experts by a
``Partition`` on data selectors; online-softmax attention over ragged KV).  Data movement
between rows (permutations, slices and concatenations along a non-last dimension) is a
``RandomOffChipStore`` of each source row at the row a host-computed index tensor names.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from torch2step.layers import ops as L
from torch2step.layers.graph import Node
from torch2step.step import fn
from torch2step.step.fn_library_layers import LAYERNORM_FNS

from .context import LowerCtx
from .linear import lower_linear
from .rules_broadcast import lower_elementwise
from .rules_index import lower_arange, lower_concat, lower_permute, lower_slice
from .rules_models import lower_attention, lower_moe, lower_topk
from .rules_tensor import (
    lower_concat_cols,
    lower_gather,
    lower_matmul,
    lower_slice_elements,
    lower_transpose,
)

__all__ = ["RULES"]


def _linear(ctx: LowerCtx, n: Node) -> None:
    b = n.inputs[2] if len(n.inputs) > 2 else None
    lower_linear(ctx, n.inputs[0], n.inputs[1], b, n.outputs[0])


def _reshape(ctx: LowerCtx, n: Node) -> None:
    src, out = n.inputs[0], n.outputs[0]
    p = ctx.placed[src]
    _, cols = ctx.rc(out)
    sc = p.tensor.shape[-1]
    if sp.simplify(sp.Mod(sc, cols)) == 0 or sp.simplify(sp.Mod(cols, sc)) == 0:
        ctx.alias(out, src)
        return
    raise ctx.fail(
        f"a view of rows of {p.cols} elements as rows of {cols} elements needs a re-layout "
        "that is not implemented; keep the last dimension or split/merge it by whole factors"
    )


def _unit_permute(shape: tuple, dims: tuple[int, ...]) -> bool:
    """True when the permutation only moves size-1 axes (so memory order is unchanged)."""
    kept = [d for d in dims if shape[d] != 1]
    return kept == sorted(kept)


def _permute(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.Permute)
    shape = ctx.type(n.inputs[0]).shape
    if _unit_permute(shape, op.dims):
        ctx.alias(n.outputs[0], n.inputs[0])
    elif op.dims[-1] != len(op.dims) - 1:
        lower_transpose(ctx, n)
    else:
        lower_permute(ctx, n)


def _last(ctx: LowerCtx, n: Node, dim: int) -> bool:
    return dim % len(ctx.shape(n.inputs[0])) == len(ctx.shape(n.inputs[0])) - 1


def _concat(ctx: LowerCtx, n: Node) -> None:
    assert isinstance(n.op, L.Concat)
    (lower_concat_cols if _last(ctx, n, n.op.dim) else lower_concat)(ctx, n)


def _slice(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.Slice)
    static = ctx.sym(op.start).is_Integer and ctx.sym(op.end).is_Integer
    (lower_slice_elements if _last(ctx, n, op.dim) and not static else lower_slice)(ctx, n)


def _rmsnorm(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.RMSNorm)
    rows = ctx.load_row_tiles(n.inputs[0])  # [k, D] tiles: the weight row broadcasts
    w = ctx.broadcast_row(n.inputs[1], rows)
    ctx.store_rows(ctx.graph.map(fn("rmsnorm", eps=op.eps), rows, w), n.outputs[0])


def _layernorm(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.LayerNorm)
    rows = ctx.load_row_tiles(n.inputs[0])  # [k, D] tiles: gain and bias rows broadcast
    wb = [ctx.broadcast_row(v, rows) for v in n.inputs[1:]]
    name = LAYERNORM_FNS[(op.weight, op.bias)]
    ctx.store_rows(ctx.graph.map(fn(name, eps=op.eps), rows, *wb), n.outputs[0])


def _softmax(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.Softmax)
    rank = len(ctx.type(n.inputs[0]).shape)
    if op.dim % max(rank, 1) != rank - 1:
        raise ctx.fail("softmax over a non-last dimension is not supported; permute first")
    rows = ctx.load_rows(n.inputs[0])
    ctx.store_rows(ctx.graph.map("softmax_row", rows), n.outputs[0])


def _reduce(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.Reduce)
    rank = len(ctx.type(n.inputs[0]).shape)
    if {d % rank for d in op.dims} != {rank - 1}:
        raise ctx.fail(f"{op.fn} over dims {op.dims}: only the last dimension is supported")
    rows = ctx.load_rows(n.inputs[0])
    ctx.store_rows(ctx.graph.map(fn("reduce_row", fn=op.fn), rows), n.outputs[0])


def _cast(ctx: LowerCtx, n: Node) -> None:
    """A ``Map(cast)`` over the rows; over single elements (``[1, 1]`` tiles) when the last
    dim is dynamic, as an elementwise operator does (an off-chip tile is statically sized)."""
    if not sp.sympify(ctx.rc(n.inputs[0])[1]).is_Integer:
        src = ctx.flat(ctx.graph.linear_load(ctx.placed[n.inputs[0]].tensor, (1, 1)))
        y = ctx.graph.map(fn("cast", dtype=ctx.dtype(n.outputs[0])), src)
        ctx.graph.linear_store(y, ctx.declare(n.outputs[0]))
        return
    rows = ctx.load_rows(n.inputs[0])
    y = ctx.graph.map(fn("cast", dtype=ctx.dtype(n.outputs[0])), rows)
    ctx.store_rows(y, n.outputs[0])


def _rotary(ctx: LowerCtx, n: Node) -> None:
    op = n.op
    assert isinstance(op, L.Rotary)
    x, pos = n.inputs
    bsz, heads, seq, _ = ctx.shape(x)
    pb, ps = ctx.shape(pos)
    if sp.simplify(ps - seq) != 0 or not (pb == 1 or sp.simplify(pb - bsz) == 0):
        raise ctx.fail(f"positions {[pb, ps]} do not match x's batch and sequence")
    pt = ctx.placed[pos].tensor
    g = ctx.graph
    if sp.sympify(seq) == 1:  # decode: each request's position read once, repeated per head
        rows = ctx.load_row_tiles(x)
        k = int(rows.type.dtype.shape[0])  # [k, D] tiles of k heads of one request share it
        if k > 1 and not (sp.sympify(heads).is_Integer and int(heads) % k == 0):
            rows, k = ctx.flat(g.flat_map(rows, fn("retile_streamify", rows=1))), 1
        p = g.linear_load(pt, (1, 1), out_shape=(bsz,), stride=(0 if pb == 1 else 1,))
        if sp.simplify(sp.sympify(heads) / k - 1) != 0:
            p = g.repeat(p, sp.sympify(heads) / k)
    else:
        rows = ctx.load_rows(x)
        p = g.linear_load(
            pt, (1, 1), out_shape=(bsz, heads, seq), stride=(0 if pb == 1 else seq, 0, 1)
        )
    y = g.map(
        fn(
            "rotary",
            theta=op.theta,
            rotary_dim=op.rotary_dim,
            table_dtype=op.table_dtype,
            **({"inv_freq": op.inv_freq} if op.inv_freq else {}),
        ),
        rows,
        ctx.flat(p),
    )
    ctx.store_rows(y, n.outputs[0])


RULES: dict[type[L.LayerOp], Callable[[LowerCtx, Node], None]] = {
    L.Linear: _linear,
    L.Reshape: _reshape,
    L.Permute: _permute,
    L.Elementwise: lower_elementwise,
    L.RMSNorm: _rmsnorm,
    L.LayerNorm: _layernorm,
    L.Softmax: _softmax,
    L.Reduce: _reduce,
    L.Cast: _cast,
    L.Rotary: _rotary,
    L.Arange: lower_arange,
    L.Concat: _concat,
    L.Slice: _slice,
    L.Gather: lower_gather,
    L.MatMul: lower_matmul,
    L.TopKRouting: lower_topk,
    L.MoEExperts: lower_moe,
    L.Attention: lower_attention,
}
"""Layer operator class -> lowering rule."""
