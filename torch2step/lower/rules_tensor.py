"""General tensor operators: batched matmul, data movement along the last dimension, transposes
that are not views, and ``index_select`` along any dimension.

* ``MatMul`` ``a [.., M, K] @ b [.., K, N]`` (batch dims broadcast as in PyTorch): ``a``'s rows
  stream in output order (a LinearOffChipLoad with stride 0 along the batch dims ``a``
  broadcasts), ``b``'s ``[K, N]`` matrix of each batch element is loaded once as one tile and
  repeated along that batch element's ``M`` rows (STeP (arXiv 2511.07776) §3.2.5 ``Expand``),
  and ``Map(matmul)`` makes each output row (§3.2.4): ``2 * K * N`` FLOPs per row, ``b`` read
  once per batch element, which is what the §4.1 metrics count.
* Concatenation along the last dimension: a ``Map(concat_cols)`` over the operands' row
  streams zipped (static widths); data-dependent widths move elements (below).
* ``index_select`` along the last dimension: ``Map(gather_cols)`` of each row with the index
  row (loaded once and repeated on chip); along a leading dimension, the source row of every
  output row is ``pre * S_d * P + idx[i] * P + post`` — computed on chip from the index data
  (``Map(affine)`` then ``Map(add)`` with host-computed offsets) and read by a
  RandomOffChipLoad (§3.2.1): the addresses depend on data, so the host cannot precompute them.
* A permutation that moves the last dimension (a transpose of rows and columns), or a slice
  of the last dimension with dynamic bounds, moves single elements: a RandomOffChipLoad of
  ``[1, 1]`` tiles at host-computed element addresses (any view keeps row-major element
  order, so the address of an element is its flat index) stored in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import sympy as sp

from torch2step.layers import ops as L
from torch2step.layers.graph import Node
from torch2step.step import fn
from torch2step.step import fn_library_tensor as _fn_tensor  # noqa: F401  (registers functions)

from .context import LowerCtx
from .rules_index import _addr_stream, concrete

__all__ = [
    "lower_concat_cols",
    "lower_gather",
    "lower_matmul",
    "lower_slice_elements",
    "lower_transpose",
]


def _prod(dims: Any) -> sp.Expr:
    out = sp.Integer(1)
    for d in dims:
        out = out * sp.sympify(d)
    return out


def _eq(a: Any, b: Any) -> bool:
    return sp.simplify(sp.sympify(a) - sp.sympify(b)) == 0


def _strides(shape: tuple, out: tuple, unit: sp.Expr) -> tuple[sp.Expr, ...]:
    """Row-major strides (in ``unit`` s) of ``shape`` aligned right to ``out``; 0 where a
    dimension of size 1 broadcasts."""
    shape = (*(sp.Integer(1),) * (len(out) - len(shape)), *shape)
    strides: list[sp.Expr] = []
    acc = sp.sympify(unit)
    for s, o in zip(reversed(shape), reversed(out)):
        strides.append(sp.Integer(0) if _eq(s, 1) and not _eq(o, 1) else acc)
        acc = acc * s
    return tuple(reversed(strides))


def _exact(ctx: LowerCtx, v: str, width: Any) -> Any:
    """``v``'s storage as rows of exactly ``width`` elements (a copy when it is a view of
    rows of another width)."""
    p = ctx.placed[v]
    if _eq(p.tensor.shape[-1], width) and len(p.tensor.shape) == 2:
        return p.tensor
    return ctx.tensor_as(v, (p.rows, width))


def lower_matmul(ctx: LowerCtx, n: Node) -> None:
    """Batched ``a @ b`` (see the module docstring)."""
    a, b = n.inputs
    out = n.outputs[0]
    ash, bsh, osh = ctx.shape(a), ctx.shape(b), ctx.shape(out)
    k, width = bsh[-2], bsh[-1]
    if not (k.is_Integer and width.is_Integer):
        raise ctx.fail(
            f"MatMul with b {list(bsh)}: the contracted and output widths must be static "
            "(a data-dependent width is attention: raise it as Attention)"
        )
    batch, m = osh[:-2], osh[-2]
    a_rows = ctx.graph.linear_load(
        _exact(ctx, a, k),
        (1, int(k)),
        out_shape=(*batch, m),
        stride=(*_strides(ash[:-2], batch, ash[-2]), 1),
    )
    b_tiles = ctx.graph.linear_load(
        _exact(ctx, b, width),
        (int(k), int(width)),
        out_shape=(*batch, 1),
        stride=(*_strides(bsh[:-2], batch, 1), 0),
    )
    b_rep = ctx.graph.expand(b_tiles, a_rows, 0)
    y = ctx.graph.map("matmul", a_rows, b_rep)
    ctx.store_rows(ctx.flat(y), out)


def lower_concat_cols(ctx: LowerCtx, n: Node) -> None:
    """Concatenation along the last dimension: ``Map(concat_cols)`` over zipped row streams."""
    widths = [ctx.shape(v)[-1] for v in n.inputs]
    if not all(sp.sympify(w).is_Integer for w in widths):
        oshape = ctx.shape(n.outputs[0])
        offsets = [sp.Integer(0)]
        for w in widths:
            offsets.append(offsets[-1] + w)
        t = ctx.declare(n.outputs[0])
        for i, v in enumerate(n.inputs):
            vshape = ctx.shape(v)

            def compute(b: dict[str, int], i: int = i) -> np.ndarray:
                lo, hi = concrete([offsets[i], offsets[i + 1]], b)
                return np.ascontiguousarray(_flat_ids(oshape, b)[..., lo:hi]).ravel()

            elems = _elements(ctx, v)
            addr = _addr_stream(ctx, f"{ctx.prefix()}_elems{i}", (*vshape, 1), compute)
            ctx.graph.random_store(addr, elems, t)
        return
    rows = [ctx.load_rows(v) for v in n.inputs]
    y = rows[0]
    for r in rows[1:]:
        y = ctx.graph.map("concat_cols", y, r)
    ctx.store_rows(y, n.outputs[0])


def _elements(ctx: LowerCtx, v: str) -> Any:
    """``v``'s elements in row-major order, as a stream of ``[1, 1]`` tiles."""
    return ctx.flat(ctx.graph.linear_load(ctx.placed[v].tensor, (1, 1)))


