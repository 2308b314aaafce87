"""Per-link loads of dimension-order-routed traffic on a mesh (ELK §4.3 "to estimate the
contention overhead on each interconnect link, ELK divides total traffic by link bandwidth";
§6.4: a "mesh-based network takes multiple hops to deliver HBM data to cores").

On a mesh whose HBM controllers sit on edge routers, every preloaded byte enters the mesh at a
controller's router and travels hop by hop to its core along the dimension-order route (``xy``:
along the controller's row to the core's column, then along that column); a store travels back.
A preload of ``b`` bytes per core, spread evenly over the channels (ELK §5: "we evenly slice
each tensor across all HBM modules"), puts ``b / channels`` bytes of every (channel, core) pair
on each link of that pair's route, so the busiest link bounds the delivery:
``max_link_pairs * b / channels / link_bandwidth`` cycles.  The same holds between cores for
an execute-state exchange (sources, destinations and their route).

Grids sit in the mesh's north-west corner (``lowering.elk_placement`` tries the west edge and
the first rows first); the link loads are counted exactly for that rectangle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["MeshLinks"]


@dataclass(frozen=True, slots=True)
class MeshLinks:
    """A mesh's geometry for link loads: ``rows x cols`` routers (the controller row
    included), ``attach``: the (row, column) of each HBM channel's router, ``routing``:
    ``"xy"`` (row first) or ``"yx"``."""

    rows: int
    cols: int
    attach: tuple[tuple[int, int], ...]
    routing: str = "xy"

    def hbm_pairs(self, h: int, w: int, store: bool = False) -> float:
        """Most (channel, core) routes of an ``h x w`` grid in the north-west corner sharing
        one link, per channel: a preload (``store``: a store) of ``b`` bytes per core, spread
        evenly over the channels, puts ``b * hbm_pairs`` bytes on the busiest link."""
        if not self.attach:
            return 0.0
        return _hbm_pairs(self, min(h, self.rows), min(w, self.cols), store)

    def gather_pairs(self, h: int, w: int) -> float:
        """Most bytes on one link, per byte each destination receives, when the first column
        of an ``h x w`` grid in the north-west corner gathers its blocks from sources spread
        evenly over the grid's cores (the next operator gathers its input activation from
        the cores the previous one left it on, ELK §4.5; placement puts both in the corner)."""
        return _gather_pairs(self, min(h, self.rows), min(w, self.cols))


def _route_loads(
    m: MeshLinks, src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Link loads (east, west, south, north) when every source core sends every destination
    core ``src[y, x] * dst[y', x']`` units (an outer product of a source and a destination
    distribution) along dimension-order routes."""
    if m.routing != "xy":  # yx: the xy loads of the transposed mesh
        tr = MeshLinks(m.cols, m.rows, tuple((c, r) for r, c in m.attach), "xy")
        e, w, s, n = _route_loads(tr, src.T, dst.T)
        return s.T, n.T, e.T, w.T
    # along the source's row to the destination's column: the link t -> t+1 of row y carries
    # the sources of row y in columns <= t to the destinations in columns > t
    col_dst = dst.sum(axis=0)
    pre_c = np.cumsum(col_dst)[:-1]
    suf_c = col_dst.sum() - pre_c
    pre_src = np.cumsum(src, axis=1)[:, :-1]
    suf_src = src.sum(axis=1)[:, None] - pre_src
    east = pre_src * suf_c[None, :]
    west = suf_src * pre_c[None, :]
    # then along the destination's column: the link z -> z+1 of column x carries the sources
    # of rows <= z to the destinations of column x in rows > z
    s_row = src.sum(axis=1)
    pre_s = np.cumsum(s_row)[:-1]
    suf_s = s_row.sum() - pre_s
    pre_d = np.cumsum(dst, axis=0)[:-1]
    suf_d = dst.sum(axis=0)[None, :] - pre_d
    return east, west, pre_s[:, None] * suf_d, suf_s[:, None] * pre_d


def _peak(loads: tuple[np.ndarray, ...]) -> float:
    return max((float(a.max()) for a in loads if a.size), default=0.0)


@lru_cache(maxsize=1024)
def _hbm_pairs(m: MeshLinks, h: int, w: int, store: bool) -> float:
    grid = np.zeros((m.rows, m.cols))
    grid[:h, :w] = 1.0
    chans = np.zeros((m.rows, m.cols))
    for r, c in m.attach:
        chans[r, c] += 1.0
    loads = _route_loads(m, grid, chans) if store else _route_loads(m, chans, grid)
    return _peak(loads) / len(m.attach)


@lru_cache(maxsize=1024)
def _gather_pairs(m: MeshLinks, h: int, w: int) -> float:
    src = np.zeros((m.rows, m.cols))
    src[:h, :w] = 1.0 / (h * w)
    dst = np.zeros((m.rows, m.cols))
    dst[:h, 0] = 1.0  # each destination gathers its own block from every source
    return _peak(_route_loads(m, src, dst))
