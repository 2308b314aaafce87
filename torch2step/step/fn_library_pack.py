"""Built-in packing, init and flat tile functions (registered on import).

Update: retile_row (pack rows into a dynamically sized tile, STeP Fig. 2 "RetileRow").
Init:   zeros(shape, dtype), full(shape, value, dtype), online_softmax_init(rows, cols, dtype).
Flat:   retile_streamify(rows) (split a tile into row tiles, Fig. 2 "RetileStreamify"),
        split_cols(cols), iota(count) (addresses start..start+count-1),
        filter_padding (drop elements whose padding flag is set, Fig. 2 "FilterPadding").
"""

from __future__ import annotations

import numpy as np
import sympy as sp

from torch2step.errors import StepTypeError

from .dims import as_dim
from .fn_library import _eq, _init_shape, _int_shape, _tile, np_dtype
from .functions import Fn, FnSpec, register_fn
from .types import ADDR, BOOL, DataType, TileType, TupleType

__all__: list[str] = []

# ---------------------------------------------------------------- packing rows


def _retile_row_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    row, a = _tile(f, args[0], "row"), _tile(f, acc, "accumulator")
    _eq(f, row.shape[1], a.shape[1], "row and accumulator cols")
    return TileType((a.shape[0] + row.shape[0], a.shape[1]), a.dtype)


def _retile_row_accum(
    f: Fn, args: tuple[DataType, ...], init: DataType, count: sp.Expr
) -> DataType:
    row, a = _tile(f, args[0], "row"), _tile(f, init, "accumulator")
    _eq(f, row.shape[1], a.shape[1], "row and accumulator cols")
    return TileType((a.shape[0] + count * row.shape[0], a.shape[1]), a.dtype)


register_fn(
    FnSpec(
        "retile_row",
        "update",
        1,
        _retile_row_rule,
        lambda f, row, acc: np.concatenate([acc, row], axis=0),
        accum_rule=_retile_row_accum,
        doc="append a row tile to the accumulator tile (dynamic tile of all rows)",
    )
)

# ---------------------------------------------------------------- init functions


def _zeros_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    return TileType(_init_shape(f), str(f.get("dtype", "fp32")))


register_fn(
    FnSpec(
        "zeros",
        "init",
        0,
        _zeros_rule,
        lambda f: np.zeros(_int_shape(f), np_dtype(str(f.get("dtype", "fp32")))),
        doc="tile of zeros, zeros(shape=(r, c), dtype='fp32')",
    )
)
register_fn(
    FnSpec(
        "full",
        "init",
        0,
        _zeros_rule,
        lambda f: np.full(
            _int_shape(f), float(f.get("value", 0.0)), np_dtype(str(f.get("dtype", "fp32")))
        ),
        doc="tile filled with value, full(shape=(r, c), value=v, dtype='fp32')",
    )
)


def _osm_init_rule(f: Fn, args: tuple[DataType, ...]) -> DataType:
    rows, cols = as_dim(f.get("rows", 0)), as_dim(f.get("cols", 0))
    dt = str(f.get("dtype", "fp32"))
    return TupleType((TileType((rows, 1), dt), TileType((rows, 1), dt), TileType((rows, cols), dt)))


def _osm_init(f: Fn) -> tuple:
    rows, cols = int(f.get("rows", 0)), int(f.get("cols", 0))
    dt = np_dtype(str(f.get("dtype", "fp32")))
    return (np.full((rows, 1), -np.inf, dt), np.zeros((rows, 1), dt), np.zeros((rows, cols), dt))


register_fn(
    FnSpec(
        "online_softmax_init",
        "init",
        0,
        _osm_init_rule,
        _osm_init,
        doc="(max=-inf [rows,1], sum=0 [rows,1], out=0 [rows,cols])",
    )
)

# ---------------------------------------------------------------- flat functions


def _split_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    a = _tile(f, args[0])
    by_rows = f.name == "retile_streamify"
    part = as_dim(f.get("rows" if by_rows else "cols", 1))
    whole = a.shape[0] if by_rows else a.shape[1]
    if not (part.is_Integer and part >= 1) or sp.Mod(whole, part) != 0:
        raise StepTypeError(f"function {f}: {sp.sstr(whole)} is not a multiple of {part}")
    piece = (part, a.shape[1]) if by_rows else (a.shape[0], part)
    return TileType(piece, a.dtype), (whole / part,)


def _split_impl(f: Fn, x: np.ndarray) -> list:
    if f.name == "retile_streamify":
        r = int(f.get("rows", 1))
        return [x[j : j + r] for j in range(0, x.shape[0], r)]
    c = int(f.get("cols", 1))
    return [x[:, j : j + c] for j in range(0, x.shape[1], c)]


for _name in ("retile_streamify", "split_cols"):
    register_fn(FnSpec(_name, "flat", 1, _split_rule, _split_impl, doc=f"{_name}: split a tile"))


def _iota_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    a = _tile(f, args[0])
    if a.dtype not in ("int32", "int64") or not (a.shape[0] == 1 and a.shape[1] in (1, 2)):
        raise StepTypeError(f"function {f}: needs an integer [1,1] or [1,2] tile, got {a}")
    count = f.get("count")
    return ADDR, ((as_dim(count) if count is not None else None),)


def _iota_impl(f: Fn, x: np.ndarray) -> list:
    start, n = (0, int(x[0, 0])) if x.shape[1] == 1 else (int(x[0, 0]), int(x[0, 1]))
    return [np.array([[start + j]], dtype=np.int64) for j in range(n)]


register_fn(
    FnSpec(
        "iota",
        "flat",
        1,
        _iota_rule,
        _iota_impl,
        doc="[count] or [start, count] -> addresses start .. start+count-1; "
        "iota(count=expr) states the count symbolically",
    )
)


def _filter_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    if args[1] != BOOL:
        raise StepTypeError(f"function {f}: second argument must be a {BOOL} flag")
    return args[0], (None,)


register_fn(
    FnSpec(
        "filter_padding",
        "flat",
        2,
        _filter_rule,
        lambda f, x, pad: [] if bool(pad[0, 0]) else [x],
        doc="(x, is_pad) -> [] if is_pad else [x]; filter_padding(total=expr) states how "
        "many elements the whole filtered stream holds",
    )
)
