"""HBM activations of an operator on a mesh fed from edge controllers (ELK §6.4: "mesh-based
network takes multiple hops to deliver HBM data to cores"; ELK §4.3: a link's time is the
traffic it carries over its bandwidth).

Inside a layer an operator gathers its input from the cores the previous one left it on and
leaves its output on its own cores (ELK §4.5), which the plans of :mod:`elk.cost` assume.  An
operator whose input comes from HBM (the layer's first, or after a relayout) or whose output
goes there (the layer's last) instead moves those bytes between the edge controllers and its
grid, hop by hop: :func:`hbm_io_extra` is what that adds to a plan's execution.
"""

from __future__ import annotations

import dataclasses

from elk.allocate import Option
from elk.chipcosts import ChipCosts
from elk.model import Item
from elk.ops import Operator

__all__ = ["hbm_io_extra", "with_hbm_io"]


def with_hbm_io(c: ChipCosts, op: Operator, it: Item, hbm_in: bool, hbm_out: bool) -> Item:
    """``it`` with every exec plan's time (alone and contended) lengthened by its HBM input
    and output on an edge-fed mesh (:func:`hbm_io_extra`; ``it.grids``: the plans' cores)."""
    add = [
        hbm_io_extra(c, o.ref.kind, o.ref.tiles, op.dims, op.elem, it.grids[e], hbm_in, hbm_out)
        for e, o in enumerate(it.execs)
    ]
    execs = tuple(Option(o.space, o.time + x, o.ref) for o, x in zip(it.execs, add))
    contended = tuple(t + x for t, x in zip(it.contended, add))
    return dataclasses.replace(it, execs=execs, contended=contended)


def hbm_io_extra(
    c: ChipCosts,
    kind: str,
    tiles: tuple[int, ...],
    dims: tuple[int, ...],
    elem: int,
    grid: tuple[int, int],
    hbm_in: bool,
    hbm_out: bool,
) -> float:
    """Cycles an execution with plan ``tiles`` (on ``grid``) adds on an edge-fed mesh when it
    reads its input activation from HBM (``hbm_in``) and / or stores its output there
    (``hbm_out``), beyond the on-chip gather its plan time counts; 0 elsewhere."""
    if not c.edge_fed or not (hbm_in or hbm_out):
        return 0.0
    extra = 0.0
    if kind == "matmul":
        m, k, n = dims
        _, tk, tn = tiles
        a, cc = m * (k // tk) * elem, m * (n // tn) * elem
        assert c.links is not None
        top = c.links.top(*grid)  # the grid's first row: its first column and top row start there
        if hbm_in:  # the first grid column loads the activation blocks instead of gathering
            got = c.hbm_link(a, (tk, 1), top=top) + c.hbm_lat + c.hbm_hops((tk, 1))
            extra += max(0.0, got - (c.gather(a, (tk, tn)) + c.net_lat * (tk + tn)))
        if hbm_out:  # the top grid row stores the result
            extra += c.hbm_link(cc, (1, tn), store=True, top=top) + c.hbm_lat + c.hbm_hops((1, tn))
        return extra
    if kind == "vector":
        r, cols = dims
        tr, tc = tiles if len(tiles) == 2 else (tiles[0], 1)
        tile = (r // tr) * (cols // tc) * elem
        # the plan counts each way as the tile over the port or all rows at the edge links
        move = max(tile / c.port, r * cols * elem / c.hbm_bw)
        if hbm_in:
            extra += max(0.0, c.hbm_link(tile, grid) + c.hbm_hops(grid) - move)
        if hbm_out:
            extra += max(0.0, c.hbm_link(tile, grid, store=True) + c.hbm_hops(grid) - move)
        return extra
    if kind == "attention" and hbm_out:
        b, hq, _, d, _ = dims
        tb, tg, _ = tiles
        out = (b // tb) * (hq // tg) * d * elem  # per grid row, stored by its first core
        return c.hbm_link(out, (grid[0], 1), store=True) + c.hbm_lat + c.hbm_hops(grid)
    return extra
