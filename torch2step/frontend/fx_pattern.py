"""Raising patterns as data (tinygrad's ``UPat``/``PatternMatcher``) over core-ATen FX graphs.

A :class:`Pattern` names one meaning (``rmsnorm``, ``attention_sdpa``, ``moe_batched_mm``, ...),
the operators its root may be, and a ``match`` function returning a :class:`Match`: the FX nodes
whose values it defines (``roots``), the FX nodes it reads (``inputs``) and an ``emit`` callback
appending layer ops.  ``match`` returns None when the root is not an instance, or raises
:class:`NoMatch` when it clearly is one but a detail has no layer op (the reason is reported if
the graph then cannot be raised).

Small tree patterns are written with :func:`P` (an operator and its argument patterns) and
:class:`Cap` (capture any argument under a name; the same name must bind the same value), e.g.
RMSNorm::

    P("mul", Cap("w"), P("mul", Cap("x"), P("rsqrt", P("add", P("mean", P("pow", Cap("x"), 2),
      Cap("dims"), True), Cap("eps")))))

``add``/``mul`` match in either argument order; every argument is first followed through
transparent ops (:func:`~torch2step.frontend.fx_view.strip`), and through dtype casts for
``P(..., casts=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import fx

from torch2step.frontend.fx_view import ProgramView, is_node, op_name, strip

if TYPE_CHECKING:
    from torch2step.frontend.fx_emit import FxEmitter

__all__ = ["P", "Cap", "Pat", "match", "Match", "Pattern", "NoMatch", "COMMUTATIVE"]

#: Operators whose two tensor arguments may come in either order.
COMMUTATIVE = frozenset({"add", "mul", "maximum", "bitwise_or", "bitwise_and", "logical_or"})


class NoMatch(Exception):
    """The anchor is an instance of the pattern (or a node has a translation), but a detail has
    no layer op; ``reason`` says why and what to do.  Both frontends raise it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Cap:
    """Capture the (stripped) argument as ``name``; ``pred`` may reject it."""

    name: str
    pred: Callable[[Any], bool] | None = None


@dataclass(frozen=True, slots=True)
class Pat:
    """An FX call whose operator is in ``ops`` and whose leading arguments match ``src``."""

    ops: frozenset[str]
    src: tuple[Any, ...]
    name: str | None = None
    casts: bool = False


def P(ops: str, *src: Any, name: str | None = None, casts: bool = False) -> Pat:
    """``ops`` is an operator name or ``"a|b"`` alternatives (short names, see ``op_name``)."""
    return Pat(frozenset(ops.split("|")), tuple(src), name, casts)


def _bind(caps: dict[str, Any], name: str, value: Any) -> bool:
    if name in caps:
        old = caps[name]
        if is_node(old) or is_node(value):
            return old is value
        return bool(old == value)
    caps[name] = value
    return True


def _literal(p: Any, x: Any) -> bool:
    if is_node(x):
        return False
    if isinstance(p, float) or isinstance(x, float):
        return isinstance(x, (int, float)) and math.isclose(float(p), float(x), rel_tol=1e-9)
    return bool(p == x)


def _match(p: Any, x: Any, caps: dict[str, Any], casts: bool) -> bool:
    if isinstance(p, Cap):
        x = strip(x, casts)
        if p.pred is not None and not p.pred(x):
            return False
        return _bind(caps, p.name, x)
    if isinstance(p, Pat):
        x = strip(x, casts or p.casts)
        if not is_node(x) or op_name(x) not in p.ops:
            return False
        args = list(x.args)
        if len(args) < len(p.src):
            return False
        orders = [args]
        if op_name(x) in COMMUTATIVE and len(args) >= 2:
            orders.append([args[1], args[0], *args[2:]])
        for order in orders:
            trial = dict(caps)
            if all(_match(s, a, trial, p.casts) for s, a in zip(p.src, order)):
                if p.name is None or _bind(trial, p.name, x):
                    caps.clear()
                    caps.update(trial)
                    return True
        return False
    if isinstance(p, (list, tuple)):
        if not isinstance(x, (list, tuple)) or len(x) != len(p):
            return False
        return all(_match(s, a, caps, casts) for s, a in zip(p, x))
    return _literal(p, x)


def match(pattern: Any, node: Any) -> dict[str, Any] | None:
    """The captures of ``pattern`` at ``node``, or None."""
    caps: dict[str, Any] = {}
    return caps if _match(pattern, node, caps, False) else None


@dataclass(frozen=True, slots=True)
class Match:
    """An instance of a pattern: ``emit`` appends layer ops reading ``inputs`` (via
    ``FxEmitter.get``) and returns one value name per root."""

    pattern: str
    roots: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    emit: Callable[[FxEmitter], Sequence[str]]
    info: dict[str, Any] = field(default_factory=dict)


MatchFn = Callable[[ProgramView, fx.Node], "Match | None"]


@dataclass(frozen=True, slots=True)
class Pattern:
    """A named raising pattern anchored at nodes whose operator is in ``anchors``."""

    name: str
    anchors: frozenset[str]
    match: MatchFn
    doc: str = ""
