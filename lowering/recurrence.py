"""Dataflow recurrences of a blocked matrix product (Cyclotron, Cyclotron §4-§7).

The product ``C[i,j] = sum_k A[i,k] B[k,j]`` over blocks is one recurrence over the iteration
space ``(i, j, k)``.  Lowering the sum gives the accumulator recurrence (Cyclotron §4.2, rule
LowerSum of §8)::

    (i,j,0)_C <- 0          (i,j,k)_C <- (i,j,k-1)_C + (i,j,k)_A * (i,j,k)_B

A :class:`MatmulSchedule` maps two iteration variables to the rows and columns of a PE grid
(space) and the third to time (Cyclotron §6), and says how each input reaches the points that
need it (Cyclotron §5 scheduling commands):

* ``prefetch`` — the operand is indexed by both space variables: loaded once, stationary;
* ``stream``   — injected at the boundary of the space axis it lacks and forwarded between
  neighbours (§4.3 and §8 rules Inject / Propagate / Send);
* ``broadcast``— multicast along that axis from a feeder PE, here the owner of the block in
  SUMMA's block distribution (§5 ``broadcast``, §8: "the propagate rule becomes irrelevant");
* ``rotate``   — Cannon's torus form of a stream: the operands are pre-skewed so PE ``(r, c)``
  starts at reduction step ``(r + c) mod p`` (the skew of §7) and shift to the previous
  neighbour on a ring after every step.

The accumulator ``C`` is stationary when both its indices are spatial (output-stationary); when
the reduction variable ``k`` is spatial, partial sums flow along ``k`` (weight-stationary, §6).
:func:`derive_dataflow` turns recurrence + schedule into a list of :class:`Rule` s — the
dataflow recurrences — which :mod:`lowering.matmul` instantiates per PE by template matching
(§6).  Cannon, SUMMA and weight-stationary are three schedules of this one recurrence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from lowering.errors import ProgramError

__all__ = [
    "Access",
    "MatmulRecurrence",
    "MatmulSchedule",
    "Rule",
    "Dataflow",
    "derive_dataflow",
    "format_dataflow",
    "CANNON",
    "SUMMA",
    "WEIGHT_STATIONARY",
    "SYSTOLIC",
    "PUMMA",
    "SCHEDULES",
]

VARS = ("i", "j", "k")
Move = Literal["prefetch", "stream", "broadcast", "rotate"]
_MOVES = ("prefetch", "stream", "broadcast", "rotate")


@dataclass(frozen=True, slots=True)
class Access:
    """Operand ``name`` read from (or written to) HBM tensor ``tensor`` at ``indices``."""

    name: str
    tensor: str
    indices: tuple[str, str]


@dataclass(frozen=True, slots=True)
class MatmulRecurrence:
    """``C[i,j] = sum_k A[i,k] B[k,j]`` with ``A`` (M x K), ``B`` (K x N), ``C`` (M x N)."""

    M: int
    K: int
    N: int
    dtype: str = "fp32"
    a: Access = Access("A", "A", ("i", "k"))
    b: Access = Access("B", "B", ("k", "j"))
    c: Access = Access("C", "C", ("i", "j"))
    reduction: str = "k"

    def extent(self, var: str) -> int:
        """Elements along iteration variable ``var``."""
        return {"i": self.M, "j": self.N, "k": self.K}[var]

    def text(self) -> str:
        """The recurrence as a line of text."""
        return "C[i,j] = sum_k A[i,k] * B[k,j]"


@dataclass(frozen=True, slots=True)
class MatmulSchedule:
    """``space`` = the iteration variables on the grid's (rows, cols); the remaining variable
    is time.  ``a`` and ``b`` are the movements of the inputs (see the module docstring)."""

    name: str
    space: tuple[str, str]
    a: Move
    b: Move

    @property
    def time(self) -> str:
        """The iteration variable mapped to time."""
        return next(v for v in VARS if v not in self.space)


#: Output-stationary Cannon on a p x p torus: skewed start, neighbour shifts (Cyclotron §2, §7).
CANNON = MatmulSchedule("cannon", ("i", "j"), "rotate", "rotate")
#: SUMMA: A panels multicast along rows, B panels along columns (Cyclotron §2, §5, §10.1).
SUMMA = MatmulSchedule("summa", ("i", "j"), "broadcast", "broadcast")
#: Weight-stationary: B blocks stay, A streams east, partial sums of C flow south (Cyclotron §6).
WEIGHT_STATIONARY = MatmulSchedule("weight_stationary", ("k", "j"), "stream", "prefetch")
#: Output-stationary systolic: A streams east, B streams south from the edges (Cyclotron §4.3).
SYSTOLIC = MatmulSchedule("systolic", ("i", "j"), "stream", "stream")
#: PUMMA: A streams along rows, B is broadcast down columns (Cyclotron §2, Fig. 13 right).
PUMMA = MatmulSchedule("pumma", ("i", "j"), "stream", "broadcast")

SCHEDULES: Mapping[str, MatmulSchedule] = {
    s.name: s for s in (CANNON, SUMMA, WEIGHT_STATIONARY, SYSTOLIC, PUMMA)
}


@dataclass(frozen=True, slots=True)
class Rule:
    """One dataflow recurrence, instantiated per PE by :mod:`lowering.matmul`.

    ``kind`` selects the emitter, ``operand`` is ``"A"``, ``"B"`` or ``"C"``, ``axis`` the space
    variable the operand moves along (``None`` for local rules), ``stage`` where the rule acts
    (``"pre"`` before the time loop, ``"step"`` in every time step, ``"post"`` after it) and
    ``text`` the rule in Cyclotron's notation ``(i,j,k)_X``."""

    kind: Literal[
        "prefetch",
        "skew",
        "inject",
        "propagate",
        "send",
        "broadcast",
        "zero",
        "accumulate",
        "rotate",
        "export",
    ]
    operand: str
    axis: str | None
    stage: Literal["pre", "step", "post"]
    text: str


