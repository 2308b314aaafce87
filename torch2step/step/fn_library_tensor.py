"""Tile functions for general tensor data movement (registered on import).

Map:    concat_cols (two tiles of the same rows side by side: a concatenation along the last
        dimension), gather_cols (a tile's columns at the integer positions of an index row:
        ``index_select`` along the last dimension).

Both move data only, so they count no FLOPs (STeP (arXiv 2511.07776) §4.1 counts compute as
matmul FLOPs); their tiles' bytes are counted by the memory operators around them.
"""

from __future__ import annotations

import numpy as np

from .fn_library import _eq, _tile
from .functions import Fn, FnSpec, register_fn
from .types import DataType, TileType

__all__: list[str] = []


def _concat_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a, b = _tile(f, args[0], "first tile"), _tile(f, args[1], "second tile")
    _eq(f, a.shape[0], b.shape[0], "tile rows")
    return TileType((a.shape[0], a.shape[1] + b.shape[1]), a.dtype)


register_fn(
    FnSpec(
        "concat_cols",
        "map",
        2,
        _concat_rule,
        lambda f, a, b: np.concatenate([a, b.astype(a.dtype, copy=False)], axis=1),
        doc="[a | b]: the columns of a then those of b (same rows)",
    )
)


def _gather_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x, idx = _tile(f, args[0], "data tile"), _tile(f, args[1], "index tile")
    _eq(f, idx.shape[0], 1, "index tile rows (one index row)")
    return TileType((x.shape[0], idx.shape[1]), x.dtype)


register_fn(
    FnSpec(
        "gather_cols",
        "map",
        2,
        _gather_rule,
        lambda f, x, idx: np.ascontiguousarray(x[:, idx[0].astype(np.int64)]),
        doc="x[:, idx]: the columns of x at the positions of an index row",
    )
)
