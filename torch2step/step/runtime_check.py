"""Check a run-time stream against its type and learn the values of its symbols.

``check_stream(type, value, env, where)`` walks the nested data with the axis indices bound
to positions, compares every size the shape rule predicts with the data, and records the
values of symbols that were not known yet (a Partition's chunk counts, a fresh ragged size,
an input's batch size) in ``env``.  This is how "the interpreter's output shape equals the
shape rule after substitution" is checked, and how metric formulas get a run's values.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import sympy as sp

from .dims import Index
from .evaluate import Bindings, _num, try_evaluate
from .types import BufferType, DataType, SelectorType, StreamType, TileType, TupleType
from .values import BufferValue, SelectorValue, StepRuntimeError, StreamValue

__all__ = ["check_stream", "unify_size"]

_KIND = {"fp32": "f", "bf16": "f", "fp16": "f", "int32": "iu", "int64": "iu", "bool": "b"}


def unify_size(
    expr: sp.Expr, observed: int, local: dict[sp.Symbol, int], env: Bindings, where: str
) -> None:
    """Bind ``expr`` to ``observed`` if it is an unknown symbol, else check it."""
    if expr.is_Integer:  # fast path: a static size
        if int(expr) != observed:
            _mismatch(expr, int(expr), observed, local, where)
        return
    if expr.is_Symbol and expr.name in env and expr not in local:
        known = env[expr.name]
        if isinstance(known, int) and not isinstance(expr, Index):  # fast path: a known size
            if known != observed:
                _mismatch(expr, known, observed, local, where)
            return
    if isinstance(expr, sp.Symbol) and not isinstance(expr, Index) and expr not in local:
        if expr.name not in env:
            env[expr.name] = observed
            return
    elif isinstance(expr, sp.Indexed):
        name, indices = _indexed_parts(expr)
        key = tuple(_index_value(i, env, local) for i in indices)
        if None not in key:
            key = tuple(int(k) for k in key)  # type: ignore[arg-type]
            table = env.get(name)
            if table is None:
                env[name] = {key: observed}
                return
            if isinstance(table, dict):
                if key not in table:
                    table[key] = observed
                    return
                value = _num(table[key])  # what evaluating ``expr`` gives, without again
                if value != observed:  # evaluating its indices
                    _mismatch(expr, value, observed, local, where)
                return
    value = try_evaluate(expr, env, local)
    if value is None and _solve_one(expr, observed, local, env):
        return
    if value is not None and value != observed:
        _mismatch(expr, value, observed, local, where)


@lru_cache(maxsize=1 << 14)
def _indexed_parts(expr: sp.Indexed) -> tuple[str, tuple[sp.Expr, ...]]:
    """The table name and the indices of a ragged size ``L[i]`` (sympy computes both in
    Python on every access; a stream's elements ask for the same few sizes again and again)."""
    label = expr.base.label  # a Symbol's str is its name (no printer)
    return (label.name if type(label) is sp.Symbol else str(label)), tuple(expr.indices)


def _index_value(i: sp.Expr, env: Bindings, local: dict[sp.Symbol, int]) -> Any:
    """``try_evaluate(i, env, local)``; an axis index bound in ``local`` is read directly."""
    if i.is_Symbol:
        v = local.get(i)
        if v is not None:
            return v
    return try_evaluate(i, env, local)


def _mismatch(expr: sp.Expr, value: Any, observed: int, local: dict, where: str) -> None:
    shown = ", ".join(f"{k}={v}" for k, v in local.items())
    raise StepRuntimeError(
        f"{where}: the shape rule gives {sp.sstr(expr)} = {value}"
        f"{' at ' + shown if shown else ''} but the data has {observed}"
    )


def _solve_one(expr: sp.Expr, observed: int, local: dict, env: Bindings) -> bool:
    """Bind the one unknown symbol of a polynomial size such as ``16*M`` from ``observed``."""
    if expr.atoms(sp.Indexed) or expr.atoms(sp.Sum) or expr.atoms(sp.Function):
        return False
    known = {s: env[s.name] for s in expr.free_symbols if s.name in env and s not in local}
    known.update({s: v for s, v in local.items() if s in expr.free_symbols})
    rest = expr.xreplace({s: sp.Integer(v) for s, v in known.items()})
    unknown = [s for s in rest.free_symbols if not isinstance(s, Index)]
    if len(unknown) != 1:
        return False
    sols = [s for s in sp.solve(sp.Eq(rest, observed), unknown[0]) if s.is_Integer and s >= 0]
    if len(sols) != 1:
        return False
    env[unknown[0].name] = int(sols[0])
    return True


def _check_elem(t: DataType, x: Any, local: dict, env: Bindings, where: str) -> None:
    if isinstance(t, TileType):
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise StepRuntimeError(f"{where}: expected a 2-D tile for {t}, got {type(x).__name__}")
        if x.dtype.kind not in _KIND[t.dtype]:
            raise StepRuntimeError(f"{where}: tile of numpy {x.dtype} where {t} is expected")
        (rows, cols), (r, c) = t.shape, x.shape
        if not (rows.is_Integer and rows.p == r):  # a static size that matches needs no more
            unify_size(rows, r, local, env, f"{where} (tile rows)")
        if not (cols.is_Integer and cols.p == c):
            unify_size(cols, c, local, env, f"{where} (tile cols)")
    elif isinstance(t, SelectorType):
        if not isinstance(x, SelectorValue):
            raise StepRuntimeError(f"{where}: expected a selector, got {x!r}")
        if any(not 0 <= i < t.n for i in x.indices) or (t.k is not None and len(x.indices) != t.k):
            raise StepRuntimeError(f"{where}: selector {x!r} does not fit {t}")
    elif isinstance(t, BufferType):
        if not isinstance(x, BufferValue):
            raise StepRuntimeError(f"{where}: expected a buffer reference, got {x!r}")
        _walk_plain(t.shape, t.elem, x.data, 0, local, env, f"{where} (buffer)")
    elif isinstance(t, TupleType):
        if not isinstance(x, tuple) or len(x) != len(t.elems):
            raise StepRuntimeError(f"{where}: expected a {len(t.elems)}-tuple, got {x!r}")
        for sub_t, sub_x in zip(t.elems, x):
            _check_elem(sub_t, sub_x, local, env, where)
    else:  # pragma: no cover - every data type is handled above
        raise StepRuntimeError(f"{where}: unknown data type {t}")


def _walk_plain(
    dims: tuple, elem: DataType, node: Any, p: int, local: dict, env: Bindings, where: str
) -> None:
    if p == len(dims):
        _check_elem(elem, node, local, env, where)
        return
    if not isinstance(node, list):
        raise StepRuntimeError(f"{where}: expected a list at buffer axis {p}")
    unify_size(dims[p], len(node), local, env, f"{where} axis {p}")
    for c in node:
        _walk_plain(dims, elem, c, p + 1, local, env, where)


def _walk(t: StreamType, node: Any, p: int, local: dict, env: Bindings, where: str) -> None:
    if not isinstance(node, list):
        raise StepRuntimeError(f"{where}: expected a list at axis {p} of {t}, got {node!r}")
    d = t.shape[p]
    if not (d.is_Integer and d.p == len(node)):  # a matching static size needs no more
        unify_size(d, len(node), local, env, f"{where} axis {p}")
    ix = t.index[p]
    last = p == len(t.shape) - 1
    # one dict per axis, its index rebound per element: the checks read it, none keeps it
    loc = dict(local) if ix is not None else local
    for j, c in enumerate(node):
        if ix is not None:
            loc[ix] = j
        if last:
            _check_elem(t.dtype, c, loc, env, where)
        else:
            _walk(t, c, p + 1, loc, env, where)


def check_stream(t: StreamType, v: StreamValue, env: Bindings, where: str) -> None:
    """Raise :class:`StepRuntimeError` unless ``v`` has the shape/type ``t`` (binding unknowns)."""
    if v.rank != t.rank:
        raise StepRuntimeError(f"{where}: stream of rank {v.rank} where {t} is expected")
    _walk(t, v.data, 0, {}, env, where)
