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

Grids sit at the west edge, centred on the worker rows (:func:`elk.grids.mesh_top`, where
``lowering.elk_placement`` places them when their cores have room); the link loads are counted
exactly for that rectangle, or for the rows from ``top`` on where a caller names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from elk.grids import mesh_top

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

    def top(self, h: int, w: int) -> int:
        """The first row of an ``h x w`` grid (:func:`elk.grids.mesh_top`)."""
        return mesh_top(h, w, self.rows, self.cols)

    def _at(self, h: int, w: int, top: int | None) -> tuple[int, int, int]:
        t = self.top(h, w) if top is None else top
        h = min(h, self.rows)
        return min(h, self.rows - t), min(w, self.cols), t

    def hbm_pairs(self, h: int, w: int, store: bool = False, top: int | None = None) -> float:
        """Most (channel, core) routes of an ``h x w`` grid (from row ``top``, default
        :meth:`top`) sharing one link, per channel: a preload (``store``: a store) of ``b``
        bytes per core, spread evenly over the channels, puts ``b * hbm_pairs`` bytes on the
        busiest link."""
        if not self.attach:
            return 0.0
        return max(_hbm_stages(self, *self._at(h, w, top), store))

    def hbm_stages(
        self, h: int, w: int, store: bool = False, top: int | None = None
    ) -> tuple[float, float]:
        """:meth:`hbm_pairs` of the row links and of the column links separately (a route
        crosses the ones, then the others)."""
        if not self.attach:
            return 0.0, 0.0
        return _hbm_stages(self, *self._at(h, w, top), store)

    def preload_span(self, h: int, w: int, in_turn: bool, top: int | None = None) -> float:
        """Cycles x link bandwidth, per byte each core of an ``h x w`` grid (from row ``top``,
        default :meth:`top`) preloads, until the last byte arrives when the channels serve the
        cores in the order they issue (``in_turn``: as the go token reaches them, else at
        once): the edge row links, then each column link, first come first served
        (:func:`_flow_shop`; xy routing, else the busiest link)."""
        if not self.attach:
            return 0.0
        h, w, t = self._at(h, w, top)
        pairs = max(_hbm_stages(self, h, w, t, False))
        if self.routing != "xy":
            return pairs
        return max(pairs, _flow_shop(self, h, w, t, in_turn))

    def hbm_hops(self, h: int, w: int, top: int | None = None) -> float:
        """Mean links a preloaded byte crosses to an ``h x w`` grid (from row ``top``, default
        :meth:`top`; the byte-hops of its routes over its bytes, spread evenly over the
        channels)."""
        if not self.attach:
            return 0.0
        return _hbm_hops(self, *self._at(h, w, top))

    def gather_pairs(self, h: int, w: int) -> float:
        """Most bytes on one link, per byte each destination receives, when the first column
        of an ``h x w`` grid (at :meth:`top`) gathers its blocks from sources spread evenly
        over the grid's cores (the next operator gathers its input activation from the cores
        the previous one left it on, ELK §4.5)."""
        return _gather_pairs(self, *self._at(h, w, None))


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
def _hbm_stages(m: MeshLinks, h: int, w: int, top: int, store: bool) -> tuple[float, float]:
    grid = np.zeros((m.rows, m.cols))
    grid[top : top + h, :w] = 1.0
    chans = np.zeros((m.rows, m.cols))
    for r, c in m.attach:
        chans[r, c] += 1.0
    east, west, south, north = (
        _route_loads(m, grid, chans) if store else _route_loads(m, chans, grid)
    )
    n = len(m.attach)
    return _peak((east, west)) / n, _peak((south, north)) / n


@lru_cache(maxsize=1024)
def _hbm_hops(m: MeshLinks, h: int, w: int, top: int) -> float:
    grid = np.zeros((m.rows, m.cols))
    grid[top : top + h, :w] = 1.0
    chans = np.zeros((m.rows, m.cols))
    for r, c in m.attach:
        chans[r, c] += 1.0
    total = sum(float(a.sum()) for a in _route_loads(m, chans, grid))
    return total / (len(m.attach) * h * w)


@lru_cache(maxsize=1024)
def _gather_pairs(m: MeshLinks, h: int, w: int, top: int) -> float:
    src = np.zeros((m.rows, m.cols))
    src[top : top + h, :w] = 1.0 / (h * w)
    dst = np.zeros((m.rows, m.cols))
    dst[top : top + h, 0] = 1.0  # each destination gathers its own block from every source
    return _peak(_route_loads(m, src, dst))


@lru_cache(maxsize=1024)
def _flow_shop(m: MeshLinks, h: int, w: int, top: int, go_order: bool) -> float:
    """Cycles x link bandwidth, per byte each core loads, until the last byte of an ``h x w``
    grid's preload (from row ``top``, xy routing) has crossed its column links, when the
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
    cores = [(r, c) for r in range(top, top + h) for c in range(w)]
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
