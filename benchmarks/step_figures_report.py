"""The printed side of ``benchmarks/step_figures.py`` (STeP, arXiv 2511.07776 §5): the row
each simulated configuration yields, the paper's headline ratios (§5.2-§5.4) and hand-picked
configurations, the table, the notes on where and why our numbers differ from the paper's,
and the PNGs redrawing Fig. 6/7, 9 and 11.  The configurations themselves are built, run and
simulated by ``step_figures.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: the paper's headline ratios (§5.2 Fig. 6/7, §5.3 Fig. 9, §5.4 Fig. 11)
PAPER = {
    "5.2 dynamic tiling speedup (geomean over static tiles)": 1.45,
    "5.2 dynamic tiling on-chip memory saving (geomean)": 2.18,
    "5.3 time-multiplexing compute-utilisation gain, static tile 32": 2.64,
    "5.3 time-multiplexing compute-utilisation gain, dynamic": 2.51,
    "5.4 dynamic parallelization speedup (geomean over coarse and interleave)": 1.5,
}


@dataclass
class Row:
    """One simulated configuration of a figure: the columns of the table and of ``--json``."""

    figure: str
    model: str
    batch: int
    strategy: str
    trace: str
    cycles: int
    offchip_bytes: int
    onchip_bytes: int
    alloc_flops_per_cycle: int
    flops: int
    compute_util: float
    offchip_bw_util: float
    units: int
    wall_s: float
    onchip_s41_bytes: int = 0
    onchip_sim_bytes: int = 0
    sim_rounds: int = 1  # simulations the decisions in simulated time took (fixed point)


def geomean(xs: list[float]) -> float:
    """Geometric mean, as the paper averages its §5 ratios (NaN for no values)."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _table(rows: list[Row]) -> str:
    head = (f"{'fig':>4} {'model':>8} {'B':>5} {'strategy':>18} {'cycles':>11} {'offchip MB':>11} "
            f"{'onchip MB':>10} {'FLOPs/cyc':>10} {'comp%':>6} {'bw%':>6} {'wall s':>7}")
    out = [head]
    for r in rows:
        out.append(
            f"{r.figure:>4} {r.model:>8} {r.batch:>5} {r.strategy:>18} {r.cycles:>11,} "
            f"{r.offchip_bytes / 1e6:>11.1f} {r.onchip_bytes / 1e6:>10.2f} "
            f"{r.alloc_flops_per_cycle:>10,} {100 * r.compute_util:>6.1f} "
            f"{100 * r.offchip_bw_util:>6.1f} {r.wall_s:>7.1f}"
        )
    return "\n".join(out)


#: the configuration the paper recommends in each figure (per model and batch)
PAPER_PICKS = {"6": ("dynamic",), "7": ("dynamic",), "8/9": ("regions32_static32", "regions32")}


def auto_vs_paper(rows: list[Row]) -> list[str]:
    """``strategy=auto``'s rule (torch2step.auto: prune by on-chip memory, decide by
    simulated cycles) applied to the configurations each figure ran, with the paper's pick's
    on-chip memory as the budget: lines saying where it finds a faster configuration at equal
    or lower on-chip memory than the paper's hand-picked one."""
    out = []
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.figure, r.model, r.batch), []).append(r)
    for (fig, model, batch), rs in groups.items():
        for pick_name in PAPER_PICKS.get(fig, ()):
            pick = next((r for r in rs if r.strategy == pick_name), None)
            if pick is None:
                continue
            fit = [r for r in rs if r.onchip_bytes <= pick.onchip_bytes]
            best = min(fit, key=lambda r: (r.cycles, r.onchip_bytes))
            if best is pick or best.cycles >= pick.cycles:
                out.append(f"auto on fig {fig} {model} b{batch}: the paper's pick {pick_name} "
                           f"is the fastest within its on-chip memory "
                           f"({pick.onchip_bytes / 1e6:.2f} MB) among {len(rs)} configurations")
                continue
            out.append(
                f"auto beats the paper's pick on fig {fig} {model} b{batch}: {best.strategy} "
                f"{best.cycles:,} cycles vs {pick_name} {pick.cycles:,} "
                f"({pick.cycles / best.cycles - 1:+.2%} faster) at {best.onchip_bytes / 1e6:.2f} "
                f"MB vs {pick.onchip_bytes / 1e6:.2f} MB on chip and "
                f"{best.alloc_flops_per_cycle:,} vs {pick.alloc_flops_per_cycle:,} FLOPs/cycle"
            )
    return out


