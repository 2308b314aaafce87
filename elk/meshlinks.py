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

When the preload ends depends also on the order the channels serve the cores (first come first
served, :func:`_flow_shop`): issued by every core at once (core order) the column links work
beside the edge row links and the busiest link bounds it; issued as the controller's go token
reaches the cores (the preloads of every section but the first, ELK §4.5), the channels serve
the cores nearest the controller first, the column links of those cores' columns get their
data in bursts, and the row and column stages largely add up.

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

    def hbm_stages(self, h: int, w: int, store: bool = False) -> tuple[float, float]:
        """:meth:`hbm_pairs` of the row links and of the column links separately (a route
        crosses the ones, then the others)."""
        if not self.attach:
            return 0.0, 0.0
        return _hbm_stages(self, min(h, self.rows), min(w, self.cols), store)

    def preload_span(self, h: int, w: int, in_turn: bool) -> float:
        """Cycles x link bandwidth, per byte each core of an ``h x w`` grid (north-west
        corner) preloads, until the last byte arrives when the channels serve the cores in
        the order they issue (``in_turn``: as the go token reaches them, else at once):
        the edge row links, then each column link, first come first served
        (:func:`_flow_shop`; xy routing, else the busiest link)."""
        if not self.attach:
            return 0.0
        h, w = min(h, self.rows), min(w, self.cols)
        if self.routing != "xy":
            return _hbm_pairs(self, h, w, False)
        return max(_hbm_pairs(self, h, w, False), _flow_shop(self, h, w, in_turn))

    def hbm_hops(self, h: int, w: int) -> float:
        """Mean links a preloaded byte crosses to an ``h x w`` grid in the north-west corner
        (the byte-hops of its routes over its bytes, spread evenly over the channels)."""
        if not self.attach:
            return 0.0
        return _hbm_hops(self, min(h, self.rows), min(w, self.cols))

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
def _hbm_stages(m: MeshLinks, h: int, w: int, store: bool) -> tuple[float, float]:
    grid = np.zeros((m.rows, m.cols))
    grid[:h, :w] = 1.0
    chans = np.zeros((m.rows, m.cols))
    for r, c in m.attach:
        chans[r, c] += 1.0
    east, west, south, north = (
        _route_loads(m, grid, chans) if store else _route_loads(m, chans, grid)
    )
    n = len(m.attach)
    return _peak((east, west)) / n, _peak((south, north)) / n


def _hbm_pairs(m: MeshLinks, h: int, w: int, store: bool) -> float:
    return max(_hbm_stages(m, h, w, store))


@lru_cache(maxsize=1024)
def _hbm_hops(m: MeshLinks, h: int, w: int) -> float:
    grid = np.zeros((m.rows, m.cols))
    grid[:h, :w] = 1.0
    chans = np.zeros((m.rows, m.cols))
    for r, c in m.attach:
        chans[r, c] += 1.0
    total = sum(float(a.sum()) for a in _route_loads(m, chans, grid))
    return total / (len(m.attach) * h * w)


@lru_cache(maxsize=1024)
def _gather_pairs(m: MeshLinks, h: int, w: int) -> float:
    src = np.zeros((m.rows, m.cols))
    src[:h, :w] = 1.0 / (h * w)
    dst = np.zeros((m.rows, m.cols))
    dst[:h, 0] = 1.0  # each destination gathers its own block from every source
    return _peak(_route_loads(m, src, dst))


@lru_cache(maxsize=1024)
def _flow_shop(m: MeshLinks, h: int, w: int, go_order: bool) -> float:
    """Cycles x link bandwidth, per byte each core loads, until the last byte of an ``h x w``
    grid's preload (north-west corner, xy routing) has crossed its column links, when the
    channels serve the cores one after another (first come first served) in the order the
    cores issue their loads: at once in core order, or (``go_order``) as the controller's go
    token reaches them (a multicast from the last core: along its row, then up the columns).
    The row links next to the edges carry every core's share in parallel (stage 1, ``1 /
    channels`` per core); then each column link the core's routes cross serves its share
    first come first served (stage 2)."""
    R, C = m.rows, m.cols
    n = len(m.attach)
    rows_of = np.zeros(R)
    for r, _ in m.attach:
        rows_of[r] += 1.0
    below = np.cumsum(rows_of[::-1])[::-1]  # channels in rows >= z
    cores = [(r, c) for r in range(h) for c in range(w)]
    if go_order:
        cores.sort(key=lambda rc: ((C - 1 - rc[1]) + (R - 1 - rc[0]), rc[0] * C + rc[1]))
    north = np.zeros((R, C))  # link z+1 -> z of column c: free time
    south = np.zeros((R, C))  # link z -> z+1
    t1 = 0.0
    for r, c in cores:
        t1 += 1.0 / n
        # north-bound links z = r .. R-2 carry the channels of rows > z
        for z in range(r, R - 1):
            north[z, c] = max(north[z, c], t1) + below[z + 1] / n
        # south-bound links z = 0 .. r-1 carry the channels of rows <= z
        for z in range(r):
            south[z, c] = max(south[z, c], t1) + (n - below[z + 1]) / n
    return float(max(t1, north.max(initial=0.0), south.max(initial=0.0)))
