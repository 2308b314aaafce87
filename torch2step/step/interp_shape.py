"""Meaning of the shape operators on data (STeP §3.2.5, table 6; STeP (revised) §3.2.5).

They only move stop tokens: Flatten drops the tokens between the merged dims, Reshape adds
one (and pads the last chunk of the innermost dim), Promote wraps the stream in one more
dimension unless it is empty, Expand/Repeat repeat elements, Zip pairs elements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .evaluate import try_evaluate
from .interp_context import Ctx, value_nbytes
from .ops_shape import Expand, Flatten, Promote, Repeat, Reshape, Zip
from .values import StepRuntimeError, StreamValue, map_at, map_at_pos, zip_at

__all__ = ["IMPLS"]


def _flatten(op: Flatten, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    hi, lo = x.rank - op.max, x.rank - op.min

    def flat(lst: list) -> list:
        for _ in range(lo - hi):
            lst = [y for sub in lst for y in sub]
        return lst

    return (StreamValue(x.rank - (op.max - op.min), map_at(x.data, hi, flat)),)


def _reshape(op: Reshape, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    p, s = x.rank - op.rank, op.chunk
    flags = map_at(x.data, x.rank + 1, lambda _: np.zeros((1, 1), dtype=np.bool_))

    def split(lst: list, filler: Callable[[list], Any]) -> list:
        chunks = [lst[k : k + s] for k in range(0, len(lst), s)]
        if chunks and len(chunks[-1]) < s:
            if op.pad is None:
                raise StepRuntimeError(
                    f"Reshape %{op.name}: {len(lst)} items do not split into chunks of {s} "
                    "and no pad value is given"
                )
            chunks[-1] = chunks[-1] + [filler(lst) for _ in range(s - len(chunks[-1]))]
        return chunks

    def pad_tile(lst: list) -> np.ndarray:
        return np.full(lst[-1].shape, op.pad, dtype=lst[-1].dtype)

    data = map_at(x.data, p, lambda lst: split(lst, pad_tile))
    flags = map_at(flags, p, lambda lst: split(lst, lambda _: np.ones((1, 1), dtype=np.bool_)))
    return (StreamValue(x.rank + 1, data), StreamValue(x.rank + 1, flags))


def _promote(op: Promote, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    return (StreamValue(x.rank + 1, [x.data] if x.data else []),)


def _expand(op: Expand, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x, r = ins
    cut = x.rank - op.rank
    out_t = ctx.out_types[0].dtype
    ctx.onchip.setdefault(op.name, {})

    def fill(xs: Any, rs: Any) -> Any:
        e = xs
        for _ in range(op.rank + 1):
            if not isinstance(e, list) or len(e) != 1:
                raise StepRuntimeError(f"Expand %{op.name}: expanded dims of the input are not 1")
            e = e[0]

        def leaf(_: Any) -> Any:
            ctx.alloc(op.name, "element", value_nbytes(e, out_t))
            return e

        return map_at(rs, op.rank + 1, leaf)

    data = zip_at(x.data, r.data, cut, fill, f"Expand %{op.name}")
    return (StreamValue(r.rank, data),)


def _zip(op: Zip, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    depth = ins[0].rank + 1

    def walk(nodes: list, d: int) -> Any:
        if d == 0:
            return tuple(nodes)
        if len({len(n) for n in nodes}) != 1:
            raise StepRuntimeError(f"Zip %{op.name}: streams differ in shape")
        return [walk([n[j] for n in nodes], d - 1) for j in range(len(nodes[0]))]

    return (StreamValue(ins[0].rank, walk([v.data for v in ins], depth)),)


def _repeat(op: Repeat, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    index = op.input.type.index
    out_t = ctx.out_types[0].dtype
    ctx.onchip.setdefault(op.name, {})

    def rep(e: Any, pos: tuple[int, ...]) -> list:
        local = {ix: j for ix, j in zip(index, pos) if ix is not None}
        n = try_evaluate(op.count, ctx.env, local)
        if n is None:
            raise StepRuntimeError(f"Repeat %{op.name}: no value for count {op.count}")
        if n:
            ctx.alloc(op.name, "element", value_nbytes(e, out_t))
        return [e] * int(n)

    return (StreamValue(x.rank + 1, map_at_pos(x.data, x.rank + 1, rep)),)


IMPLS: dict[type, Callable[..., tuple]] = {
    Flatten: _flatten,
    Reshape: _reshape,
    Promote: _promote,
    Expand: _expand,
    Zip: _zip,
    Repeat: _repeat,
}