def move_elements(ctx: LowerCtx, n: Node, compute: Callable[[dict[str, int]], np.ndarray]) -> None:
    """Output element ``e`` (row-major) is source element ``compute(b)[e]``: a
    RandomOffChipLoad of ``[1, 1]`` tiles stored in order."""
    src, out = n.inputs[0], n.outputs[0]
    addr = _addr_stream(ctx, ctx.prefix() + "_elems", (*ctx.shape(out), 1), compute)
    y = ctx.graph.random_load(addr, ctx.placed[src].tensor, (1, 1))
    ctx.graph.linear_store(y, ctx.declare(out))


def lower_gather(ctx: LowerCtx, n: Node) -> None:
    """``x.index_select(dim, idx)`` along any dimension (see the module docstring)."""
    op = n.op
    assert isinstance(op, L.Gather)
    x, idx = n.inputs
    shape = ctx.shape(x)
    rank = len(shape)
    d = op.dim % rank
    count = ctx.shape(idx)[0]
    it = ctx.placed[idx].tensor
    if d == rank - 1:
        if not sp.sympify(count).is_Integer:
            raise ctx.fail("index_select along the last dimension needs a static index count")
        rows = ctx.load_rows(x)
        ids = ctx.graph.linear_load(it, (1, int(count)), out_shape=(1,), stride=(0,))
        y = ctx.graph.map("gather_cols", rows, ctx.graph.expand(ids, rows, 0))
        ctx.store_rows(y, n.outputs[0])
        return
    pre, post = _prod(shape[:d]), _prod(shape[d + 1 : -1])
    if not post.is_Integer:
        raise ctx.fail("index_select along a leading dimension needs static inner dimensions")
    ids = ctx.graph.linear_load(it, (1, 1), out_shape=(pre, count, post), stride=(0, 1, 0))
    scaled = ctx.graph.map(fn("affine", scale=int(post), offset=0), ids)
    src_d = shape[d]

    def offsets(b: dict[str, int]) -> np.ndarray:
        p, c, s = concrete([pre, count, src_d], b)
        base = (np.arange(p, dtype=np.int64) * s * int(post))[:, None, None]
        return (base + np.arange(int(post), dtype=np.int64)[None, None, :]).repeat(c, 1)

    off = ctx.host_index(ctx.prefix() + "_offsets", (pre * count * post, 1), offsets)
    offs = ctx.graph.linear_load(off, (1, 1), out_shape=(pre, count, post))
    addr = ctx.flat(ctx.graph.map("add", scaled, offs))
    cols = shape[-1]
    rows = ctx.graph.random_load(addr, _exact(ctx, x, cols), (1, int(cols)))
    ctx.store_rows(rows, n.outputs[0])


def _flat_ids(shape: Any, b: dict[str, int]) -> np.ndarray:
    size = concrete(shape, b)
    return np.arange(int(np.prod(size, dtype=np.int64)), dtype=np.int64).reshape(size)


def lower_transpose(ctx: LowerCtx, n: Node) -> None:
    """A permutation that moves the last dimension: elements move."""
    op = n.op
    assert isinstance(op, L.Permute)
    shape = ctx.shape(n.inputs[0])
    move_elements(
        ctx, n, lambda b: np.ascontiguousarray(_flat_ids(shape, b).transpose(op.dims)).ravel()
    )


def lower_slice_elements(ctx: LowerCtx, n: Node) -> None:
    """A slice of the last dimension with data-dependent bounds: elements move."""
    op = n.op
    assert isinstance(op, L.Slice)
    shape = ctx.shape(n.inputs[0])
    start, end = ctx.sym(op.start), ctx.sym(op.end)

    def compute(b: dict[str, int]) -> np.ndarray:
        lo, hi = concrete([start, end], b)
        return np.ascontiguousarray(_flat_ids(shape, b)[..., lo:hi]).ravel()

    move_elements(ctx, n, compute)
