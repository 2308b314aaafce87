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
depths (:func:`discover_deep`).  Resuming finds exactly the channels restarting would: the unit
programs make no timing-dependent choices (every receive names its channel, merges follow the
run's arrival order), so they form a Kahn process network (Cyclotron §9.1, DAM's bounded
channels), whose channel histories — and so where it deadlocks — do not depend on timing; a
deeper FIFO only removes blocking, so the deadlocked state is a reachable state of the deeper
network, and its run from there ends where a fresh run would.  For the same reason the rounds
need no timing at all: they run on the programs' untimed replay (:mod:`runtime.replay`, no
clocks, resources or events; :func:`find_deep`), and the timed simulation runs once, with every
channel found already deep.  It is still checked: should it deadlock, the search continues on
it (resumed, then one fresh run).  In hardware a deep FIFO's messages wait in the
consumer's memory unit: their bytes are the consumer's ``fifo_bytes`` (in on-chip memory), and
the deepened channels are listed in the result (``deep_channels``).
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


def find_deep(sim: Simulator, chip: Chip, messages: Mapping[str, int]) -> dict[str, int] | None:
    """The channels (-> depths) the run of ``sim`` must have deepened, found on its untimed
    replay (:meth:`runtime.Simulator.replay`, module docstring): the replay deadlocks where the
    timed run would, so :func:`discover_deep` on it deepens the same channels.  ``None`` when
    the replay cannot decide (an operation it does not model, an error, or a deadlock more
    buffering cannot fix): the caller searches on the timed run, which reports it."""
    deep: dict[str, int] = {}
    try:
        replay = sim.replay()
    except SimulationError:
        return None
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
        replay.close()
    return deep


def run_deepening(
    programs: ProgramSet,
    chip: Chip,
    messages: Mapping[str, int],
    *,
    trace: bool | str | Path = False,
    max_cycles: int | None = None,
    watch: dict[str, int] | None = None,
    checked: bool = False,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[SimResult, ProgramSet, tuple[str, ...]]:
    """Simulate ``programs`` (timing mode), deepening FIFOs that deadlock the run (module
    docstring); ``messages`` is the number of messages each channel carries.  Returns the
    result, the programs that ran and the deepened channels (sorted).  ``watch``: channel
    names whose first-message cycle is written into it (by the run that completes); a name
    mapped to a list gets every message's cycle appended.  ``checked``: ``programs`` passed
    :func:`lowering.validate_programs` (deepening changes only FIFO depths, so every run here
    skips the simulator's own declaration checks).  ``inputs``: HBM contents (the integer
    tensors: control data is real in timing mode).

    The channels to deepen are found first on the untimed replay (:func:`find_deep`), so the
    timed simulation normally runs once; should it still deadlock (or the replay not decide),
    the search goes on in the timed run (resumed, then run afresh)."""
    sim = Simulator(programs, chip, checked=checked, inputs=inputs)
    deep = find_deep(sim, chip, messages) or {}
    for name, depth in deep.items():
        sim.deepen(name, depth)
    if watch is not None:
        sim.watch = watch
    try:
        return sim.run(trace=trace, max_cycles=max_cycles), deepen(programs, deep), _names(deep)
    except DeadlockError as err:
        discover_deep(sim, err, chip, messages, deep)
    while True:
        current = deepen(programs, deep)
        sim = Simulator(current, chip, checked=checked, inputs=inputs)
        if watch is not None:
            for k, v in watch.items():
                watch[k] = [] if isinstance(v, list) else -1
            sim.watch = watch
        try:
            return sim.run(trace=trace, max_cycles=max_cycles), current, _names(deep)
        except DeadlockError as err:  # pragma: no cover - resuming found every channel
            full = sorted(ch for ch in blocked_channels(sim) if ch not in deep)
            if not full:
                raise _annotated(err, deep) from None
            for ch in full:
                deep[ch] = _depth_of(chip, messages, ch)


def _names(deep: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(sorted(deep))


def _annotated(err: DeadlockError, deep: Mapping[str, Any]) -> DeadlockError:
    note = (
        f"\n(FIFOs already made as deep as their streams: {', '.join(sorted(deep))})"
        if deep
        else ""
    )
    return DeadlockError(f"{err}{note}")
