"""Dimensions of STeP streams and tiles: static, dynamic-regular and ragged (STeP §3.1).

Every size is a sympy expression:

* a **static** dimension is an integer (``sympy.Integer``);
* a **dynamic-regular** dimension is a symbol made with :func:`dyn` (one value per run, e.g.
  the batch ``B`` or the number of tokens routed to expert 3);
* a **ragged** dimension's size depends on the index of an outer dimension (the KV length of
  request ``i``).  It is written as an indexed symbol ``L[i]`` where ``i`` is an
  :class:`Index`, the loop index of one outer axis of the same stream.  Formulas sum over it:
  ``Sum(L[i], (i, 0, B - 1))`` is the total length of all requests.

A stream type records, per axis, which :class:`Index` names that axis (``StreamType.index``),
so a ragged dimension always knows the axis it is indexed by.  Following STeP (revised) §3.1,
raggedness is *absorbing*: when an operator removes the axis a ragged size depends on, the
operator introduces a fresh ragged symbol (:func:`absorb_ragged`); the interpreter learns its
values from the data.

Peak on-chip sizes over ragged axes use :class:`MaxOver` (max over an index range, 0 for an
empty range).  :mod:`torch2step.step.evaluate` turns any of these expressions into numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sympy as sp

__all__ = [
    "Dim",
    "Index",
    "MaxOver",
    "RaggedDim",
    "as_dim",
    "dims_equal",
    "dyn",
    "free_indices",
    "max_over",
    "sum_over",
]

Dim = sp.Expr
"""A dimension size: a sympy expression (int, symbol, ``L[i]``, ``Sum(...)``, ...)."""


class Index(sp.Symbol):
    """The loop index of one stream axis; ragged sizes such as ``L[i]`` are written with it.

    A distinct class (not a plain integer symbol) so free indices can be told apart from
    dynamic sizes in any expression: ``free_indices(expr)``.
    """

    def __new__(cls, name: str) -> Index:  # noqa: D102 - sympy constructor
        return super().__new__(cls, name, integer=True, nonnegative=True)

    def __getnewargs_ex__(self) -> tuple[tuple[str], dict[str, bool]]:
        # pickled by name only: the constructor sets the assumptions (sympy's own rule
        # passes them back as keywords, which this constructor does not take)
        return (self.name,), {}


def dyn(name: str, *, positive: bool = False) -> sp.Symbol:
    """A dynamic-regular dimension: a non-negative (or positive) integer symbol."""
    if positive:
        return sp.Symbol(name, integer=True, positive=True)
    return sp.Symbol(name, integer=True, nonnegative=True)


@dataclass(frozen=True, slots=True)
class RaggedDim:
    """A ragged dimension ``name[index]`` indexed by an outer axis whose extent is ``outer``.

    Put it in a shape given to :func:`torch2step.step.types.stream_type`; the index is bound
    to the nearest outer axis whose extent equals ``outer``.  ``total()`` is the sum of the
    sizes over the outer axis, e.g. ``Sum(L[i], (i, 0, B - 1))``.
    """

    name: str
    outer: Dim
    index: str = "i"

    @property
    def base(self) -> sp.IndexedBase:
        return sp.IndexedBase(self.name)

    @property
    def idx(self) -> Index:
        return Index(self.index)

    @property
    def expr(self) -> sp.Expr:
        """The indexed symbol ``name[index]`` stored in the shape."""
        return self.base[self.idx]

    def total(self) -> sp.Expr:
        """``Sum(name[index], (index, 0, outer - 1))``."""
        return sum_over(self.expr, self.idx, as_dim(self.outer))


def as_dim(value: object) -> sp.Expr:
    """Normalise an int / sympy expression / :class:`RaggedDim` to a sympy expression."""
    if isinstance(value, RaggedDim):
        return value.expr
    if isinstance(value, bool):
        raise TypeError(f"a dimension must be an int or a sympy expression, not {value!r}")
    expr = sp.sympify(value)
    if not isinstance(expr, sp.Expr):
        raise TypeError(f"a dimension must be an int or a sympy expression, not {value!r}")
    return expr


def free_indices(expr: sp.Basic) -> set[Index]:
    """The :class:`Index` symbols ``expr`` depends on (indices bound by ``Sum`` excluded)."""
    return {s for s in expr.free_symbols if isinstance(s, Index)}


def dims_equal(a: sp.Expr, b: sp.Expr) -> bool:
    """Symbolic equality of two sizes (structural first, then ``simplify(a - b) == 0``)."""
    if a == b:
        return True
    try:
        return bool(sp.simplify(a - b) == 0)
    except (TypeError, ValueError):  # pragma: no cover - sympy cannot decide
        return False


def _split_factors(expr: sp.Expr, var: sp.Symbol) -> tuple[sp.Expr, sp.Expr]:
    """``expr == const * rest`` where ``const`` does not depend on ``var``."""
    if isinstance(expr, sp.Mul):
        const = [f for f in expr.args if var not in f.free_symbols]
        rest = [f for f in expr.args if var in f.free_symbols]
        return sp.Mul(*const), sp.Mul(*rest)
    if var in expr.free_symbols:
        return sp.Integer(1), expr
    return expr, sp.Integer(1)


def sum_over(expr: sp.Expr, var: sp.Symbol, extent: sp.Expr) -> sp.Expr:
    """``sum_{var=0}^{extent-1} expr`` with factors independent of ``var`` pulled out.

    ``sum_over(4*L[i], i, B) == 4*Sum(L[i], (i, 0, B - 1))``; without ``var`` it is a
    product: ``sum_over(4, i, B) == 4*B``.
    """
    if var not in expr.free_symbols:
        return expr * extent
    if isinstance(expr, sp.Add):
        return sp.Add(*(sum_over(t, var, extent) for t in expr.args))
    const, rest = _split_factors(expr, var)
    return const * sp.Sum(rest, (var, 0, extent - 1))


class MaxOver(sp.Function):
    """``MaxOver(expr, v, n)``: the maximum of ``expr`` over ``v = 0 .. n-1``; 0 if ``n == 0``.

    Used for peak on-chip sizes over ragged axes (STeP §4.1).  ``v`` is a plain integer
    symbol (bound here, so it is not a free :class:`Index`).  Build it with :func:`max_over`.
    """

    nargs = 3

    @classmethod
    def eval(cls, expr: sp.Expr, var: sp.Symbol, n: sp.Expr) -> sp.Expr | None:  # noqa: D102
        if expr == 0 or (n.is_Integer and n == 0):
            return sp.Integer(0)
        if var not in expr.free_symbols:
            return sp.Piecewise((expr, _positive(n)), (0, True))
        return None


def _positive(n: sp.Expr) -> sp.Basic:
    """The condition ``n > 0``.  For a gated extent ``Piecewise((v, c), (0, True))`` with
    ``v > 0`` (Promote's ``1 if N > 0 else 0``) it is ``c`` itself: the value sympy reaches
    through its general inequality solver, without the milliseconds that costs per call."""
    if isinstance(n, sp.Piecewise) and len(n.args) == 2:
        (v, c), (zero, other) = n.args
        if zero == 0 and other is sp.true and v.is_positive:
            return c
    if isinstance(n, sp.Add) and all(_gated(t) for t in n.args):
        # a sum of non-negative gated counts is positive iff one of the gates is open;
        # sympy's inequality solver takes time exponential in the number of terms here
        return sp.Or(*(t.args[0][1] for t in n.args))
    return sp.Gt(n, 0)


def _gated(t: sp.Expr) -> bool:
    """``Piecewise((v, c), (0, True))`` with ``v > 0``."""
    if not (isinstance(t, sp.Piecewise) and len(t.args) == 2):
        return False
    (v, _), (zero, other) = t.args
    return zero == 0 and other is sp.true and bool(v.is_positive)


def max_over(expr: sp.Expr, var: Index, extent: sp.Expr) -> sp.Expr:
    """Peak of ``expr`` over the axis ``var`` of extent ``extent`` (0 when the axis is empty)."""
    if extent.is_Integer and extent > 0 and var not in expr.free_symbols:
        return expr
    if var not in expr.free_symbols:
        return MaxOver(expr, var, extent)
    bound = sp.Symbol(var.name, integer=True, nonnegative=True)
    return MaxOver(expr.xreplace({var: bound}), bound, extent)


def fmt_dims(dims: Sequence[sp.Expr]) -> str:
    """``[1, B, L[i]]`` (deterministic sympy ``sstr``)."""
    return "[" + ", ".join(sp.sstr(d) for d in dims) + "]"
