"""Numeric evaluation of STeP size and metric formulas (STeP §4.1: "substituting the
symbols ... with various input shapes or control flow decisions").

``evaluate(expr, env)`` computes a sympy expression built from integers, dynamic symbols,
indexed ragged symbols (``L[i]``), ``Sum``, :class:`~torch2step.step.dims.MaxOver`,
``floor``/``ceiling``/``Mod``/``Max``/``Min`` and ``Piecewise``.  ``env`` maps a symbol name
to a number and an indexed base name to its values: a sequence (``{"L": [3, 5, 2]}``), a
nested sequence for several indices, or a dict from index tuples to values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from functools import lru_cache
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
    if isinstance(e, (sp.Sum, MaxOver)):  # loops: their bodies are evaluated many times
        return _compiled(e)(env, local)
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


# -- compiled evaluation of loops -------------------------------------------------------------
#
# A ``Sum`` or ``MaxOver`` evaluates its body once per index value (per request, per expert:
# thousands of times in a large batch's metrics).  Its expression is turned once into nested
# closures that compute exactly what :func:`_ev` computes, in the same order and with the same
# errors (a node that cannot be evaluated raises only when it is reached), without walking the
# sympy tree and testing its node types again for every index value.

Fn = Callable[[Bindings, dict], Any]

_ABSENT = object()

_RELATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


@lru_cache(maxsize=4096)
def _compiled(e: sp.Basic) -> Fn:
    """:func:`_compile` of ``e``, kept for the next evaluation of the same expression."""
    return _compile(e)


def _const(v: Any) -> Fn:
    return lambda env, local: v


def _raises(message: str) -> Fn:
    def f(env: Bindings, local: dict) -> Any:
        raise StepTypeError(message)

    return f


def _compile(e: sp.Basic) -> Fn:
    """A closure ``f(env, local)`` equal to ``_ev(e, env, local)`` (the same case analysis)."""
    if e.is_Integer:
        return _const(int(e))
    if e.is_Rational:
        return _const(Fraction(int(e.p), int(e.q)))
    if e.is_Float:
        return _const(float(e))
    if e is sp.true or e is sp.false:
        return _const(e is sp.true)
    if e is sp.oo:
        return _const(float("inf"))
    if e is sp.zoo or e is sp.nan:
        return _raises(f"cannot evaluate undefined value {e}")
    if isinstance(e, sp.Symbol):
        return _compile_symbol(e)
    if isinstance(e, sp.Indexed):
        return _compile_indexed(e)
    args = [_compile(a) for a in e.args] if isinstance(e, (sp.Add, sp.Mul)) else []
    if isinstance(e, sp.Add):
        return lambda env, local: sum([f(env, local) for f in args], 0)
    if isinstance(e, sp.Mul):

        def mul(env: Bindings, local: dict) -> Any:
            acc: Any = 1
            for f in args:
                acc = acc * f(env, local)
            return acc

        return mul
    if isinstance(e, sp.Pow):
        return _compile_pow(_compile(e.base), _compile(e.exp))
    return _compile_function(e)


def _compile_symbol(e: sp.Symbol) -> Fn:
    name = e.name

    def symbol(env: Bindings, local: dict) -> Any:
        v = local.get(e, _ABSENT)  # one hash of the symbol (sympy computes it in Python)
        if v is not _ABSENT:
            return v
        if name in env:
            v = env[name]
            if not isinstance(v, dict):
                return v
        raise _Missing(name)

    return symbol


def _compile_indexed(e: sp.Indexed) -> Fn:
    label = e.base.label
    name = label.name if type(label) is sp.Symbol else str(label)
    index = [_compile(a) for a in e.indices]

    def indexed(env: Bindings, local: dict) -> Any:
        table = env.get(name)
        if not isinstance(table, dict):
            raise _Missing(name)
        key = tuple([int(f(env, local)) for f in index])
        if key not in table:
            raise _Missing(f"{name}[{', '.join(map(str, key))}]")
        return table[key]

    return indexed


def _compile_pow(base: Fn, ex: Fn) -> Fn:
    def power(env: Bindings, local: dict) -> Any:
        b, x = base(env, local), ex(env, local)
        if isinstance(x, int) and x < 0:
            return Fraction(1, 1) / (Fraction(b) ** (-x))
        return b**x

    return power


def _compile_function(e: sp.Basic) -> Fn:
    """The remaining cases of :func:`_ev`, in its order."""
    if isinstance(e, (sp.floor, sp.ceiling)):
        a = _compile(e.args[0])
        if isinstance(e, sp.floor):
            return lambda env, local: int(_floor(a(env, local)))
        return lambda env, local: -int(_floor(-a(env, local)))
    if isinstance(e, sp.Mod):
        a, b = _compile(e.args[0]), _compile(e.args[1])
        return lambda env, local: a(env, local) % b(env, local)
    if isinstance(e, (sp.Max, sp.Min)):
        fs = [_compile(a) for a in e.args]
        pick = max if isinstance(e, sp.Max) else min
        return lambda env, local: pick(f(env, local) for f in fs)
    if isinstance(e, sp.Piecewise):
        return _compile_piecewise(e)
    if isinstance(e, sp.Sum):
        # sympy lists limits innermost first: Sum(f, (j, 0, L[i] - 1), (i, 0, B - 1))
        limits = [(v, _compile(lo), _compile(hi)) for v, lo, hi in e.limits]
        return _compile_sum(_compile(e.function), limits)
    if isinstance(e, MaxOver):
        return _compile_max_over(_compile(e.args[0]), e.args[1], _compile(e.args[2]))
    if isinstance(e, sp.core.relational.Relational):
        lhs, rhs, rel = _compile(e.lhs), _compile(e.rhs), _RELATIONS[e.rel_op]
        return lambda env, local: rel(lhs(env, local), rhs(env, local))
    if isinstance(e, (sp.And, sp.Or)):
        fs = [_compile(a) for a in e.args]
        if isinstance(e, sp.And):
            return lambda env, local: all(f(env, local) for f in fs)
        return lambda env, local: any(f(env, local) for f in fs)
    if isinstance(e, sp.Not):
        a = _compile(e.args[0])
        return lambda env, local: not a(env, local)
    if isinstance(e, sp.ITE):
        c, a, b = (_compile(x) for x in e.args)
        return lambda env, local: a(env, local) if c(env, local) else b(env, local)
    return _raises(f"cannot evaluate {type(e).__name__} in {sp.sstr(e)}")


def _compile_piecewise(e: sp.Piecewise) -> Fn:
    pieces = [(_compile(val), _compile(cond)) for val, cond in e.args]

    def piecewise(env: Bindings, local: dict) -> Any:
        for val, cond in pieces:
            if cond(env, local):
                return val(env, local)
        raise StepTypeError(f"no branch of {e} holds")

    return piecewise


def _compile_sum(body: Fn, limits: list[tuple[sp.Symbol, Fn, Fn]]) -> Fn:
    var, lo, hi = limits[-1]
    inner_sum = _compile_sum(body, limits[:-1]) if len(limits) > 1 else body

    def total(env: Bindings, local: dict) -> Any:
        lo_v, hi_v = int(lo(env, local)), int(hi(env, local))
        acc: Any = 0
        inner = dict(local)  # the closures keep no reference to it: one dict for every k
        for k in range(lo_v, hi_v + 1):
            inner[var] = k
            acc += inner_sum(env, inner)
        return acc

    return total


def _compile_max_over(body: Fn, var: sp.Symbol, n: Fn) -> Fn:
    def best_of(env: Bindings, local: dict) -> Any:
        count = int(n(env, local))
        best: Any = 0
        inner = dict(local)
        for k in range(count):
            inner[var] = k
            v = body(env, inner)
            best = v if k == 0 else max(best, v)
        return best

    return best_of
