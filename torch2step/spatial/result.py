"""What a spatial simulation reports: :class:`SpatialResult` and its per-unit :class:`UnitRecord`.

Everything a latency report needs (``torch2step.report.Report``):

* latency: ``cycles`` and ``seconds`` (first instruction to the last unit's end, the last HBM
  write included);
* traffic and work: ``hbm_bytes`` (``hbm_read_bytes + hbm_write_bytes``, moved by the
  simulator), ``flops`` (tile functions of this run), ``noc_bytes`` (messages between units);
* the roofline: ``roofline`` cycles (chip-level bound, :func:`~.simulate.roofline_cycles`) and
  ``roofline_fraction``;
* memory: ``peak_onchip_bytes`` (SRAM the units' buffers take, summed over units, plus
  ``fifo_bytes``: what FIFOs deepened to let the run complete may hold, ``deep_channels``);
  ``memory_notes``: the units whose bytes span several cores' SRAM (:mod:`.sram`);
* where the time goes: ``breakdown`` (unit-cycles by category summed over units),
  ``by_kind`` (the same per STeP operator class), ``units`` (one :class:`UnitRecord` each,
  ``unit_rows()`` as plain dictionaries);
* ``utilisation`` of HBM channels, NoC links and compute;
* cost of simulating: ``events``, ``plan_s``, ``sim_s``, ``wall_s``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtime import SimResult, SimStats
from runtime.errors import SimulationError

from .placement import Placement

__all__ = ["UnitRecord", "SpatialResult", "CATEGORIES"]

#: Cycle categories of a unit (every cycle of the run is in exactly one): ``busy`` — unit steps
#: (the §4.2 roofline cycles of its elements); ``stall_recv`` — waiting for an input element;
#: ``stall_send`` — waiting for FIFO space downstream (back-pressure); ``stall_mem`` — waiting
#: for HBM; ``idle`` — after its program ended.
CATEGORIES = ("busy", "stall_recv", "stall_send", "stall_mem", "idle")


@dataclass(frozen=True, slots=True)
class UnitRecord:
    """One unit after the run: its operators (``ops``, primary first; ``kinds`` their classes),
    ``cores`` (program core first, then extra memory units), cycle breakdown (``busy`` +
    ``stall_recv`` + ``stall_send`` + ``stall_mem`` + ``idle`` = the run's cycles), ``finish``
    cycle, ``flops`` of its tile functions, ``sram_bytes`` its buffers held at the simulated
    peak of its core (a buffer allocated at a bound counts what it held), ``fifo_bytes`` its
    deepened input FIFOs may hold (:mod:`.fifos`) and the elements it
    ``received`` / ``sent``."""

    name: str
    ops: tuple[str, ...]
    kinds: tuple[str, ...]
    cores: tuple[int, ...]
    busy: int
    stall_recv: int
    stall_send: int
    stall_mem: int
    idle: int
    finish: int
    flops: int
    sram_bytes: int
    fifo_bytes: int
    received: int
    sent: int

    @property
    def kind(self) -> str:
        """Operator class of the unit's primary node."""
        return self.kinds[0]


@dataclass(frozen=True)
class SpatialResult:
    """Outcome of :func:`~.simulate.simulate_graph` (see the module docstring for the fields).

    ``stats`` / ``sim`` are the simulator's own statistics and result; ``plan`` the programs
    that ran; ``placement`` where each unit sat; ``deep_channels`` the streams whose FIFOs had
    to be as deep as the stream for the run to complete (:mod:`.fifos`)."""

    graph: str
    chip: str
    cycles: int
    seconds: float
    hbm_read_bytes: int
    hbm_write_bytes: int
    noc_bytes: int
    flops: int
    roofline: int
    peak_flops_per_cycle: int
    units: tuple[UnitRecord, ...]
    stats: SimStats
    events: int
    plan_s: float
    sim_s: float
    placement: Placement
    sim: SimResult = field(repr=False, compare=False)
    plan: Any = field(repr=False, compare=False)
    deep_channels: tuple[str, ...] = ()
    memory_notes: tuple[str, ...] = ()

    # -- headline numbers --------------------------------------------------------------------

    @property
    def hbm_bytes(self) -> int:
        """Bytes moved to and from HBM in the simulation."""
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def wall_s(self) -> float:
        """Wall-clock seconds of plan building plus simulation."""
        return self.plan_s + self.sim_s

    @property
    def roofline_fraction(self) -> float:
        """``roofline / cycles``: how close the run is to the chip-level bound (<= 1)."""
        return self.roofline / self.cycles if self.cycles else 0.0

    @property
    def peak_onchip_bytes(self) -> int:
        """On-chip bytes of all units' buffers at their cores' simulated peaks (each unit
        allocates its buffers once; one allocated at a bound counts the most it held in this
        run, ``lowering.isa.Alloc.held``, so the sum is the run's peak) plus what their deep
        FIFOs may hold (:attr:`fifo_bytes`)."""
        return sum(u.sram_bytes + u.fifo_bytes for u in self.units)

    @property
    def fifo_bytes(self) -> int:
        """Bytes the deepened FIFOs may hold (every message of their streams, :mod:`.fifos`),
        summed over their consumers."""
        return sum(u.fifo_bytes for u in self.units)

    @property
    def cores_used(self) -> int:
        """Cores taken by the units, extra memory units included."""
        return self.placement.cores_used

    # -- where the time goes -----------------------------------------------------------------

    @property
    def breakdown(self) -> dict[str, int]:
        """Unit-cycles per category (:data:`CATEGORIES`) summed over all units; the values add
        up to ``len(units) * cycles``."""
        return {c: sum(getattr(u, c) for u in self.units) for c in CATEGORIES}

    @property
    def by_kind(self) -> dict[str, dict[str, int]]:
        """Per STeP operator class (of the units' primary nodes): ``units`` (how many),
        ``flops`` and unit-cycles per category (:data:`CATEGORIES`), sorted by busy cycles
        (most first, then name)."""
        out: dict[str, dict[str, int]] = {}
        for u in self.units:
            row = out.setdefault(u.kind, {"units": 0, "flops": 0, **dict.fromkeys(CATEGORIES, 0)})
            row["units"] += 1
            row["flops"] += u.flops
            for c in CATEGORIES:
                row[c] += getattr(u, c)
        return dict(sorted(out.items(), key=lambda kv: (-kv[1]["busy"], kv[0])))

    def unit(self, name: str) -> UnitRecord:
        """The record of the unit executing node ``name``."""
        primary = self.placement.unit(name).name
        return next(u for u in self.units if u.name == primary)

    def unit_rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dictionary per unit (the fields of :class:`UnitRecord`)."""
        return [asdict(u) for u in self.units]

    @property
    def utilisation(self) -> dict[str, float]:
        """Fractions of the run's cycles: ``hbm`` — mean busy share of the HBM channels;
        ``noc_links`` — mean busy share of the NoC links (or all-to-all ports) that carried
        traffic, ``noc_links_peak`` — of the busiest one; ``units_busy`` — mean busy share of
        the units; ``compute`` — FLOPs over the peak of the cores the units occupy."""
        s, n = self.stats, self.cycles
        if not n:
            return dict.fromkeys(
                ("hbm", "noc_links", "noc_links_peak", "units_busy", "compute"), 0.0
            )
        used = [r for r in s.links + s.ports if r.transfers]
        cores = self.cores_used
        return {
            "hbm": s.hbm_utilisation,
            "noc_links": sum(r.busy for r in used) / (len(used) * n) if used else 0.0,
            "noc_links_peak": max((r.busy for r in used), default=0.0) / n,
            "units_busy": sum(u.busy for u in self.units) / (len(self.units) * n)
            if self.units
            else 0.0,
            "compute": self.flops / (cores * self.peak_flops_per_cycle * n) if cores else 0.0,
        }

    # -- output --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The headline numbers, breakdowns and unit rows as a JSON-ready dictionary."""
        return {
            "graph": self.graph,
            "chip": self.chip,
            "cycles": self.cycles,
            "seconds": self.seconds,
            "hbm_bytes": self.hbm_bytes,
            "hbm_read_bytes": self.hbm_read_bytes,
            "hbm_write_bytes": self.hbm_write_bytes,
            "noc_bytes": self.noc_bytes,
            "flops": self.flops,
            "roofline_cycles": self.roofline,
            "roofline_fraction": self.roofline_fraction,
            "peak_onchip_bytes": self.peak_onchip_bytes,
            "fifo_bytes": self.fifo_bytes,
            "deep_channels": list(self.deep_channels),
            "cores_used": self.cores_used,
            "breakdown": self.breakdown,
            "by_kind": self.by_kind,
            "utilisation": self.utilisation,
            "units": self.unit_rows(),
            "events": self.events,
            "plan_s": self.plan_s,
            "sim_s": self.sim_s,
        }

    def trace_json(self) -> str:
        """Chrome trace JSON of the run (needs ``simulate_graph(..., trace=True)``); core tracks
        are named after the units on them."""
        if not self.sim.trace_events:
            raise SimulationError(
                "no trace was recorded; run simulate_graph(..., trace=True) or give a path"
            )
        names = {c: u for u in self.placement.units for c in u.cores}
        events = []
        for ev in self.sim.trace_events:
            if ev.get("ph") == "M" and ev.get("name") == "thread_name" and ev.get("pid") == 1:
                u = names.get(ev["tid"])
                if u is not None:
                    role = " ".join(f"{k} %{n}" for n, k in zip(u.ops, u.kinds))
                    if ev["tid"] != u.core:
                        role = f"memory of %{u.name}"
                    ev = {**ev, "args": {"name": f"{ev['args']['name']}: {role}"}}
            events.append(ev)
        doc = {
            "traceEvents": events,
            "otherData": {
                "graph": self.graph,
                "chip": self.chip,
                "time_unit": "1 trace microsecond = 1 cycle",
                "cycles": self.cycles,
            },
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    def write_trace(self, path: str | Path) -> Path:
        """Write :meth:`trace_json` to ``path``."""
        p = Path(path)
        p.write_text(self.trace_json())
        return p

    def summary(self) -> str:
        """A printable report: latency, traffic, roofline, breakdown and the busiest units."""
        u = self.utilisation
        lines = [
            f"graph {self.graph} on {self.chip}: {self.cycles} cycles ({self.seconds * 1e6:.3f} us), "
            f"{len(self.units)} units on {self.cores_used} cores",
            f"HBM traffic {self.hbm_bytes} bytes, {self.flops} FLOPs, roofline {self.roofline} "
            f"cycles ({self.roofline_fraction:.1%} of it reached), on-chip "
            f"{self.peak_onchip_bytes} bytes",
            f"utilisation: HBM {u['hbm']:.1%}, NoC links {u['noc_links']:.1%} (peak "
            f"{u['noc_links_peak']:.1%}), units busy {u['units_busy']:.1%}, compute "
            f"{u['compute']:.1%}",
            *(f"memory: {n}" for n in self.memory_notes),
            f"simulated {self.events} events in {self.sim_s:.2f} s (plan {self.plan_s:.2f} s)",
            f"  {'operator':<18} {'units':>6} {'busy':>12} {'recv':>12} {'send':>12} {'mem':>12}",
        ]
        for kind, row in self.by_kind.items():
            lines.append(
                f"  {kind:<18} {row['units']:>6} {row['busy']:>12} {row['stall_recv']:>12} "
                f"{row['stall_send']:>12} {row['stall_mem']:>12}"
            )
        lines.append(
            f"  {'unit':<24} {'busy':>10} {'recv':>10} {'send':>10} {'mem':>10}  operators"
        )
        for r in sorted(self.units, key=lambda r: (-r.busy, r.name))[:12]:
            lines.append(
                f"  {r.name:<24} {r.busy:>10} {r.stall_recv:>10} {r.stall_send:>10} "
                f"{r.stall_mem:>10}  {', '.join(r.kinds)}"
            )
        return "\n".join(lines)
