"""Tile functions of causal (prefill) attention over ragged KV caches (registered on import).

They extend the decode-attention functions of :mod:`~torch2step.step.fn_library_models` to
``S`` query tokens per request (STeP (arXiv 2511.07776) §5.1 "FlashAttention implementation"
with the causal mask expressed as the set of rows each query tile reads):

Update: prefill_cursor           running ``[row_base, n, stride, S, t]`` over the query tokens
                                 of every (request, KV head): ``t = 1 .. S`` is the number of
                                 new rows query token ``t - 1`` sees; ``row_base`` advances by
                                 ``stride`` when a new (request, KV head) starts.
Flat:   kv_rows_causal(causal)   ``[row_base, n, stride, S, t]`` -> the row addresses
                                 ``row_base + j`` (``j < n``) then the new rows
                                 ``row_base + stride - S + u`` for ``u < t`` (``u < S`` when not
                                 causal).
        query_rows(group)        ``[row_base, n, stride, S, t]`` -> the ``group`` rows
                                 ``(row_base / stride * group + g) * S + t - 1`` of a
                                 ``[B*Hq*S, D]`` query / output tensor (query token ``t - 1``
                                 of the heads of KV head ``row_base / stride``).
"""

from __future__ import annotations

import numpy as np
import sympy as sp

from torch2step.errors import StepTypeError

from .fn_library import _eq, _tile
from .functions import Fn, FnSpec, register_fn, registered_fns
from .types import ADDR, DataType, TileType
from .values import StepRuntimeError

__all__ = ["PREFILL_FNS"]

_INT = ("int32", "int64")


def _int_tile(f: Fn, t: DataType, what: str) -> TileType:
    tt = _tile(f, t, what)
    if tt.dtype not in _INT:
        raise StepTypeError(f"function {f}: {what} must be an integer tile, got {tt}")
    return tt


def _cursor_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    n, st = _int_tile(f, args[0], "length"), _int_tile(f, acc, "state")
    _eq(f, n.shape[0], sp.Integer(1), "length rows")
    _eq(f, n.shape[1], sp.Integer(1), "length cols")
    _eq(f, st.shape[1], sp.Integer(5), "state cols [row_base, n, stride, S, t]")
    return acc


def _cursor(f: Fn, n: np.ndarray, state: np.ndarray) -> np.ndarray:
    base, _, stride, s, t = (int(v) for v in state[0])
    if t >= s:  # the first query token of the next (request, KV head)
        base, t = base + stride, 0
    return np.array([[base, int(n[0, 0]), stride, s, t + 1]], dtype=state.dtype)


def _rows_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    t = _int_tile(f, args[0], "argument")
    if not (t.shape[0] == 1 and t.shape[1] == 5):
        raise StepTypeError(
            f"function {f}: needs a [1, 5] [row_base, n, stride, S, t] tile, got {t}"
        )
    return ADDR, (None,)


def _rows(f: Fn, x: np.ndarray) -> list:
    base, n, stride, s, t = (int(v) for v in x[0])
    if not 0 <= n <= stride - s:
        raise StepRuntimeError(
            f"{f}: KV length {n} must lie in 0..{stride - s} (cache rows {stride} minus the "
            f"{s} new tokens); grow the cache or clip kv_len"
        )
    new = t if f.get("causal", True) else s
    first = base + stride - s
    rows = [*range(base, base + n), *range(first, first + new)]
    return [np.array([[r]], dtype=np.int64) for r in rows]


def _qrows_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    _rows_rule(f, args)
    group = f.get("group", 0)
    if not isinstance(group, int) or group < 1:
        raise StepTypeError(f"function {f}: group must be a positive int")
    return ADDR, (sp.Integer(group),)


def _qrows(f: Fn, x: np.ndarray) -> list:
    base, _, stride, s, t = (int(v) for v in x[0])
    group = int(f.get("group"))
    head0 = base // stride * group
    return [np.array([[(head0 + g) * s + t - 1]], dtype=np.int64) for g in range(group)]


PREFILL_FNS: tuple[FnSpec, ...] = (
    FnSpec(
        "prefill_cursor",
        "update",
        1,
        _cursor_rule,
        _cursor,
        doc="n x [base, _, stride, S, t] -> the cursor of the next query token (t = 1..S)",
    ),
    FnSpec(
        "kv_rows_causal",
        "flat",
        1,
        _rows_rule,
        _rows,
        doc="[base, n, stride, S, t] -> base .. base+n-1, then the first t of the S new rows",
    ),
    FnSpec(
        "query_rows",
        "flat",
        1,
        _qrows_rule,
        _qrows,
        doc="[base, n, stride, S, t] -> the group's rows of query token t-1 in [B*Hq*S, D]",
    ),
)
"""The specs this module registers."""

for _spec in PREFILL_FNS:
    if _spec.name not in registered_fns():
        register_fn(_spec)
