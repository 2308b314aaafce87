"""Structural signatures of STeP nodes, for computing each §4.1 metric formula once per shape.

A graph built per expert or per head repeats the same node many times with other names and
other size symbols (``moe_n0``, ``moe_n1``...).  Every STeP §4.1 formula of a node is a
function of the node's parameters and input types only, so two nodes that are equal up to an
injective renaming of their names and symbols have formulas equal up to the same renaming.
:func:`signature` gives a node's shape with names dropped and symbols numbered in order of
appearance (class and assumptions kept); :class:`FormulaTemplate` holds the formulas of the
first node of a signature and renames them for the others — the same formulas as computing
them again (an ``xreplace`` that skips sympy's re-evaluation where it cannot change anything,
:func:`_rebuild`), without re-running the rules' simplifications.

A formula may use symbols the node's fields do not hold:

* bound variables named after a field symbol (``MaxOver``'s copy of a ragged axis index) are
  renamed with it;
* fixed helper symbols (``_p0``: the axes of ``StreamType.peak``) stay;
* a symbol whose name contains one of the node's names (a fresh ragged size ``{node}_r``, a
  merge's count ``{node}_sel``) cannot be renamed from the signature: such a signature is not
  cached (:meth:`FormulaTemplate.of` returns ``None``) and every node of it is computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import sympy as sp
from sympy.core.relational import Relational

from .dims import Index
from .op_base import OffChipTensor, Op, Value

__all__ = ["FormulaTemplate", "Signature", "signature"]


@dataclass(frozen=True, slots=True)
class Signature:
    """A node up to renaming: ``key`` (hashable shape), the node's size symbols in the order
    the key numbers them, and the names it dropped (node, streams, tensors)."""

    key: tuple
    symbols: tuple[sp.Symbol, ...]
    names: frozenset[str]


class _NoSignature(Exception):
    """A field holds a value the walk does not know how to compare up to renaming."""


_NAMED = (Op, Value, OffChipTensor)
_ASSUMPTIONS: dict[sp.Symbol, tuple] = {}


def _assumptions(s: sp.Symbol) -> tuple:
    got = _ASSUMPTIONS.get(s)
    if got is None:
        got = _ASSUMPTIONS[s] = tuple(sorted(s.assumptions0.items()))
    return got


_Local = tuple[Any, tuple[sp.Symbol, ...]]
_KINDS: dict[type, tuple[str, tuple[str, ...]]] = {}


def _kind(cls: type) -> tuple[str, tuple[str, ...]]:
    """How the walk treats instances of ``cls`` (and the field names of a dataclass)."""
    got = _KINDS.get(cls)
    if got is None:
        if issubclass(cls, (bool, int, float, str, type(None))):
            got = ("plain", ())
        elif issubclass(cls, sp.Basic):
            got = ("shared", ())
        elif issubclass(cls, (tuple, list)):
            got = ("seq", ())
        elif is_dataclass(cls):
            names = tuple(f.name for f in fields(cls))
            # values without names (types, functions) are shared by many nodes: walk them once
            got = ("named" if issubclass(cls, _NAMED) else "shared", names)
        else:
            got = ("unknown", ())
        _KINDS[cls] = got
    return got


class _Walk:
    """Builds a key; ``memo`` keeps the key of each expression / data type / function with its
    symbols numbered locally, so what many nodes share is walked once per :func:`metrics`."""

    def __init__(self, memo: dict[Any, _Local], ignore: Mapping[type, frozenset[str]]) -> None:
        self.symbols: dict[sp.Symbol, int] = {}
        self.names: set[str] = set()
        self.memo = memo
        self.ignore = ignore

    def obj(self, x: Any) -> Any:
        kind = _kind(type(x))[0]
        if kind == "plain":
            return x
        if kind == "shared":
            try:
                local = self.memo.get(x)
            except TypeError:  # not hashable: walk it every time
                return self.plain(x)
            if local is None:
                sub = _Walk(self.memo, self.ignore)
                local = self.memo[x] = (sub.plain(x), tuple(sub.symbols))
            # same local shape + same numbers for its symbols: the same up to renaming
            numbers = tuple(self.symbols.setdefault(s, len(self.symbols)) for s in local[1])
            return (local[0], numbers)
        if kind == "seq":
            return (type(x), tuple(self.obj(v) for v in x))
        return self.plain(x)

    def plain(self, x: Any) -> Any:
        if isinstance(x, sp.Basic):
            return self.expr(x)
        kind, names = _kind(type(x))
        if not names:
            raise _NoSignature(type(x).__name__)
        items = []
        skip = self.ignore.get(type(x), ())
        for name in names:
            v = getattr(x, name)
            if kind == "named" and name == "name":
                self.names.add(v)
            elif name not in skip:
                items.append(self.obj(v))
        return (type(x), tuple(items))

    def expr(self, e: sp.Basic) -> Any:
        if isinstance(e, sp.Symbol):
            k = self.symbols.setdefault(e, len(self.symbols))
            return ("sym", k, type(e), _assumptions(e))
        if not e.args:
            return e  # numbers and other name-free atoms (a named atom keeps its name)
        return (e.func, tuple(self.expr(a) for a in e.args))


def signature(
    op: Op,
    memo: dict[Any, Any] | None = None,
    ignore: Mapping[type, frozenset[str]] | None = None,
) -> Signature | None:
    """``op``'s :class:`Signature`, or ``None`` if a field cannot be compared up to renaming.

    ``memo`` (any dict, kept by the caller) speeds up signatures of many nodes of one graph;
    ``ignore`` names, per operator class, fields left out of the key (the caller knows the
    formulas do not read them).
    """
    w = _Walk({} if memo is None else memo, ignore or {})
    try:
        key = (type(op), w.plain(op))
    except _NoSignature:
        return None
    return Signature(key, tuple(w.symbols), frozenset(w.names))


def _rename(e: sp.Basic, mapping: dict, memo: dict) -> sp.Basic:
    """``e.xreplace(mapping)`` for a renaming, sharing rebuilt subexpressions through ``memo``."""
    got = memo.get(e)
    if got is None:
        if e in mapping:
            got = mapping[e]
        elif not e.args:
            got = e
        else:
            args = tuple(_rename(a, mapping, memo) for a in e.args)
            got = e if all(a is b for a, b in zip(args, e.args)) else _rebuild(e, args)
        memo[e] = got
    return got


def size_vs_number(c: sp.Basic) -> bool:
    """True for ``True``/``False`` and a comparison of one size symbol with a number
    (``N > 0``): conditions sympy's piecewise evaluation keeps as they are, whatever the
    symbol's name."""
    return (
        c is sp.true
        or c is sp.false
        or (isinstance(c, Relational) and c.lhs.is_Symbol and c.rhs.is_Number)
    )