NOTES = """\
Notes on differences from the paper (modelling choices):
- HBM: our HBM is 32 channels x 32 B/cycle with a fixed 160-cycle latency and 256 B
  interleaving, each channel first come first served; the paper's simulator uses Ramulator 2.0
  timing.  Memory-bound points (batch 64) land near the 1024 B/cycle bound in both.
- On-chip memory (column "onchip MB") is counted as the paper's figures count it
  (torch2step.step.metrics_artifact): one staging tile per off-chip load, nothing for a Map,
  the accumulators / repeated tiles of computed values at 4 bytes per element (the artifact's
  Float32 tiles), weight tiles in bf16, experts without tokens hold nothing.  The §4.1 text
  (and torch2step's reports) count two staging tiles per load (double buffering) and a
  matrix product's 16 x in_tile_col + weight tile: with that accounting the geomean saving is
  ~1.6x, because the weight tiles, the same in both strategies, weigh twice as much.  This
  accounting reproduces the paper's printed Fig. 7 values (Mixtral b1024 tile 1024: 3.67x vs
  the paper's 3.7x; Qwen3 b1024 tile 1024: 8.1x vs 8.1x).  Two of the eight pairs are exactly
  1.0x in the artifact's accounting too (Mixtral b64 tile 16 and b1024 tile 256: the padded
  tiles hold 8 x 16 = 64 x 2 and 8 x 256 = 1024 x 2 rows, the token totals); the remaining
  few percent of the geomean we could not attribute from the artifact's code.
- Compute bandwidth per operator follows the artifact (static 4096, dynamic 6400 FLOPs/cycle);
  at batch 1024 the layer is compute-bound, so this choice is part of the paper's speedup
  (Mixtral b1024: 1024/414 rows x 6400/4096 = 3.87x for tile 1024, as the paper's 3.8x).
- Qwen3 b1024, static tile 256 (1.41M cycles, 1.54x dynamic tiling's 0.91M): the critical
  expert (814 tokens, 4 tiles) is compute-bound (~196K cycles per tile and operator at 4096
  FLOPs/cycle), and it waits ~570K cycles for its second tile's weights.  Each other used
  expert (82, one tile each) requests all its weights (3 x 12 tiles of 256 KB; a load keeps up
  to 16 in flight) as soon as its tile's reference comes (STeP §3.2.1: a load issues per
  reference element), on an HBM that serves each channel first come first served.  The big
  expert asks for its second tile's first weight tile when it sends its first tile's last one
  (~162K) and gets it at 797,841 (the HBM delivering ~650 MB queued ahead of it meanwhile),
  after every other expert's first weight tile (the last at 785,297); its tiles 3 and 4 then
  follow without waiting.  Before the tile loops (1,268,868 cycles) a load held a tile's weights
  back until the next tile's reference (for a one-tile expert: the Partition's stop token), so
  the others started loading later (first weight tile at >= 75K, not 28.5K) after the big
  expert had queued its second tile (arrived 212K-393K), and the long wait fell on its third
  tile (393K -> 854K), ~140K cycles shorter.  So the +11% is the order in which a first-come
  HBM serves a ~4x oversubscribed burst, not a change of work (same off-chip bytes); it
  lifts the 5.2 speedup geomean from 1.571 to 1.593.  Ramulator's FR-FCFS (the paper's) also
  serves by arrival apart from row hits; an arbitration that favours the request stream on
  the critical path (or bounded per-channel request queues that make the loads share the HBM
  round-robin) would shorten this wait.  We keep the dataflow semantics (a load issues when
  its reference arrives) rather than tune the order.
- Time-multiplexing (Fig. 8/9) is measured as the paper's artifact measures it: the baseline
  is the dedicated-region graph (128 regions), the gain is read at 32 regions (4 experts
  each; the artifact's compare point), compute utilisation = FLOPs / (cycles x allocated
  FLOPs/cycle) and allocated compute counts 1024 FLOPs/cycle for each region's gate, up,
  activation, multiply and down operators, each expert's routing-weight scaling and the final
  sum (787,456 FLOPs/cycle at 128 regions, 295,936 at 32: 2.66x less), so a gain is 2.66x
  times the cycle ratio.  Address computations (expert id -> weight tile addresses) and the
  routing-weight pick allocate no compute, as in the artifact.
- Static tile 32: 32 shared regions run as fast as 128 dedicated ones (+0.6%; paper: <1%
  overhead), so the gain matches (2.65x vs 2.64x).  Each region's EagerMerge names a chunk
  (its selector, from which the region computes the expert's weight addresses) only once the
  chunk's first row has arrived, so a region reads an expert's weights after that expert's
  tokens arrive, not from the program's start (first weight tile at cycle ~1.1K; when the
  selectors were sent at the start it was read at cycle ~430, before any token reached a
  region, and 32 regions were 3% *faster* than the baseline: 2.75x).  Likewise in the Qwen3
  main job (dispatched lanes) the first weight tile is read after the token ids are loaded
  (cycle ~30K), not at cycle ~330 (a change of under 0.1% of its latency when it was made).
- Dynamic tiling: 32 shared regions are 5% *faster* than the dedicated baseline (paper: ~5%
  slower), which lifts the gain to 2.80x vs 2.51x.  Routing ends at ~2.4K cycles (the token
  and id loads), and each expert's Bufferize completes - and its weight load starts - at the
  Partition's stop token, as in the paper's simulator.  The dedicated graph (585K cycles, 95%
  of the HBM bound of 553.5K) then has ~180 weight streams sharing the HBM fairly: at 1024
  FLOPs/cycle per operator the experts whose weights come last cannot pull them fast enough
  alone and the HBM idles at the end; at 6400 FLOPs/cycle (Fig. 6) the same graph reaches
  the bound.  Shared regions have fewer weight streams in flight and hit the bound (555K
  cycles, 99.7%).  With the dedicated graph at the bound the gain would be 2.66 x
  553.5/555.0 = 2.65x; the paper's 2.51x has its 32 regions 6% slower.  Each region's
  merge takes whichever expert's chunk is ready first in the simulation (a WaitAny; one
  simulation decides and runs the order) and every unit loops over the chunks, so the
  programs are the same for every routing.  In the dedicated graph no weight is read before
  routing ends (first weight tile at cycle 2,736, the Partitions finish at 2,509), so routing
  is not what separates it from the bound.  We do not retune any constant to reach 2.51x.
- Dynamic tiling at 4 regions (32 experts each) is the one configuration where taking a chunk
  as soon as its first row arrives costs time: every region names its first expert at ~200
  cycles, so four experts' weight reads (~9.4 MB each) start while the routing still reads
  the token ids and rows, and on the first-come HBM those small reads end at ~37.5K cycles
  instead of ~0.9K (704,686 cycles, with the 125 FIFOs the run's own order needs deep, as a
  search restarting the simulation after each deadlock finds them; 603,499 when the depths
  came from the untimed replay's guess of the order, 151 channels deep; 576,474 when the order
  came from a search over whole re-simulations that named every first chunk after routing had
  ended).  An HBM arbitration favouring the routing's reads is not in the paper's model, so we
  leave it.
"""


