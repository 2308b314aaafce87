"""The latency report of a compiled layer on a chip.

A :class:`Report` is plain data: numbers from one simulation plus the symbolic metrics of the
STeP graph (STeP, arXiv 2511.07776, §4.1) evaluated at this input's dynamic sizes.
``str(report)`` is the text form the CLI prints; ``to_dict``/``to_json`` the machine-readable
one; ``save(dir)`` a run directory with CSVs, plots and ``report.md``
(:mod:`torch2step.rundir`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report"]

_CATS = ("busy", "stall_recv", "stall_send", "stall_mem")


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
    ``timeline`` the busy share of compute / HBM / NoC over the run (with a trace)."""

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
    def cores_used(self) -> int:
        """Cores the units occupy (extra memory units included)."""
        return len({c for u in self.units for c in u.get("cores", ())})

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
        """On-chip memory of the cores the units occupy."""
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
        """Achieved FLOPs per cycle over the whole chip's peak at the element type."""
        if not self.peak_flops_per_cycle or not self.latency_cycles:
            return 0.0
        return self.flops / self.latency_cycles / self.peak_flops_per_cycle

    def derived(self) -> dict[str, Any]:
        """The derived numbers above, units in the key names (for ``summary.json``)."""
        clock = self.clock_ghz
        return {
            "cores_used": self.cores_used,
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
        from torch2step.rundir import write_run_dir

        def write(path: Path) -> Any:
            return trace.write_trace(path, window=trace_window, units=trace_units)

        return write_run_dir(out, self, write if trace is not None else None)

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
        lines = [
            f"  element type     {self.dtype or '?'}",
            f"  chip             {clock:g} GHz, {self.cores_used:,} of {self.cores_available:,} "
            f"cores used, HBM {_si(bw * clock * 1e9, 'B/s')} ({bw:,.0f} B/cycle)",
            f"  on-chip memory   {self.peak_onchip_bytes:>14,} bytes (STeP §4.1), "
            f"{self.simulated_onchip_bytes:,} held in the simulated run, of "
            f"{self.sram_capacity_bytes:,} in the cores used "
            f"({self.simulated_onchip_bytes / (self.sram_capacity_bytes or 1):.1%})",
            f"  HBM bandwidth    {_si(self.hbm_bytes / self.latency_s if self.latency_s else 0, 'B/s')}"
            f" achieved = {self.hbm_bandwidth_fraction:.1%} of peak",
            f"  compute          {self.compute_fraction:.1%} of the chip's peak "
            f"{self.peak_flops_per_cycle:,} FLOPs/cycle",
        ]
        return lines

    def __str__(self) -> str:
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
        lines.append(f"  FLOPs            {self.flops:>14,}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        ops = self.operator_breakdown()
        if ops:
            total = sum(r["busy"] for r in ops.values()) or 1
            lines.append("  by operator (busy unit-cycles, share, FLOPs):")
            for name, r in list(ops.items())[:16]:
                lines.append(
                    f"    {name:<34} {r['busy']:>12,}  {r['busy'] / total:6.1%}  {r['flops']:>14,}"
                )
        if self.breakdown:
            lines.append("  breakdown (unit-cycles):")
            total = sum(v for k, v in self.breakdown.items() if ":" not in k) or 1
            for k, v in self.breakdown.items():
                lines.append(f"    {k:<24} {v:>14,}  {v / total:6.1%}")
        if self.utilisation:
            lines.append("  utilisation (busy share of the run's cycles):")
            for k, v in self.utilisation.items():
                lines.append(f"    {k:<16} {v:6.1%}")
        if self.dynamic:
            lines.append(
                "  dynamic sizes: " + ", ".join(f"{k}={v}" for k, v in self.dynamic.items())
            )
        return "\n".join(lines)
