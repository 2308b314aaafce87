"""Dynamic routing and merging operators (STeP §3.2.3, Appendix A table 5; STeP (revised) §3.2.3).

A *chunk* is one top-level tensor of a stream: for ``Strm<R,a> [D_a, D_{a-1}..D_0]`` each of
the ``D_a`` rank-``a`` tensors ``[D_{a-1}..D_0]``.  Chunk sizes may vary from chunk to chunk
(ragged, e.g. ``[N, L[i]]``); merged outputs then get fresh ragged sizes.  Partition routes chunks of its input to the
outputs chosen by each selector (a chunk may go to several outputs: multi-hot); Reassemble
gathers, for every selector, one chunk from each selected input and adds a dimension;
EagerMerge interleaves whole chunks in arrival order and reports where each came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy as sp

from .dims import Index, dyn, free_indices
from .op_base import Op, Value, prefix_equal, require
from .types import SelectorType, StreamType, absorb_ragged, types_equal

__all__ = ["EagerMerge", "Partition", "Reassemble"]


_RAGGED = sp.Symbol("ragged_chunk_size")


def _chunk_type(t: StreamType) -> StreamType:
    """One chunk's type (the stream without its outermost dim, as a 1-tensor stream); sizes
    that vary from chunk to chunk (use the outer index) become one marker symbol."""
    top = t.index[0]

    def mark(e: sp.Expr) -> sp.Expr:
        return _RAGGED if top is not None and top in free_indices(e) else e

    return StreamType(
        t.dtype.map_exprs(mark), (1, *(mark(d) for d in t.shape[1:])), (None, *t.index[1:])
    )


def _check_chunks(op: Op, ins: Sequence[Value]) -> StreamType:
    """All inputs have the same rank and chunk type (ragged chunk sizes match ragged ones)."""
    require(len(ins) >= 1, op, "at least one input stream")
    first = ins[0].type
    for k, v in enumerate(ins):
        t = v.type
        require(
            t.rank == first.rank,
            op,
            "all inputs have the same rank",
            input=k,
            rank=t.rank,
            expected=first.rank,
        )
        require(
            types_equal(_chunk_type(t), _chunk_type(first)),
            op,
            "all inputs have the same inner dims [D_{a-1}..D_0] and data type",
            input=k,
            got=t,
            expected=first,
        )
    return first


@dataclass(frozen=True, slots=True)
class Partition(Op):
    """Route chunks by selector (table 5): ``in: Strm<R,a> [D_a..D_0]``,
    ``sel: Strm<SEL,b> [D_a..D_{a-b}]`` -> output ``i``: ``Strm<R,a-b> [N_i, D_{a-b-1}..D_0]``.

    ``N_i`` (``{name}_n{i}`` unless ``count_names`` is given) is a new dynamic dimension: the
    number of chunks whose selector picks output ``i``.  The outer dims are flattened away.
    """

    name: str
    input: Value
    sel: Value
    num_consumers: int
    count_names: tuple[str, ...] | None = None

    def inputs(self) -> tuple[Value, ...]:
        return (self.input, self.sel)

    def num_outputs(self) -> int:
        return self.num_consumers

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("num_consumers", self.num_consumers),)

    def counts(self) -> tuple[sp.Symbol, ...]:
        """The dynamic chunk-count symbols ``N_i``."""
        names = self.count_names or tuple(f"{self.name}_n{i}" for i in range(self.num_consumers))
        return tuple(dyn(n) for n in names)

    def out_types(self) -> tuple[StreamType, ...]:
        t, s = self.input.type, self.sel.type
        require(
            isinstance(s.dtype, SelectorType) and s.dtype.n == self.num_consumers,
            self,
            "sel carries selectors over num_consumers outputs",
            sel=s.dtype,
            num_consumers=self.num_consumers,
        )
        require(
            self.count_names is None or len(self.count_names) == self.num_consumers,
            self,
            "one count name per output",
            count_names=self.count_names,
        )
        b = s.rank
        require(b <= t.rank, self, "selector rank b <= input rank a", b=b, a=t.rank)
        require(
            prefix_equal(t, s, b + 1),
            self,
            "sel shape equals the outer b+1 dims of the input [D_a..D_{a-b}]",
            input=t,
            sel=s,
        )
        outs = []
        for i, n_i in enumerate(self.counts()):
            shape = (n_i, *t.shape[b + 1 :])
            index = (None, *t.index[b + 1 :])
            shape, index, dtype = absorb_ragged(shape, index, t.dtype, f"{self.name}{i}_r")
            outs.append(StreamType(dtype, shape, index))
        return tuple(outs)


@dataclass(frozen=True, slots=True)
class Reassemble(Op):
    """Gather chunks by selector (table 5): ``in_i: Strm<R,a> [D^i_a, D_{a-1}..D_0]``,
    ``sel: Strm<SEL,b> [S_b..S_0]`` -> ``Strm<R,a+b+1> [S_b..S_0, K, D_{a-1}..D_0]``.

    For every selector one chunk of each selected input is collected, whole (inputs are not
    interleaved), in the order the chunks arrive (STeP (revised) §3.2.3); ``K`` is the popcount:
    ``k`` for a k-hot selector type, else a fresh ragged dimension.
    """

    name: str
    ins: tuple[Value, ...]
    sel: Value

    def inputs(self) -> tuple[Value, ...]:
        return (*self.ins, self.sel)

    def out_types(self) -> tuple[StreamType, ...]:
        first = _check_chunks(self, self.ins)
        s = self.sel.type
        require(
            isinstance(s.dtype, SelectorType) and s.dtype.n == len(self.ins),
            self,
            "sel carries selectors over the inputs",
            sel=s.dtype,
            inputs=len(self.ins),
        )
        assert isinstance(s.dtype, SelectorType)
        k = s.dtype.k
        count = sp.Integer(k) if k is not None else Index(f"{self.name}_sel")
        inner_idx = list(first.index[1:])
        clash = {ix: Index(f"{self.name}_i{p}") for p, ix in enumerate(inner_idx) if ix in s.index}
        inner = [d.xreplace(clash) for d in first.shape[1:]]
        inner_idx = [clash.get(ix, ix) if ix is not None else None for ix in inner_idx]
        dtype = first.dtype.map_exprs(lambda e: e.xreplace(clash))
        shape = (*s.shape, count, *inner)
        index = (*s.index, None, *inner_idx)
        shape, index, dtype = absorb_ragged(shape, index, dtype, f"{self.name}_r")
        return (StreamType(dtype, shape, index),)


@dataclass(frozen=True, slots=True)
class EagerMerge(Op):
    """Merge chunks in arrival order (table 5): ``in_i: Strm<R,a> [D^i_a, D_{a-1}..D_0]`` ->
    data ``Strm<R,a> [sum_i D^i_a, D_{a-1}..D_0]`` and ``Strm<SEL,0> [sum_i D^i_a]`` (one-hot:
    the input each chunk came from)."""

    name: str
    ins: tuple[Value, ...]

    def inputs(self) -> tuple[Value, ...]:
        return self.ins

    def num_outputs(self) -> int:
        return 2

    def optional_outputs(self) -> frozenset[int]:
        return frozenset({1})

    def out_types(self) -> tuple[StreamType, ...]:
        first = _check_chunks(self, self.ins)
        total = sp.Add(*(v.type.shape[0] for v in self.ins))
        shape, index, dtype = absorb_ragged(
            (total, *first.shape[1:]), (None, *first.index[1:]), first.dtype, f"{self.name}_r"
        )
        data = StreamType(dtype, shape, index)
        sel = StreamType(SelectorType(len(self.ins), 1), (total,))
        return (data, sel)
