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

Split-K lanes (``linear_k_lanes``; what ``compile`` uses on a large chip): the ``K`` input
features are split into ``P`` slices of ``kp = K/P``. Lane ``p`` reads its own column slice
``x[:, p*kp:(p+1)*kp]`` from HBM (the input is read once in all), packs each row block into one
``[tm, kp]`` tile and holds it in an on-chip buffer (``Bufferize``, STeP §3.2.2) that is read
once per weight tile (``Streamify``): the block crosses the NoC once per row block, and each
weight tile re-reads it from the lane's memory unit at on-chip memory bandwidth (STeP §4.2).
The lane's weight tiles ``[tn, kp]`` (column block ``p`` of every row block of ``W``) stream
from HBM once per row block into its ``Map(matmul_t)``; the ``P`` partial ``[tm, tn]`` products
are summed by a binary tree of ``Map(add)`` units and packed into rows as above. A lane holds a
``tm x kp`` block rather than ``tm x K``, so a matmul unit is not starved by the NoC carrying the
whole block to it per weight tile, and ``P`` matmul units keep up with the HBM weight stream
(STeP §5: the compute allocated to an operator is matched to its off-chip bandwidth).

Column groups (:func:`k_groups`): each lane's partial products leave it at a rate inverse to
``kp``, and every add of the tree takes two of them, so with thin slices (``kp`` below
:data:`K_LANE_SUM_COLS`) the tree, not HBM, would bound the Linear.  The ``P`` lanes are then
``pk`` K-slices times ``groups`` groups of the output features: lane ``(p, j)`` holds the
block of slice ``p`` in its own buffer and multiplies it by the weight tiles of group ``j``;
each group sums its ``pk`` partials in its own tree and turns its tiles into row pieces in its
own buffer (the transposing read runs ``groups`` times in parallel); ``Map(concat_cols)``
joins the groups' row pieces into the rows.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import sympy as sp

from torch2step.step import Value, fn, zeros
from torch2step.step.types import DTYPE_BYTES

from .context import LowerCtx

__all__ = [
    "K_LANE_MIN_BYTES",
    "K_LANE_MIN_COLS",
    "K_LANE_MIN_TILE_COLS",
    "K_LANE_SUM_COLS",
    "K_LANE_TILE_BYTES",
    "LANE_MIN_TILES",
    "LINEAR_K_LANES",
    "LINEAR_LANES",
    "k_groups",
    "linear_k_lanes",
    "linear_lanes",
    "lower_linear",
    "row_tile",
    "weight_tile",
]

LINEAR_LANES = 8
"""Parallel lanes of a Linear that ``compile`` asks for on a large chip (fewer when the Linear
has fewer weight tiles)."""

LINEAR_K_LANES = 32
"""Split-K lanes of a Linear that ``compile`` asks for on a large chip: with 64-row blocks of a
bf16 Linear, each weight byte carries 64 FLOPs, so 32 units of 2048 FLOPs/cycle match 1024
B/cycle of HBM (fewer for small Linears, see :func:`linear_k_lanes`)."""

K_LANE_MIN_BYTES = 1 << 19
"""Weight bytes per split-K lane below which automatic lanes are not used (an MoE router stays
one lane)."""

K_LANE_TILE_BYTES = 32 * 1024
"""Weight tile budget of a split-K lane: small tiles interleave the lanes' HBM reads finely (no
lane starves while others run ahead) and shorten each hop of the add tree."""

K_LANE_MIN_TILE_COLS = 64
"""Output features per split-K weight tile at least: a tile's matmul (``2 tm kp tn`` FLOPs at
2048 FLOPs/cycle) then lasts at least as long as re-reading the ``tm x kp`` block from the
lane's buffer at 64 B/cycle (``tn >= 32`` for bf16), with slack."""

K_LANE_MIN_COLS = 64
"""Input features per split-K lane at least (whole 16x16 compute tiles, 128-byte bf16 rows)."""

K_LANE_SUM_COLS = 128
"""Input features per split-K slice above which further lanes split the output features
instead (:func:`k_groups`): the partial sums' NoC traffic falls as ``1/kp``."""


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


