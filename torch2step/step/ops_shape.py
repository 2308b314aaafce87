"""Shape operators: Flatten, Reshape, Promote, Expand, Zip, Repeat (STeP §3.2.5, table 6).

They change the stop-token structure, not the elements.  Dimension numbers follow the paper:
``D_0`` is innermost, ``D_a`` (the tensor count) outermost.  Repeat is the static repeat of
STeP Fig. 12 (``Expand n=[224]`` in Fig. 2 is "syntax sugar for static repeating").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp

from .dims import as_dim, free_indices
from .op_base import Op, Value, adopt_indices, prefix_equal, require
from .types import BOOL, StreamType, TileType, TupleType, absorb_ragged

__all__ = ["Expand", "Flatten", "Promote", "Repeat", "Reshape", "Zip"]


@dataclass(frozen=True, slots=True)
class Flatten(Op):
    """Merge dims ``D_max..D_min`` into one of size ``prod`` (a sum over ragged dims):
    ``Strm<R,a>`` -> ``Strm<R,a-(max-min)>``."""

    name: str
    input: Value
    min: int
    max: int

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("min", self.min), ("max", self.max))

    def out_types(self) -> tuple[StreamType, ...]:
        t = self.input.type
        require(
            0 <= self.min < self.max <= t.rank,
            self,
            "0 <= min < max <= input rank",
            min=self.min,
            max=self.max,
            rank=t.rank,
        )
        hi, lo = t.rank - self.max, t.rank - self.min
        sub = StreamType(t.dtype, t.shape[hi : lo + 1], t.index[hi : lo + 1])
        shape = (*t.shape[:hi], sub.card(), *t.shape[lo + 1 :])
        index = (*t.index[:hi], None, *t.index[lo + 1 :])
        shape, index, dtype = absorb_ragged(shape, index, t.dtype, f"{self.name}_r")
        return (StreamType(dtype, shape, index),)


@dataclass(frozen=True, slots=True)
class Reshape(Op):
    """Split ``D_rank`` into chunks of ``chunk`` (table 6): ``[.., D_b, ..]`` ->
    ``[.., ceil(D_b / S), S, ..]`` plus a padding-flag stream of the same shape.

    Above the innermost dim, ``D_b`` must be static and divisible by ``S``; the innermost dim
    may be anything and its last chunk is padded with tiles filled with ``pad``.
    """

    name: str
    input: Value
    rank: int
    chunk: int
    pad: float | None = None

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def num_outputs(self) -> int:
        return 2

    def optional_outputs(self) -> frozenset[int]:
        return frozenset({1})

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("rank", self.rank), ("chunk", self.chunk), ("pad", self.pad))

    def out_types(self) -> tuple[StreamType, ...]:
        t = self.input.type
        require(
            0 <= self.rank <= t.rank,
            self,
            "0 <= rank <= input rank",
            rank=self.rank,
            input_rank=t.rank,
        )
        require(self.chunk >= 1, self, "chunk size >= 1", chunk=self.chunk)
        p = t.rank - self.rank
        d = t.shape[p]
        divisible = d.is_Integer and int(d) % self.chunk == 0
        if self.rank > 0:
            require(
                divisible,
                self,
                "a dimension above the innermost is split only if static and divisible by chunk",
                dim=d,
                chunk=self.chunk,
            )
        elif not divisible:
            require(
                self.pad is not None,
                self,
                "splitting a dynamic or indivisible innermost dim pads it: give pad",
                dim=d,
                chunk=self.chunk,
            )
        if self.pad is not None:
            require(isinstance(t.dtype, TileType), self, "pad fills a tile", dtype=t.dtype)
        n = sp.ceiling(d / self.chunk)
        shape = (*t.shape[:p], n, sp.Integer(self.chunk), *t.shape[p + 1 :])
        index = (*t.index[:p], None, None, *t.index[p + 1 :])
        shape, index, dtype = absorb_ragged(shape, index, t.dtype, f"{self.name}_r")
        return (StreamType(dtype, shape, index), StreamType(BOOL, shape, index))


@dataclass(frozen=True, slots=True)
class Promote(Op):
    """Add an outermost dim (table 6, STeP (revised) §3.2.5): ``[D_a..D_0]`` -> ``[P, D_a..D_0]``,
    ``P = 1 if D_a > 0 else 0`` (an empty stream stays empty)."""

    name: str
    input: Value

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def out_types(self) -> tuple[StreamType, ...]:
        t = self.input.type
        top = t.shape[0]
        if top.is_Integer:
            new = sp.Integer(1 if top > 0 else 0)
        else:
            new = sp.Piecewise((1, sp.Gt(top, 0)), (0, True))
        return (StreamType(t.dtype, (new, *t.shape), (None, *t.index)),)


@dataclass(frozen=True, slots=True)
class Expand(Op):
    """Repeat elements along ``ref`` (table 6): ``in: [D_a..D_{b+1}, 1_b..1_0]``,
    ``ref: [D_a..D_{b+1}, D_b..D_0]`` -> the shape of ``ref``."""

    name: str
    input: Value
    ref: Value
    rank: int

    def inputs(self) -> tuple[Value, ...]:
        return (self.input, self.ref)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("rank", self.rank),)

    def out_types(self) -> tuple[StreamType, ...]:
        t, r = self.input.type, self.ref.type
        require(t.rank == r.rank, self, "input and ref have the same rank", input=t, ref=r)
        require(0 <= self.rank <= t.rank, self, "0 <= rank <= stream rank", rank=self.rank)
        cut = t.rank - self.rank
        require(
            all(d == 1 for d in t.shape[cut:]),
            self,
            "the expanded inner dims D_b..D_0 of the input are 1",
            input=t.shape,
            rank=self.rank,
        )
        require(
            prefix_equal(t, r, cut),
            self,
            "input and ref agree on the outer dims D_a..D_{b+1}",
            input=t,
            ref=r,
        )
        index = list(r.index)
        mapping = adopt_indices(index, t.index, cut, self.name)
        dtype = t.dtype.map_exprs(lambda e: e.xreplace(mapping))
        shape, idx, dtype = absorb_ragged(r.shape, index, dtype, f"{self.name}_r")
        return (StreamType(dtype, shape, idx),)

    def onchip_bytes(self) -> sp.Expr:
        out = self.out_types()[0]
        return out.peak(out.dtype.nbytes())


@dataclass(frozen=True, slots=True)
class Zip(Op):
    """Group streams of the same shape into a stream of tuples (table 6; n-ary)."""

    name: str
    ins: tuple[Value, ...]

    def inputs(self) -> tuple[Value, ...]:
        return self.ins

    def out_types(self) -> tuple[StreamType, ...]:
        require(len(self.ins) >= 2, self, "Zip takes at least two streams", got=len(self.ins))
        first = self.ins[0].type
        index = list(first.index)
        dtypes = []
        for k, v in enumerate(self.ins):
            t = v.type
            require(
                t.rank == first.rank and prefix_equal(first, t, len(first.shape)),
                self,
                "all zipped streams have the same shape",
                input=k,
                got=t,
                expected=first,
            )
            mapping = adopt_indices(index, t.index, len(index), self.name)
            dtypes.append(t.dtype.map_exprs(lambda e, m=mapping: e.xreplace(m)))
        return (StreamType(TupleType(tuple(dtypes)), first.shape, tuple(index)),)


@dataclass(frozen=True, slots=True)
class Repeat(Op):
    """Repeat every element ``count`` times as a new innermost dim (STeP Fig. 12):
    ``Strm<R,a> [D_a..D_0]`` -> ``Strm<R,a+1> [D_a..D_0, count]``."""

    name: str
    input: Value
    count: sp.Expr

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("count", self.count),)

    def out_types(self) -> tuple[StreamType, ...]:
        t = self.input.type
        n = as_dim(self.count)
        require(
            not (free_indices(n) - set(t.index)),
            self,
            "count may only use indices of the input's axes",
            count=n,
        )
        require(not (n.is_Integer and n < 0), self, "count >= 0", count=n)
        return (StreamType(t.dtype, (*t.shape, n), (*t.index, None)),)

    def onchip_bytes(self) -> sp.Expr:
        out = self.out_types()[0]
        return out.peak(out.dtype.nbytes())
