"""Off-chip and on-chip memory operators (STeP §3.2.1–3.2.2, Appendix A tables 2–3).

Addresses and ``base`` offsets are in tiles of the accessed tensor viewed as a row-major grid
of tiles (``tiled_in_shape``).  Metric formulas follow STeP §4.1: an off-chip operator
moves ``cardinality x |tile|`` bytes and needs ``|tile| x 2`` on-chip (double buffering);
Bufferize needs ``|in| + ||buffer|| x |in| x 2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp

from torch2step.errors import StepTypeError

from .dims import Index, as_dim, free_indices
from .op_base import (
    OffChipTensor,
    Op,
    Value,
    adopt_indices,
    prefix_equal,
    require,
    rule_error,
)
from .types import BOOL, BufferType, StreamType, TileType, TupleType, absorb_ragged

__all__ = [
    "Bufferize",
    "LinearOffChipLoad",
    "LinearOffChipStore",
    "RandomOffChipLoad",
    "RandomOffChipLoadRows",
    "RandomOffChipStore",
    "Streamify",
    "row_major_strides",
]


def row_major_strides(shape: tuple[sp.Expr, ...]) -> tuple[sp.Expr, ...]:
    """Strides that read ``shape`` contiguously in row-major order."""
    out: list[sp.Expr] = []
    acc: sp.Expr = sp.Integer(1)
    for d in reversed(shape):
        out.append(acc)
        acc = acc * d
    return tuple(reversed(out))


def _tiles(op: Op, tensor: OffChipTensor, tile: TileType) -> tuple[sp.Expr, ...]:
    try:
        return tensor.tiled_shape(tile, f"{op.op_name} %{op.name}")
    except StepTypeError as e:
        raise StepTypeError(str(e)) from None


def _check_affine(op: Op, stride: tuple, out_shape: tuple, base: int, size: sp.Expr) -> None:
    require(
        len(stride) == len(out_shape) >= 1,
        op,
        "stride and out_shape have the same, non-zero length",
        stride=stride,
        out_shape=out_shape,
    )
    last = base + sum((o - 1) * s for o, s in zip(out_shape, stride))
    if all(sp.sympify(x).is_Integer for x in (*out_shape, *stride, size)) and all(
        o >= 1 for o in out_shape
    ):
        require(
            0 <= last < size,
            op,
            "the affine read stays inside the data (base + sum((out-1)*stride) < size)",
            last=last,
            size=size,
        )


def _addr_stream(op: Op, v: Value, what: str) -> None:
    t = v.type.dtype
    require(
        isinstance(t, TileType) and t.dtype in ("int32", "int64") and t.shape == (1, 1),
        op,
        f"{what} carries [1,1] integer address tiles (I)",
        got=t,
    )


@dataclass(frozen=True, slots=True)
class LinearOffChipLoad(Op):
    """Affine read of ``tensor`` in ``tile`` tiles, once per element of ``ref`` (Table 2).

    ``ref: Strm<R,b> [D_b..D_0]`` -> ``Strm<S,a+b> [D_b..D_0, D'_{a-1}..D'_0]`` with
    ``[D'] = out_shape``; tile ``j`` of the read is tile ``base + sum(j_k * stride_k)`` of the
    tiled tensor.  Without ``ref`` the tensor is read once (shape ``[1, out_shape...]``).
    """

    name: str
    tensor: OffChipTensor
    tile: TileType
    ref: Value | None
    stride: tuple[sp.Expr, ...]
    out_shape: tuple[sp.Expr, ...]
    base: int = 0

    def inputs(self) -> tuple[Value, ...]:
        return (self.ref,) if self.ref is not None else ()

    def tensors(self) -> tuple[OffChipTensor, ...]:
        return (self.tensor,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (
            ("tensor", self.tensor.name),
            ("tile", self.tile),
            ("stride", self.stride),
            ("out_shape", self.out_shape),
            ("base", self.base),
        )

    def out_types(self) -> tuple[StreamType, ...]:
        tiled = _tiles(self, self.tensor, self.tile)
        _check_affine(self, self.stride, self.out_shape, self.base, sp.Mul(*tiled))
        if self.ref is None:
            return (StreamType(self.tile, (1, *self.out_shape)),)
        r = self.ref.type
        index = (*r.index, *([None] * len(self.out_shape)))
        return (StreamType(self.tile, (*r.shape, *self.out_shape), index),)

    def offchip_read_bytes(self) -> sp.Expr:
        return self.out_types()[0].total_bytes()

    def onchip_bytes(self) -> sp.Expr:
        out = self.out_types()[0]
        return out.peak(self.tile.nbytes()) * 2


@dataclass(frozen=True, slots=True)
class LinearOffChipStore(Op):
    """Store the tiles of ``input`` linearly into ``tensor`` from tile ``base`` (Table 2)."""

    name: str
    input: Value
    tensor: OffChipTensor
    base: int = 0

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def num_outputs(self) -> int:
        return 0

    def tensors(self) -> tuple[OffChipTensor, ...]:
        return (self.tensor,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("tensor", self.tensor.name), ("base", self.base))

    def out_types(self) -> tuple[StreamType, ...]:
        t = self.input.type
        require(
            isinstance(t.dtype, TileType) and t.dtype.is_static,
            self,
            "the stored stream carries statically sized tiles (S)",
            dtype=t.dtype,
        )
        assert isinstance(t.dtype, TileType)
        tiled = _tiles(self, self.tensor, t.dtype)
        n, cap = t.card(), sp.Mul(*tiled) - self.base
        if n.is_Integer and cap.is_Integer:
            require(n <= cap, self, "the stream fits in the tensor", tiles=n, capacity=cap)
        return ()

    def offchip_write_bytes(self) -> sp.Expr:
        return self.input.type.total_bytes()

    def onchip_bytes(self) -> sp.Expr:
        t = self.input.type
        return t.peak(t.dtype.nbytes()) * 2


@dataclass(frozen=True, slots=True)
class RandomOffChipLoad(Op):
    """Read the tile at each address of ``raddr`` (tile ``base + addr``) (Table 2).

    ``raddr: Strm<I,a> [D_a..D_0]`` -> ``Strm<S,a> [D_a..D_0]``.
    """

    name: str
    raddr: Value
    tensor: OffChipTensor
    tile: TileType
    base: int = 0

    def inputs(self) -> tuple[Value, ...]:
        return (self.raddr,)

    def tensors(self) -> tuple[OffChipTensor, ...]:
        return (self.tensor,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("tensor", self.tensor.name), ("tile", self.tile), ("base", self.base))

    def out_types(self) -> tuple[StreamType, ...]:
        _addr_stream(self, self.raddr, "raddr")
        _tiles(self, self.tensor, self.tile)
        return (self.raddr.type.with_(dtype=self.tile),)

    def offchip_read_bytes(self) -> sp.Expr:
        return self.out_types()[0].total_bytes()

    def onchip_bytes(self) -> sp.Expr:
        return self.out_types()[0].peak(self.tile.nbytes()) * 2


@dataclass(frozen=True, slots=True)
class RandomOffChipLoadRows(RandomOffChipLoad):
    """RandomOffChipLoad of a run of consecutive rows whose count comes with the address.

    ``raddr: Strm<(I, I),a> [D_a..D_0]`` of ``(row, r)`` pairs -> ``Strm<Tile[R, C],a>``: rows
    ``base + row .. base + row + r - 1`` of ``tensor`` (``C`` = its column count, so the
    ``r * C`` elements are one contiguous off-chip access), ``1 <= r <= tile rows``.  The
    row count ``R`` is a ragged size learnt from the data, one per address; it is named after
    the address stream, so loads sharing an address stream (the K and V tiles of one KV
    block) carry the same row count.  This is STeP (arXiv 2511.07776) §3.2.1's random-access
    load with a dynamically sized tile (the §3.1 dynamic tile dimension) instead of a
    ``[1, C]`` row per address followed by a RetileRow (Fig. 2): §4.1's off-chip traffic is
    still exactly the rows used, in one request per tile.  ``tile`` is the largest tile
    (``[rows, C]``); the on-chip requirement is its double buffer.
    """

    def out_types(self) -> tuple[StreamType, ...]:
        a = self.raddr.type
        t = a.dtype
        ok = (
            isinstance(t, TupleType)
            and len(t.elems) == 2
            and all(
                isinstance(e, TileType) and e.dtype in ("int32", "int64") and e.shape == (1, 1)
                for e in t.elems
            )
        )
        require(ok, self, "raddr carries (row, row count) pairs of [1,1] integer tiles", got=t)
        cols = self.tensor.shape[-1] if self.tensor.shape else None
        require(
            len(self.tensor.shape) == 2
            and self.tile.shape[1] == cols
            and self.tile.shape[0].is_Integer
            and int(self.tile.shape[0]) >= 1,
            self,
            "tiles are whole rows of the 2-D tensor (tile cols = tensor cols, static rows >= 1)",
            tile=self.tile,
            tensor=self.tensor,
        )
        rows = Index(f"{self.raddr.name}_rows_data")  # known only from the data
        tile = TileType((rows, self.tile.shape[1]), self.tile.dtype)
        shape, index, dtype = absorb_ragged(a.shape, a.index, tile, f"{self.raddr.name}_rows")
        return (StreamType(dtype, shape, index),)

    def onchip_bytes(self) -> sp.Expr:
        return self.out_types()[0].peak(self.tile.nbytes() * 2)


@dataclass(frozen=True, slots=True)
class RandomOffChipStore(Op):
    """Write each tile of ``wdata`` at the matching address of ``waddr`` (Table 2).

    ``waddr: Strm<I,b>``, ``wdata: Strm<S,b>`` of the same shape -> ``Strm<bool,b>`` (one
    acknowledgement per write; it may be left unconsumed).
    """

    name: str
    waddr: Value
    wdata: Value
    tensor: OffChipTensor
    base: int = 0

    def inputs(self) -> tuple[Value, ...]:
        return (self.waddr, self.wdata)

    def tensors(self) -> tuple[OffChipTensor, ...]:
        return (self.tensor,)

    def optional_outputs(self) -> frozenset[int]:
        return frozenset({0})

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("tensor", self.tensor.name), ("base", self.base))

    def out_types(self) -> tuple[StreamType, ...]:
        _addr_stream(self, self.waddr, "waddr")
        a, d = self.waddr.type, self.wdata.type
        require(
            a.rank == d.rank and prefix_equal(a, d, len(a.shape)),
            self,
            "waddr and wdata have the same shape",
            waddr=a,
            wdata=d,
        )
        require(
            isinstance(d.dtype, TileType) and d.dtype.is_static,
            self,
            "wdata carries statically sized tiles (S)",
            dtype=d.dtype,
        )
        assert isinstance(d.dtype, TileType)
        _tiles(self, self.tensor, d.dtype)
        return (a.with_(dtype=BOOL),)

    def offchip_write_bytes(self) -> sp.Expr:
        return self.wdata.type.total_bytes()

    def onchip_bytes(self) -> sp.Expr:
        d = self.wdata.type
        return d.peak(d.dtype.nbytes()) * 2


@dataclass(frozen=True, slots=True)
class Bufferize(Op):
    """Store the inner ``rank`` dims of ``input`` in on-chip buffers (Table 3, STeP (revised) §3.2.2).

    ``Strm<S,a> [D_a..D_b, D_{b-1}..D_0]`` -> ``Strm<Buffer<S,b>, a-b> [D_a..D_b]``, buffer
    shape ``[D_{b-1}..D_0]``.  Inner buffer dims must be regular (static or dynamic); the
    outermost buffered dim may be ragged.
    """

    name: str
    input: Value
    rank: int

    def inputs(self) -> tuple[Value, ...]:
        return (self.input,)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("rank", self.rank),)

    def out_types(self) -> tuple[StreamType, ...]:
        t = self.input.type
        require(
            1 <= self.rank <= t.rank,
            self,
            "1 <= rank <= input rank",
            rank=self.rank,
            input_rank=t.rank,
        )
        require(
            isinstance(t.dtype, TileType) and t.dtype.is_static,
            self,
            "the buffered stream carries statically sized tiles (S)",
            dtype=t.dtype,
        )
        cut = t.rank + 1 - self.rank
        buf_dims = t.shape[cut:]
        inner_idx = {ix for ix in t.index[cut:] if ix is not None}
        for d in buf_dims:
            if free_indices(d) & inner_idx:
                raise rule_error(
                    self,
                    "only the outermost buffered dimension may be ragged",
                    buffer_shape=buf_dims,
                )
        buf = BufferType(t.dtype, buf_dims)
        return (StreamType(buf, t.shape[:cut], t.index[:cut]),)

    def onchip_bytes(self) -> sp.Expr:
        out = self.out_types()[0]
        buf = out.dtype
        assert isinstance(buf, BufferType)
        s = buf.elem.nbytes()
        return out.peak(s + buf.card() * s * 2)


@dataclass(frozen=True, slots=True)
class Streamify(Op):
    """Read each buffer once per element of the inner ``c`` dims of ``ref`` (Table 3).

    ``input: Strm<Buffer<S,a>,b> [D_b..D_0]``, ``ref: Strm<R,b+c> [D_b..D_0, D'_{c-1}..D'_0]``
    -> ``Strm<S,|out_shape|+b+c> [D_b..D_0, D'.., D''..]`` where ``D''`` is ``out_shape`` of an
    affine read (static buffers) or the buffer shape (linear read; dynamic buffers always).
    """

    name: str
    input: Value
    ref: Value
    stride: tuple[sp.Expr, ...] | None = None
    out_shape: tuple[sp.Expr, ...] | None = None

    def inputs(self) -> tuple[Value, ...]:
        return (self.input, self.ref)

    def params(self) -> tuple[tuple[str, Any], ...]:
        return (("stride", self.stride), ("out_shape", self.out_shape))

    def out_types(self) -> tuple[StreamType, ...]:
        t, r = self.input.type, self.ref.type
        buf = t.dtype
        if not isinstance(buf, BufferType):
            raise rule_error(self, "input carries buffer references (Buffer<S,a>)", dtype=buf)
        b = t.rank
        require(r.rank >= b, self, "ref rank >= buffer stream rank b", ref=r, input=t)
        require(
            prefix_equal(t, r, b + 1),
            self,
            "the outer b+1 dims of ref equal the buffer stream's dims",
            input=t,
            ref=r,
        )
        if self.stride is not None or self.out_shape is not None:
            require(
                buf.is_static,
                self,
                "a dynamically sized buffer is read linearly: pass stride=None, out_shape=None",
                buffer=buf,
            )
            stride = tuple(as_dim(s) for s in (self.stride or ()))
            out_shape = tuple(as_dim(s) for s in (self.out_shape or ()))
            _check_affine(self, stride, out_shape, 0, buf.card())
            index = (*r.index, *([None] * len(out_shape)))
            return (StreamType(buf.elem, (*r.shape, *out_shape), index),)
        index = list(r.index)
        mapping = adopt_indices(index, t.index, b + 1, self.name)
        dims = tuple(d.xreplace(mapping) for d in buf.shape)
        return (StreamType(buf.elem, (*r.shape, *dims), (*index, *([None] * len(dims)))),)
