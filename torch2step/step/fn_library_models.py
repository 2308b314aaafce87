"""Tile functions used by the model graphs of :mod:`torch2step.lower.blocks` (registered on import).

They complete the built-in library (:mod:`torch2step.step.fn_library`) with what the MoE and
decode-attention graphs of STeP §5 need and the paper names only in passing ("a function
supported by the hardware", §3.2.4):

Map:    to_selector(n)           ``[1, k]`` integer expert ids -> a k-hot selector over ``n``
                                 outputs (the router's top-k as a Partition/Reassemble selector,
                                 STeP §3.2.3, Fig. 2 "Selector stream");
        pick_weight(expert)      ``([1, k] ids, [1, k] weights) -> [1, 1]``: the routing weight
                                 of one expert (0 if the token did not choose it);
        gelu_mul, gelu_tanh_mul, relu_mul
                                 ``act(a) * b``: the gated-MLP products besides ``silu_mul``.
Update: retile_col               append a column block to the accumulator tile (the column
                                 analogue of STeP Fig. 2 "RetileRow");
        retile_row_pair          RetileRow on a Zip of two row streams (K and V rows packed
                                 into tiles with one shared, dynamic row count);
        kv_cursor                running ``[row_base, n, stride]`` of a padded KV cache.
Init:   int_row(values, dtype)   a ``[1, len(values)]`` integer tile; values may be sizes of
                                 the run (``-Lmax``), evaluated when the Accum/Scan starts;
        empty_rows_pair(cols)    ``(Tile[0, c0], Tile[0, c1])``: the empty pair for
                                 ``retile_row_pair``.
Flat:   kv_rows(tail)            ``[row_base, n, stride]`` -> the row addresses
                                 ``row_base + j`` (``j < n``) then the last ``tail`` rows
                                 ``row_base + stride - tail + t`` of that request's cache.
        kv_tiles(tail, tile)     the same rows as ``(row, r)`` pairs: runs of at most
                                 ``tile`` consecutive rows, cut separately in the two
                                 segments (the ``n`` rows, then the ``tail`` rows), for
                                 RandomOffChipLoadRows.

FLOP counts follow :mod:`~torch2step.step.fn_library`: GELU(erf) 8 per element, GELU(tanh)
9, ReLU 1, plus 1 for the product; ``pick_weight`` ``2k`` (compare and select per choice).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy as sp

from torch2step.errors import StepTypeError

from .dims import as_dim
from .fn_library import _elems, _eq, _tile, gelu, gelu_tanh, np_dtype
from .functions import Fn, FnSpec, register_fn, registered_fns
from .types import ADDR, DataType, SelectorType, TileType, TupleType
from .values import SelectorValue, StepRuntimeError

__all__ = ["MODEL_FNS", "ROW_SPAN", "row_spans"]

ROW_SPAN = TupleType((ADDR, ADDR))
"""A ``(row, r)`` pair of ``[1, 1]`` integer tiles: ``r`` consecutive rows from ``row``."""


def row_spans(segments: list[tuple[int, int]], tile: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(row, r)`` pairs covering each ``(start, count)`` segment in runs of ``<= tile`` rows
    (a run never crosses a segment boundary; an empty segment gives none)."""
    out = []
    for start, count in segments:
        for j in range(0, count, tile):
            r = min(tile, count - j)
            out.append((np.array([[start + j]], np.int64), np.array([[r]], np.int64)))
    return out


_INT = ("int32", "int64")


def _int_tile(f: Fn, t: DataType, what: str) -> TileType:
    tt = _tile(f, t, what)
    if tt.dtype not in _INT:
        raise StepTypeError(f"function {f}: {what} must be an integer tile, got {tt}")
    return tt


# ---------------------------------------------------------------- routing (MoE)


def _to_selector_rule(f: Fn, args: tuple[DataType, ...]) -> SelectorType:
    t = _int_tile(f, args[0], "argument")
    n = f.get("n")
    if not isinstance(n, int) or n < 1:
        raise StepTypeError(f"function {f}: give the number of outputs, to_selector(n=E)")
    _eq(f, t.shape[0], sp.Integer(1), "id rows (one token per tile)")
    k = t.shape[1]
    if not k.is_Integer or int(k) > n:
        raise StepTypeError(f"function {f}: needs a static [1, k] tile with k <= n, got {t}")
    return SelectorType(n, int(k))


def _to_selector(f: Fn, ids: np.ndarray) -> SelectorValue:
    n = int(f.get("n"))
    row = [int(v) for v in ids[0]]
    if any(not 0 <= v < n for v in row):
        raise StepRuntimeError(f"{f}: expert id outside 0..{n - 1} in {row}")
    return SelectorValue(tuple(row))  # raises on a repeated id


def _pick_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    ids = _int_tile(f, args[0], "ids")
    w = _tile(f, args[1], "weights")
    _eq(f, ids.shape[1], w.shape[1], "ids and weights cols")
    _eq(f, ids.shape[0], w.shape[0], "ids and weights rows")
    if not isinstance(f.get("expert"), int):
        raise StepTypeError(f"function {f}: give the expert, pick_weight(expert=e)")
    return TileType((ids.shape[0], 1), w.dtype)


