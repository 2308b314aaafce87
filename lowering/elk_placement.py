"""Where an ELK plan's tiles go (ELK §4.5 on the chip of :mod:`hwmodel.chip`).

Placement of every operator's tile grid on the chip's worker cores (the last core is left to
the controller of :mod:`lowering.elk_programs`), the tile-major HBM layout of matmul weights
that gives each core one contiguous preload range, and the SRAM each core holds over the plan:
the execute-state tiles of every operator preloaded and not yet executed plus the output tiles
the previous operator leaves on its cores until the next one gathers them (ELK §4.5).

Tiles map to cores as :mod:`elk.cost` assumes: the least-loaded cores on an all-to-all chip, a
grid of mesh rows x columns on a mesh (row offset from operator to operator so that resident
operators spread over the chip).  In a stack of identical layers an operator takes the cores of
the same operator one layer earlier whenever its tiles fit there beside what those cores hold
over the sections it stays resident (and, on a mesh, that grid is one of its candidates): the
layers then have the same placement as they have the same plans and preload order (ELK §4.4),
so their per-core programs are renamed copies of each other (:mod:`lowering.elk_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elk.cost import Plan, grid
from elk.grids import footprint, mesh_top
from elk.ops import Operator
from hwmodel.chip import Chip, MeshNoC
from lowering.errors import ProgramError

__all__ = [
    "Placed",
    "place",
    "core_peaks",
    "held_output",
    "tile_major",
    "weight_shape",
]


@dataclass(frozen=True, slots=True)
class Placed:
    """An operator, its plan and the core of every tile (grid row-major: ``rows x cols``)."""

    op: Operator
    plan: Plan
    rows: int
    cols: int
    cores: tuple[int, ...]

    def core(self, r: int, c: int) -> int:
        return self.cores[r * self.cols + c]


def weight_shape(op: Operator, plan: Plan) -> tuple[int, int]:
    """Shape of a matmul's weight tensor in HBM, stored tile-major for ``plan``."""
    _, k, n = op.dims
    tn = plan.tiles[2]
    return (k * tn, n // tn)


def tile_major(w: np.ndarray, plan: Plan) -> np.ndarray:
    """A ``K x N`` weight laid out tile-major for ``plan``: the ``(K/tk) x (N/tn)`` block of
    grid position ``(r, c)`` is rows ``(r*tn + c)*K/tk ..`` (one contiguous HBM range per core,
    so a preload spreads over every HBM channel)."""
    k, n = w.shape
    tk, tn = plan.tiles[1], plan.tiles[2]
    kb, nb = k // tk, n // tn
    return np.ascontiguousarray(
        w.reshape(tk, kb, tn, nb).transpose(0, 2, 1, 3).reshape(tk * tn * kb, nb)
    )


def _grid(op: Operator, plan: Plan) -> tuple[int, int]:
    return grid(plan)


def _sections(n: int, order: Sequence[int], issued: Sequence[int]) -> list[int]:
    """The section (``execute`` index) whose preloads include each operator's."""
    first = [0] * n
    prev = 0
    for i in range(n):
        for k in range(prev, issued[i]):
            first[order[k]] = i
        prev = max(prev, issued[i])
    return first


def place(
    chip: Chip,
    ops: Sequence[Operator],
    plans: Sequence[Plan],
    order: Sequence[int] | None = None,
    issued: Sequence[int] | None = None,
) -> list[Placed]:
    """Cores of every tile, the last core left to the controller.  Operators are placed in
    preload order on the cores with the most free SRAM over the sections they stay resident
    (all-to-all: any cores, ELK §5 maps tiles in order because location does not matter; mesh:
    at the west edge centred on the worker rows, where the cost model counts the grid's link
    loads (:func:`elk.grids.mesh_top`), when those cores have room, else the grid's row offset
    with the most free SRAM)."""
    return _place(chip, ops, plans, order, issued)[0]


def core_peaks(
    chip: Chip,
    ops: Sequence[Operator],
    plans: Sequence[Plan],
    order: Sequence[int] | None = None,
    issued: Sequence[int] | None = None,
) -> np.ndarray:
    """Most bytes each worker core holds at once under :func:`place` (execute-state tiles of
    the executing operator and of every operator preloaded and not yet executed, and the
    output tiles of the previous operator, :func:`held_output`)."""
    load = _place(chip, ops, plans, order, issued)[1]
    return load.max(axis=1) if load.size else np.zeros(load.shape[0], dtype=np.int64)


def _place(
    chip: Chip,
    ops: Sequence[Operator],
    plans: Sequence[Plan],
    order: Sequence[int] | None,
    issued: Sequence[int] | None,
) -> tuple[list[Placed], np.ndarray]:
    n = len(ops)
    order = tuple(range(n)) if order is None else tuple(order)
    issued = tuple(range(1, n + 1)) if issued is None else tuple(issued)
    first = _sections(n, order, issued)
    earlier = _same_earlier(ops, plans)
    sram = chip.core.sram_bytes
    noc = chip.noc
    workers = chip.num_cores - 1
    load = np.zeros((workers, n), dtype=np.int64)
    out: dict[int, Placed] = {}
    for j in order:
        op, plan = ops[j], plans[j]
        rows, cols = _grid(op, plan)
        span = slice(first[j], j + 1)
        if isinstance(noc, MeshNoC):
            usable_rows = noc.rows - 1
            if rows == 1 and cols > noc.cols and cols <= usable_rows * noc.cols:
                cands = [tuple(range(cols))]
            elif rows > usable_rows and cols <= noc.cols:
                cands = _folded(chip, rows, cols, usable_rows)
                if not cands:
                    raise ProgramError(
                        f"{op.name}: plan {plan.label()} needs {rows} grid rows of {cols} cores; "
                        f"the mesh has {usable_rows}x{noc.cols} worker cores"
                    )
            elif cols > noc.cols or rows > usable_rows:
                raise ProgramError(
                    f"{op.name}: plan {plan.label()} needs a {rows}x{cols} grid; the mesh has "
                    f"{usable_rows}x{noc.cols} worker cores"
                )
            else:
                # every row offset, at the west edge, the east edge and in the middle
                c0s = sorted({0, (noc.cols - cols) // 2, noc.cols - cols})
                cands = [
                    tuple(chip.core_at(r0 + r, c0 + c) for r in range(rows) for c in range(cols))
                    for c0 in c0s
                    for r0 in range(usable_rows - rows + 1)
                ]
            peak = [int(load[list(cs), span].max(initial=0)) for cs in cands]
            # where the cost model counts the grid's link loads (elk.grids.mesh_top: west
            # edge, centred on the worker rows), if its cores have room; else the least
            # loaded row offset.  The candidates list the west edge's row offsets first, from
            # row 0 on.
            home = mesh_top(*footprint(plan, (usable_rows, noc.cols)), noc.rows, noc.cols)
            if peak[home] + plan.core_space <= sram:
                cores = cands[home]
            else:
                cores = cands[int(np.argmin(peak))]
            if j in earlier and earlier[j] in out:  # the same operator a layer earlier
                same = out[earlier[j]].cores
                if same in cands and peak[cands.index(same)] + plan.core_space <= sram:
                    cores = same
        else:
            if rows * cols > workers:
                raise ProgramError(f"{op.name}: plan {plan.label()} needs {rows * cols} cores")
            busy = load[:, span].max(axis=1)
            pick = np.argsort(busy, kind="stable")[: rows * cols]
            cores = tuple(int(x) for x in sorted(pick))
            if j in earlier and earlier[j] in out:  # the same operator a layer earlier
                same = out[earlier[j]].cores
                if int(busy[list(same)].max()) + plan.core_space <= sram:
                    cores = same
        load[list(cores), span] += plan.core_space
        placed = Placed(op, plan, rows, cols, cores)
        if j + 1 < n:  # its output tiles stay until the next operator has gathered them
            for core, nbytes in held_output(placed):
                load[core, j + 1] += nbytes
        out[j] = placed
    return [out[j] for j in range(n)], load


def _same_earlier(ops: Sequence[Operator], plans: Sequence[Plan]) -> dict[int, int]:
    """Operator index -> the index of the same operator one layer earlier (same kind, sizes,
    dtype, node and plan; ``Operator.layer`` one less), in a stack of equal-sized layers."""
    size = next((i for i, o in enumerate(ops) if o.layer != ops[0].layer), len(ops))
    out: dict[int, int] = {}
    for j in range(size, len(ops)):
        a, b = ops[j - size], ops[j]
        if (
            b.layer == a.layer + 1
            and (a.kind, a.dims, a.dtype, a.node, a.slot) == (b.kind, b.dims, b.dtype, b.node, b.slot)
            and plans[j - size] == plans[j]
        ):
            out[j] = j - size
    return out


def _folded(chip: Chip, rows: int, cols: int, usable_rows: int) -> list[tuple[int, ...]]:
    """Placements of a ``rows x cols`` grid taller than the mesh (:func:`elk.cost.footprint`):
    ``noc.cols // cols`` grid rows side by side in each mesh row, every grid row contiguous
    along its mesh row; one candidate per row offset and west / middle / east column offset."""
    noc = chip.noc
    assert isinstance(noc, MeshNoC)
    per = noc.cols // cols
    height = -(-rows // per)
    if height > usable_rows:
        return []
    width = per * cols
    c0s = sorted({0, (noc.cols - width) // 2, noc.cols - width})
    return [
        tuple(
            chip.core_at(r0 + r // per, c0 + (r % per) * cols + c)
            for r in range(rows)
            for c in range(cols)
        )
        for c0 in c0s
        for r0 in range(usable_rows - height + 1)
    ]


def held_output(pl: Placed) -> list[tuple[int, int]]:
    """(core, bytes) of the output tiles ``pl`` leaves on its cores (ELK §4.5: activations
    stay in the producing cores' SRAM until the next operators gather them): a matmul's top
    grid row, an attention's first grid column, every core of a vector operator."""
    op, e = pl.op, pl.op.elem
    if op.kind == "matmul":
        m, _, n = op.dims
        return [(pl.core(0, c), m * (n // pl.cols) * e) for c in range(pl.cols)]
    if op.kind == "attention":
        b, hq, _, d, _ = op.dims
        tb, tg, _ = pl.plan.tiles
        return [(pl.core(r, 0), (b // tb) * (hq // tg) * d * e) for r in range(pl.rows)]
    r, c = op.dims
    per = (r // pl.rows) * (c // pl.cols) * e if op.node is None else r * c * e
    return [(core, per) for core in pl.cores]
