"""FIFO depths of the channels between units: bounded, deepened where the run needs buffering.

Streams become bounded FIFOs (``fifo_depth`` messages, default the chip's ``core.fifo_depth``;
STeP §4.2 runs on DAM's bounded channels).  The reference interpreter runs operators one
after another on unbounded streams; bounded FIFOs can deadlock where a stream *reconverges*
with a path that must take in many elements before it emits one.  The typical case is a MoE
layer: the selector stream feeds the Partition at the front and the Reassemble at the back,
and each expert buffers all of its tokens before it emits anything, so the Reassemble cannot
take a second selector before the Partition has taken the last one — the selector producer
stops on the Reassemble's full FIFO and the Partition starves.

The fix is buffering on the short path, exactly as much as the run needs.  :func:`run_deepening`
simulates; on a :class:`~runtime.DeadlockError` it follows the wait-for graph (each blocked unit
waits on one other: for a message or for FIFO space) to its cycles and makes every full FIFO on a
cycle deep — as deep as the messages it carries in this run, so it never stops its sender
again.  With every channel unbounded the programs cannot deadlock (they follow the reference
run's element order), so this ends after at most one round per channel.  A channel that never
fills stays at its depth, so pipelines without reconvergence keep their exact timing.

Finding the channels does not restart anything each round (a time-multiplexed MoE needs
dozens of rounds, one per lane and reconvergence): the deadlocked run is *resumed* with the new
depths (:func:`discover_deep`).  Resuming finds exactly the channels restarting would when the
unit programs make no timing-dependent choices (every receive names its channel): they form a
Kahn process network (Cyclotron §9.1, DAM's bounded channels), whose channel histories — and so
where it deadlocks — do not depend on timing; a deeper FIFO only removes blocking, so the
deadlocked state is a reachable state of the deeper network, and its run from there ends where
a fresh run would.  For the same reason the rounds need no timing at all: they run on the
programs' untimed replay (:mod:`runtime.replay`, no clocks, resources or events;
:func:`find_deep`), and the timed simulation runs once, with every channel found already deep.

A merge that takes whichever input is ready first (a ``WaitAny``, :mod:`.merge_any`; STeP arXiv
2511.07776 §3.2.3, §5.3) is the one timing-dependent choice: which channels deadlock depends on
the order it takes its inputs in, and that order is the timed run's.  Given an order, though,
the choice is data again — the replay follows it (:attr:`runtime.replay.Replay.order`: each
``WaitAny`` waits for the input recorded next) — and the programs are a Kahn network with a
deep set of their own, ``need(order)``.  The depths are therefore searched as a fixed point of
the timed run and the replay (:func:`run_deepening`): the replay finds ``D = need(order)`` for
an order (its own lowest-ready-index choice the first time), the timed run with ``D`` records
the order its ``WaitAny`` s take (resumed with more channels deep should it deadlock), and the
search stops when that order is the one ``D`` was found for, or ``need`` of it is ``D``.  So the
result is the run whose every choice was made in simulated time, with exactly the channels its
own order needs deep.  A search restarting the timed run after each deadlock keeps every
channel any of its runs needed, so it ends with the same channels when its runs' orders settle
before it deepens one only another order needs (the time-multiplexed MoE layers tested, and
Fig. 9's 4-region run: the same channels and cycles); the replay's first guess, by contrast,
may need channels no timed run does, which is why its deep set is not kept.  Without a
``WaitAny`` the first order is already the run's and the timed simulation runs once; with one it
runs once per round (typically two: a first order is the replay's guess).  Should the rounds
not settle (an order whose deep set makes the timed run take another order, back and forth),
the search keeps every channel any round needed and goes on in the timed run (run afresh after
each deadlock), which ends deadlock-free.

In hardware a deep FIFO's messages wait in the consumer's memory unit: their bytes are the
consumer's ``fifo_bytes`` (in on-chip memory), and the deepened channels are listed in the
result (``deep_channels``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hwmodel.chip import Chip
from lowering.isa import ProgramSet
from runtime import DeadlockError, SimResult, Simulator
from runtime.errors import SimulationError
from runtime.ops_select import watch_key
from runtime.state import fifo_depth

__all__ = ["blocked_channels", "deepen", "discover_deep", "find_deep", "run_deepening"]


def blocked_channels(sim: Simulator) -> set[str]:
    """The full FIFOs on the cycles of a deadlocked simulation's wait-for graph (every blocked
    core waits on one other core: for a message, or for FIFO space).  Deepening them breaks
    every cycle; full FIFOs that merely hang off a cycle are left alone.  Empty when no cycle
    goes through a full FIFO (a deadlock more buffering cannot fix)."""
    nxt = sim.waits()
    out: set[str] = set()
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for start in sorted(nxt):
        path: list[int] = []
        c: int | None = start
        while c is not None and c in nxt and c not in state:
            state[c] = 1
            path.append(c)
            c = nxt[c][0]
        if c is not None and state.get(c) == 1:  # a new cycle: the path from c on
            for k in path[path.index(c) :]:
                ch = nxt[k][1]
                if ch is not None:
                    out.add(ch)
        for k in path:
            state[k] = 2
    return out


def deepen(programs: ProgramSet, depths: Mapping[str, int]) -> ProgramSet:
    """``programs`` with the channels named in ``depths`` given those depths."""
    if not depths:
        return programs
    chans = tuple(
        dataclasses.replace(ch, depth=depths[ch.name]) if ch.name in depths else ch
        for ch in programs.channels
    )
    return dataclasses.replace(programs, channels=chans)


def _depth_of(chip: Chip, messages: Mapping[str, int], ch: str) -> int:
    base = fifo_depth(None, chip)
    return max(base, messages.get(ch, base))


def discover_deep(
    sim: Simulator,
    err: DeadlockError,
    chip: Chip,
    messages: Mapping[str, int],
    deep: dict[str, int],
) -> None:
    """Resume the simulation ``sim``, deadlocked with ``err``, until it completes, deepening in
    place the full FIFOs on every wait cycle it reaches (module docstring); ``deep`` collects
    them (channel -> depth).  Raises the annotated :class:`DeadlockError` when a deadlock has no
    full FIFO on a cycle (more buffering cannot fix it).  The resumed timing is discarded, so
    no cycle limit applies."""
    while True:
        full = sorted(ch for ch in blocked_channels(sim) if ch not in deep)
        if not full:
            raise _annotated(err, deep) from None
        for name in full:
            deep[name] = _depth_of(chip, messages, name)
            sim.deepen(name, deep[name])  # a sender stopped on this FIFO retries its send now
        try:
            sim.resume()
            return
        except DeadlockError as again:
            err = again


def find_deep(
    sim: Simulator,
    chip: Chip,
    messages: Mapping[str, int],
    order: Mapping[str, list[int]] | None = None,
) -> dict[str, int] | None:
    """The channels (-> depths) the run of ``sim`` must have deepened, found on its untimed
    replay (:meth:`runtime.Simulator.replay`, module docstring): the replay deadlocks where the
    timed run would, so :func:`discover_deep` on it deepens the same channels.  ``order``: the
    choices of each ``WaitAny`` register to follow (a timed run's, recorded under
    :func:`runtime.ops_select.watch_key`); without it a ``WaitAny`` takes the lowest ready
    index.  ``None`` when the replay cannot decide (an operation it does not model, an error,
    or a deadlock more buffering cannot fix): the caller searches on the timed run, which
    reports it."""
    found = _replay_deep(sim, chip, messages, order)
    return None if found is None else found[0]


def _replay_deep(
    sim: Simulator,
    chip: Chip,
    messages: Mapping[str, int],
    order: Mapping[str, list[int]] | None,
) -> tuple[dict[str, int], dict[str, list[int]]] | None:
    """:func:`find_deep`, and the choices each ``WaitAny`` register made in the replay."""
    deep: dict[str, int] = {}
    try:
        replay = sim.replay()
    except SimulationError:
        return None
    replay.order = dict(order or {})
    try:
        replay.run()
    except DeadlockError as err:
        try:
            discover_deep(replay, err, chip, messages, deep)
        except SimulationError:
            return None
    except SimulationError:
        return None
    finally:
        chosen = dict(replay.chosen)
        replay.close()
    return deep, chosen


#: Rounds of the order search (module docstring) before it keeps every channel found.
MAX_ROUNDS = 6


def run_deepening(
    programs: ProgramSet,
    chip: Chip,
    messages: Mapping[str, int],
    *,
    trace: bool | str | Path = False,
    max_cycles: int | None = None,
    watch: dict[str, Any] | None = None,
    checked: bool = False,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[SimResult, ProgramSet, tuple[str, ...]]:
    """Simulate ``programs`` (timing mode), deepening FIFOs that deadlock the run (module
    docstring); ``messages`` is the number of messages each channel carries.  Returns the
    result, the programs that ran and the deepened channels (sorted).  ``watch``: channel
    names whose first-message cycle is written into it (by the run returned); a name mapped
    to a list gets every message's cycle appended (a ``WaitAny`` register's
    :func:`runtime.ops_select.watch_key`: its choices).  ``checked``: ``programs`` passed
    :func:`lowering.validate_programs` (deepening changes only FIFO depths, so every run here
    skips the simulator's own declaration checks).  ``inputs``: HBM contents (the integer
    tensors: control data is real in timing mode).

    The channels to deepen are found on the untimed replay (:func:`find_deep`), for the order
    the timed run takes its ``WaitAny`` s in (the fixed point of the module docstring); should
    the replay not decide, or the rounds not settle, the search goes on in the timed run."""
    given = set(watch) if watch is not None else set()
    try:
        return _Search(programs, chip, messages, trace, max_cycles, watch, checked, inputs).run()
    finally:
        if watch is not None:  # the choices recorded for the search only
            for k in set(watch) - given:
                del watch[k]


def _watching(
    sim: Simulator, watch: dict[str, Any] | None, chose: Mapping[str, list[int]]
) -> dict[str, Any]:
    """Give run ``sim`` the caller's ``watch`` (reset: only the returned run's entries count)
    with a record of every ``WaitAny`` register of ``chose`` added; the record is returned."""
    if watch is not None:
        for k, v in watch.items():
            watch[k] = [] if isinstance(v, list) else -1
    log = watch if watch is not None else {}
    for reg in chose:
        log.setdefault(watch_key(reg), [])
    sim.watch = log or None
    return log


@dataclasses.dataclass(frozen=True)
class _Search:
    """:func:`run_deepening`'s search (module docstring) over its arguments."""

    programs: ProgramSet
    chip: Chip
    messages: Mapping[str, int]
    trace: bool | str | Path
    max_cycles: int | None
    watch: dict[str, Any] | None
    checked: bool
    inputs: Mapping[str, Any] | None

    def simulator(self, programs: ProgramSet | None = None) -> Simulator:
        return Simulator(
            self.programs if programs is None else programs,
            self.chip,
            checked=self.checked,
            inputs=self.inputs,
        )

    def simulate(self, sim: Simulator) -> SimResult:
        return sim.run(trace=self.trace, max_cycles=self.max_cycles)

    def run(self) -> tuple[SimResult, ProgramSet, tuple[str, ...]]:
        """The fixed point of the timed run's ``WaitAny`` order and the replay's deep set."""
        chip, messages = self.chip, self.messages
        sim = self.simulator()
        found = _replay_deep(sim, chip, messages, None)
        if found is None:
            return self.timed(sim, {})
        deep, chose = found
        tried: list[dict[str, int]] = []
        for _ in range(MAX_ROUNDS):
            for name, depth in deep.items():
                sim.deepen(name, depth)
            log = _watching(sim, self.watch, chose)
            result: SimResult | None
            try:
                result = self.simulate(sim)
            except DeadlockError as err:
                if not chose:  # no choice to search: a Kahn network, the channels it blocks on
                    discover_deep(sim, err, chip, messages, deep)
                    return self.fresh(deep)
                # the order it takes from here on is the resumed run's: the next round's guess
                discover_deep(sim, err, chip, messages, dict(deep))
                result = None
            order = {reg: list(log[watch_key(reg)]) for reg in chose}
            if result is not None and order == chose:  # deep is the need of the run's own order
                return result, deepen(self.programs, deep), _names(deep)
            tried.append(deep)
            sim = self.simulator()
            found = _replay_deep(sim, chip, messages, order)
            if found is None:
                break
            if result is not None and found[0] == deep:  # the run's order needs exactly deep
                return result, deepen(self.programs, deep), _names(deep)
            deep, chose = found
            if deep in tried:  # the rounds go back and forth between orders
                break
        every = {k: v for d in (*tried, deep) for k, v in d.items()}
        return self.timed(self.simulator(), every)

    def timed(
        self, sim: Simulator, deep: dict[str, int]
    ) -> tuple[SimResult, ProgramSet, tuple[str, ...]]:
        """The search on the timed run ``sim`` with ``deep`` deep: resumed after its deadlocks
        until it completes, then run afresh with every channel found, after a deadlock again
        with the channels it blocks on, until a run completes."""
        for name, depth in deep.items():
            sim.deepen(name, depth)
        _watching(sim, self.watch, {})
        try:
            return self.simulate(sim), deepen(self.programs, deep), _names(deep)
        except DeadlockError as err:
            discover_deep(sim, err, self.chip, self.messages, deep)
        return self.fresh(deep)

    def fresh(self, deep: dict[str, int]) -> tuple[SimResult, ProgramSet, tuple[str, ...]]:
        """Run the programs afresh with ``deep`` deep, after a deadlock again with the channels
        it blocks on too, until a run completes."""
        while True:
            current = deepen(self.programs, deep)
            sim = self.simulator(current)
            _watching(sim, self.watch, {})
            try:
                return self.simulate(sim), current, _names(deep)
            except DeadlockError as err:  # pragma: no cover - resuming found every channel
                full = sorted(ch for ch in blocked_channels(sim) if ch not in deep)
                if not full:
                    raise _annotated(err, deep) from None
                for ch in full:
                    deep[ch] = _depth_of(self.chip, self.messages, ch)


def _names(deep: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(sorted(deep))


def _annotated(err: DeadlockError, deep: Mapping[str, Any]) -> DeadlockError:
    note = (
        f"\n(FIFOs already made as deep as their streams: {', '.join(sorted(deep))})"
        if deep
        else ""
    )
    return DeadlockError(f"{err}{note}")
