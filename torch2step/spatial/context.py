"""What the emitters of unit programs share: the graph's structure, the run's streams, the timing
model, per-unit configuration and the HBM layout of off-chip tensors.

HBM layout.  A STeP off-chip tensor is addressed in tiles ("a row-major grid of tiles", seed 000
Appendix A table 2).  In HBM each tensor is stored tile by tile — tile ``t`` is the contiguous
elements ``[t * rows * cols, (t + 1) * rows * cols)`` — the pre-tiled layout SDAs keep weights
in, so one tile access is one contiguous burst spread over all HBM channels.  A tensor is
therefore accessed with one tile shape throughout a graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from torch2step.errors import LoweringError
from torch2step.step.evaluate import evaluate
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

__all__ = ["TensorLayout", "EmitCtx", "tensor_layouts"]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """An off-chip tensor stored tile by tile: ``tiles`` tiles of ``tile`` (rows, cols)."""

    name: str
    dtype: str
    tile: tuple[int, int]
    tiles: int

    @property
    def tile_elems(self) -> int:
        return self.tile[0] * self.tile[1]

    @property
    def elems(self) -> int:
        return self.tiles * self.tile_elems


def _tile_of(op: Op) -> TileType | None:
    if isinstance(op, (LinearOffChipLoad, RandomOffChipLoad)):
        return op.tile
    if isinstance(op, LinearOffChipStore):
        t = op.input.type.dtype
    elif isinstance(op, RandomOffChipStore):
        t = op.wdata.type.dtype
    else:
        return None
    return t if isinstance(t, TileType) else None


def tensor_layouts(graph: Program, run: RunResult) -> dict[str, TensorLayout]:
    """The HBM layout of every off-chip tensor a node accesses (see the module docstring)."""
    seen: dict[str, tuple[tuple[int, int], str]] = {}
    out: dict[str, TensorLayout] = {}
    for op in graph.nodes:
        tile = _tile_of(op)
        if tile is None:
            continue
        (tensor,) = op.tensors()
        shape = (int(tile.shape[0]), int(tile.shape[1]))
        if tensor.name in seen and seen[tensor.name][0] != shape:
            first_shape, first_op = seen[tensor.name]
            raise LoweringError(
                f"tensor {tensor.name} is accessed in {list(first_shape)} tiles by %{first_op} "
                f"and in {list(shape)} tiles by %{op.name}; spatial execution stores a tensor "
                "tile by tile in HBM, so access it with one tile shape"
            )
        seen[tensor.name] = (shape, op.name)
        arr = run.tensors[tensor.name]
        elems = math.prod(int(d) for d in arr.shape)
        out[tensor.name] = TensorLayout(
            tensor.name, tensor.dtype, shape, elems // (shape[0] * shape[1])
        )
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

    def stream(self, v: Value | str) -> StreamInfo:
        """The run's contents of a stream."""
        return self.streams[v if isinstance(v, str) else v.name]

    def config(self, op: Op) -> UnitConfig:
        """The unit configuration of node ``op`` (default: :class:`UnitConfig()`)."""
        return self.configs.get(op.name, _DEFAULT)

    def ev(self, expr: sp.Expr | int, what: str) -> int:
        """A size expression's value in this run."""
        try:
            return int(evaluate(expr, self.bindings))
        except Exception as e:
            raise LoweringError(f"{what}: {e}") from None


_DEFAULT = UnitConfig()
