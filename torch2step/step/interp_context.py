"""State shared by the interpreter's per-operator functions: off-chip memory, symbol values,
byte counters and the arrival order used by the merging operators.

Accounting (what the interpreter *measures*, to compare with STeP §4.1 formulas):

* ``read`` / ``write``: bytes actually moved per node (element count x declared element size);
* ``flops``: per node, the tile functions' FLOP counts on the actual tile shapes;
* ``onchip``: per node and per allocation slot, the largest allocation actually made (a
  staged tile, a buffer, an accumulator state, a matmul's scratch); a node's on-chip memory is
  the sum of its slots, times 2 where the §4.1 model double-buffers.

Copy-on-write memory.  ``memory`` holds the caller's arrays themselves (read-only views, no
copy on entry) and loads hand out read-only views of tiles instead of copies; ``shared`` names
the arrays such views may still look at.  A store first asks :meth:`Ctx.writable`, which
replaces a shared array by a private copy, so the caller's arrays are never written and a tile
loaded earlier keeps the value it had when its load ran.  A tile function that tries to write
into an argument fails loudly (numpy raises on a read-only array).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy as sp

from torch2step.errors import StepTypeError

from .evaluate import Bindings, evaluate_bound
from .types import REF_BYTES, BufferType, DataType, SelectorType, StreamType, TileType, TupleType
from .values import StepRuntimeError

__all__ = ["Ctx", "runtime_type", "tile_slice", "value_nbytes"]


def runtime_type(t: DataType, x: Any) -> DataType:
    """The declared type ``t`` with the actual sizes of the element ``x``."""
    if isinstance(t, TileType):
        return TileType((int(x.shape[0]), int(x.shape[1])), t.dtype)
    if isinstance(t, TupleType):
        return TupleType(tuple(runtime_type(s, v) for s, v in zip(t.elems, x)))
    return t


def value_nbytes(x: Any, t: DataType) -> int:
    """Bytes of a run-time element of declared type ``t``."""
    if isinstance(t, TileType):
        return int(x.size) * t.itemsize
    if isinstance(t, SelectorType):
        return (t.n + 7) // 8
    if isinstance(t, BufferType):
        return REF_BYTES
    if isinstance(t, TupleType):
        return sum(value_nbytes(v, s) for v, s in zip(x, t.elems))
    raise StepRuntimeError(f"unknown data type {t}")  # pragma: no cover


def tile_slice(
    arr: np.ndarray, tiled: Sequence[int], lin: int, tile: tuple[int, int], what: str
) -> tuple:
    """The index expression of tile number ``lin`` of ``arr`` viewed as a grid of tiles."""
    total = math.prod(tiled)
    if not 0 <= lin < total:
        raise StepRuntimeError(f"{what}: tile address {lin} is outside the {total} tiles")
    coords = []
    for n in reversed(tiled):  # row-major unravel of lin over the tile grid
        lin, k = divmod(lin, int(n))
        coords.append(k)
    j, i, *lead = coords
    r, c = tile
    return (*reversed(lead), slice(i * r, (i + 1) * r), slice(j * c, (j + 1) * c))


@dataclass
class Ctx:
    """Interpreter state for one run."""

    memory: dict[str, np.ndarray]
    env: Bindings
    arrival: dict[str, list[int]] = field(default_factory=dict)
    read: dict[str, int] = field(default_factory=dict)
    write: dict[str, int] = field(default_factory=dict)
    onchip: dict[str, dict[str, int]] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    out_types: tuple[StreamType, ...] = ()
    shared: set[str] = field(default_factory=set)
    shape_only: frozenset[str] = frozenset()
    store_overrides: dict[str, np.ndarray] = field(default_factory=dict)
    inert: frozenset[str] = frozenset()  # timing-only: tensors whose values are never read

    def impl(self, node: str, spec: Any) -> Any:
        """The implementation of ``spec`` at ``node``: shape-only in a timing-only run when
        the node does not steer control (:mod:`.timing_only`), else the real one."""
        if self.shape_only and node in self.shape_only:
            from .timing_only import shape_only_impl

            return shape_only_impl(spec.name) or spec.impl
        return spec.impl

    def tile(self, name: str, index: tuple) -> np.ndarray:
        """A read-only view of ``memory[name][index]`` (marks the array as shared)."""
        view = self.memory[name][index]
        view.flags.writeable = False
        self.shared.add(name)
        return view

    def writable(self, name: str) -> np.ndarray:
        """``memory[name]`` ready to be written: a private copy first if it is shared."""
        if name in self.shared:
            self.memory[name] = np.array(self.memory[name], copy=True)
            self.shared.discard(name)
        return self.memory[name]

    def ev(self, expr: sp.Expr | int, what: str) -> int:
        """Evaluate a size with the run's symbol values."""
        if isinstance(expr, int):
            return expr
        try:
            return int(evaluate_bound(expr, self.env))
        except StepTypeError as e:
            raise StepRuntimeError(f"{what}: {e}") from None

    def alloc(self, node: str, slot: str, nbytes: int) -> None:
        """Record an on-chip allocation of ``nbytes`` (the node keeps the largest per slot)."""
        slots = self.onchip.get(node)
        if slots is None:
            slots = self.onchip[node] = {}
        n, old = int(nbytes), slots.get(slot, 0)
        slots[slot] = n if n > old else old

    def count_read(self, node: str, nbytes: int) -> None:
        self.read[node] = self.read.get(node, 0) + int(nbytes)

    def count_flops(self, node: str, n: int) -> None:
        self.flops[node] = self.flops.get(node, 0) + int(n)

    def count_write(self, node: str, nbytes: int) -> None:
        self.write[node] = self.write.get(node, 0) + int(nbytes)