def _rebuild(e: sp.Basic, args: tuple) -> sp.Basic:
    """``e.func(*args)`` for renamed ``args``.  Where sympy's evaluation decides the same for
    any symbols of the same assumptions — it already left the original unchanged — the node
    is built without it (the costly part of renaming):

    * a comparison of a size with a number, and a piecewise made of such conditions;
    * a sum or product whose non-numeric arguments are of distinct classes (sympy orders
      arguments by class name first, so no name can change their order).

    Everything else (same-class sums, logical operators...) is evaluated."""
    if isinstance(e, Relational):
        return e.func(*args, evaluate=not (args[0].is_Symbol and args[1].is_Number))
    if isinstance(e, sp.Piecewise) and all(size_vs_number(p.cond) for p in args):
        return sp.Piecewise(*args, evaluate=False)
    if isinstance(e, (sp.Add, sp.Mul)):
        classes = [type(a).__name__ for a in args if not a.is_Number]
        if len(set(classes)) == len(classes):
            return e.func(*args, evaluate=False)
    return e.func(*args)


@dataclass(frozen=True, slots=True)
class FormulaTemplate:
    """Formulas of one node and how to rename them for another node of the same signature.

    ``bound``: ``(symbol, k)`` for each bound variable named after field symbol ``k``.
    """

    formulas: dict[str, sp.Expr]
    symbols: tuple[sp.Symbol, ...]
    bound: tuple[tuple[sp.Symbol, int], ...]

    @classmethod
    def of(cls, formulas: dict[str, sp.Expr], sig: Signature) -> FormulaTemplate | None:
        """The template, or ``None`` if a formula uses a symbol made from one of the names."""
        own = set(sig.symbols)
        position = {s.name: k for k, s in enumerate(sig.symbols)}
        bound = []
        for s in set().union(*(f.atoms(sp.Symbol) for f in formulas.values())):
            if s in own:
                continue
            if s.name in position and type(s) in (sp.Symbol, Index):
                bound.append((s, position[s.name]))
            elif any(n in s.name for n in sig.names):
                return None
        for f in formulas.values():  # a named atom that is not a symbol cannot be renamed
            if any(not a.is_Symbol and hasattr(a, "name") for a in f.atoms()):
                return None
        return cls(dict(formulas), sig.symbols, tuple(bound))

    def rename(self, sig: Signature, memo: dict | None = None) -> dict[str, sp.Expr]:
        """The formulas of the node whose signature is ``sig`` (same key as the template's).

        ``memo`` (any dict, kept by the caller) shares the renamed subexpressions between
        nodes renamed the same way (all the nodes of one expert, say)."""
        mapping: dict[sp.Basic, sp.Basic] = {
            a: b for a, b in zip(self.symbols, sig.symbols) if a is not b and a != b
        }
        for s, k in self.bound:
            name = sig.symbols[k].name
            if name != s.name:
                mapping[s] = Index(name) if type(s) is Index else sp.Symbol(name, **s.assumptions0)
        if not mapping:
            return dict(self.formulas)
        shared = {} if memo is None else memo.setdefault(frozenset(mapping.items()), {})
        return {k: _rename(v, mapping, shared) for k, v in self.formulas.items()}
