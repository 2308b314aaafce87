"""The core grid of a partition plan and the cores it occupies on a mesh (ELK §5: each
partitioned dimension maps to a mesh dimension; :mod:`lowering.elk_placement` places the tiles
so)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["grid", "footprint", "mesh_top"]


class _Tiled(Protocol):
    kind: str
    tiles: tuple[int, ...]


def grid(p: _Tiled) -> tuple[int, int]:
    """The core grid (rows, columns) a plan's tiles occupy (as :mod:`lowering.elk_placement`
    places them)."""
    if p.kind == "matmul":
        return p.tiles[1], p.tiles[2]
    if p.kind == "attention":
        return p.tiles[0] * p.tiles[1], p.tiles[2]
    return (1, p.tiles[0]) if len(p.tiles) == 1 else (p.tiles[0], p.tiles[1])


def footprint(p: _Tiled, mesh: tuple[int, int] | None) -> tuple[int, int]:
    """The cores (rows, columns) a plan occupies on a ``mesh`` of worker rows x columns: its
    :func:`grid`, except that a grid with more rows than the mesh is folded, ``cols // c``
    grid rows side by side in one mesh row (a decode attention's groups only exchange partials
    within their own grid row, ELK §5 maps each partitioned dimension to a mesh dimension).
    All-to-all (``mesh`` ``None``): the grid."""
    r, c = grid(p)
    if mesh is None or r <= mesh[0] or c > mesh[1]:
        return r, c
    per = mesh[1] // c
    return -(-r // per), per * c


def mesh_top(h: int, w: int, rows: int, cols: int) -> int:
    """The first mesh row of an ``h x w`` core grid (see :func:`footprint`) on a mesh of
    ``rows x cols`` routers whose last row is left to the controller core: the grid centred
    on the worker rows, at the west edge.  HBM controllers on the edge routers of every row
    feed a centred grid from above and below, so each column's preload traffic splits between
    its north- and south-bound links; in the north-west corner every byte from the rows below
    climbs the same links (ELK §6.4: mesh HBM data takes multiple hops).  A grid as tall as
    the worker rows, or a single row wider than the mesh (laid out from core 0), starts at
    row 0.  :mod:`lowering.elk_placement` places each grid there when its cores have room,
    and the cost model (:mod:`elk.meshlinks`) counts link loads for that rectangle."""
    if w > cols:
        return 0
    return max(0, (rows - 1 - h) // 2)
