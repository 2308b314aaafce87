"""Named tile functions for the higher-order operators (STeP §3.2.4).

Map, Accum, Scan and FlatMap take "a function supported by the hardware as an argument".  In
this IR a function is a value, :class:`Fn` (a registered name plus parameters), so graphs stay
printable and comparable; what a name means lives in one :class:`FnSpec` in the registry:
its kind, its shape rule, its FLOP count, its on-chip scratch (STeP §4.1: matrix products
keep ``16 x in_tile_col`` of the input and the whole weight tile) and its numpy
implementation.  The built-in functions are in :mod:`torch2step.step.fn_library`; a user
function is added with :func:`register_fn`.

Kinds and the signatures of ``type_rule`` / ``impl``:

* ``"map"``    ``type_rule(fn, args) -> DataType``; ``impl(fn, *args) -> value``.  A 2-argument
  map function (``add``, ``maximum``) can also be an Accum/Scan update: ``acc = f(acc, x)``.
* ``"update"`` ``type_rule(fn, args, acc) -> DataType`` (must return ``acc``'s type unless
  ``accum_rule`` is given); ``impl(fn, *args, acc) -> value``.
* ``"init"``   ``type_rule(fn, ()) -> DataType``; ``impl(fn) -> value``.
* ``"flat"``   ``type_rule(fn, args) -> (DataType, dims)`` where ``dims`` is the shape
  ``[D'_b..D'_0]`` of the stream made from one element (``None`` = known only at run time);
  ``impl(fn, *args) -> list`` (the stream's nested data, see :mod:`torch2step.step.values`).

``args`` are the element types (or values): one, or the members of a Zip tuple when
``nargs > 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy as sp

from torch2step.errors import StepTypeError

from .types import DataType, TupleType

__all__ = ["Fn", "FnSpec", "as_fn", "fn", "fn_spec", "register_fn", "registered_fns", "unpack_args"]

KINDS = ("map", "update", "init", "flat")


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, sp.Basic):
        return value
    if isinstance(value, (bool, str, float)) or value is None:
        return value
    if isinstance(value, int):
        return value
    raise StepTypeError(f"function parameter {value!r} must be a number, string, sympy or tuple")


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, sp.Basic):
        return sp.sstr(value)
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True, slots=True)
class Fn:
    """A tile function: registered ``name`` and sorted ``params`` (``(key, value)`` pairs)."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "params", tuple(sorted((k, _freeze(v)) for k, v in dict(self.params).items()))
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The value of parameter ``key`` (``default`` if absent)."""
        for k, v in self.params:
            if k == key:
                return v
        return default

    @property
    def spec(self) -> FnSpec:
        return fn_spec(self.name)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}(" + ", ".join(f"{k}={_fmt(v)}" for k, v in self.params) + ")"


def fn(name: str, **params: Any) -> Fn:
    """``fn("scale", alpha=0.125)``; checks that ``name`` is registered."""
    fn_spec(name)
    return Fn(name, tuple(params.items()))


def as_fn(value: Fn | str) -> Fn:
    """Accept an :class:`Fn` or a registered name."""
    return value if isinstance(value, Fn) else fn(value)


@dataclass(frozen=True, slots=True)
class FnSpec:
    """What a function name means: kind, shape rule, FLOPs, scratch bytes, implementation."""

    name: str
    kind: str
    nargs: int
    type_rule: Callable[..., Any]
    impl: Callable[..., Any]
    flops: Callable[..., sp.Expr] | None = None
    scratch: Callable[[Fn, tuple[DataType, ...]], sp.Expr] | None = None
    scratch_value: Callable[..., int] | None = None
    accum_rule: Callable[..., DataType] | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StepTypeError(f"function {self.name}: kind must be one of {KINDS}")
        if self.kind == "init" and self.nargs != 0:
            raise StepTypeError(f"init function {self.name} takes no element arguments")
        if self.kind != "init" and self.nargs < 1:
            raise StepTypeError(f"function {self.name} needs at least one element argument")

    def flops_of(self, f: Fn, *types: Any) -> sp.Expr:
        """FLOPs of one application (0 if the spec gives no count)."""
        return sp.sympify(self.flops(f, *types)) if self.flops else sp.Integer(0)

    def scratch_of(self, f: Fn, args: tuple[DataType, ...]) -> sp.Expr:
        """On-chip working bytes of one application (STeP §4.1 matmul rule; else 0)."""
        return sp.sympify(self.scratch(f, args)) if self.scratch else sp.Integer(0)


_REGISTRY: dict[str, FnSpec] = {}


def register_fn(spec: FnSpec, *, replace: bool = False) -> FnSpec:
    """Add a function to the registry (``replace=True`` to redefine a name)."""
    if spec.name in _REGISTRY and not replace:
        raise StepTypeError(
            f"function {spec.name!r} is already registered; pass replace=True to redefine it"
        )
    _REGISTRY[spec.name] = spec
    return spec


def fn_spec(name: str) -> FnSpec:
    """The spec of a registered function."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise StepTypeError(
            f"unknown tile function {name!r}; registered: {', '.join(sorted(_REGISTRY))}. "
            "Register new functions with torch2step.step.register_fn"
        ) from None


def registered_fns() -> tuple[str, ...]:
    """Names of every registered function, sorted."""
    return tuple(sorted(_REGISTRY))


def unpack_args(f: Fn, spec: FnSpec, elem: DataType) -> tuple[DataType, ...]:
    """The argument types of ``spec`` given a stream element type (Zip tuples unpack)."""
    if spec.nargs == 1:
        return (elem,)
    if isinstance(elem, TupleType) and len(elem.elems) == spec.nargs:
        return elem.elems
    raise StepTypeError(
        f"function {f} takes {spec.nargs} arguments; the stream element must be a "
        f"{spec.nargs}-tuple (use Zip), got {elem}"
    )
