"""The order in which a core issues, and its kernel consumes, the preload pieces of an operator
(ELK §4.5 ``preload_async``; ELK §6.1: "we evenly slice each tensor across all HBM modules to
balance traffic").

The cores of a grid issue their preload pieces at the same cycle and every HBM channel serves
the requests it gets first come first served, so the ``s``-th request of every core is served
at about the same time.  When the ``s``-th pieces of all cores fall on a few channels — a KV
cache ``(batch, heads, length, D)`` cut along ``length`` puts piece ``s`` of every core on the
same channels — those channels run long queues while the others idle, and a core's port waits
for its slow channels.  A core may instead start at piece ``t mod pieces`` (``t`` its index in
the grid) and go round.  :func:`rotates` rotates an attention's KV pieces when the per-step
channel load is lower so (the busiest channel's units summed over the steps; the order in turn
on a tie), from the tensor's address interleaving (``HbmSpec.interleave_bytes`` over
``channels``; every tensor starts on a whole interleave round, ``runtime.layout``).  A matrix
product keeps its pieces in turn: each weight piece is multiplied with the activation piece
the grid row's first core gathers and multicasts in turn, so a rotated core's first product
would wait for a later activation piece (its tile-major weight blocks spread over the channels
already; rotating the products of one simulated Llama-3-8B layer on ``ipu-hbm`` cost 4%).
An attention's KV pieces are its only piecewise input.  The
kernels of :mod:`lowering.elk_programs` consume the pieces in the order they are issued, so
each piece is computed on as it arrives (the ``slack`` of :mod:`elk.cost`)."""

from __future__ import annotations

import numpy as np

from elk.cost import chunks
from hwmodel.chip import HbmSpec
from lowering.elk_placement import Placed

__all__ = ["rotates", "piece_order", "piece_runs"]


def piece_runs(pl: Placed, t: np.ndarray, q: int) -> tuple[np.ndarray, int]:
    """Byte offsets (one row per contiguous run, ``cores x runs``) and run length of preload
    piece ``q`` of the grid cores ``t`` (indices ``r * cols + c``) in its tensor: a weight block
    stored tile-major (one contiguous block per core, :func:`lowering.elk_placement.tile_major`)
    or the rows of a KV block (each ``(batch, head)`` a run along the length)."""
    op, plan = pl.op, pl.plan
    e = op.elem
    if op.kind == "matmul":
        _, k, n = op.dims
        kb, nb = k // pl.rows, n // pl.cols
        rb = kb // chunks(kb)
        return ((t * kb + q * rb) * nb * e)[:, None], rb * nb * e
    b, _, hkv, d, length = op.dims
    tb, tg, ts = plan.tiles
    bb, hb, lb = b // tb, hkv // tg, length // ts
    sb = lb // chunks(lb)
    r, c = np.divmod(t, pl.cols)
    ib, ig = np.divmod(r, tg)
    bs = (ib[:, None] * bb + np.arange(bb)[None, :])[:, :, None]
    hs = (ig[:, None] * hb + np.arange(hb)[None, :])[:, None, :]
    rows = (bs * hkv + hs) * length + (c * lb + q * sb)[:, None, None]
    return (rows * d * e).reshape(len(t), -1), sb * d * e


def _units(spec: HbmSpec, starts: np.ndarray, length: int) -> np.ndarray:
    """Interleave units per channel of the runs ``[start, start + length)``."""
    g, ch = spec.interleave_bytes, spec.channels
    u0 = starts.ravel() // g
    n = (starts.ravel() + length - 1) // g - u0 + 1
    out = np.zeros(ch, dtype=np.int64) + int((n // ch).sum())
    rem = n % ch
    diff = np.zeros(2 * ch + 1, dtype=np.int64)
    lo = u0 % ch
    np.add.at(diff, lo, 1)
    np.add.at(diff, lo + rem, -1)
    run = np.cumsum(diff)[: 2 * ch]
    return out + run[:ch] + run[ch:]


def _steps(spec: HbmSpec, pl: Placed, rotate: bool) -> list[np.ndarray]:
    """Interleave units per channel requested at each step of the preload when every core of
    ``pl`` issues its pieces in :func:`piece_order`."""
    nc = _pieces(pl)
    t = np.arange(pl.rows * pl.cols)
    runs = [piece_runs(pl, t, q) for q in range(nc)]
    out = []
    for s in range(nc):
        if not rotate:
            out.append(_units(spec, runs[s][0], runs[s][1]))
            continue
        load = np.zeros(spec.channels, dtype=np.int64)
        for q in range(nc):
            mine = (t + s) % nc == q  # the cores whose step ``s`` is piece ``q``
            if mine.any():
                load += _units(spec, runs[q][0][mine], runs[q][1])
        out.append(load)
    return out


def _balance(spec: HbmSpec, pl: Placed, rotate: bool) -> int:
    """The busiest channel's interleave units at each step of the preload, summed over the
    steps (:func:`_steps`)."""
    return sum(int(u.max()) for u in _steps(spec, pl, rotate))


#: :func:`rotates` answers by (channels, interleave, operator kind, dims, dtype, tiles, grid).
_ROTATES: dict[tuple, bool] = {}


def _pieces(pl: Placed) -> int:
    op = pl.op
    if op.kind == "matmul":
        return chunks(op.dims[1] // pl.rows)
    if op.kind == "attention":
        return chunks(op.dims[4] // pl.plan.tiles[2])
    return 1


def rotates(spec: HbmSpec, pl: Placed) -> bool:
    """Whether the cores of ``pl`` issue their preload pieces rotated by their grid index
    (module docstring); ``False`` for operators without several preloaded pieces."""
    op = pl.op
    if op.kind != "attention" or _pieces(pl) < 2:
        return False
    key = (spec.channels, spec.interleave_bytes, op.kind, op.dims, op.dtype, pl.plan.tiles)
    key += (pl.rows, pl.cols)
    if key not in _ROTATES:
        _ROTATES[key] = _balance(spec, pl, True) < _balance(spec, pl, False)
    return _ROTATES[key]


#: :func:`piece_order` answers by (pieces, first piece): the cores of a grid share them
_ORDERS: dict[tuple[int, int], tuple[int, ...]] = {}


def piece_order(pl: Placed, r: int, c: int, rotate: bool) -> tuple[int, ...]:
    """The pieces of core ``(r, c)`` of ``pl`` in the order it loads and computes on them."""
    nc = _pieces(pl)
    first = (r * pl.cols + c) % nc if rotate else 0
    out = _ORDERS.get((nc, first))
    if out is None:
        out = _ORDERS[(nc, first)] = tuple((first + s) % nc for s in range(nc))
    return out