def _plot11(rows: list[Row], out: Path) -> list[Path]:
    sub = [r for r in rows if r.figure == "11"]
    if not sub:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    batches = sorted({r.batch for r in sub})
    f, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), sharey=True)
    for ax, b in zip(np.atleast_1d(axes), batches):
        tiers = ("high", "med", "low")
        x = np.arange(len(tiers))
        for j, st in enumerate(("coarse", "interleave", "dynamic")):
            perf = []
            for tier in tiers:
                pairs = [(r, d) for r in sub for d in sub
                         if r.batch == d.batch == b and r.trace == d.trace
                         and r.strategy == st and d.strategy == "dynamic"
                         and r.trace.split("/")[1].startswith(tier)]
                perf.append(geomean([d.cycles / r.cycles for r, d in pairs]))
            ax.bar(x + (j - 1) * 0.27, perf, 0.27, label=st)
        ax.set_xticks(x, [f"{t} KV$ var." for t in tiers])
        ax.set_title(f"B={b}" if b != 80 else "B=64+16")
    np.atleast_1d(axes)[0].set_ylabel("performance / dynamic")
    np.atleast_1d(axes)[0].legend()
    p = out / "fig11.png"
    f.savefig(p, dpi=100, bbox_inches="tight")
    plt.close(f)
    return [p]