@dataclass(frozen=True, slots=True)
class Dataflow:
    """A recurrence under a schedule on a ``rows`` x ``cols`` grid: block counts per variable
    and the derived rules, in the order they act within a time step."""

    recurrence: MatmulRecurrence
    schedule: MatmulSchedule
    rows: int
    cols: int
    tiles: tuple[tuple[str, int], ...]
    rules: tuple[Rule, ...]

    def tiles_of(self, var: str) -> int:
        """Number of blocks along ``var``."""
        return dict(self.tiles)[var]

    def block(self, var: str) -> int:
        """Elements per block along ``var``."""
        return self.recurrence.extent(var) // self.tiles_of(var)

    def grid_extent(self, var: str) -> int:
        """PEs along space variable ``var``."""
        return self.rows if var == self.schedule.space[0] else self.cols

    def accumulator_axis(self) -> str | None:
        """The space variable partial sums flow along (``None``: output-stationary)."""
        rec = self.recurrence
        return rec.reduction if rec.reduction in self.schedule.space else None

    def period(self) -> int:
        """Time steps after which every PE's role repeats: the lcm of the broadcast lines
        (a SUMMA feeder is the owner of block ``t``, at position ``t mod extent``)."""
        p = 1
        for access, move in self.inputs():
            if move == "broadcast":
                p = math.lcm(p, self.grid_extent(_missing(access, self.schedule.space)))
        return p

    def inputs(self) -> tuple[tuple[Access, Move], ...]:
        """The two inputs with their movements."""
        rec, sch = self.recurrence, self.schedule
        return ((rec.a, sch.a), (rec.b, sch.b))


def _missing(access: Access, space: tuple[str, str]) -> str:
    """The space variable an operand is not indexed by (the axis it moves along)."""
    return next(v for v in space if v not in access.indices)


def _point(**shift: str) -> str:
    """``(i,j-1,k)``: the iteration point with some coordinates replaced."""
    return "(" + ",".join(shift.get(v, v) for v in VARS) + ")"


def _tensor(access: Access, **sub: str) -> str:
    return f"{access.tensor}[{','.join(sub.get(v, v) for v in access.indices)}]"


