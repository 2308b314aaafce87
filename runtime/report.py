"""Turning a finished (or stuck) simulation into its results: statistics, trace, deadlock text."""

from __future__ import annotations

from typing import Any

from hwmodel.chip import Chip, MeshNoC
from runtime.checks import describe
from runtime.state import Core, Post
from runtime.stats import CoreStats, EventCounts, ResourceStats, SimResult, SimStats
from runtime.trace import build_trace

__all__ = ["core_name", "deadlock_message", "build_result", "wait_for"]


def core_name(chip: Chip, cid: int) -> str:
    """``core 5`` or, on a mesh, ``core 5 (r0c5)``."""
    noc = chip.noc
    if isinstance(noc, MeshNoC):
        r, c = divmod(cid, noc.cols)
        return f"core {cid} (r{r}c{c})"
    return f"core {cid}"


def _why(core: Core, finished: set[int]) -> str:
    why = core.blocked
    if why is None:
        return "is runnable but was never resumed (internal error)"
    kind = why[0]
    if kind in ("buf", "value"):
        p = why[-1]
        target = f"buffer {why[1].name!r}" if kind == "buf" else "a control value"
        if isinstance(p, Post) and p.end is not None:
            ch = p.end.chan
            state = (
                f"core {ch.src} finished without sending it"
                if ch.src in finished
                else "no message has been sent on it yet"
            )
            return (
                f"waits for {target} from a receive on channel {ch.name!r} (sent by core "
                f"{ch.src}); {state}"
            )
        return f"waits for {target}: HBM access to {getattr(p, 'what', '?')!r}"
    if kind == "credit":
        end = why[1]
        ch = end.chan
        done = f" (core {end.dst} has finished)" if end.dst in finished else ""
        return (
            f"waits for space in the FIFO of channel {ch.name!r} to core {end.dst}: all "
            f"{ch.depth} slots hold messages core {end.dst} has not received{done}"
        )
    if kind == "any":  # a WaitAny (runtime.ops_select)
        return f"waits for a message on any of channels {[e.chan.name for e in why[1]]}"
    if kind == "barrier":
        g = why[1]
        here = {c.id for c in g.arrived}
        missing = [c for c in g.members if c not in here]
        return f"waits at barrier {g.name!r} for cores {missing}"
    return f"waits for HBM access to {why[1].what!r}"


def _waits_on(core: Core) -> tuple[int | None, str | None]:
    why = core.blocked
    if why is None or core.done:
        return None, None
    if why[0] == "credit":
        end = why[1]
        return end.dst, end.chan.name
    post = why[-1] if why[0] in ("buf", "value") else None
    end = getattr(post, "end", None)
    if end is not None:
        return end.chan.src, None
    return None, None


def wait_for(sim: Any) -> dict[int, tuple[int | None, str | None]]:
    """The wait-for graph of a stuck simulation: for every unfinished core, the core it waits
    on and, for a full FIFO, the channel — ``(core, channel)``; ``(None, None)`` for waits on
    HBM or barriers, which no single core holds up."""
    return {c.id: _waits_on(c) for c in sim.comp.active if not c.done}


def deadlock_message(sim: Any) -> str:
    """Every unfinished core with its instruction and what it waits on."""
    stuck = [c for c in sim.comp.active if not c.done]
    finished = {c.id for c in sim.comp.active if c.done}
    lines = [
        f"deadlock at cycle {sim.now}: {len(stuck)} core(s) are blocked and nothing is in "
        f"flight (program set {sim.programs.name!r})"
    ]
    for c in stuck:
        ins = c.code[c.pc].src
        lines.append(f"  {core_name(sim.chip, c.id)} at `{describe(ins)}` {_why(c, finished)}")
    lines.append(
        "Each core waits on another: reorder Sends before the Recvs they feed, make FIFOs "
        "deeper, or make every barrier member reach the barrier."
    )
    return "\n".join(lines)


def _num(x: float) -> int | float:
    """Whole cycles as ints, fractional ones rounded to 1/1000 cycle (stable output)."""
    r = round(x, 3)
    return int(r) if r == int(r) else r


def event_counts(sim: Any) -> EventCounts:
    """What the simulator has processed so far (:mod:`runtime.engine`: what an event is)."""
    cores = sim.comp.cores
    stepped = sum(c.stepped for c in cores)
    ff = sum(c.ff for c in cores)
    # per-channel HBM grants counted per resource (``rs``) but computed once per channel class
    closed = 0 if sim.attached else sum(sim.rs[r][3] for r in sim.chan_res) - sim.n_cls
    grants = sum(r[3] for r in sim.rs)
    return EventCounts(stepped + ff, stepped, ff, grants - closed, sim.n_deliv, sim.n_pops, closed)


def build_result(sim: Any, wall: float) -> SimResult:
    """Freeze the simulator's counters into a :class:`SimResult`."""
    comp = sim.comp
    cycles = max((c.finish for c in comp.active), default=0)
    cores = []
    for c in comp.cores:
        st = c.st
        idle = cycles - sum(st)
        assert idle >= 0, (c.id, st, cycles)
        cores.append(CoreStats(c.id, *st, idle, c.finish, c.stepped + c.ff, c.sram_peak))
    groups: dict[str, list[ResourceStats]] = {"link": [], "hbm": [], "port": []}
    link_bytes = 0
    res = sim.fabric.res
    for r, (_, busy_f, nbytes, grants, _) in zip(res, sim.rs):
        busy = _num(busy_f)
        util = busy / cycles if cycles else 0.0
        groups["port" if r.kind in ("inject", "eject") else r.kind].append(
            ResourceStats(r.name, r.kind, busy, nbytes, grants, util)
        )
        if r.kind != "hbm":
            link_bytes += nbytes
    stats = SimStats(
        cycles,
        tuple(cores),
        tuple(groups["link"]),
        tuple(groups["hbm"]),
        tuple(groups["port"]),
        (
            ("hbm_read", sim.hbm_rd),
            ("hbm_write", sim.hbm_wr),
            ("noc_messages", sim.msg_bytes),
            ("noc_link_traffic", link_bytes),
        ),
        event_counts(sim),
    )
    trace_events: tuple = ()
    if sim.tracing:
        trace_events = build_trace(
            sim.ctrace,
            sim.rtrace,
            [r.name for r in res],
            [r.kind for r in res],
            [core_name(sim.chip, i) for i in range(sim.chip.num_cores)],
            cycles,
            _num,
        )
    chip = sim.chip
    return SimResult(
        cycles,
        stats,
        dict(sim.hbm_data),
        sim.mode,
        chip.name,
        chip.clock_ghz,
        trace_events,
        wall,
        tuple(sim.copy_starts or ()),
        dict(getattr(sim, "copy_marks", None) or {}),
    )
