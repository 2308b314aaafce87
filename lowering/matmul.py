"""Per-PE programs for distributed matrix multiplication, from dataflow recurrences.

Space-time mapping and lowering of Cyclotron §6: every PE ``(r, c)`` of the grid instantiates
the rules of a :class:`~lowering.recurrence.Dataflow` that match its position (boundary PEs
inject from HBM, interior PEs receive from a neighbour, the last PE along the reduction axis
exports ``C``), and the time variable becomes a loop.  Each rule kind has one emitter in
:data:`_EMIT`.  Data layout: ``A`` (M x K), ``B`` (K x N) in HBM tensors ``"A"``/``"B"``, the
product written to ``"C"``; each PE holds one block of each operand in buffers ``a``, ``b``, ``c``.

PE ``(r, c)`` runs on core ``chip.core_at(r, c)`` when the target is a mesh chip (the grid sits
at the top-left of the mesh), else on core ``r * cols + c``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hwmodel.chip import Chip, MeshNoC
from lowering.builder import CoreBuilder, ProgramBuilder
from lowering.errors import ProgramError
from lowering.isa import Affine, Index, ProgramSet, Region
from lowering.recurrence import (
    CANNON,
    PUMMA,
    SCHEDULES,
    SUMMA,
    SYSTOLIC,
    WEIGHT_STATIONARY,
    Access,
    Dataflow,
    MatmulRecurrence,
    MatmulSchedule,
    Rule,
    derive_dataflow,
)

__all__ = [
    "Grid",
    "resolve_grid",
    "lower_dataflow",
    "matmul_programs",
    "cannon_matmul",
    "summa_matmul",
    "weight_stationary_matmul",
    "systolic_matmul",
    "pumma_matmul",
]

_BUF = {"A": "a", "B": "b", "C": "c"}


@dataclass(frozen=True, slots=True)
class Grid:
    """A ``rows`` x ``cols`` PE grid and the core id of each PE (row-major)."""

    rows: int
    cols: int
    cores: tuple[int, ...]

    def core(self, r: int, c: int) -> int:
        """Core id of PE ``(r, c)``."""
        return self.cores[r * self.cols + c]


def resolve_grid(target: Chip | tuple[int, int], grid: tuple[int, int] | None = None) -> Grid:
    """The PE grid for ``target``: a chip (its whole mesh, or ``grid`` at the mesh's top-left)
    or a ``(rows, cols)`` shape (cores numbered row-major)."""
    if isinstance(target, Chip):
        if isinstance(target.noc, MeshNoC):
            rows, cols = grid or (target.noc.rows, target.noc.cols)
            if rows > target.noc.rows or cols > target.noc.cols:
                raise ProgramError(
                    f"grid {rows}x{cols} does not fit chip {target.name!r}'s "
                    f"{target.noc.rows}x{target.noc.cols} mesh; pass a smaller grid"
                )
            cores = tuple(target.core_at(r, c) for r in range(rows) for c in range(cols))
            return Grid(rows, cols, cores)
        if grid is None:
            raise ProgramError(
                f"chip {target.name!r} has an all-to-all NoC, so there is no natural PE grid; "
                "pass grid=(rows, cols)"
            )
        rows, cols = grid
        if rows * cols > target.num_cores:
            raise ProgramError(
                f"grid {rows}x{cols} needs {rows * cols} cores; chip {target.name!r} has "
                f"{target.num_cores}"
            )
        return Grid(rows, cols, tuple(range(rows * cols)))
    rows, cols = grid or target
    if rows < 1 or cols < 1:
        raise ProgramError(f"grid {rows}x{cols}: rows and cols must be positive")
    return Grid(rows, cols, tuple(range(rows * cols)))


@dataclass(slots=True)
class _Ctx:
    """One PE while its rules are instantiated: position, builder, current time step."""

    df: Dataflow
    grid: Grid
    b: ProgramBuilder
    p: CoreBuilder
    r: int
    c: int
    time: Index = 0  # block index along the time variable
    phase: int = 0  # time step modulo the dataflow period (static)
    last: bool = False  # last time step (Cannon shifts are skipped)

    def pos(self, var: str) -> int:
        """This PE's coordinate along space variable ``var``."""
        return self.r if var == self.df.schedule.space[0] else self.c

    def neighbour(self, var: str, delta: int, wrap: bool = False) -> tuple[int, int]:
        """Grid position ``delta`` steps along space variable ``var``."""
        extent = self.df.grid_extent(var)
        target = self.pos(var) + delta
        if wrap:
            target %= extent
        if var == self.df.schedule.space[0]:
            return target, self.c
        return self.r, target

    def core_of(self, rc: tuple[int, int]) -> int:
        return self.grid.core(*rc)

    def block_region(self, access: Access, time: Index) -> Region:
        """The block of ``access`` at this PE for time block ``time``."""
        starts: list[Index] = []
        extents: list[Index] = []
        for var in access.indices:
            blk = self.df.block(var)
            index: Index = time if var == self.df.schedule.time else self.pos(var)
            starts.append(_scale(index, blk))
            extents.append(blk)
        return Region(tuple(starts), tuple(extents))

    def channel(self, operand: str, src: tuple[int, int], dsts: list[tuple[int, int]], tag: str):
        """Declare (once) and return the channel of ``operand`` sent by PE ``src``."""
        name = f"{operand}_{tag}_{src[0]}_{src[1]}"
        if not self.b.has_channel(name):
            self.b.channel(name, self.core_of(src), tuple(self.core_of(d) for d in dsts))
        return name


def _scale(index: Index, factor: int) -> Index:
    if isinstance(index, int):
        return index * factor
    if isinstance(index, str):
        return Affine(0, ((index, factor),))
    return Affine(index.const * factor, tuple((n, c * factor) for n, c in index.terms))


def _access(df: Dataflow, operand: str) -> Access:
    rec = df.recurrence
    return {"A": rec.a, "B": rec.b, "C": rec.c}[operand]


def _direction(df: Dataflow, axis: str, forward: bool) -> str:
    along_rows = axis == df.schedule.space[0]
    if along_rows:
        return "S" if forward else "N"
    return "E" if forward else "W"


# -- emitters: one per rule kind (Cyclotron §6 template matching) ---------------------------------
def _prefetch(ctx: _Ctx, rule: Rule) -> None:
    access = _access(ctx.df, rule.operand)  # indexed by space variables only: time unused
    ctx.p.load(_BUF[rule.operand], access.tensor, ctx.block_region(access, 0))


def _skew(ctx: _Ctx, rule: Rule) -> None:
    start = (ctx.r + ctx.c) % ctx.df.tiles_of(ctx.df.schedule.time)
    access = _access(ctx.df, rule.operand)
    ctx.p.load(_BUF[rule.operand], access.tensor, ctx.block_region(access, start))


def _inject(ctx: _Ctx, rule: Rule) -> None:
    if ctx.pos(rule.axis) == 0:
        access = _access(ctx.df, rule.operand)
        ctx.p.load(_BUF[rule.operand], access.tensor, ctx.block_region(access, ctx.time))


def _propagate(ctx: _Ctx, rule: Rule) -> None:
    if ctx.pos(rule.axis) > 0:
        prev = ctx.neighbour(rule.axis, -1)
        tag = _direction(ctx.df, rule.axis, forward=True)
        name = ctx.channel(rule.operand, prev, [(ctx.r, ctx.c)], tag)
        ctx.p.recv(name, _BUF[rule.operand])


def _send(ctx: _Ctx, rule: Rule) -> None:
    if ctx.pos(rule.axis) < ctx.df.grid_extent(rule.axis) - 1:
        nxt = ctx.neighbour(rule.axis, +1)
        tag = _direction(ctx.df, rule.axis, forward=True)
        name = ctx.channel(rule.operand, (ctx.r, ctx.c), [nxt], tag)
        ctx.p.send(name, _BUF[rule.operand])


def _broadcast(ctx: _Ctx, rule: Rule) -> None:
    axis = rule.axis
    extent = ctx.df.grid_extent(axis)
    root_pos = ctx.phase % extent
    line = [ctx.neighbour(axis, n - ctx.pos(axis)) for n in range(extent)]
    root = line[root_pos]
    others = [rc for rc in line if rc != root]
    buf = _BUF[rule.operand]
    if (ctx.r, ctx.c) == root:
        access = _access(ctx.df, rule.operand)
        ctx.p.load(buf, access.tensor, ctx.block_region(access, ctx.time))
        if others:
            ctx.p.send(ctx.channel(rule.operand, root, others, f"bcast{axis}"), buf)
    else:
        ctx.p.recv(ctx.channel(rule.operand, root, others, f"bcast{axis}"), buf)


def _zero(ctx: _Ctx, rule: Rule) -> None:
    if rule.axis is None or ctx.pos(rule.axis) == 0:
        shape = f"{ctx.df.block('i')}x{ctx.df.block('j')}"
        ctx.p.compute("zeros", "c", (), {"shape": shape}, ctx.df.recurrence.dtype)


def _accumulate(ctx: _Ctx, rule: Rule) -> None:
    ctx.p.compute("matmul_acc", "c", ("a", "b", "c"), None, ctx.df.recurrence.dtype)


def _export(ctx: _Ctx, rule: Rule) -> None:
    if rule.axis is None or ctx.pos(rule.axis) == ctx.df.grid_extent(rule.axis) - 1:
        access = _access(ctx.df, "C")
        ctx.p.store("c", access.tensor, ctx.block_region(access, ctx.time))


def _rotate_channels(ctx: _Ctx, rule: Rule) -> tuple[str, str] | None:
    """Cannon's ring along ``rule.axis``: (channel to the previous PE, channel from the next)."""
    if ctx.last or ctx.df.grid_extent(rule.axis) == 1:
        return None
    tag = _direction(ctx.df, rule.axis, forward=False)
    prev = ctx.neighbour(rule.axis, -1, wrap=True)
    nxt = ctx.neighbour(rule.axis, +1, wrap=True)
    out = ctx.channel(rule.operand, (ctx.r, ctx.c), [prev], tag)
    into = ctx.channel(rule.operand, nxt, [(ctx.r, ctx.c)], tag)
    return out, into


def _rotate_send(ctx: _Ctx, rule: Rule) -> None:
    chans = _rotate_channels(ctx, rule)
    if chans:
        ctx.p.send(chans[0], _BUF[rule.operand])


def _rotate_recv(ctx: _Ctx, rule: Rule) -> None:
    chans = _rotate_channels(ctx, rule)
    if chans:
        ctx.p.recv(chans[1], _BUF[rule.operand])


_EMIT: dict[str, Callable[[_Ctx, Rule], None]] = {
    "prefetch": _prefetch,
    "skew": _skew,
    "inject": _inject,
    "propagate": _propagate,
    "send": _send,
    "broadcast": _broadcast,
    "zero": _zero,
    "accumulate": _accumulate,
    "export": _export,
    "rotate": _rotate_recv,
}


def _emit_stage(ctx: _Ctx, stage: str, rules: tuple[Rule, ...]) -> None:
    step = [r for r in rules if r.stage == stage]
    # Cannon's shifts send the current blocks first (a send copies the buffer), so the
    # transfers overlap this step's compute; the blocks of the next step are received last.
    for rule in step:
        if rule.kind == "rotate":
            _rotate_send(ctx, rule)
    for rule in step:
        _EMIT[rule.kind](ctx, rule)


def _emit_pe(ctx: _Ctx) -> None:
    df = ctx.df
    dtype = df.recurrence.dtype
    shapes = {
        "a": (df.block("i"), df.block("k")),
        "b": (df.block("k"), df.block("j")),
        "c": (df.block("i"), df.block("j")),
    }
    for buf, shape in shapes.items():
        ctx.p.alloc(buf, shape, dtype)
    _emit_stage(ctx, "pre", df.rules)
    steps = df.tiles_of(df.schedule.time)
    rotating = any(r.kind == "rotate" for r in df.rules)
    if rotating:
        # Cannon: shifts after every step but the last (Cyclotron §7 skewed torus schedule).
        if steps > 2:
            with ctx.p.loop(steps - 1):
                _emit_stage(ctx, "step", df.rules)
        elif steps == 2:
            _emit_stage(ctx, "step", df.rules)
        ctx.last = True
        _emit_stage(ctx, "step", df.rules)
    else:
        period = df.period()
        rounds, rest = divmod(steps, period)
        if rounds == 1:  # one round: literal block indices, no loop
            rounds, rest = 0, steps
        if rounds:
            with ctx.p.loop(rounds, var="t"):
                for phase in range(period):
                    ctx.phase = phase
                    ctx.time = Affine(phase, (("t", period),)) if period > 1 else "t"
                    _emit_stage(ctx, "step", df.rules)
        for phase in range(rest):
            ctx.phase = phase
            ctx.time = rounds * period + phase
            _emit_stage(ctx, "step", df.rules)
    ctx.time = 0
    _emit_stage(ctx, "post", df.rules)
    for buf in shapes:
        ctx.p.free(buf)


def lower_dataflow(df: Dataflow, grid: Grid, name: str | None = None) -> ProgramSet:
    """Instantiate the rules of ``df`` for every PE of ``grid`` (Cyclotron §6)."""
    if (grid.rows, grid.cols) != (df.rows, df.cols):
        raise ProgramError(
            f"dataflow is for a {df.rows}x{df.cols} grid but the grid is {grid.rows}x{grid.cols}"
        )
    rec, sch = df.recurrence, df.schedule
    b = ProgramBuilder(name or f"{sch.name}_matmul")
    b.tensor(rec.a.tensor, (rec.M, rec.K), rec.dtype)
    b.tensor(rec.b.tensor, (rec.K, rec.N), rec.dtype)
    b.tensor(rec.c.tensor, (rec.M, rec.N), rec.dtype)
    b.meta("recurrence", rec.text())
    b.meta(
        "schedule",
        f"{sch.name} (space {sch.space[0]},{sch.space[1]}; time {sch.time}; A {sch.a}; B {sch.b})",
    )
    b.meta("grid", f"{grid.rows}x{grid.cols}")
    b.meta("blocks", " ".join(f"{v}={df.tiles_of(v)}x{df.block(v)}" for v in ("i", "j", "k")))
    for r in range(grid.rows):
        for c in range(grid.cols):
            _emit_pe(_Ctx(df, grid, b, b.core(grid.core(r, c)), r, c))
    return b.build()


def matmul_programs(
    target: Chip | tuple[int, int],
    M: int,
    K: int,
    N: int,
    schedule: MatmulSchedule | str,
    dtype: str = "fp32",
    *,
    grid: tuple[int, int] | None = None,
    time_tiles: int | None = None,
    name: str | None = None,
) -> ProgramSet:
    """Per-core programs computing ``C = A @ B`` under ``schedule`` (a :class:`MatmulSchedule`
    or a name in :data:`~lowering.recurrence.SCHEDULES`).  ``time_tiles`` is the number of
    blocks along the schedule's time variable (default: Cannon ``p``; SUMMA/PUMMA/systolic the
    lcm of the grid sides; weight-stationary the grid rows)."""
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ProgramError(
                f"unknown matmul schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        schedule = SCHEDULES[schedule]
    g = resolve_grid(target, grid)
    if time_tiles is None:
        time_tiles = g.rows if schedule.time != "k" else math.lcm(g.rows, g.cols)
    rec = MatmulRecurrence(M, K, N, dtype)
    df = derive_dataflow(rec, schedule, g.rows, g.cols, time_tiles)
    return lower_dataflow(df, g, name)


def cannon_matmul(
    target: Chip | tuple[int, int],
    M: int,
    K: int,
    N: int,
    dtype: str = "fp32",
    *,
    grid: tuple[int, int] | None = None,
) -> ProgramSet:
    """Output-stationary Cannon on a square p x p grid: skewed initial blocks
    ``A[i,(i+j) mod p]``, ``B[(i+j) mod p, j]``, then p-1 shifts of A west and B north on rings."""
    return matmul_programs(target, M, K, N, CANNON, dtype, grid=grid)


def summa_matmul(
    target: Chip | tuple[int, int],
    M: int,
    K: int,
    N: int,
    dtype: str = "fp32",
    *,
    grid: tuple[int, int] | None = None,
    k_tiles: int | None = None,
) -> ProgramSet:
    """SUMMA: for each of ``k_tiles`` panels, the owner PE multicasts its A block along its row
    and its B block along its column; every PE accumulates its C block."""
    return matmul_programs(target, M, K, N, SUMMA, dtype, grid=grid, time_tiles=k_tiles)


def weight_stationary_matmul(
    target: Chip | tuple[int, int],
    M: int,
    K: int,
    N: int,
    dtype: str = "fp32",
    *,
    grid: tuple[int, int] | None = None,
    m_tiles: int | None = None,
) -> ProgramSet:
    """Weight-stationary: PE (k, j) keeps B[k, j]; ``m_tiles`` row blocks of A stream east
    along grid rows, partial sums of C flow south and leave the bottom row."""
    return matmul_programs(target, M, K, N, WEIGHT_STATIONARY, dtype, grid=grid, time_tiles=m_tiles)


def systolic_matmul(
    target: Chip | tuple[int, int],
    M: int,
    K: int,
    N: int,
    dtype: str = "fp32",
    *,
    grid: tuple[int, int] | None = None,
    k_tiles: int | None = None,
) -> ProgramSet:
    """Output-stationary systolic array: A enters on the west edge and streams east, B enters
    on the north edge and streams south (Cyclotron §4.3, §6 first program)."""
    return matmul_programs(target, M, K, N, SYSTOLIC, dtype, grid=grid, time_tiles=k_tiles)


def pumma_matmul(
    target: Chip | tuple[int, int],
    M: int,
    K: int,
    N: int,
    dtype: str = "fp32",
    *,
    grid: tuple[int, int] | None = None,
    k_tiles: int | None = None,
) -> ProgramSet:
    """PUMMA: A streams along rows between neighbours, B is multicast down columns."""
    return matmul_programs(target, M, K, N, PUMMA, dtype, grid=grid, time_tiles=k_tiles)
