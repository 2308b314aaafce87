"""A run directory: everything one report knows, as files a person and a script can open.

``write_run_dir(dir, report, trace=...)`` (and :meth:`torch2step.Report.save`) writes

* ``summary.json`` — every field of the report (units in the key names), the chip description,
  the options used and the versions of the project, torch and Python;
* ``units.csv`` — one row per unit (STeP operator on its cores): cycles busy / stalled / idle,
  elements in and out, on-chip bytes, FLOPs;
* ``operators.csv`` — the same summed per operator: the user's own (router, experts, combine,
  attention...) where the program records them, and per STeP operator class;
* ``trace.json`` — the Chrome / Perfetto timeline when the report was made with a trace;
* ``roofline.png``, ``utilisation.png`` (with a trace), ``breakdown.png``;
* ``report.md`` — the text report with the plots, and the trace's size and how to open it.
"""

from __future__ import annotations

import csv
import json
import logging
import platform
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch2step.report import Report

__all__ = ["write_run_dir", "versions", "UNIT_COLUMNS", "OPERATOR_COLUMNS"]

log = logging.getLogger("torch2step")

UNIT_COLUMNS = (
    "unit",
    "operators",
    "kinds",
    "cores",
    "busy_cycles",
    "stall_recv_cycles",
    "stall_send_cycles",
    "stall_mem_cycles",
    "idle_cycles",
    "finish_cycle",
    "flops",
    "sram_bytes",
    "fifo_bytes",
    "elements_in",
    "elements_out",
)
OPERATOR_COLUMNS = (
    "group",
    "operator",
    "units",
    "busy_cycles",
    "stall_recv_cycles",
    "stall_send_cycles",
    "stall_mem_cycles",
    "flops",
    "sram_bytes",
)


