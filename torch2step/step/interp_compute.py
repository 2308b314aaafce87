"""Meaning of the higher-order operators on data (STeP §3.2.4, Appendix A table 4).

Accum starts a fresh state from ``init`` for every reduction — also for an empty one, so the
three empty rank-2 tensors of Revet §III-A reduce to ``[0]``, ``[0, 0]`` and ``[]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy as sp

from .evaluate import evaluate, try_evaluate
from .functions import Fn, FnSpec, unpack_args
from .interp_context import Ctx, runtime_type, value_nbytes
from .ops_compute import Accum, FlatMap, Map, Scan, update_args
from .types import DataType, TileType
from .values import StepRuntimeError, StreamValue, iter_leaves, map_at, map_at_pos

__all__ = ["IMPLS"]


def _itemsizes(types: tuple[DataType, ...]) -> tuple[int, ...]:
    return tuple(t.itemsize if isinstance(t, TileType) else 0 for t in types)


class _FlopCounter:
    """FLOPs of one application from the actual argument shapes (cached per shape)."""

    def __init__(self, f: Fn, spec: FnSpec, declared: tuple[DataType, ...]) -> None:
        self.f, self.spec, self.declared = f, spec, declared
        self.cache: dict[tuple, int] = {}

    def __call__(self, args: tuple) -> int:
        if self.spec.flops is None:
            return 0
        key = tuple(_shape_key(a) for a in args)
        n = self.cache.get(key)
        if n is None:
            types = tuple(runtime_type(t, a) for t, a in zip(self.declared, args))
            n = self.cache[key] = int(evaluate(self.spec.flops_of(self.f, types)))
        return n


def _shape_key(x: Any) -> Any:
    """What :func:`runtime_type` reads of an argument: the shape of each tile in it."""
    if isinstance(x, tuple):
        return tuple(_shape_key(v) for v in x)
    return getattr(x, "shape", None)


def _map(op: Map, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    spec = op.fn.spec
    declared = unpack_args(op.fn, spec, op.input.type.dtype)
    isz = _itemsizes(declared)
    flops = _FlopCounter(op.fn, spec, declared)
    ctx.onchip.setdefault(op.name, {})
    ctx.flops.setdefault(op.name, 0)
    impl = ctx.impl(op.name, spec)

    def apply(e: Any) -> Any:
        args = e if spec.nargs > 1 else (e,)
        ctx.count_flops(op.name, flops(args))
        if spec.scratch_value is not None:
            ctx.alloc(op.name, "scratch", spec.scratch_value(op.fn, isz, *args))
        return impl(op.fn, *args)

    return (StreamValue(x.rank, map_at(x.data, x.rank + 1, apply)),)


def _stepper(op: Accum | Scan, ctx: Ctx) -> Callable[[Any, Any], Any]:
    """``state, element -> new state`` for Accum/Scan, recording the scratch allocation."""
    spec = op.fn.spec
    init_t = op.init.spec.type_rule(op.init, ())
    declared = update_args(op.fn, spec, op.input.type.dtype, init_t)
    isz = _itemsizes(declared)
    flops = _FlopCounter(op.fn, spec, declared)
    ctx.flops.setdefault(op.name, 0)
    impl = ctx.impl(op.name, spec)

    # read once: ``step`` runs once per element of the stream
    name, fn, scratch = op.name, op.fn, spec.scratch_value
    count, alloc = ctx.count_flops, ctx.alloc
    if spec.kind == "map":

        def step_map(state: Any, e: Any) -> Any:
            count(name, flops((state, e)))
            if scratch is not None:
                alloc(name, "scratch", scratch(fn, isz, state, e))
            return impl(fn, state, e)

        return step_map
    several = spec.nargs > 1

    def step(state: Any, e: Any) -> Any:
        args = e if several else (e,)
        count(name, flops(args))
        if scratch is not None:
            alloc(name, "scratch", scratch(fn, isz, *args))
        return impl(fn, *args, state)

    return step


def _concrete(f: Fn, ctx: Ctx, local: dict) -> Fn:
    """``f`` with symbolic parameters (e.g. a dynamic accumulator shape) evaluated."""

    def conv(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        if isinstance(v, sp.Basic):
            n = try_evaluate(v, ctx.env, local)
            if n is None:
                raise StepRuntimeError(f"{f}: no value for {sp.sstr(v)} in this run")
            return int(n)
        return v

    return Fn(f.name, tuple((k, conv(v)) for k, v in f.params))


def _init_at(op: Accum | Scan, ctx: Ctx) -> Callable[[tuple[int, ...]], Any]:
    """``position -> fresh initial state`` (init parameters evaluated at that position)."""
    index = op.input.type.index

    def init(pos: tuple[int, ...]) -> Any:
        local = {ix: j for ix, j in zip(index, pos) if ix is not None}
        f = _concrete(op.init, ctx, local)
        return f.spec.impl(f)

    return init


def _accum(op: Accum, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    step = _stepper(op, ctx)
    init = _init_at(op, ctx)
    out_t = ctx.out_types[0].dtype
    ctx.onchip.setdefault(op.name, {})

    def reduce(sub: Any, pos: tuple[int, ...]) -> Any:
        state = init(pos)
        for e in iter_leaves(sub, op.rank):
            state = step(state, e)
        ctx.alloc(op.name, "state", value_nbytes(state, out_t))
        return state

    cut = x.rank + 1 - op.rank
    return (StreamValue(x.rank - op.rank, map_at_pos(x.data, cut, reduce)),)


def _scan(op: Scan, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    step = _stepper(op, ctx)
    init = _init_at(op, ctx)
    out_t = ctx.out_types[0].dtype
    ctx.onchip.setdefault(op.name, {})

    def scan(sub: Any, pos: tuple[int, ...]) -> Any:
        state = [init(pos)]

        def visit(e: Any) -> Any:
            state[0] = step(state[0], e)
            ctx.alloc(op.name, "state", value_nbytes(state[0], out_t))
            return state[0]

        return map_at(sub, op.rank, visit)

    cut = x.rank + 1 - op.rank
    return (StreamValue(x.rank, map_at_pos(x.data, cut, scan)),)


def _flat_map(op: FlatMap, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    spec = op.fn.spec
    flops = _FlopCounter(op.fn, spec, unpack_args(op.fn, spec, op.input.type.dtype))
    ctx.flops.setdefault(op.name, 0)

    def expand(elems: list) -> list:
        out: list = []
        for e in elems:
            args = e if spec.nargs > 1 else (e,)
            ctx.count_flops(op.name, flops(args))
            out.extend(spec.impl(op.fn, *args))
        return out

    return (StreamValue(ctx.out_types[0].rank, map_at(x.data, x.rank, expand)),)


IMPLS: dict[type, Callable[..., tuple]] = {
    Map: _map,
    Accum: _accum,
    Scan: _scan,
    FlatMap: _flat_map,
}
