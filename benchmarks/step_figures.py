"""Reproduce the STeP paper's §5 figures (STeP, arXiv 2511.07776) on the shipped traces.

* Fig. 6 / 7 — dynamic vs static tiling of the tokens routed to each expert (§5.2):
  Mixtral-8x7B and Qwen3-30B-A3B MoE layers at batch 64 (static tiles 16, 64) and batch 1024
  (static tiles 256, 1024), tile 64 along the expert's intermediate dimension.
* Fig. 8 / 9 — configuration time-multiplexing (§5.3): Qwen3-30B-A3B at batch 64 with 128,
  64, 32, 16, 8, 4 expert regions (128/R consecutive experts each), static tiles of 32 tokens
  (Fig. 9(a)) and dynamic tiling (Fig. 9(b)), tile 48 along the intermediate dimension, 1024
  FLOPs/cycle per operator; 128 regions is the dedicated-region graph (the paper's baseline);
  each shared region's EagerMerge order is decided in simulated time
  (:mod:`torch2step.spatial.dynamic`).  The gains are read at 32 regions as the paper does.
* Fig. 11 — dynamic parallelization (§5.4): Qwen3-30B-A3B decode attention for one KV head
  over 4 regions, requests assigned coarse (16 consecutive per region), interleaved or
  dynamically (first free region, decided in simulated time by
  :mod:`torch2step.spatial.dispatch`), on the b16 / b64 / b80 KV-length traces (high, med,
  low spread), 2048 FLOPs/cycle per operator.

Set-up (§5.1, and the paper's artifact for the per-operator compute): chip preset
``step-paper`` (one unit per operator, 64 B/cycle on-chip memory units, 1024 B/cycle HBM over
32 channels), bf16, weights of shape ``[D, tile_F]`` streamed per tile, compute bandwidth
allocated per operator: 4096 FLOPs/cycle for static tiling, 6400 for dynamic tiling (the
artifact's ``run_ws_tile_mn_mk`` / ``run_ws_tile_mn_mk_dyn_tile``).  Every run is a full-size
simulation: the STeP graph is built, run by the reference interpreter in timing-only mode
(routing, selectors and sizes computed; matrix products only shaped) and simulated unit by
unit on the event simulator.

``python benchmarks/step_figures.py`` prints one table per figure, the paper's headline ratios
next to ours and notes on the differences, and writes PNGs (``--png-dir``); ``--json`` prints
one JSON object per configuration.  ``--figures 6,7`` picks figures.

Metrics as the paper's figures define them (its artifact): on-chip memory counted by
:mod:`torch2step.step.metrics_artifact` (``onchip_bytes``; the §4.1 text accounting and the
simulated peak are the extra keys ``onchip_s41_bytes`` and ``onchip_sim_bytes``); allocated
compute by :func:`allocated_flops_per_cycle`; compute utilisation = FLOPs / (cycles x
allocated FLOPs/cycle).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.traces import FIGURE_GROUPS, kv_lengths  # noqa: E402
from models.traces import routing as load_routing  # noqa: E402
from torch2step.lower.blocks.gqa import gqa_decode_graph  # noqa: E402
from torch2step.lower.blocks.gqa_regions import assign_coarse, assign_interleave  # noqa: E402
from torch2step.lower.blocks.moe import moe_graph  # noqa: E402
from torch2step.spatial import simulate_graph  # noqa: E402
from torch2step.spatial.dispatch import list_schedule, simulate_dispatched  # noqa: E402
from torch2step.spatial.dynamic import simulate_decided  # noqa: E402
from torch2step.spatial.timing import UnitConfig  # noqa: E402
from torch2step.step import run  # noqa: E402
from torch2step.step.metrics import metrics  # noqa: E402
from torch2step.step.metrics_artifact import onchip_bytes_artifact  # noqa: E402
from torch2step.step.ops_compute import Accum, FlatMap, Map, Scan  # noqa: E402

CHIP = "step-paper"
MODELS = {  # experts, top-k, hidden D, expert intermediate F
    "mixtral": (8, 2, 4096, 14336),
    "qwen3": (128, 8, 2048, 768),
}
STATIC_BW, DYNAMIC_BW, REGION_BW = 4096, 6400, 1024

PAPER = {
    "5.2 dynamic tiling speedup (geomean over static tiles)": 1.45,
    "5.2 dynamic tiling on-chip memory saving (geomean)": 2.18,
    "5.3 time-multiplexing compute-utilisation gain, static tile 32": 2.64,
    "5.3 time-multiplexing compute-utilisation gain, dynamic": 2.51,
    "5.4 dynamic parallelization speedup (geomean over coarse and interleave)": 1.5,
}


@dataclass
class Row:
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


def _trace(model: str, batch: int) -> tuple[str, np.ndarray]:
    name = {"mixtral": "mixtral", "qwen3": "qwen"}[model] + f"_b{batch}"
    return name, np.asarray(load_routing(name), dtype=np.int64)


def moe_case(
    figure: str,
    model: str,
    batch: int,
    *,
    static_tile: int | None,
    tile_f: int,
    flops_per_cycle: int,
    regions: int | None = None,
    label: str | None = None,
) -> Row:
    """Build, run (timing-only) and simulate one MoE configuration (``label``: its strategy
    name in the table, default from the tiling and regions)."""
    t0 = time.perf_counter()
    E, k, D, F = MODELS[model]
    trace, sel = _trace(model, batch)
    g = moe_graph(
        num_experts=E,
        top_k=k,
        hidden=D,
        intermediate=F,
        tokens=batch,
        dtype="bf16",
        tile_h=D,
        tile_i=tile_f,
        static_tile=static_tile,
        lanes=regions,
        repeat_tile=regions is None,
        scale_in_lanes=False,  # the artifact scales per expert after the regions
    )
    zero = torch.zeros(())  # weights: zero-stride views (timing-only runs never read them)
    tensors = {
        "x": torch.zeros(batch, D),
        "topk_idx": torch.as_tensor(sel),
        "topk_w": torch.full((batch, k), 1.0 / k),
        "w_gate": zero.expand(E, F, D),
        "w_up": zero.expand(E, F, D),
        "w_down": zero.expand(E, D, F),
    }
    compute = [op.name for op in g.nodes if isinstance(op, (Map, Accum, Scan, FlatMap))]
    cfg = {n: UnitConfig(flops_per_cycle=flops_per_cycle) for n in compute}
    rounds = 1
    if regions is None:
        res = run(g, tensors=tensors, check=False, timing_only=True)
        sim = simulate_graph(g, CHIP, res, configs=cfg)
    else:  # each region's EagerMerge forwards the expert whose tokens are ready first
        decided = simulate_decided(g, CHIP, tensors, configs=cfg)
        sim, res, rounds = decided.result, decided.run, decided.rounds
    alloc = allocated_flops_per_cycle(g, flops_per_cycle)
    hbm = 1024
    if label is not None:
        strategy = label
    elif regions is None:
        strategy = "dynamic" if static_tile is None else f"static{static_tile}"
    else:
        strategy = f"regions{regions}" + ("" if static_tile is None else f"_static{static_tile}")
    return Row(
        figure,
        model,
        batch,
        strategy,
        trace,
        int(sim.cycles),
        int(sim.hbm_bytes),
        onchip_bytes_artifact(g, res.bindings),
        alloc,
        int(sim.flops),
        sim.flops / (sim.cycles * alloc),
        sim.hbm_bytes / (sim.cycles * hbm),
        len(sim.units),
        round(time.perf_counter() - t0, 2),
        int(metrics(g).evaluate(res.bindings)["onchip_bytes"]),
        int(sim.peak_onchip_bytes),
        rounds,
    )


#: tile functions that compute addresses or pick routing data: the artifact gives the
#: operators doing this (ExpertAddrGen, the weights' FlatPartition) no compute bandwidth
ADDRESS_FNS = frozenset(
    {"affine", "pick_weight", "pick_weight_of", "to_selector", "selector_index", "tile_grid",
     "iota"}
)
#: a gated activation act(gate) * up is the artifact's two operators (activation, multiply)
GATED_FNS = frozenset({"silu_mul", "gelu_mul", "gelu_tanh_mul", "relu_mul"})


def allocated_flops_per_cycle(g, flops_per_cycle: int) -> int:
    """Compute bandwidth allocated as the paper's artifact allocates it (Fig. 8/9's
    "allocated compute"): ``flops_per_cycle`` for every operator applying a tile function
    with a FLOP count, none for address and routing-data functions (:data:`ADDRESS_FNS`),
    two for a fused gated activation (:data:`GATED_FNS`)."""
    units = 0
    for op in g.nodes:
        if not isinstance(op, (Map, Accum, Scan, FlatMap)) or op.fn.spec.flops is None:
            continue
        if op.fn.name in ADDRESS_FNS:
            continue
        units += 2 if op.fn.name in GATED_FNS else 1
    return flops_per_cycle * units


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ---------------------------------------------------------------- figures


def fig67(emit) -> tuple[list[Row], dict[str, float]]:
    rows: list[Row] = []
    speed, mem = [], []
    for fig, batch, tiles in (("6", 64, (16, 64)), ("7", 1024, (256, 1024))):
        for model in ("mixtral", "qwen3"):
            dyn = emit(moe_case(fig, model, batch, static_tile=None, tile_f=64,
                                flops_per_cycle=DYNAMIC_BW))
            rows.append(dyn)
            for t in tiles:
                st = emit(moe_case(fig, model, batch, static_tile=t, tile_f=64,
                                   flops_per_cycle=STATIC_BW))
                rows.append(st)
                speed.append(st.cycles / dyn.cycles)
                mem.append(st.onchip_bytes / dyn.onchip_bytes)
    ratios = {
        "5.2 dynamic tiling speedup (geomean over static tiles)": geomean(speed),
        "5.2 dynamic tiling on-chip memory saving (geomean)": geomean(mem),
    }
    return rows, ratios


#: the time-multiplexed point the paper reads its §5.3 gains at (its Fig. 9 marks 32 regions,
#: 4 experts each, against the 128 dedicated regions: the artifact's ``fig_*_compare_base``)
TM_POINT = 32
TM_REGIONS = (128, 64, 32, 16, 8, 4)


def fig89(emit) -> tuple[list[Row], dict[str, float]]:
    rows: list[Row] = []
    ratios: dict[str, float] = {}
    for tile, label in ((32, "static tile 32"), (None, "dynamic")):
        series = []
        for r in TM_REGIONS:
            # 128 regions of one expert each are the dedicated-region graph: the paper's
            # baseline (Revet-expressible; the artifact's run_ws_tile_mn_mk_revet / _dyn_tile)
            row = emit(moe_case("8/9", "qwen3", 64, static_tile=tile, tile_f=48,
                                flops_per_cycle=REGION_BW, regions=None if r == 128 else r,
                                label=f"regions{r}" + ("" if tile is None else f"_static{tile}")))
            rows.append(row)
            series.append(row)
        base = series[0]
        at = next(s for s in series if s.strategy.startswith(f"regions{TM_POINT}"))
        ratios[f"5.3 time-multiplexing compute-utilisation gain, {label}"] = (
            at.compute_util / base.compute_util
        )
        ratios[f"5.3 cycle overhead at {TM_POINT} regions, {label} (paper: <1% static, "
               f"~5% dynamic)"] = at.cycles / base.cycles - 1
        ratios[f"5.3 allocated-compute ratio 128/{TM_POINT} regions, {label}"] = (
            base.alloc_flops_per_cycle / at.alloc_flops_per_cycle
        )
        ok = [s for s in series if s.cycles <= base.cycles * 1.05]
        best = max(ok, key=lambda s: s.compute_util)
        ratios[f"5.3 best gain at <5% overhead ({best.strategy}), {label}"] = (
            best.compute_util / base.compute_util
        )
    return rows, ratios


# ---------------------------------------------------------------- Fig. 11 (§5.4)

ATTN_BW, ATTN_REGIONS, ATTN_TILE, COARSE_CHUNK = 2048, 4, 32, 16
ATTN_QUEUE = 16  # requests queued in front of each region (the artifact's metadata FIFOs)
ATTN_MAXN = {16: 4672, 64: 6464, 80: 6528}  # the artifact's KV buffer rows per request
QWEN_ATTN = (8, 1, 64)  # query heads per KV head, one KV head, head dim (Qwen3-30B-A3B)


def attn_case(folder: str, tier: str, index: int, strategy: str) -> Row:
    """Build, run (timing-only) and simulate Qwen3 decode attention for one KV head over
    4 regions on one KV-length trace, with a static or the dynamic assignment."""
    t0 = time.perf_counter()
    name = f"{folder}/{tier}{index}"
    lens = np.asarray(kv_lengths(name), dtype=np.int64)
    B, Lmax = len(lens), ATTN_MAXN[len(lens)]
    G, Hkv, D = QWEN_ATTN
    g = gqa_decode_graph(num_q_heads=G * Hkv, num_kv_heads=Hkv, head_dim=D, batch=B,
                         max_len=Lmax, dtype="bf16", regions=ATTN_REGIONS, tail_rows=1,
                         tile_kv=ATTN_TILE)
    zero = torch.zeros(())  # caches: zero-stride views (timing-only runs never read them)
    tensors = {"q": zero.expand(B * G * Hkv, D), "k_cache": zero.expand(B * Hkv * Lmax, D),
               "v_cache": zero.expand(B * Hkv * Lmax, D),
               "kv_len": torch.as_tensor(lens).reshape(B, 1), "out": torch.zeros(B * G, D)}
    compute = [op.name for op in g.nodes if isinstance(op, (Map, Accum, Scan, FlatMap))]
    cfg = {n: UnitConfig(flops_per_cycle=ATTN_BW) for n in compute}
    queue = {f"attn_route_{v}.{r}": ATTN_QUEUE for v in ("cursor", "q")
             for r in range(ATTN_REGIONS)}
    if strategy == "dynamic":  # first free region, decided in simulated time
        d = simulate_dispatched(g, CHIP, tensors, configs=cfg, depths=queue, max_rounds=5,
                                start=list_schedule(lens + 1, ATTN_REGIONS))
        sim, res = d.result, d.run
    else:
        region = (assign_coarse(B, ATTN_REGIONS, COARSE_CHUNK) if strategy == "coarse"
                  else assign_interleave(B, ATTN_REGIONS))
        res = run(g, tensors={**tensors, "region": torch.as_tensor(region)}, check=False,
                  timing_only=True)
        sim = simulate_graph(g, CHIP, res, configs=cfg, depths=queue)
    at = metrics(g).evaluate(res.bindings)
    alloc = ATTN_BW * sum(1 for op in g.nodes if op.name in set(compute)
                          and op.fn.spec.flops is not None)
    return Row("11", "qwen3", B, strategy, name, int(sim.cycles), int(sim.hbm_bytes),
               int(at["onchip_bytes"]), alloc, int(sim.flops), sim.flops / (sim.cycles * alloc),
               sim.hbm_bytes / (sim.cycles * 1024), len(sim.units),
               round(time.perf_counter() - t0, 2))


FIG11_FILES = 1  # trace files per (batch, spread tier); the paper uses 3 (--fig11-files 3)


def fig11(emit) -> tuple[list[Row], dict[str, float]]:
    rows: list[Row] = []
    speed: dict[str, list[float]] = {"coarse": [], "interleave": []}
    for folder in ("b16", "b64", "b80"):
        for tier in ("high", "med", "low"):
            for i in range(min(FIG11_FILES, len(FIGURE_GROUPS[folder][tier]))):
                dyn = emit(attn_case(folder, tier, i, "dynamic"))
                rows.append(dyn)
                for st in ("coarse", "interleave"):
                    r = emit(attn_case(folder, tier, i, st))
                    rows.append(r)
                    speed[st].append(r.cycles / dyn.cycles)
    both = speed["coarse"] + speed["interleave"]
    ratios = {
        "5.4 dynamic parallelization speedup (geomean over coarse and interleave)": geomean(both),
        "5.4 dynamic over coarse (geomean)": geomean(speed["coarse"]),
        "5.4 dynamic over interleave (geomean)": geomean(speed["interleave"]),
    }
    return rows, ratios


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


MAIN_JOBS = ("qwen3-moe", "mixtral-moe", "llama-gqa", "qwen3-gqa")
ROOFLINE_TARGET = 0.80  # the acceptance bar (goal 0.95)


def main_jobs(emit) -> tuple[list[Row], dict[str, float]]:
    """Each shipped MoE and attention layer's full-size report at batch 64 on ``step-sda``
    (bf16, the default strategy, the packaged routing and KV-length traces, as ``torch2step
    report --layer L --batch 64``): the fraction of the chip's roofline bound it reaches."""
    from torch2step.named import report_layer

    rows: list[Row] = []
    ratios: dict[str, float] = {}
    for layer in MAIN_JOBS:
        t0 = time.perf_counter()
        rep = report_layer(layer, 64, "step-sda").report
        row = Row("main", layer, 64, "default", "packaged", rep.latency_cycles, rep.hbm_bytes,
                  rep.simulated_onchip_bytes, 0, rep.flops, rep.compute_fraction,
                  rep.hbm_bandwidth_fraction, len(rep.units),
                  round(time.perf_counter() - t0, 2), rep.peak_onchip_bytes,
                  rep.simulated_onchip_bytes)
        rows.append(emit(row))
        ratios[f"roofline fraction, {layer} b64 bf16 on step-sda (target {ROOFLINE_TARGET:.0%})"] = (
            rep.roofline_fraction
        )
    return rows, ratios


