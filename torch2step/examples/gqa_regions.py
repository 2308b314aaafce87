"""Decode attention parallelised over ``R`` regions (STeP, arXiv 2511.07776, §5.4 "Dynamic
parallelization").

The requests of a ragged decode batch have very different KV lengths, so how they are spread
over ``R`` spatially parallel copies of the attention pipeline (*regions*) decides how evenly
the regions are loaded.  The graph is the one of :mod:`torch2step.examples.gqa` with its
per-request part replicated ``R`` times:

1. ``kv_len`` is read and turned into the request cursors ``[row_base, n_b, Lmax]`` once (the
   cheap Scan of the single-region graph); the ``[G, D]`` query tiles are read once.
2. ``region: [B, 1]`` holds the region of each request.  ``to_selector`` makes it a one-hot
   selector and two Partitions (sharing the count symbols ``{prefix}_n{r}``) route each
   request's cursors and query tiles to its region: region ``r`` sees a stream ``[N_r, Hkv]``.
3. Each region builds its KV row addresses, loads and retiles K/V, and runs the online softmax
   exactly as the single-region graph does, on its own units.
4. Each region stores its results with a RandomOffChipStore at the row block of the request
   (``cursor_block``: ``row_base // Lmax = b*Hkv + kvh``), so no region waits for another.

The assignment is data (the ``region`` tensor): one graph serves every strategy of §5.4 —
:func:`assign_coarse` (consecutive requests per region, ``chunk`` of them, wrapping around:
the paper uses 16), :func:`assign_interleave` (round-robin) and the dynamic assignment, which
depends on simulated time and is decided by
:func:`torch2step.spatial.dispatch.simulate_dispatched` (first ``R`` requests round-robin,
then each request to the region that becomes free first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from torch2step.errors import StepTypeError
from torch2step.step import ADDR, DataType, FnSpec, TileType, fn, register_fn, registered_fns

if TYPE_CHECKING:
    from torch2step.step import Graph, OffChipTensor, Value

__all__ = ["ASSIGNMENTS", "add_region_attention", "assign_coarse", "assign_interleave"]

ASSIGNMENTS = ("coarse", "interleave", "dynamic")


def assign_coarse(batch: int, regions: int, chunk: int | None = None) -> np.ndarray:
    """Static coarse-grained assignment (STeP §5.4): ``chunk`` consecutive requests per region
    (default ``ceil(B / R)``), wrapping around when ``B > chunk * R`` — request ``i`` goes to
    region ``(i // chunk) mod R``.  Returns ``[B, 1]`` int64."""
    _check(batch, regions)
    c = chunk if chunk is not None else -(-batch // regions)
    if c < 1:
        raise StepTypeError(f"assign_coarse: chunk={chunk} must be a positive integer")
    return ((np.arange(batch) // max(c, 1)) % regions).astype(np.int64).reshape(batch, 1)


def assign_interleave(batch: int, regions: int) -> np.ndarray:
    """Static interleaved assignment (STeP §5.4): request ``i`` to region ``i mod R``."""
    _check(batch, regions)
    return (np.arange(batch) % regions).astype(np.int64).reshape(batch, 1)


def _check(batch: int, regions: int) -> None:
    if regions < 1 or batch < 0:
        raise StepTypeError(f"attention regions={regions} must be >= 1 (batch {batch})")


# ---------------------------------------------------------------- tile function


def _block_rule(f: Any, args: tuple[DataType, ...]) -> TileType:
    t = args[0]
    if not isinstance(t, TileType) or t.dtype not in ("int32", "int64") or t.shape != (1, 3):
        raise StepTypeError(f"function {f}: needs a [1, 3] [row_base, n, stride] tile, got {t}")
    return ADDR


def _block(f: Any, x: np.ndarray) -> np.ndarray:
    base, _, stride = (int(v) for v in x[0])
    return np.array([[base // stride]], dtype=np.int64)


if "cursor_block" not in registered_fns():
    register_fn(
        FnSpec(
            "cursor_block",
            "map",
            1,
            _block_rule,
            _block,
            doc="[row_base, n, stride] -> [1, 1] row_base // stride (the request's row block)",
        )
    )


# ---------------------------------------------------------------- graph


def add_region_attention(
    g: Graph,
    *,
    cursor: Value,
    q_tiles: Value,
    region: OffChipTensor,
    regions: int,
    out: OffChipTensor,
    attend: Any,
    prefix: str,
) -> None:
    """Route ``cursor`` / ``q_tiles`` (both ``[1, B, Hkv]``) over ``regions`` regions by the
    ``region`` tensor and run ``attend(g, cursor, q, prefix) -> results`` in each region
    (module docstring); results are stored into ``out`` per region."""
    B = region.shape[0]
    if region.dtype not in ("int32", "int64") or len(region.shape) != 2:
        raise StepTypeError(f"attention regions: tensor {region} must be [B, 1] integer")
    p = prefix
    ids = g.linear_load(region, (1, 1), out_shape=(B,), stride=(1,), name=f"{p}_region")
    sel = g.map(fn("to_selector", n=regions), ids, name=f"{p}_region_sel")  # [1, B]
    counts = [f"{p}_n{r}" for r in range(regions)]
    curs = g.partition(cursor, sel, regions, count_names=counts, name=f"{p}_route_cursor")
    qs = g.partition(q_tiles, sel, regions, count_names=counts, name=f"{p}_route_q")
    for r in range(regions):
        q = f"{p}_r{r}"
        res = attend(g, curs[r], qs[r], q)  # [N_r, Hkv] of [G, D]
        addr = g.map("cursor_block", curs[r], name=f"{q}_out_addr")
        g.random_store(addr, res, out, name=f"{q}_store")