NOTES11 = """\
Notes on Fig. 11 (dynamic parallelization, §5.4):
- Set-up as the artifact: Qwen3-30B-A3B decode attention for one KV head (8 query heads,
  head dim 64), KV tiles of 32 rows, ceil((L+1)/32) tiles per request, 4 regions, 2048
  FLOPs/cycle per operator, coarse = 16 consecutive requests per region (B=16 uses one region,
  B=80 gives region 0 requests 0-15 and 64-79), interleave = round-robin, dynamic = first 4
  round-robin then the first free region.  B=64+16 is run as one batch of 80 requests.
- Dynamic is decided in simulated time by a fixed point over whole simulations (each
  request's region follows the order in which the regions completed their requests in the
  run that used that assignment), not by a feedback EagerMerge inside one run: a region may
  prefetch its next request's KV rows before it finishes the current one, which the paper's
  feedback loop does not allow; this favours dynamic slightly.
- KV rows are read in tiles of up to 32 consecutive rows per (request, KV head)
  (RandomOffChipLoadRows: one contiguous access per tile), as the artifact reads its 32-row
  tiles, but only the rows used (the artifact pads the last tile).  Every strategy reads the
  same bytes, so the ratios compare load balance, which is what §5.4 measures; with tile
  loads a request's cost follows HBM bandwidth, shared by the 4 regions.
- Coarse at B=16 uses one of four regions, so it is ~3-4x slower at every spread.
- Each region's request queue (the Partition's outputs) holds 16 requests, the artifact's
  metadata FIFO depth.  With 2-deep queues requests routed in order would starve the later
  regions under coarse assignment (region 1 gets its first request only after region 0 took
  nearly all of its 16); with 16-deep queues all regions start at once and coarse pays only
  the imbalance of the regions' KV totals.
- At B=64 the paper finds coarse better than interleave (interleave blocked by a long request
  in front of a region); in ours interleave stays ahead at every B=64 point: the cycles
  follow the largest region's KV total and the 16-deep queues keep interleave from blocking.
- Dynamic is a greedy list schedule, not an optimal one: interleave is faster on 2 of the 9
  points (up to 12%), which pulls the geomean over interleave down to ~1.05x; over coarse
  dynamic is ~1.8x, and over both static strategies ~1.37x (paper 1.5x).
"""


def _plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fig in sorted({r.figure for r in rows if r.figure in ("6", "7")}):
        sub = [r for r in rows if r.figure == fig]
        f, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, model in zip(axes, ("mixtral", "qwen3")):
            ms = [r for r in sub if r.model == model]
            dyn = next(r for r in ms if r.strategy == "dynamic")
            order = [r for r in ms if r.strategy != "dynamic"] + [dyn]
            x = np.arange(3)
            for j, r in enumerate(order):
                vals = [r.cycles / dyn.cycles, r.offchip_bytes / dyn.offchip_bytes,
                        r.onchip_bytes / dyn.onchip_bytes]
                ax.bar(x + (j - 1) * 0.25, vals, 0.25, label=r.strategy)
            ax.set_xticks(x, ["Cycles", "Off-chip\nTraffic", "On-chip\nMem."])
            ax.set_yscale("log")
            ax.set_title(model)
        axes[0].set_ylabel("Normalized to dynamic (log)")
        axes[0].legend()
        p = out / f"fig{fig}.png"
        f.savefig(p, dpi=100, bbox_inches="tight")
        plt.close(f)
        written.append(p)
    tm = [r for r in rows if r.figure == "8/9"]
    if tm:
        f, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, tag in zip(axes, ("static32", "dynamic")):
            ser = [r for r in tm if (tag in r.strategy) == (tag == "static32")]
            lab = [r.strategy.split("_")[0].replace("regions", "") for r in ser]
            ax.bar(lab, [100 * r.compute_util for r in ser], color="tab:blue")
            ax2 = ax.twinx()
            ax2.plot(lab, [r.cycles for r in ser], "o-", color="tab:red")
            ax.set_title(tag)
            ax.set_xlabel("parallel regions")
            ax.set_ylabel("compute util. (%)")
            ax2.set_ylabel("cycles")
        p = out / "fig9.png"
        f.savefig(p, dpi=100, bbox_inches="tight")
        plt.close(f)
        written.append(p)
    return written


def print_report(rows: list[Row], ratios: dict[str, float], png_dir: Path) -> None:
    """Print the table of ``rows``, ``ratios`` next to the paper's (:data:`PAPER`), where
    ``strategy=auto`` would pick differently from the paper (:func:`auto_vs_paper`) and the
    notes, and write the figures' PNGs to ``png_dir``."""
    print(_table(rows))
    print("\nratio                                                         ours    paper")
    for k, v in ratios.items():
        p = PAPER.get(k)
        ps = f"{p:7.2f}" if p is not None else "      -"
        print(f"{k:<60} {v:7.2f} {ps}")
    print()
    for line in auto_vs_paper(rows):
        print(line)
    print()
    print(NOTES)
    if any(r.figure == "11" for r in rows):
        print(NOTES11)
    for p in _plot(rows, png_dir) + _plot11(rows, png_dir):
        print("wrote", p)
