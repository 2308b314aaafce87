"""Higher-order operators: Map, Accum, Scan, FlatMap (STeP §3.2.4, Appendix A table 4).

Each applies a registered tile function (:mod:`torch2step.step.functions`).  On-chip memory
(STeP §4.1): Accum and Scan hold their output element; matrix-product functions add their
scratch ``16 x in_tile_col + |weight tile|`` (Map and Accum alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp

from torch2step.errors import StepTypeError

from .dims import Index, free_indices, sum_over
from .functions import Fn, FnSpec, unpack_args
from .op_base import Op, Value, require, rule_error, wrap_fn_error
from .types import DataType, StreamType, absorb_ragged, dtypes_equal

__all__ = ["Accum", "FlatMap", "Map", "Scan", "update_args"]


def update_args(f: Fn, spec: FnSpec, elem: DataType, acc: DataType) -> tuple[DataType, ...]:
    """Arguments used for the FLOP / scratch count of one update application."""
    if spec.kind == "map":
        return (acc, elem)
    return unpack_args(f, spec, elem)


def _state_type(op: Op, f: Fn, elem: DataType, init: DataType, count: sp.Expr | None) -> DataType:
    """Accumulator type after a reduction of ``count`` elements (``None``: one Scan step)."""
    spec = f.spec
    if spec.kind == "update":
        args = unpack_args(f, spec, elem)
        if spec.accum_rule is not None:
            if count is None:
                raise rule_error(
                    op,
                    "a Scan update must return the accumulator type (its state cannot grow)",
                    fn=f,
                )
            return spec.accum_rule(f, args, init, count)
        out = spec.type_rule(f, args, init)
    elif spec.kind == "map" and spec.nargs == 2:
        out = spec.type_rule(f, (init, elem))
    else:
        raise rule_error(
            op, "update_fn is an update function or a 2-argument map function", fn=f, kind=spec.kind
        )
    require(
        dtypes_equal(out, init),
        op,
        "update_fn: Fn(A, R) -> R returns the accumulator type",
        fn=f,
        returns=out,
        accumulator=init,
    )
    return init


def _init_type(op: Op, init: Fn) -> DataType:
    spec = init.spec
    require(spec.kind == "init", op, "init_fn is an init function: Fn() -> R", init=init)
    return spec.type_rule(init, ())


@dataclass(frozen=True, slots=True)
class Map(Op):
    """``Strm<A,a> [D_a..D_0]`` -> ``Strm<B,a>`` of the same shape: ``fn`` on every element."""

    name: str
    input: Value
    fn: Fn

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("fn", self.fn),)

    def _args(self) -> tuple[DataType, ...]:
        spec = self.fn.spec
        require(spec.kind == "map", self, "fn is a map function: Fn(A) -> B", fn=self.fn)
        try:
            return unpack_args(self.fn, spec, self.input.type.dtype)
        except StepTypeError as e:
            raise wrap_fn_error(self, e) from None

    def out_types(self) -> tuple[StreamType, ...]:
        args = self._args()
        try:
            out = self.fn.spec.type_rule(self.fn, args)
        except StepTypeError as e:
            raise wrap_fn_error(self, e) from None
        return (self.input.type.with_(dtype=out),)

    def flops(self) -> sp.Expr:
        return self.input.type.card(self.fn.spec.flops_of(self.fn, self._args()))

    def onchip_bytes(self) -> sp.Expr:
        return self.input.type.peak(self.fn.spec.scratch_of(self.fn, self._args()))


class _Stateful(Op):
    """What Accum and Scan share: an ``input``, an update ``fn`` with an ``init`` state over
    the inner ``rank`` dims, and the §4.1 FLOP and on-chip rules of a stateful update."""

    __slots__ = ()
    input: Value
    fn: Fn
    init: Fn
    rank: int

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("fn", self.fn), ("init", self.init), ("rank", self.rank))

    def _checked_input(self) -> StreamType:
        t = self.input.type
        require(
            1 <= self.rank <= t.rank,
            self,
            "1 <= rank <= input rank",
            rank=self.rank,
            input_rank=t.rank,
        )
        return t

    def _update_args(self) -> tuple[DataType, ...]:
        init = _init_type(self, self.init)
        return update_args(self.fn, self.fn.spec, self.input.type.dtype, init)

    def flops(self) -> sp.Expr:
        return self.input.type.card(self.fn.spec.flops_of(self.fn, self._update_args()))

    def onchip_bytes(self) -> sp.Expr:
        out = self.out_types()[0]
        scratch = self.fn.spec.scratch_of(self.fn, self._update_args())
        return out.peak(out.dtype.nbytes()) + self.input.type.peak(scratch)


@dataclass(frozen=True, slots=True)
class Accum(_Stateful):
    """Reduce the inner ``rank`` dims (table 4): ``Strm<A,a> [D_a..D_b, D_{b-1}..D_0]`` ->
    ``Strm<R,a-b> [D_a..D_b]``.  The state starts at ``init()`` for every reduction (also an
    empty one, Revet §III-A) and becomes ``update(x, state)`` on every element."""

    name: str
    input: Value
    fn: Fn
    init: Fn
    rank: int

    def out_types(self) -> tuple[StreamType, ...]:
        t = self._checked_input()
        cut = t.rank + 1 - self.rank
        try:
            init = _init_type(self, self.init)
            state = _state_type(self, self.fn, t.dtype, init, t.card(start=cut))
        except StepTypeError as e:
            raise e if str(e).startswith(f"{self.op_name} %") else wrap_fn_error(self, e) from None
        shape, index, dtype = absorb_ragged(t.shape[:cut], t.index[:cut], state, f"{self.name}_r")
        return (StreamType(dtype, shape, index),)


@dataclass(frozen=True, slots=True)
class Scan(_Stateful):
    """Like Accum but emits the state on every element (table 4): shape unchanged."""

    name: str
    input: Value
    fn: Fn
    init: Fn
    rank: int

    def out_types(self) -> tuple[StreamType, ...]:
        t = self._checked_input()
        try:
            state = _state_type(self, self.fn, t.dtype, _init_type(self, self.init), None)
        except StepTypeError as e:
            raise e if str(e).startswith(f"{self.op_name} %") else wrap_fn_error(self, e) from None
        return (t.with_(dtype=state),)


@dataclass(frozen=True, slots=True)
class FlatMap(Op):
    """Expand every element into a rank-``b`` stream and concatenate (table 4).

    ``Strm<A,a> [D_a..D_1, D_0]`` -> ``Strm<B,a+b> [D_a..D_1, D'_b, .., D'_0]``: the ``D_0``
    elements of each innermost vector give ``D'_b`` tensors in total (``D_0 x E_b`` for a
    regular function, ``Sum(E_b)`` when the count depends on the element's index, a fresh
    symbol when it depends on the data).
    """

    name: str
    input: Value
    fn: Fn

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("fn", self.fn),)

    def _rule(self) -> tuple[tuple[DataType, ...], DataType, tuple]:
        spec = self.fn.spec
        require(spec.kind == "flat", self, "fn is a flat function: Fn(A) -> Strm<B,b>", fn=self.fn)
        try:
            args = unpack_args(self.fn, spec, self.input.type.dtype)
            dtype, dims = spec.type_rule(self.fn, args)
        except StepTypeError as e:
            raise wrap_fn_error(self, e) from None
        return args, dtype, tuple(dims)

    def out_types(self) -> tuple[StreamType, ...]:
        _, dtype, dims = self._rule()
        t = self.input.type
        data = Index(f"{self.name}_data")  # stands for "known only from the data"
        dims = tuple(data if d is None else sp.sympify(d) for d in dims)
        d0, ix0 = t.shape[-1], t.index[-1]
        top = dims[0]
        keep_ix: Index | None = None
        if top == 1:
            new_top, keep_ix = d0, ix0
        elif ix0 is None or ix0 not in free_indices(top):
            new_top = d0 * top
        else:
            new_top = sum_over(top, ix0, d0)
        total = self.fn.get("total")
        if total is not None and len(dims) == 1 and t.rank == 1:
            # the function states how many elements the whole stream yields
            new_top, keep_ix = sp.sympify(total), None
        shape = (*t.shape[:-1], new_top, *dims[1:])
        index = (*t.index[:-1], keep_ix, *([None] * (len(dims) - 1)))
        shape, index, dtype = absorb_ragged(shape, index, dtype, f"{self.name}_r")
        return (StreamType(dtype, shape, index),)

    def flops(self) -> sp.Expr:
        args, _, _ = self._rule()
        return self.input.type.card(self.fn.spec.flops_of(self.fn, args))
