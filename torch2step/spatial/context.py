"""What the emitters of unit programs share: the graph's structure, the run's streams, the timing
model, per-unit configuration and the HBM layout of off-chip tensors.

HBM layout.  A STeP off-chip tensor is addressed in tiles ("a row-major grid of tiles", STeP
Appendix A table 2).  A tensor that every node accesses with one tile shape is stored tile by
tile — tile ``t`` is the contiguous elements ``[t * rows * cols, (t + 1) * rows * cols)`` — the
pre-tiled layout SDAs keep weights in, so one tile access is one contiguous burst spread over
the HBM channels.  A tensor accessed with several tile shapes (a projection stored in
``[1, 128]`` rows and read back per head in ``[1, 16]`` pieces) is stored row-major, and each
access must be one contiguous range: a single-row tile, or whole rows.  A run-time tile address
(RandomOffChipLoad/Store) into a row-major tensor must name whole rows (tiles as wide as the
tensor), so the address stays affine in the received register.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy as sp

from lowering.isa import Affine
from torch2step.errors import LoweringError
from torch2step.step.evaluate import evaluate_bound, normalise_env
from torch2step.step.graph import Program
from torch2step.step.interpreter import RunResult
from torch2step.step.op_base import Op, Value
from torch2step.step.ops_memory import (
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipStore,
)
from torch2step.step.types import TileType

from .streams import StreamInfo
from .structure import Structure
from .timing import TimingModel, UnitConfig
from .unit_reuse import ALL, Deps, Tally, looser

__all__ = ["TensorLayout", "EmitCtx", "int_contents", "tensor_layouts", "tile_of"]

#: Starts and extents of an HBM region (per dimension of the declared tensor).
Region2 = tuple[tuple[Any, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """An off-chip tensor of ``shape`` in HBM, flat: tile by tile in ``tile`` tiles, or
    row-major (``tile is None``); see the module docstring."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tile: tuple[int, int] | None

    @property
    def elems(self) -> int:
        return math.prod(self.shape)

    @property
    def decl_shape(self) -> tuple[int, ...]:
        """Shape of the simulator's tensor (flat: regions are element ranges)."""
        return (self.elems,)

    def region(self, lin: int, tile: tuple[int, int]) -> Region2:
        """The element range of tile number ``lin`` (of the grid of ``tile`` tiles)."""
        r, c = tile
        if self.tile is not None:
            return (lin * r * c,), (r * c,)
        grid = (*self.shape[:-2], self.shape[-2] // r, self.shape[-1] // c)
        coords = np.unravel_index(lin, grid)
        lead = int(np.ravel_multi_index(coords[:-2], self.shape[:-2])) if len(coords) > 2 else 0
        row = lead * self.shape[-2] + int(coords[-2]) * r
        return (row * self.shape[-1] + int(coords[-1]) * c,), (r * c,)

    def region_at(self, base: int, reg: str, tile: tuple[int, int], what: str) -> Region2:
        """The element range of tile ``base + reg`` (a run-time tile address in ``reg``)."""
        r, c = tile
        n = r * c
        if self.tile is None and (c != self.shape[-1] or self.shape[-2] % r):
            raise LoweringError(
                f"{what} accesses tensor {self.name} in [{r}, {c}] tiles at run-time "
                f"addresses, but {self.name} is also accessed in other tile shapes, so it is "
                "stored row-major; a run-time address must then name whole rows: use tiles as "
                "wide as the tensor, or one tile shape for every access"
            )
        return (Affine(base * n, ((reg, n),)),), (n,)


def tile_of(op: Op) -> TileType | None:
    """The tile type an off-chip node accesses its tensor in (``None``: not an off-chip node)."""
    if isinstance(op, (LinearOffChipLoad, RandomOffChipLoad)):
        return op.tile
    if isinstance(op, LinearOffChipStore):
        t = op.input.type.dtype
    elif isinstance(op, RandomOffChipStore):
        t = op.wdata.type.dtype
    else:
        return None
    return t if isinstance(t, TileType) else None


def tile_shape(op: Op) -> tuple[int, int]:
    """``(rows, cols)`` of the tiles off-chip node ``op`` accesses."""
    t = tile_of(op)
    assert t is not None
    return (int(t.shape[0]), int(t.shape[1]))


def tensor_layouts(graph: Program, run: RunResult) -> dict[str, TensorLayout]:
    """The HBM layout of every off-chip tensor a node accesses (see the module docstring)."""
    shapes: dict[str, set[tuple[int, int]]] = {}
    dtypes: dict[str, str] = {}
    for op in graph.nodes:
        if tile_of(op) is None:
            continue
        (tensor,) = op.tensors()
        shapes.setdefault(tensor.name, set()).add(tile_shape(op))
        dtypes[tensor.name] = tensor.dtype
    out: dict[str, TensorLayout] = {}
    for name, tiles in shapes.items():
        shape = tuple(int(d) for d in run.tensors[name].shape)
        tile = next(iter(tiles)) if len(tiles) == 1 else None
        if len(shape) < 2:  # pragma: no cover - tiles are 2-D, so tensors are too
            raise LoweringError(f"tensor {name} of shape {list(shape)} cannot hold 2-D tiles")
        if tile is None:
            bad = sorted((r, c) for r, c in tiles if r > 1 and c != shape[-1])
            if bad:
                raise LoweringError(
                    f"tensor {name} {list(shape)} is accessed in tiles {sorted(tiles)}; with "
                    "several tile shapes it is stored row-major, where a tile must be one "
                    f"contiguous range (one row, or whole rows), which {bad} are not: access "
                    f"{name} with one tile shape, or with single-row or full-width tiles"
                )
        out[name] = TensorLayout(name, dtypes[name], shape, tile)
    return out


@dataclass
class EmitCtx:
    """Shared state of one program generation (see the module docstring)."""

    structure: Structure
    streams: dict[str, StreamInfo]
    timing: TimingModel
    bindings: Mapping[str, Any]
    layouts: dict[str, TensorLayout]
    configs: Mapping[str, UnitConfig] = field(default_factory=dict)
    #: channels whose every request's elements follow a count message (:mod:`.kv_loop`)
    headed: frozenset[str] = frozenset()
    #: streams of a decode-attention lane or region ending with a stop token (:mod:`.item_loop`)
    looped: frozenset[str] = frozenset()
    #: node -> its statically tiled expert's reference channel, for the units that loop over
    #: the expert's tiles (:mod:`.tile_loop`)
    tiled: Mapping[str, str] = field(default_factory=dict)
    #: the unit is a member of an expert region (:mod:`.region_loop`): one program, built from
    #: the region's first chunk, serves every chunk, so the control values it sends are
    #: computed from the ones it receives (:func:`~.control.lower_value`), never the run's
    region: bool = False
    #: while a unit is emitted, what its emitter asks of the run (:mod:`.unit_reuse`)
    deps: Deps | None = field(default=None, init=False, repr=False, compare=False)
    _env: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def stream(self, v: Value | str) -> StreamInfo:
        """The run's contents of a stream."""
        name = v if isinstance(v, str) else v.name
        if self.deps is not None:
            self.deps.streams[name] = ALL
        return self.streams[name]

    def relax(self, v: Value | str, level: str | None) -> None:
        """The unit being emitted read stream ``v`` only at ``level`` (:data:`FORM`: not its
        control values; ``None``: not at all beyond its channel) — its program decides from
        the values at run time (:mod:`.unit_reuse`)."""
        name = v if isinstance(v, str) else v.name
        if self.deps is not None:
            if level is None:
                self.deps.streams.pop(name, None)
            elif name in self.deps.streams:
                self.deps.streams[name] = looser(self.deps.streams[name], level)
            else:
                self.deps.streams[name] = level

    def tally(self, fn: Tally) -> tuple[int, int, int, int]:
        """``(received, sent, busy cycles, FLOPs)`` of the run-time decisions of the unit being
        emitted, counted by ``fn`` from this run's streams (and again for every later run that
        reuses its program, :mod:`.unit_reuse`)."""
        if self.deps is not None:
            return self.deps.count(fn, self)
        return fn(self)

    def config(self, op: Op) -> UnitConfig:
        """The unit configuration of node ``op`` (default: :class:`UnitConfig()`)."""
        return self.configs.get(op.name, _DEFAULT)

    def ev(self, expr: sp.Expr | int, what: str) -> int:
        """A size expression's value in this run (the bindings are brought into
        :func:`normalise_env` form once, not on every call: the ragged tables are large)."""
        env = self._env
        if env is None:
            env = self._env = normalise_env(self.bindings)
        try:
            value = int(evaluate_bound(sp.sympify(expr), env))
        except Exception as e:
            raise LoweringError(f"{what}: {e}") from None
        if self.deps is not None:
            self.deps.evals.append((expr, value))
        return value


_DEFAULT = UnitConfig()


_INT = frozenset({"int32", "int64", "int8", "bool"})


def flat_contents(lay: TensorLayout, value: Any) -> np.ndarray:
    """``value`` (the tensor in its graph shape) flattened in ``lay``'s HBM order."""
    a = np.asarray(value).reshape(lay.shape)
    if lay.tile is None or len(lay.shape) < 2:
        return a.reshape(-1)
    r, c = lay.tile
    *lead, rows, cols = lay.shape
    a = a.reshape(*lead, rows // r, r, cols // c, c)
    return np.moveaxis(a, -3, -2).reshape(-1)


def int_contents(
    layouts: dict[str, TensorLayout], tensors: dict[str, Any]
) -> dict[str, np.ndarray]:
    """The integer tensors' contents as the simulator holds them (flat, in layout order):
    control data (expert ids, KV lengths) is real in timing mode too.  ``tensors``: the
    reference run's final off-chip memory, so a tensor the programs store holds what they
    store (the run computed the control values anyway)."""
    return {
        lay.name: flat_contents(lay, tensors[lay.name])
        for lay in layouts.values()
        if lay.dtype in _INT and lay.name in tensors
    }