def versions() -> dict[str, str]:
    """Versions of the project, torch, numpy and Python."""
    out = {"python": platform.python_version()}
    for dist in ("torch2step", "torch", "numpy", "onnx"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def _unit_rows(report: Report) -> list[dict[str, Any]]:
    rows = []
    for u in report.units:
        rows.append(
            {
                "unit": u["name"],
                "operators": " ".join(u["ops"]),
                "kinds": " ".join(u["kinds"]),
                "cores": " ".join(str(c) for c in u["cores"]),
                "busy_cycles": u["busy"],
                "stall_recv_cycles": u["stall_recv"],
                "stall_send_cycles": u["stall_send"],
                "stall_mem_cycles": u["stall_mem"],
                "idle_cycles": u["idle"],
                "finish_cycle": u["finish"],
                "flops": u["flops"],
                "sram_bytes": u["sram_bytes"],
                "fifo_bytes": u["fifo_bytes"],
                "elements_in": u["received"],
                "elements_out": u["sent"],
            }
        )
    return rows


def _operator_rows(report: Report) -> list[dict[str, Any]]:
    rows = []
    for group, table in (("user", report.operator_breakdown()), ("step", report.kind_breakdown())):
        for name, r in table.items():
            rows.append(
                {
                    "group": group,
                    "operator": name,
                    "units": r["units"],
                    "busy_cycles": r["busy"],
                    "stall_recv_cycles": r["stall_recv"],
                    "stall_send_cycles": r["stall_send"],
                    "stall_mem_cycles": r["stall_mem"],
                    "flops": r["flops"],
                    "sram_bytes": r["sram_bytes"],
                }
            )
    return rows


def _plots(out: Path, report: Report) -> list[str]:
    from torch2step import plots

    made = []
    spec = report.chip_spec
    if spec and report.latency_cycles:
        peak = report.peak_flops_per_cycle
        bw = report.hbm_peak_bytes_per_cycle
        if peak and bw:
            ai = report.flops / report.hbm_bytes if report.hbm_bytes else 0.0
            plots.plot_roofline(
                out / "roofline.png",
                peak_flops_per_cycle=peak,
                hbm_bytes_per_cycle=bw,
                points={f"{report.layer} (simulated)": (ai, report.flops / report.latency_cycles)},
                title=f"{report.layer} on {report.chip}",
            )
            made.append("roofline.png")
    if report.timeline.get("compute"):
        plots.plot_utilisation(
            out / "utilisation.png", report.timeline, f"{report.layer} on {report.chip}"
        )
        made.append("utilisation.png")
    table = report.operator_breakdown() or report.kind_breakdown()
    if table:
        plots.plot_breakdown(
            out / "breakdown.png", table, f"where the unit-cycles go ({report.layer})"
        )
        made.append("breakdown.png")
    return made


def _markdown(report: Report, pngs: list[str], trace: str | None, trace_note: str) -> str:
    """``report.md``: the text report, the plots, the files; ``trace``: the trace file's
    name (None: no trace) and ``trace_note`` its size."""
    text = report.text("see operators.csv and summary.json")
    lines = [f"# {report.layer} on {report.chip}", "", "```", text, "```", ""]
    captions = {
        "roofline.png": "Roofline: the layer against the chip's peak compute and HBM bandwidth",
        "utilisation.png": "Busy share of compute, HBM channels and NoC links over the run",
        "breakdown.png": "Where the unit-cycles go, per operator (busy and stalls)",
    }
    for png in pngs:
        lines += [f"## {captions[png]}", "", f"![{png}]({png})", ""]
    lines += [
        "## Files",
        "",
        "- `summary.json`: every number above, the chip description, options and versions",
        "- `units.csv`: one row per unit (STeP operator on its cores)",
        "- `operators.csv`: the same per user operator and per STeP operator class",
    ]
    if trace:
        lines.append(
            f"- `{trace}`" + (f" ({trace_note})" if trace_note else "") + ": the timeline — "
            'open it at https://ui.perfetto.dev ("Open trace '
            'file") or chrome://tracing; one trace microsecond is one cycle'
        )
    return "\n".join(lines) + "\n"


def write_run_dir(
    out: str | Path,
    report: Report,
    trace: Callable[[Path], Any] | None = None,
    limits: dict[str, Any] | None = None,
) -> Path:
    """Write the run directory ``out`` (created if needed) for ``report``; ``trace`` writes
    ``trace.json`` given its path (e.g. :meth:`torch2step.Program.write_trace`), ``limits``
    what it was cut to (``window_cycles``, ``units_kept``; ``summary.json`` and ``report.md``
    say so).  Files of an earlier run this one does not write (a trace, a plot) are removed,
    so every file in the directory is of this run."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    trace_name, trace_note, trace_info = None, "", None
    if trace is not None:
        trace(d / "trace.json")
        trace_name = "trace.json"
        size = (d / "trace.json").stat().st_size
        trace_info = {"file": trace_name, "bytes": size, **(limits or {})}
        trace_note = f"{size:,} bytes" + _limits_note(limits or {})
        log.info("trace.json: %s", trace_note)
    else:
        (d / "trace.json").unlink(missing_ok=True)
    summary = {**report.to_dict(), **report.derived(), "versions": versions(), "trace": trace_info}
    (d / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    _write_csv(d / "units.csv", UNIT_COLUMNS, _unit_rows(report))
    _write_csv(d / "operators.csv", OPERATOR_COLUMNS, _operator_rows(report))
    pngs = _plots(d, report)
    for stale in _PLOTS - set(pngs):
        (d / stale).unlink(missing_ok=True)
    (d / "report.md").write_text(_markdown(report, pngs, trace_name, trace_note))
    return d


#: the plots a run directory may hold (:func:`_plots`)
_PLOTS = frozenset({"roofline.png", "utilisation.png", "breakdown.png"})


def _limits_note(limits: dict[str, Any]) -> str:
    """What a trace was cut to, for ``report.md`` (empty: the whole run)."""
    out = ""
    window = limits.get("window_cycles")
    if window:
        lo, hi = window
        out += f"; cycles {lo:,.0f} to {'the end' if hi is None else f'{hi:,.0f}'} only"
    if limits.get("units_kept") is not None:
        out += f"; the cores of the {limits['units_kept']} busiest units only (every NoC, HBM and utilisation track)"
    return out
