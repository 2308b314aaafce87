"""Where every layer value lives in HBM, and the row streams the lowering builds from it.

Every layer value ``v`` of shape ``[d_0, .., d_{n-1}]`` is viewed as a row-major matrix of
``rows = d_0 * .. * d_{n-2}`` rows of ``cols = d_{n-1}`` elements (a 0-D or static-length 1-D value is one row, a dynamic-length vector one column).
A value is stored in an off-chip tensor (:class:`Placed`): its own ``[rows, cols]`` tensor,
or the tensor of the value it is a view of (``Reshape``, a permutation of unit dimensions):
views move no data, as in PyTorch.  A consumer reads a value as a *row stream*
``Strm<Tile[1, cols], 1>[1, rows]`` (:meth:`LowerCtx.load_rows`); a producer writes a row
stream with :meth:`LowerCtx.store_rows`.  Layer operators between two values thus
communicate through HBM (STeP §3.2.1 off-chip operators at the boundaries of each
layer operator's STeP subgraph).

Indices a host computes at launch from the dynamic sizes — decode positions (``Arange``),
the rows a permutation or concatenation writes (vLLM's ``slot_mapping`` plays this role for a
KV-cache append), uniform KV lengths — are :class:`HostIndex` tensors: ``Program.run`` fills
them from the run's sizes before the STeP program starts; the program reads them from HBM
like any other tensor, so their bytes are counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np
import sympy as sp

from torch2step.errors import LoweringError
from torch2step.layers.graph import LayerGraph, Node
from torch2step.layers.ops import TensorType
from torch2step.step import Graph, OffChipTensor, Value, dyn, fn, zeros
from torch2step.step.types import DTYPE_BYTES, TileType

__all__ = [
    "ATTN_LANES",
    "DEFAULT_MOE_LANES",
    "HostIndex",
    "LowerCtx",
    "LowerOptions",
    "Placed",
    "default_moe_lanes",
    "rows_cols",
]

ATTN_LANES = 16

"""Default decode-attention pipelines.  A lane's K and V tiles (and its expanded query tiles)
all enter its one online-softmax unit over one NoC link (the placement lays a lane's K and V
loaders side by side), so a lane draws at most one link's bandwidth (64 B/cycle on the STeP
chips; that link is busy 97% of a Qwen3 decode step) and 16 lanes just match a 1 KB/cycle HBM
(STeP (arXiv 2511.07776) §5.1).  32 lanes would leave headroom for uneven KV lengths, but
the full-size Llama GQA decode at batch 64 then needs more cores than ``step-sda`` has and runs
as two sequential configurations (2.6% fewer cycles, 2.7 GB instead of 0.5 GB to simulate), so
``attn_lanes=32`` is an option, not the default."""

#: Expert lanes of a MoE layer of more experts than this when ``moe_lanes`` is not given.
DEFAULT_MOE_LANES = 16


def default_moe_lanes(num_experts: int) -> int:
    """The expert lanes (STeP §5.3) of ``num_experts`` experts when ``moe_lanes`` is not given:
    :data:`DEFAULT_MOE_LANES` for a larger layer, so that large MoEs fit a chip's units, and
    ``0`` (a region per expert) otherwise."""
    return DEFAULT_MOE_LANES if num_experts > DEFAULT_MOE_LANES else 0


@dataclass(frozen=True, slots=True)
class LowerOptions:
    """Tiling options: ``tile_rows`` rows per block of a Linear's input (static tiling of the
    token dimension, padded at the end); ``tile_cols`` output features per weight tile (``None``:
    the largest power of two dividing the output size whose ``[tile_cols, in]`` weight tile
    fits ``weight_tile_bytes``); ``tile_kv`` KV rows per attention tile; ``moe_tile_h`` /
    ``moe_tile_i``: the MoE weight tiles (``None``: the example builder's defaults);
    ``moe_lanes``: expert lanes that time-multiplex the experts (STeP §5.3; ``None``: one
    branch per expert up to ``16`` experts, else ``16`` lanes so large MoEs fit a chip's
    units; ``0``: always one branch per expert); ``moe_lane_assign``: which experts a lane
    serves, ``"dispatch"`` (every expert with tokens to the next lane round-robin in arrival
    order: lanes balanced whatever the routing) or ``"consecutive"`` (``E/R`` consecutive
    experts per lane, the regions of STeP §5.3); ``moe_static_tile``: static tiling of each
    expert's tokens in tiles of that many rows (STeP (arXiv 2511.07776) §5.2; ``None``: dynamic
    tiling, one tile of exactly the expert's tokens); ``attn_regions``: decode attention's
    requests spread over that many parallel regions (STeP §5.4; ``None``: one pipeline) by
    ``attn_assign``: ``"coarse"`` (``attn_coarse_chunk`` consecutive requests per region,
    default ``ceil(B / R)``), ``"interleave"`` (round-robin) or ``"dynamic"`` (each request
    to the first free region, decided in simulated time by
    :func:`torch2step.spatial.dispatch.simulate_dispatched`; a functional run uses
    round-robin, which computes the same values); ``attn_lanes``: without regions, decode
    attention's (request, KV head) items spread over that many pipelines, balanced by their KV
    rows (``None``: :data:`ATTN_LANES`, at most one per item; ``1``: one pipeline);
    ``linear_lanes``: a Linear's weight tiles split over that many parallel load + matmul
    lanes (STeP (arXiv 2511.07776) §5; at most one per weight tile; ``None``: one lane, which
    ``torch2step.compile`` raises to ``LINEAR_LANES`` of :mod:`torch2step.lower.linear` on
    chips of at least 256 cores, setting ``linear_lanes_auto``: lanes only where each gets at
    least ``LANE_MIN_TILES`` weight tiles); ``linear_k_lanes``: a Linear's input features split
    over that many parallel lanes whose partial products are summed (split-K, see
    :mod:`torch2step.lower.linear`; ``None``: none, which ``torch2step.compile`` raises to
    ``LINEAR_K_LANES`` on chips of at least 256 cores, with ``linear_lanes_auto``: at least
    ``K_LANE_MIN_BYTES`` of weights per lane; a Linear with split-K lanes has no
    ``linear_lanes``); ``stream_rows``: an operator reading a value another operator stored
    as rows reads that row stream directly instead of loading it back from HBM (``False``:
    every operator round-trips through HBM); ``store_tile_bytes``: a row stream narrower than
    this is stored in tiles of whole consecutive rows of at most that many bytes (see
    :meth:`LowerCtx.store_pack`; ``1``: row by row)."""

    tile_rows: int = 64
    tile_cols: int | None = None
    weight_tile_bytes: int = 128 * 1024
    tile_kv: int = 64
    moe_tile_h: int | None = None
    moe_tile_i: int | None = None
    moe_lanes: int | None = None
    moe_static_tile: int | None = None
    moe_lane_assign: str = "dispatch"
    attn_regions: int | None = None
    attn_assign: str = "interleave"
    attn_coarse_chunk: int | None = None
    attn_lanes: int | None = None
    linear_lanes: int | None = None
    linear_lanes_auto: bool = False
    linear_k_lanes: int | None = None
    stream_rows: bool = True
    store_tile_bytes: int = 4096

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # each option's kind first, named in the message
            v = getattr(self, f.name)
            kind = str(f.type)
            if v is None and kind.endswith("| None"):
                continue
            if kind.startswith("int") and (not isinstance(v, Integral) or isinstance(v, bool)):
                what = "an integer" + (" or None" if kind.endswith("| None") else "")
                raise LoweringError(f"option {f.name}={v!r}: must be {what}")
            if kind == "bool" and not isinstance(v, bool):
                raise LoweringError(f"option {f.name}={v!r}: must be True or False")
            if kind == "str" and not isinstance(v, str):
                raise LoweringError(f"option {f.name}={v!r}: must be a string")
        if self.attn_lanes is not None and int(self.attn_lanes) < 1:
            raise LoweringError("option attn_lanes must be a positive integer or None")
        if self.linear_lanes is not None and int(self.linear_lanes) < 1:
            raise LoweringError("option linear_lanes must be a positive integer or None")
        if self.linear_k_lanes is not None and int(self.linear_k_lanes) < 1:
            raise LoweringError("option linear_k_lanes must be a positive integer or None")
        if self.attn_regions is not None and int(self.attn_regions) < 1:
            raise LoweringError("option attn_regions must be a positive integer or None")
        if self.attn_assign not in ("coarse", "interleave", "dynamic"):
            raise LoweringError(
                f"option attn_assign={self.attn_assign!r}: use 'coarse', 'interleave' or 'dynamic'"
            )
        if self.attn_coarse_chunk is not None and int(self.attn_coarse_chunk) < 1:
            raise LoweringError("option attn_coarse_chunk must be a positive integer or None")
        for name in ("tile_rows", "tile_kv", "weight_tile_bytes", "store_tile_bytes"):
            if int(getattr(self, name)) < 1:
                raise LoweringError(f"option {name} must be a positive integer")
        if self.moe_lane_assign not in ("dispatch", "consecutive"):
            raise LoweringError(
                f"option moe_lane_assign={self.moe_lane_assign!r}: use 'dispatch' or 'consecutive'"
            )
        if self.moe_static_tile is not None and int(self.moe_static_tile) < 1:
            raise LoweringError(
                "option moe_static_tile must be a positive integer (rows per tile) or None "
                "for dynamic tiling"
            )


@dataclass(frozen=True, slots=True)
class Placed:
    """A value's storage: ``tensor`` (2-D, or the 3-D expert weights) viewed as ``rows`` rows
    of ``cols`` elements."""

    tensor: OffChipTensor
    rows: sp.Expr
    cols: sp.Expr


@dataclass(frozen=True, slots=True)
class HostIndex:
    """An integer tensor the host computes at launch: ``compute(bindings) -> int64 array``
    of the tensor's shape."""

    tensor: OffChipTensor
    compute: Callable[[dict[str, int]], np.ndarray]


def rows_cols(shape: tuple[Any, ...]) -> tuple[sp.Expr, sp.Expr]:
    """``(rows, cols)`` of a value of ``shape`` (see the module docstring)."""
    if not shape:
        return sp.Integer(1), sp.Integer(1)
    if len(shape) == 1 and not sp.sympify(shape[0]).is_Integer:
        return sp.sympify(shape[0]), sp.Integer(1)  # a dynamic-length vector: a column
    rows = sp.Integer(1)
    for d in shape[:-1]:
        rows = rows * sp.sympify(d)
    return sp.sympify(rows), sp.sympify(shape[-1])


def _step_dtype(name: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


@dataclass
class LowerCtx:
    """State of one lowering: the STeP graph under construction, each layer value's storage,
    the host-computed index tensors, and the symbol renaming layer dims -> STeP sizes."""

    layer: LayerGraph
    graph: Graph
    options: LowerOptions
    placed: dict[str, Placed] = field(default_factory=dict)
    host: list[HostIndex] = field(default_factory=list)
    prefill: dict[str, tuple[str, Callable[[dict[str, int]], np.ndarray]]] = field(
        default_factory=dict
    )
    syms: dict[sp.Symbol, sp.Symbol] = field(default_factory=dict)
    streamed: dict[str, Value] = field(default_factory=dict)
    node: Node | None = None
    _names: set[str] = field(default_factory=set)

    # -- sizes --------------------------------------------------------------------------------
    def sym(self, expr: Any) -> sp.Expr:
        """A layer-graph size as a STeP size (layer symbols renamed to STeP ``dyn`` sizes)."""
        e = sp.sympify(expr)
        subs = {}
        for s in e.free_symbols:
            if s not in self.syms:
                self.syms[s] = dyn(str(s))
            subs[s] = self.syms[s]
        return e.xreplace(subs) if subs else e

    def type(self, value: str) -> TensorType:
        return self.layer.types[value]

    def shape(self, value: str) -> tuple[sp.Expr, ...]:
        return tuple(self.sym(d) for d in self.type(value).shape)

    def dtype(self, value: str) -> str:
        return _step_dtype(self.type(value).dtype)

    def rc(self, value: str) -> tuple[sp.Expr, sp.Expr]:
        return rows_cols(self.shape(value))

    # -- names --------------------------------------------------------------------------------
    def tensor_name(self, base: str) -> str:
        """A fresh off-chip tensor name derived from a layer value name."""
        clean = "".join(c if c.isalnum() or c == "_" else "_" for c in base) or "t"
        if not clean[0].isalpha():
            clean = "t_" + clean
        name, i = clean, 0
        while name in self._names:
            i += 1
            name = f"{clean}_{i}"
        self._names.add(name)
        return name

    def prefix(self) -> str:
        assert self.node is not None
        return self.tensor_name(self.node.name)

    # -- storage ------------------------------------------------------------------------------
    def declare(self, value: str, shape: tuple[Any, ...] | None = None) -> OffChipTensor:
        """A fresh tensor holding ``value`` (``[rows, cols]`` unless ``shape`` is given)."""
        rows, cols = self.rc(value)
        shp = shape if shape is not None else (rows, cols)
        t = self.graph.tensor(self.tensor_name(value), shp, self.dtype(value))
        self.placed[value] = Placed(t, rows, cols)
        return t

    def alias(self, value: str, of: str) -> None:
        """``value`` is a view of ``of``'s storage (same elements in the same order)."""
        src = self.placed[of]
        rows, cols = self.rc(value)
        self.placed[value] = Placed(src.tensor, rows, cols)

    def host_index(self, base: str, shape: tuple[Any, ...], compute: Callable) -> OffChipTensor:
        """Declare a host-computed int64 tensor."""
        t = self.graph.tensor(self.tensor_name(base), shape, "int64")
        self.host.append(HostIndex(t, compute))
        return t

    def fail(self, why: str) -> LoweringError:
        n = self.node
        where = f"{n.name} ({type(n.op).__name__})" if n else "graph"
        src = f"\n    at {n.source}" if n and n.source else ""
        return LoweringError(f"{where}: {why}{src}")

    # -- row streams --------------------------------------------------------------------------
    def load_rows(self, value: str, ref: Value | None = None) -> Value:
        """``value`` as a row stream ``[1, rows]`` of ``[1, cols]`` tiles (one HBM read)."""
        p = self.placed[value]
        t = p.tensor
        scols = t.shape[-1]
        cols = p.cols
        if ref is None:
            fwd = self._forwarded(t, p.rows, cols)
            if fwd is not None:
                return fwd
        if not sp.sympify(cols).is_Integer:
            raise self.fail(
                f"{value}'s last dim {cols} is dynamic, but this operator reads whole rows as "
                f"tiles of a static width; compile with a static last dim (a fixed size there, "
                f"or dynamic_shapes marking only the leading dims dynamic)"
            )
        if sp.simplify(sp.Mod(scols, cols)) == 0:
            v = self.graph.linear_load(t, (1, int(cols)), ref)
        elif sp.simplify(sp.Mod(cols, scols)) == 0:
            k = int(cols / scols)
            v = self.graph.linear_load(t, (k, int(scols)), ref)
            v = self.graph.map(fn("tile_reshape", rows=1, cols=int(cols)), v)
        else:
            raise self.fail(
                f"cannot read {value} [{p.rows} x {cols}] from {t.name} {list(t.shape)}: "
                "the row widths neither divide nor are multiples of each other"
            )
        return self.flat(v)

    def load_row_tiles(self, value: str) -> Value:
        """``value`` as a stream of ``[k, cols]`` tiles of ``k`` consecutive rows
        (``[1, rows/k]``): the stream an earlier operator stored, whose rows are ``k`` times
        wider (a projection's ``[1, heads*head_dim]`` rows seen as ``[heads, head_dim]``
        tiles) or that already carries such tiles; else its rows (``k = 1``).  A row-wise
        operator then handles one message per ``k`` rows: a chain of such operators over a
        decode step's per-head rows is not bound by one small message per row."""
        p = self.placed[value]
        fwd = self._forwarded(p.tensor, p.rows, p.cols, tiles=True)
        return fwd if fwd is not None else self.load_rows(value)

    def _forwarded(
        self, t: OffChipTensor, rows: sp.Expr, cols: sp.Expr, *, tiles: bool = False
    ) -> Value | None:
        """The stream an earlier operator stored into ``t``, as ``[1, rows]`` of ``[1, cols]``
        (its rows split on chip when they are wider; its ``[k, cols]`` tiles cut into rows),
        or with ``tiles`` as ``[1, rows/k]`` of ``[k, cols]`` (wider rows viewed as tiles),
        or ``None``: consecutive row-wise operators stream into each other instead of
        round-tripping through HBM (STeP §3: a stream may feed several consumers; the store
        stays for any reader of the tensor)."""
        if not self.options.stream_rows or t.name not in self.streamed:
            return None
        v = self.streamed[t.name]
        tile = v.type.dtype
        if not isinstance(tile, TileType) or tile.dtype != t.dtype or v.type.rank != 1:
            return None
        width, c = sp.sympify(tile.shape[1]), sp.sympify(cols)
        k = sp.sympify(tile.shape[0])
        if not (width.is_Integer and c.is_Integer and k.is_Integer):
            return None
        if int(k) > 1:  # a tile stream: [k, cols] tiles of consecutive rows
            if int(width) != int(c) or sp.simplify(v.type.shape[1] * k - sp.sympify(rows)):
                return None
            return v if tiles else self.flat(self.graph.flat_map(v, fn("retile_streamify", rows=1)))
        if int(width) % int(c):
            return None
        per = int(width) // int(c)
        if sp.simplify(v.type.shape[1] * per - sp.sympify(rows)) != 0:
            return None
        if per > 1 and tiles:
            return self.graph.map(fn("tile_reshape", rows=per, cols=int(c)), v)
        if per > 1:
            v = self.flat(self.graph.flat_map(v, fn("split_cols", cols=int(c))))
        return v

    def flat(self, v: Value) -> Value:
        """Flatten all dims below the outermost one: ``[1, a, b, ..] -> [1, a*b*..]``."""
        r = v.type.rank
        return self.graph.flatten(v, 0, r - 1) if r > 1 else v

    def store_rows(self, rows: Value, value: str) -> OffChipTensor:
        """Write the row stream ``rows`` (or a stream of ``[k, cols]`` tiles of consecutive
        rows, :meth:`load_row_tiles`) as ``value``'s fresh ``[rows, cols]`` tensor: narrow
        rows are first packed into ``[k, cols]`` tiles of ``k`` consecutive rows
        (:meth:`store_pack`; ``Accum(retile_row)``), one contiguous HBM write each."""
        t = self.declare(value)
        tile = rows.type.dtype
        k = 1 if isinstance(tile, TileType) and tile.shape[0] != 1 else self.store_pack(value)
        stored = rows  # row tiles (load_row_tiles) are stored as they are: consecutive rows
        if k > 1:
            data, _ = self.graph.reshape(rows, 0, k, 0.0)  # [1, R/k, k]: k divides R, no pad
            zero = zeros(0, int(self.placed[value].cols), self.dtype(value))
            stored = self.graph.accum(data, "retile_row", zero, 1)  # [1, R/k] of [k, cols]
        self.graph.linear_store(stored, t)
        self.streamed[t.name] = rows
        return t

    def store_pack(self, value: str) -> int:
        """Rows of ``value`` per HBM write: the largest power of two ``k`` dividing its row
        count whose ``k`` rows fit ``store_tile_bytes`` (1: rows are stored one by one).

        A store unit keeps a bounded number of writes in flight over the HBM latency (Little's
        law, STeP §4.2 off-chip operators), so a stream of small rows — a decode step's
        ``[1, head_dim]`` per-head rows — is limited by write latency, not bandwidth; tiles of
        whole consecutive rows are one contiguous write each and keep the link busy."""
        p = self.placed[value]
        cols = sp.sympify(p.cols)
        if not cols.is_Integer:
            return 1
        row_bytes = int(cols) * DTYPE_BYTES[self.dtype(value)]
        k = 1
        while (2 * k) * row_bytes <= self.options.store_tile_bytes and sp.simplify(
            sp.Mod(sp.sympify(p.rows), 2 * k)
        ) == 0:
            k *= 2
        return k

    def tensor_as(self, value: str, shape: tuple[Any, ...]) -> OffChipTensor:
        """An off-chip tensor of exactly ``shape`` holding ``value`` (its storage when it has
        that shape, else a copy through a row stream)."""
        p = self.placed[value]
        shp = tuple(sp.sympify(d) for d in shape)
        if len(p.tensor.shape) == len(shp) and all(
            sp.simplify(a - b) == 0 for a, b in zip(p.tensor.shape, shp)
        ):
            return p.tensor
        rows = self.load_rows(value)
        width = int(shp[-1])
        if width != int(p.cols):
            if int(p.cols) % width:
                raise self.fail(f"cannot copy {value} into a {list(shp)} tensor")
            rows = self.graph.flat_map(rows, fn("split_cols", cols=width))
        t = self.graph.tensor(self.tensor_name(value + "_as"), shp, self.dtype(value))
        self.graph.linear_store(rows, t)
        return t

    def broadcast_row(self, value: str, ref: Value) -> Value:
        """A one-row value loaded once and repeated on chip along ``ref`` (Expand)."""
        one = self.load_rows(value)
        return self.graph.expand(one, ref, 0)
