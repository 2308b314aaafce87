"""STeP data types and stream types (STeP §3.1, Appendix A.1).

A stream's data type is a tile (2-D, static or dynamically sized), a selector (multi-hot over
``n`` choices), a read-only reference to an on-chip buffer, or a tuple of these.

A rank-``r`` stream ``Strm<T, r>`` is a stream of zero or more rank-``r`` tensors of ``T`` and
has the shape ``[D_r, D_{r-1}, ..., D_0]`` (``r + 1`` dimensions, outermost first):
``D_r`` counts the tensors in the stream, and the stop tokens ``S_1 .. S_r`` close dimensions
``D_0 .. D_{r-1}`` (the done token closes ``D_r``).  ``StreamType.shape`` stores the sizes in
exactly that order and ``StreamType.index`` names the loop index of each axis that a ragged
size refers to (see :mod:`torch2step.step.dims`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import sympy as sp

from torch2step.errors import StepTypeError

from .dims import (
    Index,
    RaggedDim,
    as_dim,
    dims_equal,
    dyn,
    fmt_dims,
    free_indices,
    max_over,
    sum_over,
)

__all__ = [
    "ADDR",
    "BOOL",
    "DTYPE_BYTES",
    "REF_BYTES",
    "BufferType",
    "DataType",
    "SelectorType",
    "StreamType",
    "TileType",
    "TupleType",
    "absorb_ragged",
    "stream_type",
    "types_equal",
]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "int32": 4, "int64": 8, "bool": 1}
"""Element size in bytes of each tile element type."""

REF_BYTES = 8
"""Size in bytes of a buffer reference travelling on a stream (an on-chip address)."""


class DataType:
    """Base class of stream element types."""

    __slots__ = ()

    def nbytes(self) -> sp.Expr:
        """Size of one element in bytes (``|x|`` in STeP §4.1)."""
        raise NotImplementedError

    def exprs(self) -> tuple[sp.Expr, ...]:
        """Every size expression inside the type."""
        raise NotImplementedError

    def map_exprs(self, f: Callable[[sp.Expr], sp.Expr]) -> DataType:
        """The same type with every size expression replaced by ``f(expr)``."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class TileType(DataType):
    """A 2-D tile ``[rows, cols]`` of ``dtype`` elements; dims may be dynamic or ragged."""

    shape: tuple[sp.Expr, ...]
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        shape = tuple(as_dim(d) for d in self.shape)
        if len(shape) != 2:
            raise StepTypeError(f"a tile is two-dimensional; got shape {fmt_dims(shape)}")
        if self.dtype not in DTYPE_BYTES:
            raise StepTypeError(
                f"unknown tile element type {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_static(self) -> bool:
        """True for a statically sized tile (``S`` in Appendix A.1)."""
        return all(d.is_Integer for d in self.shape)

    def nbytes(self) -> sp.Expr:
        return self.shape[0] * self.shape[1] * self.itemsize

    def exprs(self) -> tuple[sp.Expr, ...]:
        return self.shape

    def map_exprs(self, f: Callable[[sp.Expr], sp.Expr]) -> TileType:
        return TileType(tuple(f(d) for d in self.shape), self.dtype)

    def __str__(self) -> str:
        return f"Tile{fmt_dims(self.shape)} {self.dtype}"


ADDR = TileType((1, 1), "int64")
"""A ``[1, 1]`` integer tile: an off-chip address in tiles (``I`` in Appendix A.1)."""
BOOL = TileType((1, 1), "bool")
"""A ``[1, 1]`` boolean tile (padding flags, store acknowledgements)."""


@dataclass(frozen=True, slots=True)
class SelectorType(DataType):
    """A multi-hot vector over ``n`` choices (``SEL``); ``k`` is the popcount if it is fixed."""

    n: int
    k: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1 or (self.k is not None and not 0 <= self.k <= self.n):
            raise StepTypeError(f"invalid selector type Sel[{self.n}, k={self.k}]")

    def nbytes(self) -> sp.Expr:
        return sp.Integer((self.n + 7) // 8)

    def exprs(self) -> tuple[sp.Expr, ...]:
        return ()

    def map_exprs(self, f: Callable[[sp.Expr], sp.Expr]) -> SelectorType:
        return self

    def __str__(self) -> str:
        return f"Sel[{self.n}]" if self.k is None else f"Sel[{self.n}, k={self.k}]"


@dataclass(frozen=True, slots=True)
class BufferType(DataType):
    """A read-only reference to an on-chip buffer of ``elem`` with shape ``[D_{b-1}..D_0]``."""

    elem: DataType
    shape: tuple[sp.Expr, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(as_dim(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(d.is_Integer for d in self.shape)

    def card(self) -> sp.Expr:
        """``||buffer||``: number of elements stored."""
        return sp.Mul(*self.shape)

    def buffer_bytes(self) -> sp.Expr:
        return self.card() * self.elem.nbytes()

    def nbytes(self) -> sp.Expr:
        return sp.Integer(REF_BYTES)

    def exprs(self) -> tuple[sp.Expr, ...]:
        return self.shape + self.elem.exprs()

    def map_exprs(self, f: Callable[[sp.Expr], sp.Expr]) -> BufferType:
        return BufferType(self.elem.map_exprs(f), tuple(f(d) for d in self.shape))

    def __str__(self) -> str:
        return f"Buf<{self.elem}>{fmt_dims(self.shape)}"


@dataclass(frozen=True, slots=True)
class TupleType(DataType):
    """A tuple of data types (produced by Zip)."""

    elems: tuple[DataType, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "elems", tuple(self.elems))
        if len(self.elems) < 2:
            raise StepTypeError("a tuple type has at least two elements")

    def nbytes(self) -> sp.Expr:
        return sp.Add(*(e.nbytes() for e in self.elems))

    def exprs(self) -> tuple[sp.Expr, ...]:
        return tuple(x for e in self.elems for x in e.exprs())

    def map_exprs(self, f: Callable[[sp.Expr], sp.Expr]) -> TupleType:
        return TupleType(tuple(e.map_exprs(f) for e in self.elems))

    def __str__(self) -> str:
        return "(" + ", ".join(str(e) for e in self.elems) + ")"


@dataclass(frozen=True, slots=True)
class StreamType:
    """``Strm<dtype, rank>`` with shape ``[D_rank, ..., D_0]`` (outermost first).

    ``index[p]`` is the :class:`Index` naming axis ``p`` (``None`` if no size refers to it).
    A size at axis ``p`` may only use indices of axes outside it (``< p``); the element type
    may use any axis index.
    """

    dtype: DataType
    shape: tuple[sp.Expr, ...]
    index: tuple[Index | None, ...] = field(default=())

    def __post_init__(self) -> None:
        shape = tuple(as_dim(d) for d in self.shape)
        index = tuple(self.index) if self.index else (None,) * len(shape)
        if len(shape) < 1:
            raise StepTypeError("a stream has at least one dimension (the tensor count D_r)")
        if len(index) != len(shape):
            raise StepTypeError(f"stream index {index} does not match shape {fmt_dims(shape)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "index", index)

    @property
    def rank(self) -> int:
        """The stream rank ``r`` (``len(shape) - 1``)."""
        return len(self.shape) - 1

    def dim(self, k: int) -> sp.Expr:
        """``D_k`` in the paper's numbering (``D_0`` innermost)."""
        return self.shape[self.rank - k]

    def check(self) -> None:
        """Raise :class:`StepTypeError` if an index is unbound or bound twice."""
        seen = [i for i in self.index if i is not None]
        if len(seen) != len(set(seen)):
            raise StepTypeError(f"stream type {self}: an index names two axes")
        for p, d in enumerate(self.shape):
            bad = free_indices(d) - set(self.index[:p])
            if bad:
                raise StepTypeError(
                    f"stream type {self}: size {sp.sstr(d)} of axis {p} uses index "
                    f"{sorted(map(str, bad))} that no outer axis defines"
                )
        bad = set().union(*(free_indices(e) for e in self.dtype.exprs())) - set(self.index)
        if bad:
            raise StepTypeError(
                f"stream type {self}: element type uses index {sorted(map(str, bad))} "
                "that no axis defines"
            )

    def card(self, inner: sp.Expr | int = 1, start: int = 0) -> sp.Expr:
        """Sum of ``inner`` over every position of axes ``start..`` (cardinality if 1)."""
        acc = sp.sympify(inner)
        for p in range(len(self.shape) - 1, start - 1, -1):
            ix = self.index[p]
            acc = sum_over(acc, ix, self.shape[p]) if ix is not None else acc * self.shape[p]
        return acc

    def total_bytes(self) -> sp.Expr:
        """Bytes of all elements of the stream (cardinality x element size, summed)."""
        return self.card(self.dtype.nbytes())

    def peak(self, expr: sp.Expr) -> sp.Expr:
        """Max of ``expr`` over every element position of the stream; 0 for an empty stream."""
        acc = sp.sympify(expr)
        for p in range(len(self.shape) - 1, -1, -1):
            ix = self.index[p]
            if ix is not None and ix in acc.free_symbols:
                acc = max_over(acc, ix, self.shape[p])
            else:
                acc = max_over(acc, Index(f"_p{p}"), self.shape[p])
        return acc

    def with_(self, **changes: object) -> StreamType:
        """A copy with some fields replaced."""
        fields = {"dtype": self.dtype, "shape": self.shape, "index": self.index}
        fields.update(changes)
        return StreamType(fields["dtype"], fields["shape"], fields["index"])  # type: ignore[arg-type]

    def canonical(self) -> StreamType:
        """Indices renamed by position (``_a0``, ``_a1``...) for comparisons."""
        mapping = {ix: Index(f"_a{p}") for p, ix in enumerate(self.index) if ix is not None}
        return StreamType(
            self.dtype.map_exprs(lambda e: e.xreplace(mapping)),
            tuple(d.xreplace(mapping) for d in self.shape),
            tuple(mapping.get(ix) if ix is not None else None for ix in self.index),  # type: ignore[arg-type]
        )

    def __str__(self) -> str:
        dims = []
        for d, ix in zip(self.shape, self.index):
            dims.append(sp.sstr(d) + (f":{ix}" if ix is not None else ""))
        return f"Strm<{self.dtype}, {self.rank}>[{', '.join(dims)}]"


def stream_type(
    dtype: DataType, shape: Sequence[object], ragged: Sequence[RaggedDim] = ()
) -> StreamType:
    """Build a :class:`StreamType`; a :class:`RaggedDim` in ``shape`` binds its index to the
    nearest outer axis whose extent equals ``RaggedDim.outer``.  ``ragged`` lists ragged
    sizes used only inside ``dtype`` (e.g. a tile ``[L[i], 64]``); each binds to the innermost
    axis of extent ``outer``."""
    dims = [as_dim(d) for d in shape]
    index: list[Index | None] = [None] * len(dims)

    def bind(r: RaggedDim, start: int, where: str) -> None:
        outer = as_dim(r.outer)
        for q in range(start, -1, -1):
            if dims_equal(dims[q], outer) and index[q] in (None, r.idx):
                index[q] = r.idx
                return
        raise StepTypeError(
            f"ragged dimension {r.expr} {where} of shape {fmt_dims(dims)}: no outer axis has "
            f"extent {sp.sstr(outer)}; put the axis it is indexed by outside it"
        )

    for p, d in enumerate(shape):
        if isinstance(d, RaggedDim):
            bind(d, p - 1, f"at axis {p}")
    for r in ragged:
        bind(r, len(dims) - 1, "in the element type")
    st = StreamType(dtype, tuple(dims), tuple(index))
    st.check()
    return st


def _dtype_equal(a: DataType, b: DataType) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, TileType) and isinstance(b, TileType):
        return a.dtype == b.dtype and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))
    if isinstance(a, BufferType) and isinstance(b, BufferType):
        return (
            a.rank == b.rank
            and _dtype_equal(a.elem, b.elem)
            and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))
        )
    if isinstance(a, TupleType) and isinstance(b, TupleType):
        return len(a.elems) == len(b.elems) and all(
            _dtype_equal(x, y) for x, y in zip(a.elems, b.elems)
        )
    return a == b


def dtypes_equal(a: DataType, b: DataType) -> bool:
    """Symbolic equality of two element types."""
    return _dtype_equal(a, b)


def types_equal(a: StreamType, b: StreamType) -> bool:
    """Equality up to renaming of axis indices (positionally)."""
    if a is b or a == b:  # structurally equal (the verifier's usual case): no renaming needed
        return True
    if a.rank != b.rank:
        return False
    ca, cb = a.canonical(), b.canonical()
    return all(dims_equal(x, y) for x, y in zip(ca.shape, cb.shape)) and _dtype_equal(
        ca.dtype, cb.dtype
    )


def _fresh_over(name: str, outer: Sequence[Index]) -> sp.Expr:
    if not outer:
        return dyn(name)
    return sp.IndexedBase(name)[tuple(outer)]


def absorb_ragged(
    shape: Sequence[sp.Expr],
    index: Sequence[Index | None],
    dtype: DataType,
    prefix: str,
) -> tuple[tuple[sp.Expr, ...], tuple[Index | None, ...], DataType]:
    """Replace sizes that use an index no axis defines any more by fresh ragged symbols.

    STeP (revised) §3.1: a size derived from a ragged dimension whose defining axis is gone is a
    new ragged dimension.  A size at axis ``p`` becomes ``{prefix}{k}[i_0, .., i_{p-1}]``
    (indexed by every outer axis except those of extent 1; a plain dynamic symbol if there
    is none); an element-type size becomes ``{prefix}{k}[i_0, .., i_last]``.  Outer axes
    without an index get ``{prefix}_i{p}``.  The interpreter infers the fresh symbols' values from the data.
    """
    dims = list(shape)
    idx = list(index)
    counter = [0]

    def axis_indices(upto: int) -> list[Index]:
        # a size cannot vary along an axis of extent 1: such axes need no index
        for q in range(upto):
            if idx[q] is None and dims[q] != 1:
                idx[q] = Index(f"{prefix}_i{q}")
        return [i for q, i in enumerate(idx[:upto]) if i is not None and dims[q] != 1]

    def fresh(upto: int) -> sp.Expr:
        name = f"{prefix}{counter[0]}"
        counter[0] += 1
        return _fresh_over(name, axis_indices(upto))

    memo: dict[tuple[int, sp.Expr], sp.Expr] = {}
    for p, d in enumerate(dims):
        if free_indices(d) - set(idx[:p]):
            key = (p, d)
            if key not in memo:
                memo[key] = fresh(p)
            dims[p] = memo[key]
    live = set(idx)

    def fix(e: sp.Expr) -> sp.Expr:
        if free_indices(e) - live:
            key = (len(dims), e)
            if key not in memo:
                memo[key] = fresh(len(dims))
            return memo[key]
        return e

    new_dtype = (
        dtype.map_exprs(fix) if any(free_indices(e) - live for e in dtype.exprs()) else dtype
    )
    return tuple(dims), tuple(idx), new_dtype
