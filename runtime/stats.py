"""Frozen results of a simulation: per-core cycle breakdown, per-resource utilisation, bytes moved,
event counts, and the printable summary.

Every cycle of every core is in exactly one category: ``busy`` (running a kernel),
``stall_recv`` (waiting for a message or control value), ``stall_send`` (waiting for FIFO space,
or for a Send still reading a buffer about to be overwritten), ``stall_mem`` (waiting for an HBM
Load/Store/LoadValue), ``stall_barrier`` (waiting at a barrier), ``idle`` (after the core's
program ended, or no program).  So ``busy + stalls + idle == cycles`` for every core.
Resource ``busy`` counts the cycles a link / port / HBM channel is occupied by a transfer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CoreStats", "ResourceStats", "EventCounts", "SimStats", "SimResult"]


@dataclass(frozen=True, slots=True)
class CoreStats:
    """Cycle breakdown of one core; ``finish`` is the cycle its program ended (0 without one)."""

    core: int
    busy: int
    stall_recv: int
    stall_send: int
    stall_mem: int
    stall_barrier: int
    idle: int
    finish: int
    instructions: int
    sram_peak_bytes: int


@dataclass(frozen=True, slots=True)
class ResourceStats:
    """One link / port / HBM channel: cycles occupied, bytes carried, transfers served."""

    name: str
    kind: str
    busy: float  # cycles occupied (fractional when bytes / bandwidth is)
    bytes: int
    transfers: int
    utilisation: float


@dataclass(frozen=True, slots=True)
class EventCounts:
    """What the simulator processed (see :mod:`runtime.engine` for what an event is).  Each
    event is counted once, when the engine processes it; work done in closed form is counted
    separately (``fast_forwarded``, ``closed_form_grants``) and is not an event."""

    instructions: int  # instructions simulated, fast-forwarded ones included
    stepped: int  # operations the sequencers executed one by one (incl. loop back-edges)
    fast_forwarded: int  # instructions advanced in closed form
    reservations: int  # resource grants the engine computed (a link, a port, an HBM channel class)
    deliveries: int  # payloads delivered: a message into a FIFO, an HBM access's data to its core
    queue_pops: int  # entries taken off the event queue
    closed_form_grants: int = 0  # per-channel HBM grants served in closed form with their class

    @property
    def events(self) -> int:
        """Simulated events: stepped operations + reservations + deliveries."""
        return self.stepped + self.reservations + self.deliveries


@dataclass(frozen=True, slots=True)
class SimStats:
    """All statistics of one run."""

    cycles: int
    cores: tuple[CoreStats, ...]
    links: tuple[ResourceStats, ...]
    hbm_channels: tuple[ResourceStats, ...]
    ports: tuple[ResourceStats, ...]
    bytes_moved: tuple[tuple[str, int], ...]
    events: EventCounts

    def core(self, i: int) -> CoreStats:
        """Statistics of core ``i``."""
        return self.cores[i]

    def resource(self, name: str) -> ResourceStats:
        """A link, port or HBM channel by name."""
        for r in self.links + self.hbm_channels + self.ports:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def hbm_utilisation(self) -> float:
        """Mean HBM channel utilisation."""
        ch = self.hbm_channels
        return sum(r.busy for r in ch) / (len(ch) * self.cycles) if ch and self.cycles else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d = asdict(self)
        d["events"]["events"] = self.events.events
        return d


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`runtime.simulate`: ``cycles``, ``stats``, final HBM ``tensors``
    (functional mode: every tensor; timing mode: the bound integer tensors), trace events."""

    cycles: int
    stats: SimStats
    tensors: dict[str, np.ndarray] = field(compare=False)
    mode: str
    chip: str
    clock_ghz: float
    trace_events: tuple[dict[str, Any], ...] = ()
    wall_seconds: float = field(default=0.0, compare=False)
    #: ``(core, template, shift, cycle, categories)`` each time a core started a copy of an
    #: equal layer's section (:mod:`runtime.program_layers`; its template's first operation,
    #: the copy's name shift, the core's clock and its cycles so far per category of
    #: :data:`runtime.state.CATEGORIES`), in the order they ran; recorded when the run was
    #: asked to (``copy_starts=True``), else empty
    copy_starts: tuple[tuple[int, int, int, int, tuple[int, ...]], ...] = field(
        default=(), compare=False, repr=False
    )
    #: per copy shift (one per layer), when its first copy started: ``(core, template, cycle,
    #: backlog)``, the state of the shared resources, the event queue and the cores then
    #: (:func:`runtime.backlog.backlog`); recorded with ``copy_starts``
    copy_marks: dict[int, tuple] = field(default_factory=dict, compare=False, repr=False)

    @property
    def seconds(self) -> float:
        """Simulated wall-clock time at the chip's clock."""
        return self.cycles / (self.clock_ghz * 1e9)

    def trace_json(self) -> str:
        """The Chrome trace-event JSON text (opens in ui.perfetto.dev and chrome://tracing)."""
        doc = {
            "traceEvents": list(self.trace_events),
            "otherData": {
                "chip": self.chip,
                "clock_ghz": self.clock_ghz,
                "time_unit": "1 trace microsecond = 1 cycle",
                "cycles": self.cycles,
            },
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    def write_trace(self, path: str | Path) -> Path:
        """Write the trace JSON to ``path`` (run with ``trace=True`` to record events)."""
        p = Path(path)
        p.write_text(self.trace_json())
        return p

    def summary(self) -> str:
        """A printable report."""
        s = self.stats
        lines = [
            f"{self.mode} simulation on {self.chip}: {s.cycles} cycles "
            f"({self.seconds * 1e6:.3f} us at {self.clock_ghz} GHz)"
        ]
        act = [c for c in s.cores if c.finish or c.instructions]
        if act and s.cycles:
            tot = len(act) * s.cycles
            parts = ("busy", "stall_recv", "stall_send", "stall_mem", "stall_barrier", "idle")
            share = "  ".join(f"{p} {sum(getattr(c, p) for c in act) / tot:6.1%}" for p in parts)
            lines.append(f"cores with programs: {len(act)}   {share}")
            lines.append(f"peak SRAM per core: {max(c.sram_peak_bytes for c in act)} bytes")
        for label, group in (
            ("links", s.links),
            ("ports", s.ports),
            ("hbm channels", s.hbm_channels),
        ):
            used = [r for r in group if r.transfers]
            if used:
                top = max(used, key=lambda r: (r.utilisation, r.name))
                mean = sum(r.utilisation for r in group) / len(group)
                lines.append(
                    f"{label}: {len(used)}/{len(group)} used, mean utilisation {mean:.1%}, "
                    f"busiest {top.name} {top.utilisation:.1%}"
                )
        lines.append("bytes moved: " + ", ".join(f"{k} {v}" for k, v in s.bytes_moved))
        e = s.events
        lines.append(
            f"events: {e.events} ({e.stepped} operations stepped, {e.fast_forwarded} instructions "
            f"fast-forwarded, {e.reservations} reservations, {e.deliveries} deliveries, "
            f"{e.queue_pops} queue pops); {e.closed_form_grants} HBM channel grants served "
            f"in closed form (not events)"
        )
        return "\n".join(lines)
