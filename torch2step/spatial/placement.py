"""Spatial placement: every STeP unit on its own core of the chip (STeP §4.2, §5.1).

A unit (one STeP operator, see :mod:`.structure`) gets one core — an SDA compute unit paired
with its on-chip memory unit.  A unit whose buffers exceed one core's SRAM takes further cores
as extra memory units (``memory``: bytes per unit); its program runs on the first one.

Where units go: units are ordered by a *chain-following* topological order (after placing a
unit, place next a unit that reads from the most recently placed one), and laid along a
space-filling walk of the mesh in that order, so a producer and its consumer usually sit on
neighbouring cores.  Walks: ``"hilbert"`` (the generalised Hilbert curve "gilbert" for any
``rows x cols`` rectangle: consecutive cells are neighbours, and cells close along the walk are
close in 2-D), ``"snake"`` (row by row, alternating direction) and ``"linear"`` (core ids in
order; the only walk of an all-to-all chip, where distance does not matter).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from hwmodel.chip import Chip, MeshNoC
from hwmodel.presets import load_chip
from torch2step.errors import ScheduleError
from torch2step.step.graph import Program

from .structure import DEFAULT_WIRES, Structure, analyse

__all__ = [
    "PlacementError",
    "Unit",
    "Placement",
    "WALKS",
    "walk_cores",
    "place",
    "place_structure",
    "format_placement",
]

WALKS = ("hilbert", "snake", "linear")


@dataclass(frozen=True, slots=True)
class Unit:
    """One unit: its primary node ``name``, the nodes it executes (``ops``, primary first) and
    their operator classes, and its ``cores`` (program core first, then extra memory units)."""

    name: str
    ops: tuple[str, ...]
    kinds: tuple[str, ...]
    cores: tuple[int, ...]

    @property
    def core(self) -> int:
        """The core running the unit's program."""
        return self.cores[0]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every unit of a graph runs; ``wires`` lists the ``(node, class)`` of operators that
    occupy no unit; ``walk`` is the core order used."""

    graph: str
    chip: str
    walk: str
    units: tuple[Unit, ...]
    wires: tuple[tuple[str, str], ...]

    def unit(self, op_name: str) -> Unit:
        """The unit executing node ``op_name``."""
        for u in self.units:
            if op_name in u.ops:
                return u
        wired = [n for n, _ in self.wires]
        hint = " (it is a wire: it occupies no unit)" if op_name in wired else ""
        raise KeyError(f"node {op_name!r} has no unit in graph {self.graph!r}{hint}")

    def core(self, op_name: str) -> int:
        """The program core of the unit executing ``op_name``."""
        return self.unit(op_name).core

    @property
    def cores_used(self) -> int:
        """Cores taken by all units, extra memory units included."""
        return sum(len(u.cores) for u in self.units)


class PlacementError(ScheduleError):
    """The chip has too few cores for a graph's units; ``cores`` maps each unit (its primary
    node's name) to the cores it needs (one, or more for buffers beyond one core's SRAM), so a
    caller splitting the layer knows where the cores go (:mod:`torch2step.configurations`)."""

    def __init__(self, message: str, cores: Mapping[str, int]) -> None:
        super().__init__(message)
        self.cores = dict(cores)

    def __reduce__(self) -> tuple:
        # rebuilt from both arguments: a layer split into configurations reports them in
        # worker processes (torch2step.config_jobs), which send this error back pickled
        return (type(self), (self.args[0], self.cores), self.__dict__)


# -- walks ---------------------------------------------------------------------------------------


def _sgn(x: int) -> int:
    return (x > 0) - (x < 0)


def _gilbert(x: int, y: int, ax: int, ay: int, bx: int, by: int) -> Iterator[tuple[int, int]]:
    """Generalised Hilbert curve over the rectangle spanned by ``(ax, ay)`` and ``(bx, by)``
    from ``(x, y)`` (J. Červený's "gilbert" construction)."""
    w, h = abs(ax + ay), abs(bx + by)
    dax, day, dbx, dby = _sgn(ax), _sgn(ay), _sgn(bx), _sgn(by)
    if h == 1:
        for _ in range(w):
            yield x, y
            x, y = x + dax, y + day
        return
    if w == 1:
        for _ in range(h):
            yield x, y
            x, y = x + dbx, y + dby
        return
    ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
    w2, h2 = abs(ax2 + ay2), abs(bx2 + by2)
    if 2 * w > 3 * h:
        if w2 % 2 and w > 2:
            ax2, ay2 = ax2 + dax, ay2 + day
        yield from _gilbert(x, y, ax2, ay2, bx, by)
        yield from _gilbert(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by)
        return
    if h2 % 2 and h > 2:
        bx2, by2 = bx2 + dbx, by2 + dby
    yield from _gilbert(x, y, bx2, by2, ax2, ay2)
    yield from _gilbert(x + bx2, y + by2, ax, ay, bx - bx2, by - by2)
    yield from _gilbert(
        x + (ax - dax) + (bx2 - dbx),
        y + (ay - day) + (by2 - dby),
        -bx2,
        -by2,
        -(ax - ax2),
        -(ay - ay2),
    )


def walk_cores(chip: Chip, walk: str = "hilbert") -> list[int]:
    """Every core id of ``chip`` once, in the order of ``walk`` (see the module docstring)."""
    if walk not in WALKS:
        raise ScheduleError(f"unknown walk {walk!r}; use one of {', '.join(WALKS)}")
    noc = chip.noc
    if walk == "linear" or not isinstance(noc, MeshNoC):
        return list(range(chip.num_cores))
    rows, cols = noc.rows, noc.cols
    if walk == "snake":
        return [
            r * cols + (c if r % 2 == 0 else cols - 1 - c) for r in range(rows) for c in range(cols)
        ]
    pts = _gilbert(0, 0, cols, 0, 0, rows) if cols >= rows else _gilbert(0, 0, 0, rows, cols, 0)
    return [y * cols + x for x, y in pts]


# -- order and placement ---------------------------------------------------------------------------


def _chain_order(st: Structure) -> list[int]:
    """Topological order of the units that keeps producer -> consumer chains together: the next
    unit is a ready one reading from the most recently placed unit (ties: graph order).

    Hand-written rather than on ``graphlib`` or networkx: unit graphs may be cyclic (below),
    which ``graphlib`` refuses, the rule's key depends on the units already placed (networkx's
    ``lexicographical_topological_sort`` takes a fixed key), and the same rule driven by
    ``graphlib.TopologicalSorter`` is 1.2-3x slower (benchmarks/graph_algorithms.py)."""
    n = len(st.units)
    pos: dict[int, int] = {}
    left = [len(p) for p in st.preds]
    succs: list[list[int]] = [[] for _ in range(n)]
    for k, ps in enumerate(st.preds):
        for p in ps:
            succs[p].append(k)
    ready = {k for k in range(n) if left[k] == 0}
    order: list[int] = []
    while len(order) < n:
        if not ready:
            # Units may form a cycle although the graph does not: a Streamify runs on the unit
            # of its Bufferize and may read references derived from that Bufferize's output
            # (Repeat/Expand of the buffer stream).  Break it at the first unplaced unit.
            ready.add(next(k for k in range(n) if k not in pos))
        k = min(ready, key=lambda u: (-max((pos.get(p, -1) for p in st.preds[u]), default=-1), u))
        ready.remove(k)
        pos[k] = len(order)
        order.append(k)
        for s in succs[k]:
            left[s] -= 1
            if left[s] == 0 and s not in pos:
                ready.add(s)
    return order


_LOADS = frozenset({"LinearOffChipLoad", "RandomOffChipLoad", "RandomOffChipLoadRows"})


def _loads_at_consumers(st: Structure, order: list[int]) -> list[int]:
    """``order`` with every off-chip load moved to just before its first consumer: a load's
    output (tiles read from HBM) is the heavy stream and its inputs (addresses, references)
    are light, so it sits next to the unit that reads its tiles, not next to the unit that
    computes its addresses, and its tiles cross few NoC links."""
    n = len(order)
    pos = {k: i for i, k in enumerate(order)}
    first: dict[int, int] = {}
    for k, ps in enumerate(st.preds):
        for p in ps:
            if p not in first or pos[k] < pos[first[p]]:
                first[p] = k
    is_load = [ops[0].op_name in _LOADS for ops in st.units]
    moved = {k for k in order if is_load[k] and k in first and not is_load[first[k]]}
    before: dict[int, list[int]] = {}
    for k in order:
        if k in moved:
            before.setdefault(first[k], []).append(k)
    out: list[int] = []
    for k in order:
        if k not in moved:
            out.extend(before.get(k, ()))
            out.append(k)
    assert len(out) == n
    return out


def place_structure(
    st: Structure, chip: Chip, *, walk: str = "hilbert", memory: Mapping[str, int] | None = None
) -> Placement:
    """Place the units of ``st`` on ``chip`` (``memory``: on-chip bytes per unit name; a unit
    needing more than one core's SRAM takes ``ceil(bytes / sram_bytes)`` cores)."""
    sram = chip.core.sram_bytes
    need = [max(1, math.ceil((memory or {}).get(ops[0].name, 0) / sram)) for ops in st.units]
    total = sum(need)
    if total > chip.num_cores:
        kinds = Counter(ops[0].op_name for ops in st.units)
        listing = ", ".join(
            f"{c} {k}" for k, c in sorted(kinds.items(), key=lambda x: (-x[1], x[0]))
        )
        extra = total - len(st.units)
        mem = (
            f", plus {extra} extra memory units for operators whose buffers exceed one core's "
            f"{sram} bytes of SRAM"
            if extra
            else ""
        )
        raise PlacementError(
            f"graph {st.graph.name!r} needs {total} cores for its {len(st.units)} units (one per "
            f"STeP operator: {listing}{mem}) but chip {chip.name!r} has {chip.num_cores} cores; "
            "use a chip with more cores (e.g. hwmodel.with_mesh_shape or a bigger preset), or "
            "give the graph fewer operators: coarser tiles, fewer parallel regions, or "
            "time-multiplexed expert regions (EagerMerge + RandomOffChipLoad, STeP §5.3)",
            {ops[0].name: k for ops, k in zip(st.units, need)},
        )
    cores = walk_cores(chip, walk)
    slots: dict[int, tuple[int, ...]] = {}
    at = 0
    for k in _loads_at_consumers(st, _chain_order(st)):
        slots[k] = tuple(cores[at : at + need[k]])
        at += need[k]
    units = tuple(
        Unit(ops[0].name, tuple(o.name for o in ops), tuple(o.op_name for o in ops), slots[k])
        for k, ops in enumerate(st.units)
    )
    wires = tuple((op.name, op.op_name) for op in st.wires)
    noc_walk = walk if isinstance(chip.noc, MeshNoC) else "linear"
    return Placement(st.graph.name, chip.name, noc_walk, units, wires)


def place(
    graph: Program,
    chip: Chip | str,
    *,
    walk: str = "hilbert",
    wires: Iterable[str] = DEFAULT_WIRES,
    memory: Mapping[str, int] | None = None,
) -> Placement:
    """Place every unit of ``graph`` on its own core(s) of ``chip`` (a :class:`Chip` or a preset
    name); raises :class:`~torch2step.errors.ScheduleError` when the chip has too few cores."""
    c = load_chip(chip)
    return place_structure(analyse(graph, wires), c, walk=walk, memory=memory)


def format_placement(p: Placement, chip: Chip | None = None) -> str:
    """A table of the placement: one line per unit in core order (``chip`` adds mesh
    coordinates)."""
    mesh = chip.noc if chip is not None and isinstance(chip.noc, MeshNoC) else None
    head = (
        f"placement of graph {p.graph} on {p.chip} ({p.walk} walk): {len(p.units)} units on "
        f"{p.cores_used} cores, {len(p.wires)} wires"
    )
    lines = [head, f"  {'core':>6} {'mesh':>9}  {'unit':<24} operators"]
    for u in sorted(p.units, key=lambda u: u.core):
        where = f"r{u.core // mesh.cols}c{u.core % mesh.cols}" if mesh is not None else "-"
        extra = (
            f"  (+{len(u.cores) - 1} memory units: {list(u.cores[1:])})" if len(u.cores) > 1 else ""
        )
        ops = ", ".join(f"{k} %{n}" for n, k in zip(u.ops, u.kinds))
        lines.append(f"  {u.core:>6} {where:>9}  {u.name:<24} {ops}{extra}")
    if p.wires:
        lines.append("  wires (no unit): " + ", ".join(f"{k} %{n}" for n, k in p.wires))
    return "\n".join(lines)