def _arrival_rules(
    access: Access, move: Move, space: tuple[str, str], time: str, extents: dict[str, int]
) -> list[Rule]:
    """How input ``access`` reaches each iteration point (Cyclotron §8 Inject/Propagate; the
    broadcast variant; Cannon's skewed start)."""
    x = access.name
    if move == "prefetch":
        return [Rule("prefetch", x, None, "pre", f"{_point()}_{x} <- {_tensor(access)}")]
    axis = _missing(access, space)
    if move == "stream":
        inject = f"{_point(**{axis: '0'})}_{x} <- {_tensor(access)}"
        propagate = f"{_point()}_{x} <- {_point(**{axis: axis + '-1'})}_{x}"
        return [
            Rule("inject", x, axis, "step", inject),
            Rule("propagate", x, axis, "step", propagate),
        ]
    if move == "broadcast":
        feeder = _point(**{axis: f"{time} mod {extents[axis]}"})
        text = f"{_point()}_{x} <- {_tensor(access)} multicast along {axis} from {feeder}"
        return [Rule("broadcast", x, axis, "step", text)]
    skew = f"({space[0]}+{space[1]}) mod {extents[axis]}"
    text = f"{_point(**{time: skew})}_{x} <- {_tensor(access, **{time: skew})}"
    return [Rule("skew", x, axis, "pre", text)]


def _forward_rules(access: Access, move: Move, space: tuple[str, str]) -> list[Rule]:
    """The Send rule of a streamed input (Cyclotron §8 Send)."""
    if move != "stream":
        return []
    axis, x = _missing(access, space), access.name
    return [Rule("send", x, axis, "step", f"{_point()}_{x} -> {_point(**{axis: axis + '+1'})}_{x}")]


def _accumulator_rules(rec: MatmulRecurrence, space: tuple[str, str]) -> list[Rule]:
    """LowerSum (Cyclotron §4.2, §8) and the export of ``C``; when the reduction variable is
    spatial the partial sums travel between PEs (weight-stationary, Cyclotron §6)."""
    k = rec.reduction
    flow = k in space
    axis = k if flow else None
    acc = f"{_point()}_C <- {_point(k=k + '-1')}_C + {_point()}_A * {_point()}_B"
    rules = [Rule("zero", "C", axis, "step" if flow else "pre", f"{_point(k='0')}_C <- 0")]
    if flow:
        rules.append(Rule("propagate", "C", k, "step", f"{_point(k=k + '-1')}_C from PE {k}-1"))
    rules.append(Rule("accumulate", "C", None, "step", acc))
    if flow:
        rules.append(Rule("send", "C", k, "step", f"{_point()}_C -> {_point(k=k + '+1')}_C"))
    export = f"{_tensor(rec.c)} <- {_point(k=k + '_end')}_C"
    rules.append(Rule("export", "C", axis, "step" if flow else "post", export))
    return rules


def _rotate_rules(
    access: Access, move: Move, space: tuple[str, str], extents: dict[str, int]
) -> list[Rule]:
    """Cannon's ring shift: the block at a point comes from the next PE along the axis."""
    if move != "rotate":
        return []
    axis, x = _missing(access, space), access.name
    ring = _point(**{axis: f"({axis}+1) mod {extents[axis]}"})
    return [Rule("rotate", x, axis, "step", f"{_point()}_{x} <- {ring}_{x}")]


