"""Decode attention parallelised over ``R`` regions (STeP, arXiv 2511.07776, §5.4 "Dynamic
parallelization").

The requests of a ragged decode batch have very different KV lengths, so how they are spread
over ``R`` spatially parallel copies of the attention pipeline (*regions*) decides how evenly
the regions are loaded.  The graph is the one of :mod:`torch2step.lower.blocks.gqa` with its
per-request part replicated ``R`` times:

1. ``kv_len`` is read and turned into the request cursors ``[row_base, n_b, Lmax]`` once (the
   cheap Scan of the single-region graph); the ``[G, D]`` query tiles are read once.
2. ``region: [B, 1]`` holds the region of each request.  ``to_selector`` makes it a one-hot
   selector and two Partitions (sharing the count symbols ``{prefix}_n{r}``) route each
   request's cursors and query tiles to its region: region ``r`` sees a stream ``[N_r, Hkv]``.
3. Each region cuts its KV tile addresses, loads the K/V tiles, and runs the online softmax
   exactly as the single-region graph does, on its own units.

Without regions, :func:`add_lane_attention` spreads the (request, KV head) items over
independent lanes, balanced by their KV rows (the default of the lowering).
4. Each region stores its results with a RandomOffChipStore at the row block of the request
   (``cursor_block``: ``row_base // Lmax = b*Hkv + kvh``), so no region waits for another.

The assignment is data (the ``region`` tensor): one graph serves every strategy of §5.4 —
:func:`assign_coarse` (consecutive requests per region, ``chunk`` of them, wrapping around:
the paper uses 16), :func:`assign_interleave` (round-robin) and the dynamic assignment, which
depends on simulated time and is decided by
:func:`torch2step.spatial.dispatch.simulate_dispatched` (first ``R`` requests round-robin,
then each request to the region that becomes free first).  The units of a lane or region are
one program for every assignment: the lane decisions are computed in registers and each unit
loops until its items' stop token (:mod:`torch2step.spatial.lane_pick`,
:mod:`torch2step.spatial.item_loop`), so a new KV-length set or assignment rebuilds none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from torch2step.errors import StepTypeError
from torch2step.step import (
    ADDR,
    DataType,
    FnSpec,
    TileType,
    fn,
    register_fn,
    registered_fns,
)

if TYPE_CHECKING:
    from torch2step.step import Graph, OffChipTensor, Value

__all__ = [
    "ASSIGNMENTS",
    "add_lane_attention",
    "add_region_attention",
    "assign_coarse",
    "assign_interleave",
]

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


def _pick_rule(f: Any, args: tuple[DataType, ...], acc: DataType) -> DataType:
    t, lanes = args[0], f.get("lanes", 0)
    if not isinstance(t, TileType) or t.shape != (1, 3) or t.dtype not in ("int32", "int64"):
        raise StepTypeError(f"function {f}: needs a [1, 3] [row_base, n, stride] tile, got {t}")
    if not isinstance(lanes, int) or lanes < 1 or not isinstance(acc, TileType):
        raise StepTypeError(f"function {f}: lane_pick(lanes=P, tail=t) with P >= 1")
    if acc.shape != (1, lanes + 1):
        raise StepTypeError(f"function {f}: the state is [1, {lanes + 1}], got {acc}")
    return acc


def _pick(f: Any, x: np.ndarray, state: np.ndarray) -> np.ndarray:
    lanes = int(f.get("lanes"))
    load = state[0, :lanes].copy()
    lane = int(np.argmin(load))  # the least loaded lane; ties to the lowest
    load[lane] += int(x[0, 1]) + int(f.get("tail", 0)) + 1  # its rows (+1: per-item work)
    return np.array([[*load, lane]], dtype=state.dtype)


def _keep_rule(f: Any, args: tuple[DataType, ...]) -> tuple[DataType, tuple]:
    if len(args) != 2 or not isinstance(f.get("lane"), int):
        raise StepTypeError(f"function {f}: lane_keep(lane=r) reads (cursor, lane state)")
    return args[0], (None,)


def _keep(f: Any, cursor: np.ndarray, state: np.ndarray) -> list:
    return [cursor] if int(state[0, -1]) == int(f.get("lane")) else []


for _spec in (
    FnSpec(
        "lane_pick",
        "update",
        1,
        _pick_rule,
        _pick,
        doc="[base, n, stride] x [loads.., lane] -> the least loaded lane takes n + tail rows",
    ),
    FnSpec(
        "lane_keep",
        "flat",
        2,
        _keep_rule,
        _keep,
        doc="(cursor, [loads.., lane]) -> the cursor if the item went to lane r, else nothing",
    ),
):
    if _spec.name not in registered_fns():
        register_fn(_spec)


# ---------------------------------------------------------------- graph


def add_lane_attention(
    g: Graph,
    *,
    cursors: Any,
    q: OffChipTensor,
    group: int,
    lanes: int,
    tail_rows: int,
    out: OffChipTensor,
    attend: Any,
    prefix: str,
) -> None:
    """Spread the (request, KV head) work items over ``lanes`` attention pipelines, each item
    to the lane with the fewest KV rows so far (list scheduling with the rows as the work, a
    static parallelization in the sense of STeP (arXiv 2511.07776) §5.4, balanced by the
    data), and run ``attend(g, cursor, q, prefix) -> results`` in each lane.

    Lanes share no unit: each builds its own request cursors (``cursors(prefix)``, the cheap
    ``[1, B, Hkv]`` Scan over ``kv_len``), makes the same lane decisions (Scan
    ``lane_pick``) and keeps its items (FlatMap ``lane_keep``), loads its ``[group, D]``
    query tiles and KV tiles at the items' addresses and stores its results at their row
    blocks of ``out``.  So no lane waits for another (a shared router would stall every lane
    behind the one whose queue is full), and ``lanes`` KV streams share the HBM bandwidth."""
    for r in range(lanes):
        p = f"{prefix}_l{r}"
        cursor = cursors(p)
        init = fn("int_row", values=(0,) * (lanes + 1))
        pick = fn("lane_pick", lanes=lanes, tail=tail_rows)
        state = g.scan(cursor, pick, init, 2, name=f"{p}_lane")
        both = g.zip(cursor, state, name=f"{p}_cursor_lane")
        mine = g.flat_map(both, fn("lane_keep", lane=r), name=f"{p}_items")  # [1, B, M_b]
        block = g.map("cursor_block", mine, name=f"{p}_out_addr")  # b * Hkv + kvh
        q_t = g.random_load(block, q, (group, q.shape[1]), name=f"{p}_q")
        res = attend(g, mine, q_t, p)
        g.random_store(block, res, out, name=f"{p}_store")


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
