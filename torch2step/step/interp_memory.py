"""Meaning of the memory operators on data (STeP §3.2.1–3.2.2; STeP (revised) §3.2.2).

Every tile moved to or from ``ctx.memory`` is counted in ``ctx.read``/``ctx.write``; staged
tiles (double-buffered) and buffers are recorded as on-chip allocations.  Loaded tiles are
read-only views of the memory array and stores write into a private copy of a shared array
(copy-on-write, :class:`~torch2step.step.interp_context.Ctx`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .interp_context import Ctx, tile_slice, value_nbytes
from .op_base import OffChipTensor
from .ops_memory import (
    Bufferize,
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipLoadRows,
    RandomOffChipStore,
    Streamify,
)
from .types import BufferType, TileType
from .values import BufferValue, StepRuntimeError, StreamValue, iter_leaves, map_at, zip_at

__all__ = ["IMPLS"]


def _grid(ctx: Ctx, tensor: OffChipTensor, tile: TileType) -> tuple[np.ndarray, list[int]]:
    arr = ctx.memory[tensor.name]
    r, c = (int(d) for d in tile.shape)
    tiled = [*arr.shape[:-2], arr.shape[-2] // r, arr.shape[-1] // c]
    return arr, tiled


def _affine(dims: list[int], stride: list[int], base: int, read: Callable[[int], Any]) -> list:
    """Nested list of ``read(base + sum(j_k * stride_k))`` over ``dims``."""

    def build(k: int, offset: int) -> Any:
        if k == len(dims):
            return read(offset)
        return [build(k + 1, offset + j * stride[k]) for j in range(dims[k])]

    return build(0, base)


def _linear_load(op: LinearOffChipLoad, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    arr, tiled = _grid(ctx, op.tensor, op.tile)
    shape = (int(op.tile.shape[0]), int(op.tile.shape[1]))
    dims = [ctx.ev(d, f"%{op.name} out_shape") for d in op.out_shape]
    stride = [ctx.ev(s, f"%{op.name} stride") for s in op.stride]
    nbytes = shape[0] * shape[1] * op.tile.itemsize

    def read(lin: int) -> np.ndarray:
        tile = ctx.tile(
            op.tensor.name, tile_slice(arr, tiled, lin, shape, f"LinearOffChipLoad %{op.name}")
        )
        ctx.count_read(op.name, tile.size * op.tile.itemsize)
        ctx.alloc(op.name, "staging", 2 * nbytes)
        return tile

    ctx.read.setdefault(op.name, 0)
    if op.ref is None:
        return (StreamValue(len(dims), [_affine(dims, stride, op.base, read)]),)
    ref = ins[0]
    data = map_at(ref.data, ref.rank + 1, lambda _: _affine(dims, stride, op.base, read))
    return (StreamValue(ref.rank + len(dims), data),)


def _linear_store(op: LinearOffChipStore, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    t = op.input.type.dtype
    assert isinstance(t, TileType)
    arr, tiled = _grid(ctx, op.tensor, t)
    shape = (int(t.shape[0]), int(t.shape[1]))
    ctx.write.setdefault(op.name, 0)
    given = ctx.store_overrides.get(op.tensor.name)
    if given is not None:
        if given.size != arr.size:
            raise StepRuntimeError(
                f"LinearOffChipStore %{op.name}: the value stored to {op.tensor.name} is replaced "
                f"by an array of shape {list(given.shape)}, but this run stores shape "
                f"{list(arr.shape)} (a routing trace needs one row of expert ids per input token)"
            )
        given = given.reshape(arr.shape).astype(arr.dtype, copy=False)
    for k, tile in enumerate(ins[0].elements()):
        where = tile_slice(arr, tiled, op.base + k, shape, f"LinearOffChipStore %{op.name}")
        if given is not None:  # the value written is replaced, the write itself is not
            tile = given[where]
        if op.tensor.name not in ctx.inert:  # timing-only: values nobody reads are dropped
            ctx.writable(op.tensor.name)[where] = tile  # copy-on-write: never the caller's
        ctx.count_write(op.name, tile.size * t.itemsize)
        ctx.alloc(op.name, "staging", 2 * tile.size * t.itemsize)
    return ()


def _random_load(op: RandomOffChipLoad, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    arr, tiled = _grid(ctx, op.tensor, op.tile)
    shape = (int(op.tile.shape[0]), int(op.tile.shape[1]))
    ctx.read.setdefault(op.name, 0)

    def read(addr: np.ndarray) -> np.ndarray:
        lin = op.base + int(addr[0, 0])
        tile = ctx.tile(
            op.tensor.name, tile_slice(arr, tiled, lin, shape, f"RandomOffChipLoad %{op.name}")
        )
        ctx.count_read(op.name, tile.size * op.tile.itemsize)
        ctx.alloc(op.name, "staging", 2 * tile.size * op.tile.itemsize)
        return tile

    a = ins[0]
    return (StreamValue(a.rank, map_at(a.data, a.rank + 1, read)),)


def _random_load_rows(op: RandomOffChipLoadRows, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    arr = ctx.memory[op.tensor.name]
    n_rows, most = int(arr.shape[0]), int(op.tile.shape[0])
    isz = op.tile.itemsize
    ctx.read.setdefault(op.name, 0)
    what = f"RandomOffChipLoadRows %{op.name}"

    def read(addr: tuple) -> np.ndarray:
        row, r = op.base + int(addr[0][0, 0]), int(addr[1][0, 0])
        if not 1 <= r <= most or not 0 <= row <= n_rows - r:
            raise StepRuntimeError(
                f"{what}: rows {row}..{row + r - 1} of {op.tensor.name} ({n_rows} rows) in a "
                f"tile of at most {most} rows; addresses give 1..{most} rows inside the tensor"
            )
        tile = ctx.tile(op.tensor.name, (slice(row, row + r), slice(None)))
        ctx.count_read(op.name, tile.size * isz)
        ctx.alloc(op.name, "staging", 2 * most * tile.shape[1] * isz)
        return tile

    a = ins[0]
    return (StreamValue(a.rank, map_at(a.data, a.rank + 1, read)),)


def _random_store(op: RandomOffChipStore, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    t = op.wdata.type.dtype
    assert isinstance(t, TileType)
    arr, tiled = _grid(ctx, op.tensor, t)
    shape = (int(t.shape[0]), int(t.shape[1]))
    ctx.write.setdefault(op.name, 0)
    a, d = ins

    def write(addr: np.ndarray, tile: np.ndarray) -> np.ndarray:
        lin = op.base + int(addr[0, 0])
        where = tile_slice(arr, tiled, lin, shape, f"RandomOffChipStore %{op.name}")
        if op.tensor.name not in ctx.inert:  # timing-only: values nobody reads are dropped
            ctx.writable(op.tensor.name)[where] = tile  # copy-on-write: never the caller's
        ctx.count_write(op.name, tile.size * t.itemsize)
        ctx.alloc(op.name, "staging", 2 * tile.size * t.itemsize)
        return np.ones((1, 1), dtype=np.bool_)

    data = zip_at(a.data, d.data, a.rank + 1, write, f"RandomOffChipStore %{op.name}")
    return (StreamValue(a.rank, data),)


def _bufferize(op: Bufferize, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x = ins[0]
    t = op.input.type.dtype
    tile_bytes = int(t.nbytes())
    cut = x.rank + 1 - op.rank

    def store(sub: list) -> BufferValue:
        nbytes = sum(value_nbytes(e, t) for e in iter_leaves(sub, op.rank))
        ctx.alloc(op.name, "buffers", tile_bytes + 2 * nbytes)
        return BufferValue(sub, nbytes)

    ctx.onchip.setdefault(op.name, {})
    return (StreamValue(x.rank - op.rank, map_at(x.data, cut, store)),)


def _streamify(op: Streamify, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    bufs, ref = ins
    buf_t = op.input.type.dtype
    assert isinstance(buf_t, BufferType)
    b, c = bufs.rank, ref.rank - bufs.rank
    affine = op.out_shape is not None
    dims = [ctx.ev(d, f"%{op.name}") for d in op.out_shape or ()]
    stride = [ctx.ev(s, f"%{op.name}") for s in op.stride or ()]

    def read(buf: BufferValue) -> Any:
        if not affine:
            return buf.data
        flat = list(iter_leaves(buf.data, buf_t.rank))
        return _affine(dims, stride, 0, lambda k: flat[k])

    def per_buffer(buf: BufferValue, sub: Any) -> Any:
        if not isinstance(buf, BufferValue):
            raise StepRuntimeError(f"Streamify %{op.name}: expected a buffer, got {buf!r}")
        return map_at(sub, c, lambda _: read(buf))

    data = zip_at(bufs.data, ref.data, b + 1, per_buffer, f"Streamify %{op.name}")
    out_rank = ctx.out_types[0].rank
    return (StreamValue(out_rank, data),)


IMPLS: dict[type, Callable[..., tuple]] = {
    LinearOffChipLoad: _linear_load,
    LinearOffChipStore: _linear_store,
    RandomOffChipLoad: _random_load,
    RandomOffChipLoadRows: _random_load_rows,
    RandomOffChipStore: _random_store,
    Bufferize: _bufferize,
    Streamify: _streamify,
}
