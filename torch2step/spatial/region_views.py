"""The views of a run an expert region's looping units are built from (STeP arXiv 2511.07776
§5.3; :mod:`.region_loop`): the region's streams cut to its first chunk (:func:`region_view`),
or made of one chunk of zero tiles of their declared types when the run gives the region no
chunk, and, for a ragged region's bookkeeping, each chunk's (:func:`chunk_views`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import sympy as sp

from torch2step.step.ops_routing import Partition
from torch2step.step.types import BufferType, SelectorType, TileType, TupleType
from torch2step.step.values import BufferValue, SelectorValue, StreamValue

from .streams import WIRE_RULES, StreamInfo, flat_elements, unit_pieces
from .structure import Structure
from .tile_loop import control_stream

if TYPE_CHECKING:
    from .region_loop import RegionGroup

__all__ = ["region_view", "chunk_views"]


def _cut(info: StreamInfo, n: int) -> StreamInfo:
    """Stream ``info`` with its first ``n`` outer elements only."""
    value = StreamValue(info.value.rank, list(info.value.data[:n]))
    flat = flat_elements(value)
    return dataclasses.replace(
        info, value=value, flat=flat, pieces=info.pieces[: len(flat)], _parts=None, _decl=None
    )


def region_view(
    st: Structure, group: RegionGroup, streams: Mapping[str, StreamInfo]
) -> dict[str, StreamInfo] | None:
    """The region's streams as they hold its first chunk only (each Partition output: the
    rows of that chunk it received, its first ones); when the run gives the region no chunk,
    as one chunk of zero tiles of the declared types makes them (:func:`_blank_view`), or
    ``None`` when those do not evaluate."""
    out: dict[str, StreamInfo] = {}
    merged = streams.get(st.producer[group.ref].out_names()[0])
    if merged is None or not merged.value.data:
        return _blank_view(st, group, streams)
    for name in group.streams:
        info = streams.get(name)
        if info is None:
            continue
        if name not in st.producer or st.producer[name].name not in {
            st.units[k][0].name for k in group.partitions
        }:
            out[name] = _cut(info, 1)
    for k in group.partitions:
        op = st.units[k][0]
        assert isinstance(op, Partition)
        sel = out.get(op.sel.name)
        if sel is None:
            return None
        got = [0] * len(op.out_names())
        for s in sel.flat:
            for i in s.indices:
                got[i] += 1
        for n, c in zip(op.out_names(), got):
            out[n] = _cut(streams[n], c)
    return {**streams, **out}


def _renumbered(info: StreamInfo, i: int) -> StreamInfo:
    """Stream ``info`` with its ``i``-th outer element only, each channel's messages numbered
    from 0 (as the first chunk's are in the view a program is built from)."""
    data = info.value.data
    value = StreamValue(info.value.rank, list(data[i : i + 1]))
    flat = flat_elements(value)
    start = len(flat_elements(StreamValue(info.value.rank, list(data[:i]))))
    pieces = info.pieces[start : start + len(flat)]
    first: dict[str, int] = {}
    for pc in pieces:
        for ch, seq, _ in pc:
            if ch is not None:
                first.setdefault(ch, seq)
    pieces = [
        tuple((ch, seq - first[ch] if ch is not None else seq, p) for ch, seq, p in pc)
        for pc in pieces
    ]
    return dataclasses.replace(info, value=value, flat=flat, pieces=pieces, _parts=None, _decl=None)


def chunk_views(
    group: RegionGroup, streams: Mapping[str, StreamInfo]
) -> list[dict[str, StreamInfo]]:
    """Per chunk of the run, the region's streams as they hold that chunk only (its messages
    numbered as the first chunk's): a ragged region's member, built for the first chunk, has
    its bookkeeping in the run summed over these (its steps' cycles follow each chunk's rows,
    :class:`~.sizing.Sizing`)."""
    names = [n for n in group.streams if n in streams]
    return [
        {**streams, **{n: _renumbered(streams[n], i) for n in names}}
        for i in range(group.run_chunks)
    ]


def _blank_view(
    st: Structure, group: RegionGroup, streams: Mapping[str, StreamInfo]
) -> dict[str, StreamInfo] | None:
    """The region's streams as one chunk of zero tiles (selectors naming the first input or
    output; a ragged chunk of one row) of their declared types makes them: the region's units are then built as for a
    run that gives it a chunk, and loop over none (as :func:`~.guard.standin_streams` builds
    an expert without tokens)."""
    graph = st.graph
    types = {v.name: v.type for outs in graph.node_outputs for v in outs}
    parts = {st.units[k][0].name for k in group.partitions}
    names = set(group.streams)
    out: dict[str, StreamInfo] = {}
    routed: dict[str, int] = {}
    for op, outs in zip(graph.nodes, graph.node_outputs):
        if isinstance(op, Partition) and op.name in parts:
            sel = out.get(op.sel.name)
            if sel is None:
                return None
            routed = {op.out_names()[0]: len(sel.flat)}
        for v in outs:
            if v.name not in names:
                continue
            t = types[v.name]
            try:
                if op.name in parts:  # the chunk's rows, all to its first output
                    dims = [routed.get(v.name, 0)]
                else:
                    dims = [1] + [_size(d) for d in t.shape[1:]]
                flat = [_zero(t.dtype)] * math.prod(dims)
            except (TypeError, ValueError):
                return None
            value = StreamValue(t.rank, _nest(dims, flat))
            flat = flat_elements(value)
            if op.name in st.owner:
                pieces = unit_pieces(v.name, t.dtype, flat)
                out[v.name] = StreamInfo(v.name, t.dtype, value, flat, pieces, v.name)
            else:
                rule = WIRE_RULES.get(type(op))
                ins = [out.get(x.name) for x in op.inputs()]
                if rule is None or any(x is None for x in ins):
                    continue  # a wire of streams the view does not make (read by no member)
                try:
                    (pieces,) = rule(op, ins, [value], None)
                except Exception:
                    return None
                out[v.name] = StreamInfo(v.name, t.dtype, value, flat, pieces)
    for name in group.streams:  # a count channel (.region_tail): the blank chunk's one row
        if name not in types and name in streams:
            out[name] = control_stream(name, [1])
    return {**streams, **out}


def _zero(t: Any) -> Any:
    """A zero element of declared type ``t`` (a selector: the first index)."""
    if isinstance(t, SelectorType):
        return SelectorValue((0,))
    if isinstance(t, TileType):
        shape = tuple(_size(d) for d in t.shape)
        return np.zeros(shape, np.int64 if t.dtype.startswith("int") else np.float32)
    if isinstance(t, TupleType):
        return tuple(_zero(e) for e in t.elems)
    if isinstance(t, BufferType):
        rows = [_size(d) for d in t.shape]
        tiles = [_zero(t.elem) for _ in range(math.prod(rows))]
        return BufferValue(_nest(rows, tiles), sum(x.nbytes for x in tiles))
    raise TypeError(f"no stand-in element of type {t}")


def _size(d: Any) -> int:
    """A declared size in the blank chunk: its value, or one row for a chunk's ragged rows (an
    expert's tokens, read at run time)."""
    e = sp.sympify(d)
    if e.is_Integer:
        return int(e)
    if isinstance(e, sp.Indexed):
        return 1
    raise TypeError(f"size {d} of a region's stream does not evaluate")


def _nest(dims: list[int], flat: list[Any]) -> list:
    if len(dims) == 1:
        return list(flat)
    n = math.prod(dims[1:])
    return [_nest(dims[1:], flat[i * n : (i + 1) * n]) for i in range(dims[0])]