FIGURES = {"6,7": fig67, "8,9": fig89, "11": fig11, "main": main_jobs}


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
- Qwen3 b1024: static tile 256 beats dynamic tiling in ours (paper: dynamic best).  The
  expert with 814 tokens needs ~400K cycles of compute per operator, but its weight stream
  gets a 1/83 share of the HBM while every used expert loads (its units stall ~690K cycles on
  input); static tiles re-read its weights and spread that wait.  An HBM arbitration that
  favours the longest expert (or the paper's Ramulator FR-FCFS timing) would change this.
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
  main job (dispatched lanes) the first weight tile is read at cycle 30,490, after the token
  ids are loaded, instead of cycle 330 (latency 644,926 -> 644,636 cycles).
- Dynamic tiling: 32 shared regions are 5% *faster* than the dedicated baseline (paper: ~5%
  slower), which lifts the gain to 2.80x vs 2.51x.  Routing ends at ~2.4K cycles (the token
  and id loads), and each expert's Bufferize completes - and its weight load starts - at the
  Partition's stop token, as in the paper's simulator.  The dedicated graph (585K cycles, 95%
  of the HBM bound of 553.5K) then has ~180 weight streams sharing the HBM fairly: at 1024
  FLOPs/cycle per operator the experts whose weights come last cannot pull them fast enough
  alone and the HBM idles at the end; at 6400 FLOPs/cycle (Fig. 6) the same graph reaches
  the bound.  Shared regions have fewer weight streams in flight and hit the bound (555K
  cycles, 99.7%).  With the dedicated graph at the bound the gain would be 2.66 x
  553.5/555.0 = 2.65x; the paper's 2.51x has its 32 regions 6% slower.  Our unit programs
  are still built per run (the experts' token counts N_e in the units after the Partition;
  EagerMerge's chunk order, decided by re-simulating to a fixed point), but in the dedicated
  graph no weight is read before routing ends (first weight tile at cycle 2,736, the
  Partitions finish at 2,509), so this is not what separates it from the bound.
  We do not retune any constant to reach 2.51x.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--figures", default="6,7;8,9;11;main",
                    help="';'-separated groups: 6,7 and 8,9 and 11 and main (the main jobs' "
                    "roofline fractions)")
    ap.add_argument("--fig11-files", type=int, default=1,
                    help="Fig. 11 trace files per (batch, spread tier), 1-3 (the paper: 3)")
    ap.add_argument("--json", action="store_true", help="one JSON object per configuration")
    ap.add_argument("--png-dir", default="step_figures_out", help="where the PNGs go")
    args = ap.parse_args(argv)
    global FIG11_FILES
    FIG11_FILES = args.fig11_files

    def emit(row: Row) -> Row:
        if args.json:
            print(json.dumps(asdict(row)), flush=True)
        else:
            print(f"  done fig {row.figure} {row.model} b{row.batch} {row.strategy}: "
                  f"{row.cycles:,} cycles in {row.wall_s:.1f} s", flush=True)
        return row

    rows: list[Row] = []
    ratios: dict[str, float] = {}
    for group in args.figures.split(";"):
        r, q = FIGURES[group.strip()](emit)
        rows += r
        ratios.update(q)
    if args.json:
        print(json.dumps({"ratios": ratios, "paper": PAPER}))
        return 0
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
    for p in _plot(rows, Path(args.png_dir)) + _plot11(rows, Path(args.png_dir)):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