def _pick(f: Fn, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    hit = ids == int(f.get("expert"))
    return np.where(hit, w, 0).sum(axis=1, keepdims=True).astype(w.dtype)


# ---------------------------------------------------------------- gated activations



_GATED = {
    "gelu_mul": (gelu, 9, "GELU(a) * b (erf form, torch.nn.functional.gelu)"),
    "gelu_tanh_mul": (gelu_tanh, 10, "GELU_tanh(a) * b (gelu(approximate='tanh'))"),
    "relu_mul": (lambda x: np.maximum(x, 0), 2, "ReLU(a) * b"),
}


def _gated_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a, b = _tile(f, args[0]), _tile(f, args[1])
    _eq(f, a.shape[0], b.shape[0], "rows")
    _eq(f, a.shape[1], b.shape[1], "cols")
    return a


def _gated_spec(name: str, act: Callable[[np.ndarray], np.ndarray], per: int, doc: str) -> FnSpec:
    """A 2-argument map ``act(a) * b`` with ``per`` FLOPs per element."""
    return FnSpec(
        name,
        "map",
        2,
        _gated_rule,
        lambda f, a, b: (act(a) * b).astype(a.dtype, copy=False),
        flops=lambda f, args: per * _elems(_tile(f, args[0])),
        doc=doc,
    )


# ---------------------------------------------------------------- packing


def _retile_col_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    piece, a = _tile(f, args[0], "column block"), _tile(f, acc, "accumulator")
    _eq(f, piece.shape[0], a.shape[0], "column block and accumulator rows")
    return TileType((a.shape[0], a.shape[1] + piece.shape[1]), a.dtype)


def _retile_col_accum(
    f: Fn, args: tuple[DataType, ...], init: DataType, count: sp.Expr
) -> DataType:
    piece, a = _tile(f, args[0], "column block"), _tile(f, init, "accumulator")
    _eq(f, piece.shape[0], a.shape[0], "column block and accumulator rows")
    return TileType((a.shape[0], a.shape[1] + count * piece.shape[1]), a.dtype)


def _pair_state(f: Fn, acc: DataType) -> tuple[TileType, TileType]:
    if not (isinstance(acc, TupleType) and len(acc.elems) == 2):
        raise StepTypeError(f"function {f}: the accumulator is a pair of tiles, got {acc}")
    return _tile(f, acc.elems[0], "accumulator"), _tile(f, acc.elems[1], "accumulator")


def _pair_accum(f: Fn, args: tuple[DataType, ...], init: DataType, count: sp.Expr) -> DataType:
    a0, a1 = _pair_state(f, init)
    r0, r1 = _tile(f, args[0], "first row"), _tile(f, args[1], "second row")
    _eq(f, r0.shape[0], r1.shape[0], "rows of the two members")
    _eq(f, a0.shape[0], a1.shape[0], "accumulator rows of the two members")
    _eq(f, r0.shape[1], a0.shape[1], "first row and accumulator cols")
    _eq(f, r1.shape[1], a1.shape[1], "second row and accumulator cols")
    rows = a0.shape[0] + count * r0.shape[0]
    return TupleType(
        (TileType((rows, a0.shape[1]), a0.dtype), TileType((rows, a1.shape[1]), a1.dtype))
    )


def _pair_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    return _pair_accum(f, args, acc, sp.Integer(1))


def _pair_impl(f: Fn, r0: np.ndarray, r1: np.ndarray, acc: tuple) -> tuple:
    return (np.concatenate([acc[0], r0], axis=0), np.concatenate([acc[1], r1], axis=0))


def _empty_pair_rule(f: Fn, args: tuple[DataType, ...]) -> TupleType:
    cols = f.get("cols", ())
    dt = str(f.get("dtype", "fp32"))
    if not (isinstance(cols, tuple) and len(cols) == 2):
        raise StepTypeError(f"function {f}: give two column counts, empty_rows_pair(cols=(c0, c1))")
    return TupleType(tuple(TileType((0, as_dim(c)), dt) for c in cols))


def _empty_pair(f: Fn) -> tuple:
    dt = np_dtype(str(f.get("dtype", "fp32")))
    return tuple(np.zeros((0, int(c)), dt) for c in f.get("cols"))


# ---------------------------------------------------------------- KV-cache addresses (GQA)


def _int_row_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    values = f.get("values", ())
    dt = str(f.get("dtype", "int64"))
    if not isinstance(values, tuple) or not values or dt not in _INT:
        raise StepTypeError(f"function {f}: int_row(values=(v0, ...), dtype='int64')")
    return TileType((1, len(values)), dt)


def _int_row(f: Fn) -> np.ndarray:
    return np.array([[int(v) for v in f.get("values")]], np_dtype(str(f.get("dtype", "int64"))))


def _cursor_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    n, st = _int_tile(f, args[0], "length"), _int_tile(f, acc, "state")
    _eq(f, n.shape[0], sp.Integer(1), "length rows")
    _eq(f, n.shape[1], sp.Integer(1), "length cols")
    _eq(f, st.shape[1], sp.Integer(3), "state cols [row_base, n, stride]")
    return acc


def _cursor(f: Fn, n: np.ndarray, state: np.ndarray) -> np.ndarray:
    base, _, stride = (int(v) for v in state[0])
    return np.array([[base + stride, int(n[0, 0]), stride]], dtype=state.dtype)


def _kv_rows_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    t = _int_tile(f, args[0], "argument")
    if not (t.shape[0] == 1 and t.shape[1] == 3):
        raise StepTypeError(f"function {f}: needs a [1, 3] [row_base, n, stride] tile, got {t}")
    tail = f.get("tail", 0)
    if not isinstance(tail, int) or tail < 0:
        raise StepTypeError(f"function {f}: tail must be a non-negative int")
    return ADDR, (None,)


def _kv_cursor(f: Fn, x: np.ndarray) -> tuple[int, int, int, int]:
    """``(row_base, n, stride, tail)`` of a ``[row_base, n, stride]`` cursor, ``n`` checked."""
    base, n, stride = (int(v) for v in x[0])
    tail = int(f.get("tail", 0))
    if not 0 <= n <= stride - tail:
        raise StepRuntimeError(
            f"{f}: KV length {n} must lie in 0..{stride - tail} (cache rows {stride} minus "
            f"{tail} tail rows); grow the cache or clip kv_len"
        )
    return base, n, stride, tail


def _kv_rows(f: Fn, x: np.ndarray) -> list:
    base, n, stride, tail = _kv_cursor(f, x)
    rows = [*range(base, base + n), *range(base + stride - tail, base + stride)]
    return [np.array([[r]], dtype=np.int64) for r in rows]


def _kv_tiles_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    _kv_rows_rule(f, args)
    tile = f.get("tile", 0)
    if not isinstance(tile, int) or tile < 1:
        raise StepTypeError(f"function {f}: give the tile rows, kv_tiles(tail=t, tile=64)")
    return ROW_SPAN, (None,)


def _kv_tiles(f: Fn, x: np.ndarray) -> list:
    base, n, stride, tail = _kv_cursor(f, x)
    return row_spans([(base, n), (base + stride - tail, tail)], int(f.get("tile")))


# ---------------------------------------------------------------- registration

MODEL_FNS: tuple[FnSpec, ...] = (
    FnSpec(
        "to_selector",
        "map",
        1,
        _to_selector_rule,
        _to_selector,
        doc="[1, k] integer ids -> k-hot selector over n outputs, to_selector(n=E)",
    ),
    FnSpec(
        "pick_weight",
        "map",
        2,
        _pick_rule,
        _pick,
        flops=lambda f, args: 2 * _elems(_tile(f, args[0])),
        doc="(ids [1,k], weights [1,k]) -> [1,1] weight of one expert, pick_weight(expert=e)",
    ),
    *(_gated_spec(name, act, per, doc) for name, (act, per, doc) in _GATED.items()),
    FnSpec(
        "retile_col",
        "update",
        1,
        _retile_col_rule,
        lambda f, piece, acc: np.concatenate([acc, piece], axis=1),
        accum_rule=_retile_col_accum,
        doc="append a column block to the accumulator tile (dynamic tile of all columns)",
    ),
    FnSpec(
        "retile_row_pair",
        "update",
        2,
        _pair_rule,
        _pair_impl,
        accum_rule=_pair_accum,
        doc="(row0, row1) x (tile0, tile1): RetileRow on both members of a Zip",
    ),
    FnSpec(
        "empty_rows_pair",
        "init",
        0,
        _empty_pair_rule,
        _empty_pair,
        doc="(Tile[0, c0], Tile[0, c1]), empty_rows_pair(cols=(c0, c1), dtype='fp32')",
    ),
    FnSpec(
        "int_row",
        "init",
        0,
        _int_row_rule,
        _int_row,
        doc="[1, n] integer tile of values (sizes of the run allowed), int_row(values=(...))",
    ),
    FnSpec(
        "kv_cursor",
        "update",
        1,
        _cursor_rule,
        _cursor,
        doc="n x [base, _, stride] -> [base + stride, n, stride] (request row bases)",
    ),
    FnSpec(
        "kv_rows",
        "flat",
        1,
        _kv_rows_rule,
        _kv_rows,
        doc="[base, n, stride] -> base .. base+n-1, then the last `tail` rows of the stride",
    ),
    FnSpec(
        "kv_tiles",
        "flat",
        1,
        _kv_tiles_rule,
        _kv_tiles,
        doc="[base, n, stride] -> (row, r) runs of <= tile rows of kv_rows' two segments",
    ),
)
"""The specs this module registers."""

for _spec in MODEL_FNS:
    if _spec.name not in registered_fns():
        register_fn(_spec)
