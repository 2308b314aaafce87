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
        kv_tiles_prefill(tile)   ``[row_base, n, stride, S]`` -> per KV tile of at most
                                 ``tile`` rows, ``(row, r, [u0, S])``: the rows
                                 ``row_base + j`` (``j < n``) then the ``S`` new rows, cut per
                                 segment; ``u0`` is the tile's first new-token index (``-1``
                                 in the cached prefix), for the causal mask.
Update: prefill_kv_cursor        ``[row_base, n, stride, S]`` per (request, KV head).
        online_softmax_causal(scale)
                                 ``online_softmax`` of a ``[G*S, D]`` query tile (row
                                 ``g*S + i`` is token ``i``) with the causal mask of its KV
                                 tile: new row ``u0 + j`` is visible to token ``i`` iff
                                 ``u0 + j <= i`` (prefix rows always are).
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
from .fn_library_models import row_spans
from .functions import Fn, FnSpec, fn_spec, register_fn, registered_fns
from .types import ADDR, DataType, TileType, TupleType
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


def _kv_cursor_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    n, st = _int_tile(f, args[0], "length"), _int_tile(f, acc, "state")
    _eq(f, n.shape[1], sp.Integer(1), "length cols")
    _eq(f, st.shape[1], sp.Integer(4), "state cols [row_base, n, stride, S]")
    return acc


def _kv_cursor(f: Fn, n: np.ndarray, state: np.ndarray) -> np.ndarray:
    base, _, stride, s = (int(v) for v in state[0])
    return np.array([[base + stride, int(n[0, 0]), stride, s]], dtype=state.dtype)


_META = TileType((1, 2), "int64")
_TRIPLE = TupleType((ADDR, ADDR, _META))


def _tiles_rule(f: Fn, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    t = _int_tile(f, args[0], "argument")
    if not (t.shape[0] == 1 and t.shape[1] == 4):
        raise StepTypeError(f"function {f}: needs a [1, 4] [row_base, n, stride, S] tile, got {t}")
    if not isinstance(f.get("tile"), int) or int(f.get("tile")) < 1:
        raise StepTypeError(f"function {f}: give the tile rows, kv_tiles_prefill(tile=64)")
    return _TRIPLE, (None,)


def _tiles(f: Fn, x: np.ndarray) -> list:
    base, n, stride, s = (int(v) for v in x[0])
    if not 0 <= n <= stride - s:
        raise StepRuntimeError(
            f"{f}: KV length {n} must lie in 0..{stride - s} (cache rows {stride} minus the "
            f"{s} new tokens); grow the cache or clip kv_len"
        )
    first = base + stride - s
    out = []
    for row, r in row_spans([(base, n), (first, s)], int(f.get("tile"))):
        u0 = int(row[0, 0]) - first if int(row[0, 0]) >= first else -1
        out.append((row, r, np.array([[u0, s]], np.int64)))
    return out


def _causal_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    _int_tile(f, args[3], "mask tile [u0, S]")
    return fn_spec("online_softmax").type_rule(f, args[:3], acc)


def _causal(f: Fn, q: np.ndarray, k: np.ndarray, v: np.ndarray, meta: np.ndarray, acc: tuple):
    m, s, o = acc
    if k.shape[0] == 0:
        return acc
    u0, n_new = int(meta[0, 0]), int(meta[0, 1])
    scores = (q @ k.T) * float(f.get("scale", 1.0))
    if u0 >= 0:  # new rows u0 + j, visible to token i = row % S iff u0 + j <= i
        token = np.arange(q.shape[0])[:, None] % max(n_new, 1)
        scores = np.where(u0 + np.arange(k.shape[0])[None, :] <= token, scores, -np.inf)
    m_new = np.maximum(m, scores.max(axis=1, keepdims=True))
    safe = np.where(np.isfinite(m_new), m_new, 0)  # a row that has seen nothing yet
    p = np.exp(scores - safe)
    alpha = np.where(np.isfinite(m), np.exp(m - safe), 0)
    return (m_new, alpha * s + p.sum(axis=1, keepdims=True), alpha * o + p @ v)


def _causal_flops(f: Fn, args: tuple[DataType, ...]) -> sp.Expr:
    q, k = _tile(f, args[0]), _tile(f, args[1])
    return fn_spec("online_softmax").flops_of(f, args[:3]) + q.shape[0] * k.shape[0]


PREFILL_FNS: tuple[FnSpec, ...] = (
    FnSpec(
        "prefill_kv_cursor",
        "update",
        1,
        _kv_cursor_rule,
        _kv_cursor,
        doc="n x [base, _, stride, S] -> [base + stride, n, stride, S] per (request, KV head)",
    ),
    FnSpec(
        "kv_tiles_prefill",
        "flat",
        1,
        _tiles_rule,
        _tiles,
        doc="[base, n, stride, S] -> (row, r, [u0, S]) per KV tile of the prefix, then new rows",
    ),
    FnSpec(
        "online_softmax_causal",
        "update",
        4,
        _causal_rule,
        _causal,
        flops=_causal_flops,
        scratch=lambda f, args: fn_spec("online_softmax").scratch_of(f, args[:3]),
        scratch_value=lambda f, isz, q, k, v, meta: fn_spec("online_softmax").scratch_value(
            f, isz[:3], q, k, v
        ),
        doc="(q [G*S, D], k, v, [u0, S]) x (max, sum, out): online_softmax, causal mask",
    ),
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
