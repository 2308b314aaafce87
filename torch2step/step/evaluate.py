"""Numeric evaluation of STeP size and metric formulas (STeP §4.1: "substituting the
symbols ... with various input shapes or control flow decisions").

``evaluate(expr, env)`` computes a sympy expression built from integers, dynamic symbols,
indexed ragged symbols (``L[i]``), ``Sum``, :class:`~torch2step.step.dims.MaxOver`,
``floor``/``ceiling``/``Mod``/``Max``/``Min`` and ``Piecewise``.  ``env`` maps a symbol name
to a number and an indexed base name to its values: a sequence (``{"L": [3, 5, 2]}``), a
nested sequence for several indices, or a dict from index tuples to values.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import sympy as sp

from torch2step.errors import StepTypeError

from .dims import MaxOver

__all__ = ["Bindings", "evaluate", "evaluate_bound", "normalise_env"]

Number = int | float | Fraction
Bindings = dict[str, Any]
"""Symbol name -> int, indexed base name -> dict from index tuple to int."""


def normalise_env(env: Mapping[str, Any] | None) -> Bindings:
    """Copy ``env`` turning sequences of ragged values into ``{(i,): v}`` dicts."""
    out: Bindings = {}
    for name, value in (env or {}).items():
        if isinstance(value, Mapping):
            out[name] = {(k if isinstance(k, tuple) else (k,)): v for k, v in value.items()}
        elif isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
            seq = value.tolist() if hasattr(value, "tolist") else value
            if isinstance(seq, (list, tuple)):
                table: dict[tuple[int, ...], Any] = {}
                _flatten_table(seq, (), table)
                out[name] = table
            else:
                out[name] = seq
        else:
            out[name] = value
    return out


def _flatten_table(seq: Any, prefix: tuple[int, ...], out: dict[tuple[int, ...], Any]) -> None:
    for k, v in enumerate(seq):
        if isinstance(v, (list, tuple)):
            _flatten_table(v, (*prefix, k), out)
        else:
            out[(*prefix, k)] = int(v) if float(v).is_integer() else v


class _Missing(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _num(x: Number) -> Number:
    if isinstance(x, Fraction) and x.denominator == 1:
        return int(x)
    return x


def _ev(e: sp.Basic, env: Bindings, local: dict[sp.Symbol, int]) -> Any:
    if e.is_Integer:
        return int(e)
    if e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    if e.is_Float:
        return float(e)
    if e is sp.true:
        return True
    if e is sp.false:
        return False
    if e is sp.oo:
        return float("inf")
    if e is sp.zoo or e is sp.nan:
        raise StepTypeError(f"cannot evaluate undefined value {e}")
    if isinstance(e, sp.Symbol):
        if e in local:
            return local[e]
        if e.name in env and not isinstance(env[e.name], dict):
            return env[e.name]
        raise _Missing(e.name)
    if isinstance(e, sp.Indexed):
        label = e.base.label  # a Symbol's str is its name: read it without sympy's printer
        name = label.name if type(label) is sp.Symbol else str(label)
        table = env.get(name)
        if not isinstance(table, dict):
            raise _Missing(name)
        key = tuple(int(_ev(a, env, local)) for a in e.indices)
        if key not in table:
            raise _Missing(f"{name}[{', '.join(map(str, key))}]")
        return table[key]
    if isinstance(e, sp.Add):
        return sum((_ev(a, env, local) for a in e.args), 0)
    if isinstance(e, sp.Mul):
        acc: Any = 1
        for a in e.args:
            acc = acc * _ev(a, env, local)
        return acc
    if isinstance(e, sp.Pow):
        base, ex = _ev(e.base, env, local), _ev(e.exp, env, local)
        if isinstance(ex, int) and ex < 0:
            return Fraction(1, 1) / (Fraction(base) ** (-ex))
        return base**ex
    if isinstance(e, sp.floor):
        return int(_floor(_ev(e.args[0], env, local)))
    if isinstance(e, sp.ceiling):
        return -int(_floor(-_ev(e.args[0], env, local)))
    if isinstance(e, sp.Mod):
        return _ev(e.args[0], env, local) % _ev(e.args[1], env, local)
    if isinstance(e, sp.Max):
        return max(_ev(a, env, local) for a in e.args)
    if isinstance(e, sp.Min):
        return min(_ev(a, env, local) for a in e.args)
    if isinstance(e, sp.Piecewise):
        for val, cond in e.args:
            if _ev(cond, env, local):
                return _ev(val, env, local)
        raise StepTypeError(f"no branch of {e} holds")
    if isinstance(e, sp.Sum):
        return _ev_sum(e.function, list(e.limits), env, local)
    if isinstance(e, MaxOver):
        body, var, n = e.args
        count = int(_ev(n, env, local))
        best: Any = 0
        for k in range(count):
            v = _ev(body, env, {**local, var: k})
            best = v if k == 0 else max(best, v)
        return best
    if isinstance(e, sp.core.relational.Relational):
        lhs, rhs = _ev(e.lhs, env, local), _ev(e.rhs, env, local)
        return {
            ">": lhs > rhs,
            ">=": lhs >= rhs,
            "<": lhs < rhs,
            "<=": lhs <= rhs,
            "==": lhs == rhs,
            "!=": lhs != rhs,
        }[e.rel_op]
    if isinstance(e, sp.And):
        return all(_ev(a, env, local) for a in e.args)
    if isinstance(e, sp.Or):
        return any(_ev(a, env, local) for a in e.args)
    if isinstance(e, sp.Not):
        return not _ev(e.args[0], env, local)
    if isinstance(e, sp.ITE):  # sympy's if-then-else, as a simplified Piecewise condition
        c, a, b = e.args
        return _ev(a, env, local) if _ev(c, env, local) else _ev(b, env, local)
    raise StepTypeError(f"cannot evaluate {type(e).__name__} in {sp.sstr(e)}")


def _floor(x: Any) -> int:
    if isinstance(x, Fraction):
        return x.numerator // x.denominator
    import math

    return math.floor(x)


def _ev_sum(body: sp.Expr, limits: list[tuple], env: Bindings, local: dict) -> Any:
    # sympy lists limits innermost first: Sum(f, (j, 0, L[i] - 1), (i, 0, B - 1))
    var, lo, hi = limits[-1]
    lo_v, hi_v = int(_ev(lo, env, local)), int(_ev(hi, env, local))
    total: Any = 0
    for k in range(lo_v, hi_v + 1):
        inner = {**local, var: k}
        total += (
            _ev_sum(body, limits[:-1], env, inner) if len(limits) > 1 else _ev(body, env, inner)
        )
    return total


def evaluate(expr: sp.Basic | int, env: Mapping[str, Any] | None = None, **values: Any) -> Any:
    """The value of ``expr`` with symbols taken from ``env`` and ``values``.

    Raises :class:`StepTypeError` naming the first symbol without a value.
    """
    full = normalise_env({**(env or {}), **values})
    try:
        return _num(_ev(sp.sympify(expr), full, {}))  # type: ignore[arg-type]
    except _Missing as m:
        raise StepTypeError(
            f"cannot evaluate {sp.sstr(expr)}: no value for {m.what}; pass it in env"
        ) from None


def evaluate_bound(expr: sp.Basic, env: Bindings, local: dict[sp.Symbol, int] | None = None) -> Any:
    """:func:`evaluate` for an ``env`` already in :func:`normalise_env` form (used as it is,
    not copied: the interpreter's hot path) and optional local index values."""
    try:
        return _num(_ev(expr, env, local or {}))
    except _Missing as m:
        raise StepTypeError(
            f"cannot evaluate {sp.sstr(expr)}: no value for {m.what}; pass it in env"
        ) from None


def try_evaluate(expr: sp.Basic, env: Bindings, local: dict[sp.Symbol, int]) -> Any:
    """Like :func:`evaluate` with local index values; returns ``None`` if a value is missing."""
    try:
        return _num(_ev(expr, env, local))
    except _Missing:
        return None