def linear_k_lanes(ctx: LowerCtx, k: int, weight_bytes: int) -> int:
    """Split-K lanes of a Linear with ``k`` input features and ``weight_bytes`` of weights: the
    largest power of two ``P <= linear_k_lanes`` dividing ``k`` with ``k/P >=``
    :data:`K_LANE_MIN_COLS` (``None``: one lane) and, when ``linear_lanes_auto``, at least
    :data:`K_LANE_MIN_BYTES` of weights per lane."""
    want = ctx.options.linear_k_lanes
    want = 1 if want is None else int(want)
    if ctx.options.linear_lanes_auto:
        want = min(want, max(1, weight_bytes // K_LANE_MIN_BYTES))
    p = 1
    while p * 2 <= want and k % (p * 2) == 0 and k // (p * 2) >= min(K_LANE_MIN_COLS, k):
        p *= 2
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
    dt = ctx.dtype(x)
    wt = ctx.placed[w].tensor
    itemsize = _itemsize(wt.dtype)
    ksplit = linear_k_lanes(ctx, k, n * k * itemsize)
    if ksplit > 1:
        _lower_split_k(ctx, x, w, b, out, rows_n, tm, k, n, ksplit, dt)
        return
    tn = weight_tile(ctx, n, k, itemsize)

    rows = ctx.load_rows(x)  # [1, R] of [1, K]
    data, pad = g.reshape(rows, 0, tm, 0.0)  # [1, Rb, tm]
    blocks = g.accum(data, "retile_row", zeros(0, k, dt), 1)  # [1, Rb] of [tm, K]
    bias = ctx.placed[b].tensor if b is not None else None
    tiles = n // tn
    lanes = linear_lanes(ctx, tiles)
    per = tiles // lanes
    parts = [_lane(ctx, blocks, wt, bias, tn, k, tm, per, p * per, dt) for p in range(lanes)]
    full = parts[0]
    for part in parts[1:]:
        full = g.map("concat_cols", full, part)  # [1, Rb] of [tm, N]
    _store_blocks(ctx, full, pad, out)


def _store_blocks(ctx: LowerCtx, full: Value, pad: Value, out: str) -> None:
    """``[1, Rb]`` of ``[tm, N]`` output blocks -> rows without the padding -> ``out``."""
    g = ctx.graph
    out_rows = g.flat_map(full, fn("retile_streamify", rows=1))  # [1, Rb*tm] of [1, N]
    kept = _drop_padding(ctx, out_rows, pad, ctx.rc(out)[0])
    ctx.store_rows(kept, out)


def _itemsize(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def k_groups(k: int, n_tiles: int, lanes: int) -> tuple[int, int]:
    """``(pk, groups)``: ``lanes`` split-K matmul units as ``pk`` slices of the ``k`` input
    features times ``groups`` groups of the ``n_tiles`` output tiles.

    A lane's partial sums leave it at ``F s / (2 kp)`` bytes per cycle (``F`` FLOPs/cycle of
    its unit, ``s`` bytes per element: ``tm tn s`` bytes per ``2 tm kp tn / F`` cycles), and each
    add of the reduction tree takes two such streams.  With ``kp`` of at least
    :data:`K_LANE_SUM_COLS` input features an add takes at most half of a 64 B/cycle link on
    the STeP chips (2048 bf16 FLOPs/cycle per unit), so the tree keeps pace with the
    matmuls; the lanes beyond ``k / K_LANE_SUM_COLS`` split the output features instead
    (``groups`` reduction trees, each of ``pk`` lanes), which costs only the input slice sent
    to ``groups`` lanes (STeP §5: the compute allocated to an operator is matched to its
    off-chip bandwidth; here also its reduction to the NoC)."""
    pk = lanes
    while pk > 1 and k // pk < min(K_LANE_SUM_COLS, k):
        pk //= 2
    groups = lanes // pk
    while n_tiles % groups:
        groups -= 1
    return pk, groups


def _lower_split_k(
    ctx: LowerCtx,
    x: str,
    w: str,
    b: str | None,
    out: str,
    rows_n: sp.Expr,
    tm: int,
    k: int,
    n: int,
    lanes: int,
    dt: str,
) -> None:
    """Split-K lanes, in column groups (see the module docstring and :func:`k_groups`)."""
    g = ctx.graph
    wt = ctx.placed[w].tensor
    s = _itemsize(wt.dtype)
    pk, _ = k_groups(k, n, lanes)
    kp = k // pk
    budget = max(min(ctx.options.weight_tile_bytes, K_LANE_TILE_BYTES), K_LANE_MIN_TILE_COLS * kp * s)
    small = dataclasses.replace(ctx.options, weight_tile_bytes=budget)
    tn = weight_tile(SimpleNamespace(options=small), n, kp, s)  # type: ignore[arg-type]
    nt = n // tn
    _, groups = k_groups(k, nt, lanes)
    per = nt // groups  # weight tiles of a lane (its group's output features)
    xs = _x_slices(ctx, x, rows_n, k, kp, pk)
    pad: Value | None = None
    parts: list[list[Value]] = [[] for _ in range(groups)]
    first: Value | None = None
    for p, xr in enumerate(xs):
        data, flags = g.reshape(xr, 0, tm, 0.0)  # [1, Rb, tm] of [1, kp]
        pad = flags if pad is None else pad
        blk = g.accum(data, "retile_row", zeros(0, kp, dt), 1)  # [1, Rb] of [tm, kp]
        one, _ = g.reshape(blk, 0, 1, 0.0)  # [1, Rb, 1] (chunks of 1 never pad)
        first = one if first is None else first
        for j in range(groups):
            buf = g.bufferize(one, 1)  # [1, Rb] of Buf[1] of [tm, kp]: the block, on chip
            # the weight reads follow the blocks, not the buffer: a load running ahead into
            # the next block must not wait for a buffer that waits for this block's tiles
            w_tiles = g.flatten(
                g.linear_load(
                    wt, (tn, kp), one, out_shape=(per,), stride=(pk,), base=j * per * pk + p
                ),
                0,
                1,
            )  # [1, Rb, per] of [tn, kp]: column block p of group j's weight row blocks
            x_again = g.flatten(g.streamify(buf, w_tiles), 0, 1)  # [1, Rb, per] of [tm, kp]
            parts[j].append(g.map("matmul_t", x_again, w_tiles))  # [1, Rb, per] of [tm, tn]
    assert pad is not None and first is not None
    rows: Value | None = None
    for j in range(groups):
        y = _sum_tree(ctx, parts[j])
        if b is not None:
            bias = ctx.placed[b].tensor
            b_tiles = g.flatten(
                g.linear_load(bias, (1, tn), first, out_shape=(per,), stride=(1,), base=j * per),
                0,
                1,
            )
            y = g.map("add", y, b_tiles)
        part = _tile_rows(ctx, y, tm, per, dt)  # [1, Rb, tm] of [1, per*tn]
        rows = part if rows is None else g.map("concat_cols", rows, part)
    assert rows is not None
    kept = _drop_padding(ctx, ctx.flat(rows), pad, ctx.rc(out)[0])
    ctx.store_rows(kept, out)


def _sum_tree(ctx: LowerCtx, parts: list[Value]) -> Value:
    """The sum of ``parts`` by a binary tree of ``Map(add)`` units."""
    g = ctx.graph
    while len(parts) > 1:
        nxt = [g.map("add", parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        parts = nxt + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def _tile_rows(ctx: LowerCtx, y: Value, tm: int, nt: int, dt: str) -> Value:
    """``[1, Rb, nt]`` of ``[tm, tn]`` output tiles -> ``[1, Rb, tm]`` of ``[1, nt*tn]`` rows,
    pipelined row by row: each tile is cut into its ``tm`` row pieces as it arrives and held
    in an on-chip buffer per row block (``Bufferize``), which is read back row-major
    (``Streamify`` with an affine transposing read, STeP §3.2.2) and joined into rows
    (``Accum(retile_col)``), so no message carries a whole ``[tm, nt*tn]`` block."""
    g = ctx.graph
    pieces = g.flat_map(y, fn("retile_streamify", rows=1))  # [1, Rb, nt*tm] of [1, tn]
    buf = g.bufferize(pieces, 1)  # [1, Rb] of Buf[nt*tm]
    again = g.streamify(buf, buf, stride=(1, tm), out_shape=(tm, nt))  # [1, Rb, tm, nt]
    return g.accum(again, "retile_col", zeros(1, 0, dt), 1)  # [1, Rb, tm] of [1, nt*tn]


def _x_slices(
    ctx: LowerCtx, x: str, rows_n: sp.Expr, k: int, kp: int, lanes: int
) -> list[Value]:
    """Per lane, the row stream ``[1, R]`` of ``[1, kp]`` column slices of ``x``: read straight
    from HBM when ``x`` is stored as ``[.., K]`` rows (every byte once), else its rows read once
    and sliced on chip."""
    g = ctx.graph
    t = ctx.placed[x].tensor
    shp = tuple(sp.sympify(d) for d in t.shape)
    tile = _slice_tile(shp, rows_n, k, kp)
    if tile is not None:
        # the tensor's elements are x's rows in order, so slice p of row r is chunk
        # r * lanes + p of kp consecutive elements: one tile of ``tile``
        out: list[Value] = []
        for p in range(lanes):
            v = g.linear_load(t, tile, None, out_shape=(rows_n,), stride=(lanes,), base=p)
            if tile[0] > 1:
                v = g.map(fn("tile_reshape", rows=1, cols=kp), v)
            out.append(ctx.flat(v))
        return out
    rows = ctx.load_rows(x)
    return [g.map(fn("slice_cols", start=p * kp, end=(p + 1) * kp), rows) for p in range(lanes)]


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


def _drop_padding(ctx: LowerCtx, rows: Value, pad: Value, total: sp.Expr) -> Value:
    """The rows without the padding rows the row blocks added: ``total`` rows, the
    Linear's own row count, so a consumer streaming them (``stream_rows``) sees the same
    row count as the rest of the layer."""
    g = ctx.graph
    flags = ctx.flat(pad)
    return g.flat_map(g.zip(rows, flags), fn("filter_padding", total=total))


def _slice_tile(
    shp: tuple[sp.Expr, ...], rows_n: sp.Expr, k: int, kp: int
) -> tuple[int, int] | None:
    """A tile of ``kp`` consecutive elements of a tensor of shape ``shp`` holding ``rows_n``
    rows of ``k`` (``(1, kp)`` when ``kp`` divides its rows, ``(kp/D, D)`` when its rows of
    ``D`` divide ``kp``), or ``None``."""
    if len(shp) < 2 or sp.simplify(sp.Mul(*shp) - sp.sympify(rows_n) * k) != 0:
        return None
    d = shp[-1]
    if not d.is_Integer:
        return None
    d = int(d)
    if d % kp == 0:
        return (1, kp)
    if kp % d == 0 and sp.simplify(sp.Mod(shp[-2], kp // d)) == 0:
        return (kp // d, d)
    return None