def _check(
    rec: MatmulRecurrence, schedule: MatmulSchedule, rows: int, cols: int, time_tiles: int
) -> None:
    space, time = schedule.space, schedule.time
    if len(set(space)) != 2 or any(v not in VARS for v in space):
        raise ProgramError(
            f"schedule {schedule.name!r}: space must be two distinct variables of {VARS}, "
            f"got {space}"
        )
    for label, move in (("a", schedule.a), ("b", schedule.b)):
        if move not in _MOVES:
            raise ProgramError(
                f"schedule {schedule.name!r}: {label} = {move!r}; choose one of {_MOVES}"
            )
    if rows < 1 or cols < 1 or time_tiles < 1:
        raise ProgramError(
            f"grid {rows}x{cols} with {time_tiles} time blocks: all must be positive"
        )
    tiles = {space[0]: rows, space[1]: cols, time: time_tiles}
    for var in VARS:
        size, n = rec.extent(var), tiles[var]
        if size < 1 or size % n:
            dim = {"i": "M", "j": "N", "k": "K"}[var]
            raise ProgramError(
                f"{schedule.name}: {dim} = {size} cannot be cut into {n} equal blocks along "
                f"{var} ({'grid' if var in space else 'time'} blocks); make {dim} a positive "
                f"multiple of {n} or change the grid / block count"
            )
    for access, move in ((rec.a, schedule.a), (rec.b, schedule.b)):
        stationary = set(access.indices) == set(space)
        if stationary and move != "prefetch":
            raise ProgramError(
                f"schedule {schedule.name!r}: {access.name} is indexed by both space variables "
                f"{space}, so it never moves; use 'prefetch' for it, not {move!r}"
            )
        if not stationary and move == "prefetch":
            raise ProgramError(
                f"schedule {schedule.name!r}: {access.name}[{','.join(access.indices)}] is not "
                f"indexed by {_missing(access, space)}, so it must move along it; choose "
                "'stream', 'broadcast' or 'rotate'"
            )
    rotating = [m == "rotate" for m in (schedule.a, schedule.b)]
    if any(rotating) and (
        not all(rotating) or time != rec.reduction or rows != cols or time_tiles != rows
    ):
        raise ProgramError(
            f"schedule {schedule.name!r}: 'rotate' is Cannon's torus shift; it needs both "
            f"inputs rotating, time = {rec.reduction}, a square grid and as many reduction "
            f"blocks as grid rows (got a={schedule.a}, b={schedule.b}, time={time}, grid "
            f"{rows}x{cols}, {time_tiles} blocks); use grid=(p, p) or 'stream'"
        )


def derive_dataflow(
    rec: MatmulRecurrence, schedule: MatmulSchedule, rows: int, cols: int, time_tiles: int
) -> Dataflow:
    """Rewrite ``rec`` under ``schedule`` on a ``rows`` x ``cols`` grid with ``time_tiles``
    blocks along the time variable into dataflow rules (Cyclotron §8 rewrite rules), in the
    order they act within a time step: arrivals of A and B, forwarding sends, the accumulator
    recurrence and export of C, Cannon's shifts.

    Raises :class:`ProgramError` naming the schedule choice that cannot work and what to pick."""
    _check(rec, schedule, rows, cols, time_tiles)
    space, time = schedule.space, schedule.time
    extents = {space[0]: rows, space[1]: cols}
    inputs = ((rec.a, schedule.a), (rec.b, schedule.b))
    rules: list[Rule] = []
    for access, move in inputs:
        rules += _arrival_rules(access, move, space, time, extents)
    for access, move in inputs:
        rules += _forward_rules(access, move, space)
    rules += _accumulator_rules(rec, space)
    for access, move in inputs:
        rules += _rotate_rules(access, move, space, extents)
    tiles = {**extents, time: time_tiles}
    return Dataflow(rec, schedule, rows, cols, tuple((v, tiles[v]) for v in VARS), tuple(rules))


def format_dataflow(df: Dataflow) -> str:
    """The dataflow recurrences and the space-time mapping as text."""
    sch = df.schedule
    head = [
        f"recurrence: {df.recurrence.text()}",
        f"schedule {sch.name}: {sch.space[0]} -> grid rows ({df.rows}), {sch.space[1]} -> grid "
        f"cols ({df.cols}), {sch.time} -> time ({df.tiles_of(sch.time)} steps); "
        f"A: {sch.a}, B: {sch.b}",
        "blocks: " + ", ".join(f"{v}={df.tiles_of(v)}x{df.block(v)}" for v in VARS),
    ]
    order = {"pre": 0, "step": 1, "post": 2}
    rules = sorted(df.rules, key=lambda r: order[r.stage])
    body = [f"  [{r.stage:<4}] {r.kind:<10} {r.text}" for r in rules]
    return "\n".join(head + body) + "\n"
