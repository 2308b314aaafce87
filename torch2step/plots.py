"""PNG plots of a report and of a sweep (matplotlib, no screen needed).

* :func:`plot_roofline` — the layer against the chip's roofline (Williams et al., "Roofline",
  CACM 2009): attainable FLOPs per cycle ``min(peak, intensity x HBM bytes per cycle)``;
* :func:`plot_utilisation` — busy share of compute, HBM and NoC over the run;
* :func:`plot_breakdown` — unit-cycles by category per operator (where the latency goes);
* :func:`plot_latency_vs_batch` and :func:`plot_pareto` — sweep results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = [
    "plot_roofline",
    "plot_utilisation",
    "plot_breakdown",
    "plot_latency_vs_batch",
    "plot_pareto",
]

_CATEGORIES = ("busy", "stall_recv", "stall_send", "stall_mem")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roofline(
    path: Path,
    *,
    peak_flops_per_cycle: float,
    hbm_bytes_per_cycle: float,
    points: Mapping[str, tuple[float, float]],
    title: str,
) -> Path:
    """Roofline chart: ``points`` maps a label to ``(FLOPs per HBM byte, FLOPs per cycle)``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ridge = peak_flops_per_cycle / hbm_bytes_per_cycle
    xs = [v[0] for v in points.values() if v[0] > 0] or [ridge]
    lo, hi = min(min(xs), ridge) / 8, max(max(xs), ridge) * 8
    grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    ax.loglog(
        grid,
        [min(peak_flops_per_cycle, x * hbm_bytes_per_cycle) for x in grid],
        color="black",
        label=f"chip roof (peak {peak_flops_per_cycle:,.0f} FLOP/cycle, "
        f"HBM {hbm_bytes_per_cycle:,.0f} B/cycle)",
    )
    for label, (x, y) in points.items():
        if x > 0 and y > 0:
            ax.loglog([x], [y], "o", label=label)
    ax.set_xlabel("arithmetic intensity (FLOPs per HBM byte)")
    ax.set_ylabel("FLOPs per cycle")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_utilisation(path: Path, timeline: Mapping[str, Sequence[float]], title: str) -> Path:
    """Busy share over time from ``timeline`` (``edges`` plus one series per kind)."""
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    edges = list(timeline.get("edges", []))
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    for kind in ("compute", "hbm", "noc"):
        series = list(timeline.get(kind, []))
        if series and mids:
            ax.step(mids, [100 * v for v in series], where="mid", label=kind)
    ax.set_xlabel("cycle")
    ax.set_ylabel("busy (% of components)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_breakdown(path: Path, rows: Mapping[str, Mapping[str, float]], title: str) -> Path:
    """Stacked bars: unit-cycles per category (busy, stalls) for each operator in ``rows``."""
    names = list(rows)[:30]
    fig, ax = plt.subplots(figsize=(7.2, 0.9 + 0.32 * max(1, len(names))))
    left = [0.0] * len(names)
    for cat in _CATEGORIES:
        vals = [float(rows[n].get(cat, 0)) for n in names]
        ax.barh(names, vals, left=left, label=cat)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("unit-cycles")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    return _save(fig, path)


def plot_latency_vs_batch(path: Path, rows: Sequence[Mapping[str, Any]], title: str) -> Path:
    """Latency (cycles) against batch, one line per (layer, chip) of the successful ``rows``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            series.setdefault(f"{r['layer']} on {r['chip']}", []).append(
                (int(r["batch"]), int(r["latency_cycles"]))
            )
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("latency (cycles)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    return _save(fig, path)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated in (lower x, lower y), sorted by x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(set(points)):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def plot_pareto(path: Path, rows: Sequence[Mapping[str, Any]], title: str) -> Path:
    """Cycles against on-chip bytes per strategy (the options of a point), with each
    strategy's Pareto front drawn as a line."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            series.setdefault(str(r.get("options") or "default"), []).append(
                (float(r["peak_onchip_bytes"]), float(r["latency_cycles"]))
            )
    for label, pts in sorted(series.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, label=label)
        front = pareto_front(pts)
        ax.plot([p[0] for p in front], [p[1] for p in front], "-", alpha=0.6)
    ax.set_xlabel("on-chip memory (bytes)")
    ax.set_ylabel("latency (cycles)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    return _save(fig, path)
