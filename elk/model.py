"""The scheduler's data (ELK §4.2-§4.5): an operator as the scheduler sees it (:class:`Item`),
the knobs of the §6.1 designs (:class:`Policy`) and a schedule (:class:`Step`,
:class:`Timeline`).  :mod:`elk.schedule` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from elk.allocate import Option

__all__ = ["Item", "Policy", "Step", "Timeline"]


@dataclass(frozen=True, slots=True)
class Item:
    """One operator as the scheduler sees it.

    ``execs``: execute-state plans, Pareto (space ascending); ``contended[e]``: the time of plan
    ``e`` while preloads share the interconnect (defaults to the plain time); ``preloads[e]``:
    the preload-state plans of exec plan ``e``, Pareto, ``time`` = data-distribution cycles;
    ``grids[e]``: the core grid (rows, columns) of exec plan ``e`` (for the per-core SRAM check);
    ``load``: preload cycles (HBM), or ``loads[e]`` per exec plan; ``after``: the index of the
    operator whose execution decides what this one preloads (a routed expert: its preload is
    issued only once the routing has executed, ELK §7), ``-1``: none; ``hbm_bytes``: bytes
    read from HBM; ``layer``/``slot``: which layer and position in it (identical layers share
    slots, ELK §4.4); ``ports[e]``: cycles one core's network port spends receiving its share
    of the preload when the operator will execute with plan ``e`` (see :func:`_queued`);
    ``slacks[e]``: cycles into execution with plan ``e`` before its kernel needs the last
    preloaded piece (its preload must end by then, not by the execution's start);
    ``quiets[e]``: cycles into execution with plan ``e`` before a message sent during it
    reaches one of its cores (a preload queued on its ports holds it up only from then on);
    ``hbm_input``: the execution reads its input activation from HBM (behind the preload
    requests the HBM channels already queue); ``hbm_output``: it stores its output to HBM
    (the next operator reads it from there); ``hbm_time``: HBM cycles of its preload;
    ``first_loads[e]``: its preload cycles when issued before the first ``execute`` (all cores
    at once; ``loads`` are those issued as a go token reaches the cores)."""

    name: str
    execs: tuple[Option, ...]
    preloads: tuple[tuple[Option, ...], ...]
    load: float
    hbm_bytes: int = 0
    contended: tuple[float, ...] = ()
    layer: int = 0
    slot: int = 0
    loads: tuple[float, ...] = ()
    core_spaces: tuple[int, ...] = ()
    after: int = -1
    grids: tuple[tuple[int, int], ...] = ()
    ports: tuple[float, ...] = ()
    front: int = 0
    slacks: tuple[float, ...] = ()
    quiets: tuple[float, ...] = ()
    hbm_input: bool = False
    hbm_output: bool = False
    hbm_time: float = 0.0
    first_loads: tuple[float, ...] = ()

    @property
    def pareto(self) -> int:
        """How many of ``execs`` form the space/time Pareto curve (the rest, ``front`` on,
        are plans only a faster preload recommends; the allocation and the fixed-rule designs
        use the curve)."""
        return self.front or len(self.execs)

    @property
    def fastest(self) -> int:
        """The fastest exec plan."""
        return self.pareto - 1

    def exec_core_space(self, e: int) -> float:
        """Bytes per core of exec plan ``e`` (``core_spaces``; else its total space)."""
        return self.core_spaces[e] if self.core_spaces else self.execs[e].space

    def slack(self, e: int) -> float:
        """Cycles into execution with plan ``e`` its preload may still arrive.  An execution
        that reads its input from HBM gets that read behind the preload's requests at the
        channels, which serve them at HBM pace; on the edge-fed mesh (the only chip where
        ``hbm_input`` is set) the grid's first column, at the west edge, receives it while
        the edge links still carry the preload, so the kernel overlaps the last pieces as
        any other does."""
        return self.slacks[e] if self.slacks else 0.0

    def quiet(self, e: int) -> float:
        """Cycles into execution with plan ``e`` before its cores receive a message."""
        return self.quiets[e] if self.quiets else 0.0

    def load_time(self, e: int) -> float:
        """Preload cycles when the operator will execute with plan ``e``."""
        return self.loads[e] if self.loads else self.load

    def first_load_time(self, e: int) -> float:
        """Preload cycles with exec plan ``e`` when issued before the first ``execute``, by
        every core at once (``first_loads``; else :meth:`load_time`)."""
        return self.first_loads[e] if self.first_loads else self.load_time(e)

    def exec_time(self, e: int, busy: bool | float) -> float:
        """Cycles of exec plan ``e``; ``busy``: preloads share the interconnect for the whole
        execution (``True``) or for ``busy`` cycles of it (ELK §4.3: the contention overhead
        grows with the preload traffic that overlaps the execution)."""
        t = self.execs[e].time
        if not busy or not self.contended:
            return t
        extra = self.contended[e] - t
        if busy is True:
            return t + extra
        return t + extra * min(1.0, float(busy) / t) if t > 0 else t


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the designs of ELK §6.1 (see :mod:`elk.designs`).

    ``capacity``: on-chip bytes; ``max_ahead``: at most this many operators that preload data
    resident (Basic: 1; operators without HBM data have nothing to preload and do not count);
    ``contention``: charge interconnect contention; ``zero_dist``: data distribution is free
    (Ideal); ``exec_space``: a fixed execute-space size (Static), taken out of ``capacity``
    whatever the executing operator uses; ``exec_core``: with ``exec_space``, the per-core
    execute space an exec plan's per-core footprint must fit (Static); ``preload_mode``:
    ``"pareto"`` (allocation chooses), ``"largest"`` or ``"smallest"`` (Static);
    ``fastest_exec``: always the fastest plan (Basic); ``window``: consider at most this many
    preload numbers per operator (K of ELK §4.2; ``None``: all); ``beam``: keep at most this many
    non-dominated suffixes per ``(operator, P)`` (``None``: all, exact); ``core_sram``: one
    core's SRAM: an exec plan whose grid must share cores with resident operators' grids
    (``workers`` cores, or a ``mesh`` of rows x columns) has to fit there with all of them;
    ``plan_branch``: besides the allocation's fastest fitting exec plan, keep a suffix for the
    fastest plan of every other set of resident operators the plan's grid must share cores
    with (:func:`_branches`: a smaller grid the resident operators' preloads do not queue on,
    ELK §4.3 trades execution time against interconnect contention); ``paced``: on an
    all-to-all chip a preload's pieces reach the cores at HBM pace whatever the executions send
    (ELK §5's emulator: one controller core broadcasts every preload to all cores, saturating
    the receivers' inbound links), so an execution sharing cores with it slows by the port
    cycles they take beyond its free ones (:func:`elk.contention._paced`); by default they
    yield to execute traffic at the ports (this project's ``runtime.network``);
    ``window_data``: count ``window`` in operators that preload data (:func:`elk.schedule._top`)."""

    capacity: float
    max_ahead: int | None = None
    contention: bool = True
    zero_dist: bool = False
    exec_space: float | None = None
    exec_core: float | None = None
    preload_mode: str = "pareto"
    fastest_exec: bool = False
    window: int | None = None
    beam: int | None = None
    core_sram: float | None = None
    workers: int = 0
    mesh: tuple[int, int] | None = None
    plan_branch: bool = False
    paced: bool = False
    window_data: bool = False

    def must_share(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        """Whether two core grids necessarily share a core: on an all-to-all chip when they
        need more cores than there are, on a mesh when they fit side by side neither in rows
        nor in columns."""
        if self.mesh is not None:
            return a[0] + b[0] > self.mesh[0] and a[1] + b[1] > self.mesh[1]
        return a[0] * a[1] + b[0] * b[1] > self.workers


@dataclass(frozen=True, slots=True)
class Step:
    """The decision for one operator: ``P`` preloads issued before it, exec plan, preload plan
    of the next operator (``-1``: not resident), step start/end, duration, on-chip space."""

    op: int
    P: int
    exec_plan: int
    next_preload: int
    start: float
    end: float
    time: float
    space: int
    busy: bool
    stall: float = 0.0
    lead: float = 0.0


@dataclass(frozen=True, slots=True)
class Timeline:
    """A complete schedule: steps per operator, preload start/end per operator, the order."""

    order: tuple[int, ...]
    steps: tuple[Step, ...]
    preload_start: tuple[float, ...]
    preload_end: tuple[float, ...]
    total: float
    preload_plan: tuple[int, ...] = field(default=())

    def preload_number(self, i: int) -> int:
        """Operators resident (preloaded, not yet executed) while ``i`` executes."""
        pos = {op: k for k, op in enumerate(self.order)}
        return sum(1 for j in range(i + 1, len(self.steps)) if pos[j] < self.steps[i].P)
