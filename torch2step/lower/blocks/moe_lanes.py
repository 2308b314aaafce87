"""Time-multiplexed expert regions for the MoE graph (STeP §5.3 "configuration
time-multiplexing").

With ``lanes = P < E`` the graph of :mod:`torch2step.lower.blocks.moe` configures ``P`` expert
branches (*lanes*, the paper's parallel regions) instead of ``E``; lane ``l`` serves ``E/P``
consecutive experts ``first_l, first_l + 1, ...`` (:func:`lane_experts`).  Per lane:

1. **Merge.** Every expert of the lane wraps its routed rows in chunks: with dynamic tiling one
   chunk of all its rows (Promote: ``[P_e, N_e]``, ``P_e = 1 if N_e > 0``), with static
   tiling (``static_tile=N``) ``ceil(N_e / N)`` chunks of ``N`` rows, the last zero-padded
   (Reshape, its padding flags zipped to the rows).  EagerMerge interleaves these chunks in
   arrival order (STeP Table 5) and its selector says which expert each chunk holds.  With
   dynamic tiling the chunk height is a ragged size ``R[i]`` (STeP (revised) §3.1): the token
   count of the ``i``-th expert served.  An expert without tokens sends no chunk, so the lane
   never serves it.
2. **Expert id.** ``selector_index`` turns the merge selector into the lane-local index ``j``
   and ``affine(scale=1, offset=first_l)`` into the expert id ``e = first_l + j``.
3. **Weights.** §5.3 replaces the experts' LinearOffChipLoads by RandomOffChipLoads "which use
   the Selector from EagerMerge to fetch the appropriate tiled weight": the addresses (in tiles)
   ``e * (I/ti)(H/th) + ...`` are computed in-graph (``affine`` then the flat ``tile_grid``),
   one ``[I/ti, H/th]`` grid per served chunk: a used expert's weights are read once per
   chunk (once with dynamic tiling), none of an unused one.
4. **Compute** exactly as a dedicated expert (STeP Fig. 2, §5.2): Bufferize the chunk's rows,
   pack them per ``tile_i`` block into a ``[R[i], H]`` tile, gate/up/act/down.
5. **Back to experts.** The output rows (padding rows of static tiles dropped,
   ``filter_padding``) and a per-row selector over the lane's experts (``to_selector`` of the
   local index) go to a Partition whose outputs are the per-expert row streams ``[N_e]``
   (same count symbols as the first Partition).
6. **Routing weight.** By default inside the lane: the expert id, repeated along the chunk's
   rows (Repeat + Expand), picks each token's weight (``pick_weight_of``) and scales the output
   tile, so the layer adds no unit per expert.  With ``scale_in_lanes=False`` (the artifact of
   STeP §5.3, whose figures this reproduces) each expert's rows are scaled after the lane, one
   unit per expert (:func:`torch2step.lower.blocks.moe.add_moe`).  The Reassemble of the
   dedicated-region graph then gathers them.

The off-chip traffic is that of the dedicated graph; only the unit count changes.  In the
spatial plan the expert id, the weight addresses and the padding index are computed in
registers from the selector the merge sends (:mod:`torch2step.spatial.region_values`), so a
region's value path is one program whichever expert a chunk holds; with static tiling the merge
itself takes whichever expert's tile is ready, decided in simulated time
(:mod:`torch2step.spatial.merge_any`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step import (
    ADDR,
    DataType,
    FnSpec,
    SelectorType,
    SelectorValue,
    StepRuntimeError,
    TileType,
    Value,
    fn,
    register_fn,
    zeros,
)

if TYPE_CHECKING:
    from torch2step.step import Graph, OffChipTensor

    from .moe import _Plan

__all__ = ["add_lanes", "lane_experts"]


def lane_experts(num_experts: int, lanes: int) -> tuple[tuple[int, ...], ...]:
    """The experts each lane serves: consecutive blocks, as STeP (arXiv 2511.07776) §5.3 puts
    ``E/R`` consecutive experts in each of ``R`` regions (the first ``E mod R`` lanes get one
    more when ``R`` does not divide ``E``)."""
    if not 1 <= lanes <= num_experts:
        raise StepTypeError(
            f"add_moe: lanes={lanes} must be between 1 and num_experts={num_experts} "
            "(or None for one dedicated branch per expert)"
        )
    base, extra = divmod(num_experts, lanes)
    out, start = [], 0
    for lane in range(lanes):
        n = base + (1 if lane < extra else 0)
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


# ---------------------------------------------------------------- tile functions


def _int11(f: Any, t: DataType, what: str) -> TileType:
    if not isinstance(t, TileType) or t.dtype not in ("int32", "int64") or t.shape != (1, 1):
        raise StepTypeError(f"function {f}: {what} must be a [1, 1] integer tile, got {t}")
    return t


#: The widest one-hot selector ``selector_index`` takes: a spatial unit decodes it in registers
#: by a binary search of ``log2`` of this many steps (``torch2step.spatial.region_values``).
MAX_SELECTOR_INPUTS = 1024


def _sel_index_rule(f: Any, args: tuple[DataType, ...]) -> TileType:
    s = args[0]
    if not isinstance(s, SelectorType) or s.k != 1:
        raise StepTypeError(f"function {f}: needs a one-hot selector, got {s}")
    if s.n > MAX_SELECTOR_INPUTS:
        raise StepTypeError(
            f"function {f}: a selector over {s.n} inputs is wider than the "
            f"{MAX_SELECTOR_INPUTS} a unit decodes; merge at most {MAX_SELECTOR_INPUTS} "
            "experts per EagerMerge (e.g. more moe_lanes)"
        )
    return ADDR


def _sel_index(f: Any, s: SelectorValue) -> np.ndarray:
    if len(s.indices) != 1:
        raise StepRuntimeError(f"{f}: {s!r} is not one-hot")
    return np.array([[s.indices[0]]], dtype=np.int64)


def _pick_of_rule(f: Any, args: tuple[DataType, ...]) -> TileType:
    ids, w, e = args
    if not isinstance(ids, TileType) or not isinstance(w, TileType) or ids.shape != w.shape:
        raise StepTypeError(f"function {f}: ids and weights must be tiles of one shape")
    _int11(f, e, "the expert id")
    return TileType((ids.shape[0], 1), w.dtype)


def _pick_of(f: Any, ids: np.ndarray, w: np.ndarray, e: np.ndarray) -> np.ndarray:
    hit = ids == int(e[0, 0])
    return np.where(hit, w, 0).sum(axis=1, keepdims=True).astype(w.dtype)


def _ragged_rule(f: Any, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    return args[0], (None,)


def _ragged(f: Any, x: Any) -> list:
    return [x]


def _rows_rule(f: Any, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    t = args[0]
    if not isinstance(t, TileType):
        raise StepTypeError(f"function {f}: needs a tile, got {t}")
    return TileType((1, t.shape[1]), t.dtype), (sp.Integer(1), t.shape[0])


def _rows(f: Any, x: np.ndarray) -> list:
    return [[x[r : r + 1] for r in range(x.shape[0])]]


def _grid_rule(f: Any, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    _int11(f, args[0], "the start address")
    rows, cols = f.get("rows"), f.get("cols")
    if not all(isinstance(v, int) and v >= 1 for v in (rows, cols)):
        raise StepTypeError(f"function {f}: give tile_grid(rows, cols, row_stride, col_stride)")
    return ADDR, (sp.Integer(1), sp.Integer(rows), sp.Integer(cols))


def _grid(f: Any, start: np.ndarray) -> list:
    s0, rs, cs = int(start[0, 0]), int(f.get("row_stride")), int(f.get("col_stride"))
    return [
        [
            [np.array([[s0 + r * rs + c * cs]], dtype=np.int64) for c in range(int(f.get("cols")))]
            for r in range(int(f.get("rows")))
        ]
    ]


def _pad_index_rule(f: Any, args: tuple[DataType, ...]) -> TileType:
    _int11(f, args[0], "the index")
    return ADDR


def _pad_index(f: Any, j: np.ndarray, pad: np.ndarray) -> np.ndarray:
    return np.array([[int(f.get("n")) if bool(pad[0, 0]) else int(j[0, 0])]], dtype=np.int64)


for _spec in (
    FnSpec(
        "pad_index",
        "map",
        2,
        _pad_index_rule,
        _pad_index,
        doc="(index [1,1], is_pad) -> n if is_pad else index: padding rows to output n",
    ),
    FnSpec(
        "selector_index",
        "map",
        1,
        _sel_index_rule,
        _sel_index,
        doc="one-hot selector -> [1, 1] index of the chosen input (EagerMerge's source)",
    ),
    FnSpec(
        "pick_weight_of",
        "map",
        3,
        _pick_of_rule,
        _pick_of,
        flops=lambda f, args: 2 * int(np.prod([int(d) for d in args[0].shape])),
        doc="(ids [1,k], weights [1,k], expert [1,1]) -> [1,1] the weight of a dynamic expert",
    ),
    FnSpec(
        "as_ragged",
        "flat",
        1,
        _ragged_rule,
        _ragged,
        doc="x -> the one-element stream [x] of a data-known length: a chunk's row count "
        "becomes a ragged size (STeP (revised) §3.1), so chunks of several experts share one type",
    ),
    FnSpec(
        "tile_rows",
        "flat",
        1,
        _rows_rule,
        _rows,
        doc="[n, c] tile -> its n rows [1, c] (RetileStreamify(rows=1) for a ragged n)",
    ),
    FnSpec(
        "tile_grid",
        "flat",
        1,
        _grid_rule,
        _grid,
        doc="start address -> [rows, cols] addresses start + r*row_stride + c*col_stride, "
        "tile_grid(rows, cols, row_stride, col_stride)",
    ),
):
    register_fn(_spec)


def _turn_rule(f: Any, args: tuple[DataType, ...], acc: DataType) -> DataType:
    lanes = f.get("lanes")
    if not isinstance(lanes, int) or lanes < 1:
        raise StepTypeError(f"function {f}: lane_turn(lanes=P) with P >= 1")
    return _int11(f, acc, "the state (the previous chunk's lane)")


def _turn(f: Any, x: Any, state: np.ndarray) -> np.ndarray:
    return (state + 1) % int(f.get("lanes"))


register_fn(
    FnSpec(
        "row_count",
        "update",
        1,
        lambda f, args, acc: _int11(f, acc, "the state (the previous row's index)"),
        lambda f, x, state: state + 1,
        doc="(row, index of the previous row [1, 1]) -> this row's index (init -1)",
    )
)
register_fn(
    FnSpec(
        "lane_turn",
        "update",
        1,
        _turn_rule,
        _turn,
        doc="(chunk, lane of the previous chunk [1, 1]) -> the next lane, round-robin over P",
    )
)


# ---------------------------------------------------------------- graph


def add_lanes(
    g: Graph,
    plan: _Plan,
    routed: tuple[Value, ...],
    counts: tuple[str, ...],
    weights: tuple[OffChipTensor, OffChipTensor, OffChipTensor],
    lanes: int,
    assign: str = "consecutive",
) -> list[Value]:
    """The lanes of the time-multiplexed layer (module docstring); ``assign``:
    ``"consecutive"`` experts per lane or ``"dispatch"`` (:func:`_dispatch`).  ``routed[e]`` is expert
    ``e``'s stream ``[N_e]`` of token rows ``[1, H]`` (with ``plan.scale_in_lanes``: of
    ``(row, ids [1, k], weights [1, k])``); returns the per-expert output row streams
    ``[N_e]`` in expert order (scaled by the routing weight when ``plan.scale_in_lanes``)."""
    E = len(routed)
    p = plan.prefix
    tiles: list[Value] = []
    for e in range(E):
        if plan.static is None:  # one chunk of exactly the expert's N_e rows (§5.2)
            tiles.append(
                g.flat_map(
                    g.promote(routed[e], name=f"{p}_e{e}_tile"),
                    fn("as_ragged"),
                    name=f"{p}_e{e}_chunk",
                )
            )
            continue
        # static tiles of N rows, the last zero-padded, each its own chunk (Reshape pads tiles:
        # a (row, ids, weights) element is cut into its parts and zipped again)
        parts = (
            [g.map(fn("get", index=i), routed[e], name=f"{p}_e{e}_part{i}") for i in range(3)]
            if plan.scale_in_lanes
            else [routed[e]]
        )
        cut = [g.reshape(v, 0, plan.static, 0.0, name=f"{p}_e{e}_tile{i}")
               for i, v in enumerate(parts)]
        tiles.append(g.zip(*(d for d, _ in cut), cut[0][1], name=f"{p}_e{e}_chunk"))
    if assign == "dispatch":
        return _dispatch(g, plan, tiles, counts, weights, lanes)
    out: list[Value | None] = [None] * E
    for lane, experts in enumerate(lane_experts(E, lanes)):
        q = f"{p}_l{lane}"
        merged, msel = g.eager_merge([tiles[e] for e in experts], name=f"{q}_merge")
        local = g.map(fn("selector_index"), msel, name=f"{q}_j")  # [M] lane-local index
        n = len(experts)
        rows, j_rows = _lane(g, plan, q, merged, local, experts[0], n, weights)
        pad = [] if plan.static is None else [f"{q}_padrows"]
        sel = g.map(fn("to_selector", n=n + len(pad)), j_rows, name=f"{q}_sel")
        backs = g.partition(
            rows,
            sel,
            len(experts) + len(pad),
            count_names=[counts[e] for e in experts] + pad,
            name=f"{q}_back",
        )
        for e, b in zip(experts, backs):
            out[e] = b
        if pad:  # the padding rows: dropped, never sent to a unit
            g.output(pad[0], backs[-1])
    return [v for v in out if v is not None]


def _lane(
    g: Graph,
    plan: _Plan,
    q: str,
    merged: Value,
    local: Value,
    first: int,
    n: int,
    weights: tuple[OffChipTensor, OffChipTensor, OffChipTensor],
) -> tuple[Value, Value]:
    """One lane named ``q``: expert chunks ``[M, R]`` in (``merged``, rows (+ routing data, pad
    flags)) with each chunk's index ``local`` ([M] of [1, 1]: expert ``first + local``) ->
    ``(output rows [M, R], per-row output index)``: the local index, or ``n`` for a
    padding row of a static tile."""
    H, th, ti, dt = plan.H, plan.th, plan.ti, plan.dtype
    w_gate, w_up, w_down = weights
    nh, ni = H // th, plan.I // ti
    width = (3 if plan.scale_in_lanes else 1) + (plan.static is not None)
    if width == 1:
        x_rows = merged
    else:
        x_rows = g.map(fn("get", index=0), merged, name=f"{q}_x")  # [M, R] of [1, H]
    flags = (
        None
        if plan.static is None
        else g.map(fn("get", index=width - 1), merged, name=f"{q}_pad")  # padding flags
    )
    if plan.gather is not None:  # the chunk carries token indices: load the rows (STeP
        # RandomOffChipLoad, one [1, H] tile per index; a static tile's padding reads row 0)
        x_rows = g.random_load(x_rows, plan.gather, (1, H), name=f"{q}_x_ld")
    buf = g.bufferize(x_rows, 1, name=f"{q}_buf")  # [M] Buf[R]
    per_i = g.repeat(buf, ni, name=f"{q}_per_i")
    again = g.streamify(buf, per_i, name=f"{q}_rows")  # [M, I/ti, R] of [1, H]
    xt = g.accum(again, "retile_row", zeros(0, H, dt), 1, name=f"{q}_xt")  # [M, I/ti] [R, H]
    n_r = xt.type.dtype.shape[0]  # type: ignore[attr-defined]
    xt = g.repeat(xt, 1, name=f"{q}_xt1")
    if nh > 1:
        xt = g.flat_map(xt, fn("split_cols", cols=th), name=f"{q}_xh")

    # the expert's first weight tile: (first + j) (I/ti)(H/th)
    start = g.map(fn("affine", scale=ni * nh, offset=first * ni * nh), local, name=f"{q}_w0")
    gu_addr = g.flat_map(
        start, fn("tile_grid", rows=ni, cols=nh, row_stride=nh, col_stride=1), name=f"{q}_gu_a"
    )  # [M, I/ti, H/th] tile indices in w_gate / w_up
    d_addr = g.flat_map(
        start, fn("tile_grid", rows=ni, cols=nh, row_stride=1, col_stride=ni), name=f"{q}_d_a"
    )  # [M, I/ti, H/th] tile indices in w_down

    def gate_up(w: OffChipTensor, what: str) -> Value:
        wt = g.random_load(gu_addr, w, (ti, th), name=f"{q}_{what}_w")
        pair = g.zip(xt, wt, name=f"{q}_{what}_in")
        return g.accum(
            pair, "matmul_t_acc", fn("zeros", shape=(n_r, ti), dtype=dt), 1, name=f"{q}_{what}"
        )

    gu = g.zip(gate_up(w_gate, "gate"), gate_up(w_up, "up"), name=f"{q}_act_in")
    h = g.map(plan.act, gu, name=f"{q}_act")
    wd = g.random_load(d_addr, w_down, (th, ti), name=f"{q}_down_w")
    pair = g.zip(g.repeat(h, nh, name=f"{q}_h_rep"), wd, name=f"{q}_down_in")
    if nh == 1:
        y = g.accum(
            pair, "matmul_t_acc", fn("zeros", shape=(n_r, H), dtype=dt), 2, name=f"{q}_down"
        )
    else:
        part = g.map("matmul_t", pair, name=f"{q}_down_mm")
        cols = g.accum(
            part, "retile_col", fn("zeros", shape=(n_r, 0), dtype=dt), 1, name=f"{q}_down_cat"
        )
        y = g.accum(cols, "add", fn("zeros", shape=(n_r, H), dtype=dt), 1, name=f"{q}_down")

    j_rows = g.expand(g.repeat(local, 1, name=f"{q}_j1"), x_rows, 0, name=f"{q}_j_r")
    if plan.scale_in_lanes:  # each token's routing weight for the served expert first + j
        e_rows = g.map(fn("affine", scale=1, offset=first), j_rows, name=f"{q}_eid")
        ids = g.map(fn("get", index=1), merged, name=f"{q}_ids")
        wts = g.map(fn("get", index=2), merged, name=f"{q}_wts")
        w_e = g.map(fn("pick_weight_of"), g.zip(ids, wts, e_rows, name=f"{q}_gw_in"),
                    name=f"{q}_gw")  # [M, R] of [1, 1]
        info_dt = w_e.type.dtype.dtype  # type: ignore[attr-defined]
        w_col = g.accum(w_e, "retile_row", zeros(0, 1, info_dt), 1, name=f"{q}_gw_col")
        y = g.map("mul", g.zip(y, w_col, name=f"{q}_scale_in"), name=f"{q}_scaled")
    rows = g.flat_map(y, fn("tile_rows"), name=f"{q}_out")  # [M, R] of [1, H]
    if flags is not None:  # padding rows of static tiles go to an extra, unread output (Fig. 2
        # "FilterPadding"): the selector depends on the expert index and the flags, not on data
        j_rows = g.map(
            fn("pad_index", n=n), g.zip(j_rows, flags, name=f"{q}_jpad_in"), name=f"{q}_jpad"
        )
    return rows, j_rows


def _dispatch(
    g: Graph,
    plan: _Plan,
    tiles: list[Value],
    counts: tuple[str, ...],
    weights: tuple[OffChipTensor, OffChipTensor, OffChipTensor],
    lanes: int,
) -> list[Value]:
    """Lanes fed by dispatch instead of by consecutive experts: one EagerMerge takes the
    chunks of every expert that has tokens in arrival order, the ``i``-th chunk goes to lane
    ``i mod P`` (Scan ``lane_turn`` then Partition), the lane reads the expert id that came
    with the chunk, and one EagerMerge over the lanes' output rows feeds one Partition back to
    the experts' row streams.  The static interleaved assignment of STeP (arXiv 2511.07776)
    §5.4 applied to the stream of non-empty expert chunks: an expert without tokens sends no
    chunk and takes no turn, so every lane serves ``ceil(U/P)`` or ``floor(U/P)`` of the
    ``U`` used experts whatever the routing (each used expert reads the same weight bytes,
    the cost that dominates at decode batch sizes), while consecutive experts per lane leave
    the lanes as uneven as the routing.  The program does not depend on the routing."""
    E, p = len(tiles), plan.prefix
    merged, msel = g.eager_merge(tiles, name=f"{p}_merge")  # [M, R] chunks, arrival order
    eid = g.map(fn("selector_index"), msel, name=f"{p}_eid")  # [M] expert of each chunk
    # the chunk count M is a sum over the experts of [N_e > 0]: a one-output Partition names
    # it (a plain dynamic size ``m``), then Promote gives the [1, m] streams the Scan walks
    one = g.map(fn("to_selector", n=1), g.map(fn("affine", scale=0, offset=0), eid,
                name=f"{p}_zero"), name=f"{p}_one")
    (eid_m,) = g.partition(eid, one, 1, count_names=[f"{p}_m"], name=f"{p}_count")
    (chunks_m,) = g.partition(merged, one, 1, count_names=[f"{p}_m"], name=f"{p}_count_x")
    eid_p = g.promote(eid_m, name=f"{p}_eid1")  # [1, m]
    turn = g.scan(eid_p, fn("lane_turn", lanes=lanes), fn("int_row", values=(lanes - 1,)), 1,
                  name=f"{p}_turn")  # [1, m] lane of each chunk
    lsel = g.map(fn("to_selector", n=lanes), turn, name=f"{p}_lane_sel")
    m = [f"{p}_l{lane}_m" for lane in range(lanes)]
    chunks = g.partition(g.promote(chunks_m, name=f"{p}_chunks1"), lsel, lanes, count_names=m,
                         name=f"{p}_deal")
    ids = g.partition(eid_p, lsel, lanes, count_names=m, name=f"{p}_deal_id")
    pad = 0 if plan.static is None else 1
    outs = []
    for lane in range(lanes):
        q = f"{p}_l{lane}"
        rows, j_rows = _lane(g, plan, q, chunks[lane], ids[lane], 0, E, weights)
        outs.append(g.zip(rows, j_rows, name=f"{q}_res"))
    back, _ = g.eager_merge(outs, name=f"{p}_gather")  # [M, R] of (row, expert)
    rows = g.map(fn("get", index=0), back, name=f"{p}_rows")
    sel = g.map(fn("to_selector", n=E + pad), g.map(fn("get", index=1), back,
                name=f"{p}_row_e"), name=f"{p}_row_sel")
    names = list(counts) + ([f"{p}_padrows"] if pad else [])
    backs = g.partition(rows, sel, E + pad, count_names=names, name=f"{p}_to_experts")
    if pad:  # the padding rows: dropped, never sent to a unit
        g.output(names[-1], backs[-1])
    return list(backs[:E])
