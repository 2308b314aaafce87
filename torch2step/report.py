"""The latency report of a compiled layer on a chip (DESIGN.md "Report").

A :class:`Report` is plain data: numbers from one simulation plus the symbolic metrics of the
STeP graph (seed 000 §4.1) evaluated at this input's dynamic sizes.  ``str(report)`` is the text
form the CLI prints; ``to_dict``/``to_json`` the machine-readable one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report"]


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
    (tokens per expert, KV lengths, ...) this report is for."""

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
    dtype: str = ""  # element type the layer is timed and its bytes counted in
    simulated_onchip_bytes: int = 0  # what the simulated run held: unit buffers + FIFOs

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary of every field."""
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def __str__(self) -> str:
        lines = [
            f"{self.layer} on {self.chip}",
            f"  latency          {self.latency_cycles:>14,} cycles  ({self.latency_s * 1e6:,.2f} us)",
            f"  roofline bound   {self.roofline_cycles:>14,} cycles  ({self.roofline_fraction:.1%} of roofline reached)",
            f"  HBM traffic      {self.hbm_bytes:>14,} bytes   (formula at this input: {self.hbm_bytes_symbolic:,})",
            f"  on-chip memory   {self.peak_onchip_bytes:>14,} bytes",
            f"  FLOPs            {self.flops:>14,}",
        ]
        if self.breakdown:
            lines.append("  breakdown (unit-cycles):")
            total = sum(v for k, v in self.breakdown.items() if ":" not in k) or 1
            for k, v in self.breakdown.items():
                lines.append(f"    {k:<24} {v:>14,}  {v / total:6.1%}")
        if self.utilisation:
            lines.append("  utilisation:")
            for k, v in self.utilisation.items():
                lines.append(f"    {k:<16} {v:6.1%}")
        if self.dynamic:
            lines.append(
                "  dynamic sizes: " + ", ".join(f"{k}={v}" for k, v in self.dynamic.items())
            )
        return "\n".join(lines)
