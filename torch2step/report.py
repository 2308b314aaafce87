"""The latency report of a compiled layer on a chip.

A :class:`Report` is plain data: numbers from one simulation plus the symbolic metrics of the
STeP graph (STeP, arXiv 2511.07776, §4.1) evaluated at this input's dynamic sizes.
``str(report)`` is the text form the CLI prints; ``to_dict``/``to_json`` the machine-readable
one; ``save(dir)`` a run directory with CSVs, plots and ``report.md``
(:mod:`torch2step.rundir`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["OPERATOR_ROWS", "Report"]

#: How the note on a run's padded Linear rows begins (``torch2step.program.padding_note``):
#: the FLOPs line says the padding is in the count only when that note is there.
PADDING_NOTE = "Linear rows are a dynamic size computed in blocks of"

_CATS = ("busy", "stall_recv", "stall_send", "stall_mem")

#: rows of the by-operator table in the text report (``--json`` and ``--out`` hold them all)
OPERATOR_ROWS = 16


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def _group(units: list[dict[str, Any]], key: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for u in units:
        name = u.get(key)
        if not name:
            continue
        row = out.setdefault(
            name, {"units": 0, "flops": 0, "sram_bytes": 0, **dict.fromkeys(_CATS, 0)}
        )
        row["units"] += 1
        row["flops"] += int(u.get("flops", 0))
        row["sram_bytes"] += int(u.get("sram_bytes", 0))
        for c in _CATS:
            row[c] += int(u.get(c, 0))
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["busy"], kv[0])))


@dataclass(frozen=True)
class Report:
    """Latency and where it goes.

    ``latency_cycles``/``latency_s``: simulated time from the first instruction to the last
    store; ``hbm_bytes``: off-chip bytes moved in the simulation; ``hbm_bytes_formula``: the
    §4.1 traffic formula of the STeP graph and ``hbm_bytes_symbolic`` its value at this input;
    ``peak_onchip_bytes``: the §4.1 on-chip memory requirement at this input;
    ``roofline_fraction``: the roofline bound (max of compute time at peak FLOPs and HBM time
    at peak bandwidth) divided by the simulated latency; ``breakdown``: cycles attributed to
    compute, HBM, NoC transfer and stalls (summed over units, see ``units``); ``units``: per
    STeP operator, its unit and busy/stall cycles; ``dynamic``: the values of the dynamic sizes
    (tokens per expert, KV lengths, ...) this report is for.

    Context of the run: ``dtype`` the element type of the activations; ``chip_spec`` the chip
    description (:func:`hwmodel.to_dict`); ``peak_flops_per_cycle`` of the whole chip at that
    element type; ``options`` the compile options and inputs used (``routing`` names the trace
    or the router); ``notes`` every choice made for the user (a fallback, a scaled trace);
    ``timeline`` the busy share of compute / HBM / NoC over the run (with a trace).

    ``utilisation`` (fractions of the run's cycles, :attr:`SpatialResult.utilisation
    <torch2step.spatial.result.SpatialResult.utilisation>`): ``hbm`` the mean busy share of
    the HBM channels; ``noc_links`` / ``noc_links_peak`` that of the NoC links that carried
    traffic / of the busiest one; ``units_busy`` the mean busy share of the units;
    ``compute`` the FLOPs over the peak of the cores the units are *placed on* (a layer split
    into configurations: each configuration's, weighted by its cycles).  The headline
    :attr:`compute_fraction` divides the same FLOPs by the peak of the *whole chip*, so it
    is the smaller of the two whenever the units leave cores free."""

    layer: str
    chip: str
    latency_cycles: int
    latency_s: float
    hbm_bytes: int
    hbm_bytes_symbolic: int
    hbm_bytes_formula: str
    peak_onchip_bytes: int
    onchip_formula: str
    flops: int
    roofline_cycles: int
    roofline_fraction: float
    breakdown: dict[str, int] = field(default_factory=dict)
    utilisation: dict[str, float] = field(default_factory=dict)
    units: list[dict[str, Any]] = field(default_factory=list)
    dynamic: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    simulation_s: float = 0.0
    # -- context of the run (rendering, summary.json) --
    dtype: str = ""  # element type the layer is timed and its bytes counted in
    simulated_onchip_bytes: int = 0  # what the simulated run held: unit buffers + FIFOs
    chip_spec: dict[str, Any] = field(default_factory=dict)
    peak_flops_per_cycle: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)

    # -- derived numbers ------------------------------------------------------------------
    @property
    def _split(self) -> bool:
        """Whether the layer ran as several configurations (:mod:`torch2step.configurations`)."""
        return any("configuration" in u for u in self.units)

    def _core_counts(self) -> tuple[int, int]:
        """``(placed, for_fifos)`` of the configuration holding the most cores: the cores its
        units are placed on (the placement's extra memory units included) and the further
        cores whose SRAM holds what a unit's simulated bytes (buffers and deepened FIFOs) add
        beyond the cores it was placed on (:mod:`torch2step.spatial.sram`: such a unit spans
        ``ceil(bytes / SRAM per core)`` cores).  A layer that is not split is one
        configuration; a split one's configurations run one after another on the chip."""
        sram = int(self.chip_spec.get("core", {}).get("sram_bytes", 0))
        groups: dict[Any, list[dict[str, Any]]] = {}
        for u in self.units:
            groups.setdefault(u.get("configuration", 1), []).append(u)
        best = (0, 0)
        for units in groups.values():
            placed = len({c for u in units for c in u.get("cores", ())})
            extra = 0
            if sram:
                for u in units:
                    held = int(u.get("sram_bytes", 0)) + int(u.get("fifo_bytes", 0))
                    extra += max(0, math.ceil(held / sram) - len(u.get("cores", ())))
            if placed + extra > sum(best):
                best = (placed, extra)
        return best

    @property
    def cores_used(self) -> int:
        """Cores the run holds: :attr:`cores_placed` plus :attr:`cores_for_fifos`."""
        return sum(self._core_counts())

    @property
    def cores_placed(self) -> int:
        """Cores the units are placed on (extra memory units of the placement included)."""
        return self._core_counts()[0]

    @property
    def cores_for_fifos(self) -> int:
        """Further cores holding the bytes of units that outgrow the SRAM of the cores they
        were placed on (FIFOs deepened during the run; the notes name the largest such
        units)."""
        return self._core_counts()[1]

    @property
    def cores_available(self) -> int:
        """Cores of the chip."""
        return int(self.chip_spec.get("num_cores", 0))

    @property
    def clock_ghz(self) -> float:
        """The chip's clock."""
        return float(self.chip_spec.get("clock_ghz", 0.0))

    @property
    def hbm_peak_bytes_per_cycle(self) -> float:
        """Aggregate peak HBM bandwidth in bytes per cycle."""
        h = self.chip_spec.get("hbm", {})
        return float(h.get("channels", 0)) * float(h.get("bytes_per_cycle_per_channel", 0))

    @property
    def sram_capacity_bytes(self) -> int:
        """On-chip memory of the cores the run holds (:attr:`cores_used`: the cores the
        units are placed on and those holding their spilled FIFOs)."""
        return self.cores_used * int(self.chip_spec.get("core", {}).get("sram_bytes", 0))

    @property
    def hbm_bandwidth_fraction(self) -> float:
        """Achieved HBM bandwidth (bytes moved over the latency) over the peak."""
        peak = self.hbm_peak_bytes_per_cycle
        if not peak or not self.latency_cycles:
            return 0.0
        return self.hbm_bytes / self.latency_cycles / peak

    @property
    def compute_fraction(self) -> float:
        """Achieved FLOPs per cycle over the whole chip's peak at the element type (all its
        cores; ``utilisation["compute"]`` counts only the cores the units are placed on)."""
        if not self.peak_flops_per_cycle or not self.latency_cycles:
            return 0.0
        return self.flops / self.latency_cycles / self.peak_flops_per_cycle

    def derived(self) -> dict[str, Any]:
        """The derived numbers above, units in the key names (for ``summary.json``):
        ``cores_used`` = ``cores_placed`` + ``cores_for_fifos``; ``sram_capacity_bytes`` the
        SRAM of the ``cores_used``; ``compute_fraction`` the FLOPs over the whole chip's peak
        (``utilisation["compute"]``: over the peak of the cores the units are placed on)."""
        clock = self.clock_ghz
        return {
            "cores_used": self.cores_used,
            "cores_placed": self.cores_placed,
            "cores_for_fifos": self.cores_for_fifos,
            "cores_available": self.cores_available,
            "clock_ghz": clock,
            "hbm_peak_bytes_per_cycle": self.hbm_peak_bytes_per_cycle,
            "hbm_peak_bytes_per_s": self.hbm_peak_bytes_per_cycle * clock * 1e9,
            "hbm_achieved_bytes_per_s": (
                self.hbm_bytes / self.latency_s if self.latency_s else 0.0
            ),
            "hbm_bandwidth_fraction": self.hbm_bandwidth_fraction,
            "compute_fraction": self.compute_fraction,
            "sram_capacity_bytes": self.sram_capacity_bytes,
            "by_operator": self.operator_breakdown(),
            "by_kind": self.kind_breakdown(),
        }

    def operator_breakdown(self) -> dict[str, dict[str, int]]:
        """Unit-cycles, FLOPs and on-chip bytes per operator of the user's layer (router,
        each expert group, combine, attention, norms), busiest first; empty when the units do
        not record the operator they came from (``origin``)."""
        return _group(self.units, "origin")

    def kind_breakdown(self) -> dict[str, dict[str, int]]:
        """The same per STeP operator class of the units' primary nodes."""
        return _group([{**u, "kind": (u.get("kinds") or ["?"])[0]} for u in self.units], "kind")

    def save(
        self,
        out: str | Path,
        trace: Any = None,
        *,
        trace_window: tuple[float, float] | None = None,
        trace_units: int | None = None,
    ) -> Path:
        """Write a run directory (:func:`torch2step.rundir.write_run_dir`); ``trace``: a
        :class:`torch2step.Program` whose last report recorded a trace, written to
        ``trace.json`` (limited to ``trace_window`` cycles / the ``trace_units`` busiest units
        when given)."""
        from torch2step.errors import Torch2StepError
        from torch2step.rundir import write_run_dir

        if trace is not None and not getattr(trace, "has_trace", True):
            # before any file is written: no half-made run directory
            raise Torch2StepError(
                "save(dir, trace=prog): the program's last report recorded no trace; call "
                "prog.report(..., trace=True) and save that report, or save without trace="
            )

        if trace is None and self.timeline:
            warnings.warn(
                "save(dir): this report recorded a trace but no trace.json is written; pass the "
                "program, save(dir, trace=prog), to write it",
                stacklevel=2,
            )

        def write(path: Path) -> Any:
            return trace.write_trace(path, window=trace_window, units=trace_units)

        limits: dict[str, Any] = {}
        if trace_window is not None:  # an open end as null: JSON has no infinity
            lo, hi = trace_window
            limits["window_cycles"] = [lo, None if hi is None or math.isinf(hi) else hi]
        if trace_units is not None:
            limits["units_kept"] = trace_units
        return write_run_dir(out, self, write if trace is not None else None, limits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary of every field."""
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def _chip_lines(self) -> list[str]:
        if not self.chip_spec:
            return []
        clock = self.clock_ghz
        bw = self.hbm_peak_bytes_per_cycle
        placed, for_fifos = self._core_counts()
        cores = f"{placed + for_fifos:,} of {self.cores_available:,} cores used"
        if for_fifos:
            cores += f" ({placed:,} placed, {for_fifos:,} more holding units' FIFOs)"
        if self._split:
            cores += " in the largest configuration"
        lines = [
            f"  element type     {self.dtype or '?'}",
            f"  chip             {clock:g} GHz, {cores}, "
            f"HBM {_si(bw * clock * 1e9, 'B/s')} ({bw:,.0f} B/cycle)",
            f"  on-chip memory   {self.peak_onchip_bytes:>14,} bytes (STeP §4.1), "
            f"{self.simulated_onchip_bytes:,} held in the simulated run, of "
            f"{self.sram_capacity_bytes:,} in the cores used "
            f"({self.simulated_onchip_bytes / (self.sram_capacity_bytes or 1):.1%})",
            f"  HBM bandwidth    {_si(self.hbm_bytes / self.latency_s if self.latency_s else 0, 'B/s')}"
            f" achieved = {self.hbm_bandwidth_fraction:.1%} of peak",
            f"  compute          {self.compute_fraction:.1%} of the whole chip's peak "
            f"{self.peak_flops_per_cycle:,} FLOPs/cycle (all {self.cores_available:,} cores)",
        ]
        return lines

    def _compute_utilisation_label(self) -> str:
        """What ``utilisation["compute"]`` divides by, beside the headline's whole chip."""
        if self._split:
            over = "each configuration's placed cores, weighted by its cycles"
        else:
            over = f"the {self.cores_placed:,} cores the units are placed on"
        whole = f"; whole chip {self.compute_fraction:.1%}" if self.chip_spec else ""
        return f"FLOPs over the peak of {over}{whole}"

    def __str__(self) -> str:
        return self.text()

    def text(self, rest_at: str = "see --json or --out") -> str:
        """The text report (``str(report)``); ``rest_at``: where the rows the by-operator
        table leaves out (past :data:`OPERATOR_ROWS`) are found."""
        lines = [
            f"{self.layer} on {self.chip}",
            f"  latency          {self.latency_cycles:>14,} cycles  ({self.latency_s * 1e6:,.2f} us)",
            f"  roofline bound   {self.roofline_cycles:>14,} cycles  ({self.roofline_fraction:.1%} of roofline reached)",
            f"  HBM traffic      {self.hbm_bytes:>14,} bytes   (formula at this input: {self.hbm_bytes_symbolic:,})",
        ]
        chip_lines = self._chip_lines()
        if chip_lines:
            lines += chip_lines
        else:
            lines.append(f"  on-chip memory   {self.peak_onchip_bytes:>14,} bytes")
        padded = any(n.startswith(PADDING_NOTE) for n in self.notes)
        lines.append(
            f"  FLOPs            {self.flops:>14,}   (as the tiles compute them"
            + ("; the padding rows of the note below included)" if padded else ")")
        )
        for note in self.notes:
            lines.append(f"  note: {note}")
        ops = self.operator_breakdown()
        if ops:
            total = sum(r["busy"] for r in ops.values()) or 1
            lines.append("  by operator (busy unit-cycles, share, FLOPs):")
            for name, r in list(ops.items())[:OPERATOR_ROWS]:
                lines.append(
                    f"    {name:<34} {r['busy']:>12,}  {r['busy'] / total:6.1%}  {r['flops']:>14,}"
                )
            if len(ops) > OPERATOR_ROWS:
                lines.append(f"    ... {len(ops) - OPERATOR_ROWS:,} more operators ({rest_at})")
        if self.breakdown:
            lines.append("  breakdown (unit-cycles):")
            total = sum(v for k, v in self.breakdown.items() if ":" not in k) or 1
            w = max(24, *(len(k) for k in self.breakdown))
            for k, v in self.breakdown.items():
                lines.append(f"    {k:<{w}} {v:>14,}  {v / total:6.1%}")
        if self.utilisation:
            lines.append("  utilisation (busy share of the run's cycles):")
            for k, v in self.utilisation.items():
                label = f"  ({self._compute_utilisation_label()})" if k == "compute" else ""
                lines.append(f"    {k:<16} {v:6.1%}{label}")
        if self.dynamic:
            lines.append(
                "  dynamic sizes: " + ", ".join(f"{k}={v}" for k, v in self.dynamic.items())
            )
        return "\n".join(lines)
