"""Linear layers as STeP: padded row blocks times streamed weight tiles (STeP §3, Fig. 2).

``y[R, N] = x[R, K] @ W[N, K]^T (+ b)``:

1. x's rows stream ``[1, R]`` is cut into blocks of ``tm = tile_rows`` rows (``Reshape`` with
   zero padding: the last block of a dynamic ``R`` is padded; its padding flags are kept);
   ``Accum(retile_row)`` packs each block into one ``[tm, K]`` tile — ``[1, ceil(R/tm)]``;
2. for every block, the ``N/tn`` weight tiles ``[tn, K]`` stream from HBM
   (``LinearOffChipLoad`` with the block stream as reference: the weights are read once per
   row block) while the block tile is repeated on chip (``Repeat``);
3. ``Map(matmul_t)`` gives ``[tm, tn]`` output tiles (plus the bias tile), which
   ``Accum(retile_col)`` packs into the block's ``[tm, N]`` output rows;
4. ``FlatMap(retile_streamify)`` splits them into rows, ``FlatMap(filter_padding)`` drops the
   padding rows, and the row stream is stored — row-major, as the consumer expects.

The weight traffic is ``ceil(R/tm) x |W|``: a larger ``tile_rows`` trades on-chip memory
(``tm x K`` per block) for weight re-reads.

Parallel lanes (STeP (arXiv 2511.07776) §5, the spatial parallelisation of a matmul over
units): the ``N/tn`` weight tiles are split into ``P`` lanes of consecutive tiles, each with its
own ``LinearOffChipLoad`` (a ``base`` offset into the same weight tensor), ``Repeat`` and
``Map(matmul_t)`` units, so ``P`` matmuls run at once and the block tile is sent over ``P``
links in parallel. Each lane packs its ``[tm, N/P]`` slice; ``Map(concat_cols)`` over zipped
lanes reassembles the row-major ``[tm, N]`` block. Every weight byte is still read once per row
block, so the off-chip traffic does not depend on ``P``.
"""

from __future__ import annotations

import sympy as sp

from torch2step.step import Value, fn, zeros

from .context import LowerCtx

__all__ = ["LANE_MIN_TILES", "LINEAR_LANES", "linear_lanes", "lower_linear", "row_tile", "weight_tile"]

LINEAR_LANES = 8
"""Parallel lanes of a Linear that ``compile`` asks for on a large chip (fewer when the Linear
has fewer weight tiles)."""


def row_tile(ctx: LowerCtx, rows: sp.Expr) -> int:
    """Rows per block: ``tile_rows``, or all rows when fewer are statically known."""
    tm = ctx.options.tile_rows
    r = sp.sympify(rows)
    return int(min(tm, int(r))) if r.is_Integer and int(r) > 0 else tm


def weight_tile(ctx: LowerCtx, n: int, k: int, itemsize: int = 4) -> int:
    """Output features per weight tile (see :class:`~torch2step.lower.context.LowerOptions`)."""
    if ctx.options.tile_cols is not None:
        tn = ctx.options.tile_cols
        if n % tn:
            raise ctx.fail(f"tile_cols={tn} does not divide the {n} output features")
        return tn
    tn = 1
    while n % (tn * 2) == 0 and (tn * 2) * k * itemsize <= ctx.options.weight_tile_bytes:
        tn *= 2
    return tn


LANE_MIN_TILES = 16
"""Weight tiles per lane below which ``compile``'s automatic lanes are not used: a small Linear
(an MoE router) gains nothing from lanes and its extra units only lengthen the NoC routes."""


def linear_lanes(ctx: LowerCtx, tiles: int) -> int:
    """Lanes of a Linear with ``tiles`` weight tiles: the largest divisor of ``tiles`` that is at
    most ``linear_lanes`` (``None``: one lane) and, when ``linear_lanes_auto``, leaves each lane
    at least :data:`LANE_MIN_TILES` tiles."""
    want = ctx.options.linear_lanes
    want = 1 if want is None else int(want)
    if ctx.options.linear_lanes_auto:
        want = min(want, max(1, tiles // LANE_MIN_TILES))
    p = max(1, min(want, tiles))
    while tiles % p:
        p -= 1
    return p


def lower_linear(ctx: LowerCtx, x: str, w: str, b: str | None, out: str) -> None:
    """Lower ``out = Linear(x, w[, b])``; see the module docstring."""
    g = ctx.graph
    rows_n, k_dim = ctx.rc(x)
    n_dim = ctx.shape(w)[0]
    if not (sp.sympify(k_dim).is_Integer and sp.sympify(n_dim).is_Integer):
        raise ctx.fail("Linear needs static feature sizes")
    k, n = int(k_dim), int(n_dim)
    tm = row_tile(ctx, rows_n)
    tn = weight_tile(ctx, n, k)
    dt = ctx.dtype(x)

    rows = ctx.load_rows(x)  # [1, R] of [1, K]
    data, pad = g.reshape(rows, 0, tm, 0.0)  # [1, Rb, tm]
    blocks = g.accum(data, "retile_row", zeros(0, k, dt), 1)  # [1, Rb] of [tm, K]
    wt = ctx.placed[w].tensor
    bias = ctx.placed[b].tensor if b is not None else None
    tiles = n // tn
    lanes = linear_lanes(ctx, tiles)
    per = tiles // lanes
    parts = [_lane(ctx, blocks, wt, bias, tn, k, tm, per, p * per, dt) for p in range(lanes)]
    full = parts[0]
    for part in parts[1:]:
        full = g.map("concat_cols", full, part)  # [1, Rb] of [tm, N]
    out_rows = g.flat_map(full, fn("retile_streamify", rows=1))  # [1, Rb*tm] of [1, N]
    kept = _drop_padding(ctx, out_rows, pad)
    ctx.store_rows(kept, out)


def _lane(
    ctx: LowerCtx,
    blocks: Value,
    wt: object,
    bias: object | None,
    tn: int,
    k: int,
    tm: int,
    per: int,
    base: int,
    dt: str,
) -> Value:
    """One lane: weight tiles ``base .. base+per`` times every block -> ``[1, Rb]`` of
    ``[tm, per*tn]``."""
    g = ctx.graph
    w_tiles = g.flatten(
        g.linear_load(wt, (tn, k), blocks, out_shape=(per, 1), base=base), 0, 1
    )  # [1, Rb, per]
    x_rep = g.repeat(blocks, per)  # [1, Rb, per]
    y = g.map("matmul_t", x_rep, w_tiles)  # [tm, tn]
    if bias is not None:
        b_tiles = g.flatten(
            g.linear_load(bias, (1, tn), blocks, out_shape=(1, per), base=base), 0, 1
        )
        y = g.map("add", y, b_tiles)
    return g.accum(y, "retile_col", zeros(tm, 0, dt), 1)


def _drop_padding(ctx: LowerCtx, rows: Value, pad: Value) -> Value:
    g = ctx.graph
    flags = ctx.flat(pad)
    return g.flat_map(g.zip(rows, flags), "filter_padding")
