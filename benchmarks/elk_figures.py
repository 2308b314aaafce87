"""The shape of ELK Fig. 17-18 (and the mesh comparison of Fig. 21) on this project's models.

For every model (Llama-3-8B, Qwen3-30B-A3B decode steps), batch size and chip set-up, plans the
whole decode step with each design of ELK §6.1 (Basic, Static, ELK-Dyn, ELK-Full, Ideal) and
reports per design the predicted latency, ELK's breakdown, HBM / interconnect utilisation and
the planning time; with ``--sim-layers N`` it also builds the per-core programs of the first N
layers for the one-chip ``ipu-hbm`` preset and simulates them (simulated cycles and wall time).

Chip set-ups: ``ipu-hbm-x4`` is ELK §6.1's emulated IPU-POD4 (4 x 1472 cores, 3.5 GB on chip,
16 TB/s HBM) modelled as one all-to-all chip (inter-chip links are not modelled);
``ipu-hbm`` and ``mesh`` are the presets (one chip).  When both are run, a line per model and
batch compares them as ELK Fig. 21 does (interconnect utilisation per design, counted as ELK
counts it: the cycles the interconnect is busy over the step's cycles, a preload's delivery
busy while its bottleneck link carries it; and the mesh's latency over the all-to-all's).

    python benchmarks/elk_figures.py                  # table
    python benchmarks/elk_figures.py --json           # one JSON object per run
    python benchmarks/elk_figures.py --sim-layers 1   # also simulate one layer per design
    python benchmarks/elk_figures.py --moe            # dynamic MoE (ELK §7) vs a dense MLP
    python benchmarks/elk_figures.py --paced          # all-to-all preloads at HBM pace (ELK §5)
    python benchmarks/elk_figures.py --window-positions   # search window counted in positions
    python benchmarks/elk_figures.py --chips ipu-hbm-x4 --hbm-tbps 8,16,32,64   # ELK Fig. 19

By default an all-to-all core's port serves execute traffic ahead of queued preload pieces (as
this project's simulator does), so preloads fill the executions' free port cycles and Static,
which preloads as far ahead as its fixed split allows, stays near ELK; ``--paced`` charges
contention as ELK's emulator does (preloads broadcast at HBM pace, saturating the receivers'
inbound links, ELK §5), where Static's preloads queued before each execution slow it (rows
with ``"contention": "paced"``).  The search window (K of ELK §4.2: how far ahead of an
execution preloads are tried) counts operators that preload data, as ELK's K counts the
operators that fit on chip and an operator without HBM data takes no preload space; so a MoE
layer's expert preloads, more than 8 positions apart, fall within it (rows with
``"window": "data"``).  ``--window-positions`` counts every operator instead (rows with
``"window": "positions"``; Qwen3-30B-A3B at batch 32 then reaches 82% of Ideal, not 96%).

Simulated figures run this project's per-core programs.  Activations stay on chip between
operators (ELK §4.5: output tiles stay in the producing cores' SRAM, the next operator gathers
them over the interconnect), so HBM carries the preloads, the layer's input and its results.
The simulator's HBM channels serve requests first come first served (on all-to-all chips a
core's port serves execute traffic ahead of preload pieces, :mod:`runtime.network`) and the one-way
synchronisation and tile-to-core mapping differ from the plan's cost model, so simulated and
planned cycles differ (see ``sim_cycles`` against ``sim_predicted``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elk.designs import DESIGNS  # noqa: E402
from elk.errors import ElkError  # noqa: E402
from elk.interconnect import fig21  # noqa: E402
from elk.moe import dynamic_vs_dense  # noqa: E402
from elk.notes import notes  # noqa: E402
from elk.ops import DECODERS, decode_step_ops  # noqa: E402
from elk.plan import ElkSchedule, plan_model  # noqa: E402
from hwmodel.chip import Chip  # noqa: E402
from hwmodel.presets import load_chip  # noqa: E402
from runtime.errors import SimulationError  # noqa: E402
from torch2step.kernel import simulate_schedule  # noqa: E402


def chip_setup(name: str, hbm_tbps: float | None = None) -> Chip:
    """A preset, or ``ipu-hbm-x4``: four ipu-hbm chips as one all-to-all chip (ELK §6.1);
    ``hbm_tbps``: the set-up's total HBM bandwidth in TB/s (ELK Fig. 19 varies it), its
    channels kept and each channel's bandwidth scaled."""
    if name == "ipu-hbm-x4":
        base = load_chip("ipu-hbm")
        chip = dataclasses.replace(
            base,
            name="ipu-hbm-x4",
            num_cores=4 * base.num_cores,
            hbm=dataclasses.replace(base.hbm, channels=4 * base.hbm.channels),
        )
    else:
        chip = load_chip(name)
    if hbm_tbps is None:
        return chip
    per_channel = hbm_tbps * 1e12 / (chip.clock_ghz * 1e9) / chip.hbm.channels
    return dataclasses.replace(
        chip, hbm=dataclasses.replace(chip.hbm, bytes_per_cycle_per_channel=per_channel)
    )


def hbm_tbps(chip: Chip) -> float:
    """``chip``'s total HBM bandwidth in TB/s."""
    return chip.hbm.bytes_per_cycle * chip.clock_ghz * 1e9 / 1e12


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="llama3-8b,qwen3-30b-a3b",
        help=f"comma-separated, of: {', '.join(DECODERS)} (default: llama3-8b,qwen3-30b-a3b)",
    )
    p.add_argument("--batches", default="32,64")
    p.add_argument("--kv-len", type=int, default=2048)
    p.add_argument("--chips", default="ipu-hbm-x4,ipu-hbm,mesh")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the model's)")
    p.add_argument("--sim-layers", type=int, default=0, help="simulate this many layers")
    p.add_argument("--sim-chip", default="ipu-hbm")
    p.add_argument("--json", action="store_true")
    p.add_argument("--moe", action="store_true", help="dynamic MoE vs dense MLP (ELK §7)")
    p.add_argument(
        "--paced",
        action="store_true",
        help="all-to-all preloads at HBM pace, as ELK §5's emulator (default: they yield to "
        "execute traffic at the ports, as this project's simulator)",
    )
    p.add_argument(
        "--hbm-tbps",
        default=None,
        help="total HBM bandwidths in TB/s to plan each set-up at, e.g. 8,16,32,64 (ELK Fig. 19; "
        "default: the set-up's own, 16 TB/s for ipu-hbm-x4)",
    )
    p.add_argument(
        "--window-positions",
        action="store_true",
        help="count the search window (8) in operator positions, not in operators that preload "
        "data (ELK §4.2's K; a MoE layer's expert preloads lie further apart than 8 positions)",
    )
    args = p.parse_args()
    unknown = [m for m in args.models.split(",") if m not in DECODERS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(DECODERS)}")
    window_data = not args.window_positions
    # the scheduler's search, the same for every design, figure and simulated plan
    search = {"window": 8, "beam": 2, "max_orders": 4, "window_data": window_data}
    bandwidths = [float(b) for b in args.hbm_tbps.split(",")] if args.hbm_tbps else [None]
    if args.moe:
        for tbps in bandwidths:
            for batch in (int(b) for b in args.batches.split(",")):
                for chip_name in args.chips.split(","):
                    chip = chip_setup(chip_name, tbps)
                    rep = dynamic_vs_dense(
                        "qwen3-30b-a3b", batch, args.kv_len, chip, layers=args.layers, **search
                    )
                    rep["chip"] = chip_name
                    rep["hbm_tbps"] = round(hbm_tbps(chip), 3)
                    rep["window"] = "data" if window_data else "positions"
                    print(json.dumps(rep), flush=True)
        return 0
    rows = []
    for tbps in bandwidths:
        for model in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                by_chip: dict[str, dict[str, dict]] = {}
                for chip_name in args.chips.split(","):
                    chip = chip_setup(chip_name, tbps)
                    ops = decode_step_ops(model, batch, args.kv_len, args.layers)
                    per: dict[str, dict] = {}
                    scheds: dict[str, ElkSchedule] = {}
                    ideal_cycles = None
                    for design in ("ideal", *(d for d in DESIGNS if d != "ideal")):
                        try:
                            s = plan_model(ops, chip, design, paced=args.paced, **search)
                            scheds[design] = s
                        except ElkError as e:
                            print(f"{model} batch {batch} on {chip.name} {design}: {e}", flush=True)
                            break
                        tot = max(s.cycles, 1e-9)
                        if design == "ideal":
                            ideal_cycles = s.cycles
                        row = {
                            "model": model,
                            "batch": batch,
                            "kv_len": args.kv_len,
                            "chip": chip.name,
                            "hbm_tbps": round(hbm_tbps(chip), 3),
                            "design": design,
                            "contention": "paced" if args.paced else "priority",
                            "window": "data" if window_data else "positions",
                            "layers": args.layers or DECODERS[model].layers,
                            "cycles": round(s.cycles),
                            "latency_ms": s.seconds * 1e3,
                            "hbm_util": round(s.hbm_utilisation(), 4),
                            "noc_util": round(s.noc_utilisation(), 4),
                            "flop_util": round(s.flop_utilisation(), 5),
                            "of_ideal": round((ideal_cycles or s.cycles) / tot, 4),
                            "core_peak": s.core_peak,
                            "plan_s": round(s.plan_seconds, 3),
                            "breakdown": {k: round(v / tot, 4) for k, v in s.breakdown().items()},
                            "sim_s": None,
                        }
                        # Ideal assumes unbounded on-chip memory: it has no program to simulate
                        if args.sim_layers and chip_name == args.sim_chip and design != "ideal":
                            sub = decode_step_ops(model, batch, args.kv_len, args.sim_layers)
                            sp = plan_model(sub, chip, design, **search)
                            try:
                                rep = simulate_schedule(sp, chip, tokens=batch)
                            except SimulationError as e:
                                print(f"  {design}: simulation failed: {e}", flush=True)
                                per[design] = row
                                rows.append(row)
                                continue
                            row.update(
                                sim_layers=args.sim_layers,
                                sim_cycles=rep.cycles,
                                sim_predicted=round(rep.predicted),
                                sim_error=round(rep.error, 4),
                                sim_hbm_util=round(rep.hbm_util, 4),
                                sim_noc_util=round(rep.noc_util, 4),
                                sim_s=round(rep.sim_seconds, 2),
                            )
                        per[design] = row
                        rows.append(row)
                        if args.json:
                            print(json.dumps(row), flush=True)
                    per = {d: per[d] for d in DESIGNS if d in per}
                    by_chip[chip_name] = per
                    if not args.json and len(per) == len(DESIGNS):
                        full = per["elk_full"]["cycles"]
                        print(
                            f"{model} batch {batch} kv {args.kv_len} on {chip.name} "
                            f"(HBM {hbm_tbps(chip):g} TB/s): ELK-Full "
                            f"{per['basic']['cycles'] / full:.2f}x Basic, "
                            f"{per['static']['cycles'] / full:.2f}x Static, "
                            f"{per['ideal']['cycles'] / full:.1%} of Ideal"
                        )
                        for d, r in per.items():
                            sim = (
                                f"  sim {r['sim_layers']} layer(s): {r['sim_cycles']:,} cycles "
                                f"(plan {r['sim_predicted']:,}, {r['sim_error']:+.1%}) in {r['sim_s']:.1f} s"
                                if r["sim_s"] is not None
                                else ""
                            )
                            b = r["breakdown"]
                            print(
                                f"  {d:9} {r['latency_ms']:8.3f} ms  HBM {r['hbm_util']:6.1%}  "
                                f"NoC {r['noc_util']:6.1%}  pre {b['preload']:5.1%} exe "
                                f"{b['execute']:5.1%} ovl {b['overlapped']:5.1%} icn "
                                f"{b['interconnect']:5.1%}  plan {r['plan_s']:6.2f} s{sim}",
                                flush=True,
                            )
                        for line in notes(scheds, args.paced):
                            print(f"  note: {line}", flush=True)
                    elif args.json and len(scheds) == len(DESIGNS):
                        key = {
                            "model": model,
                            "batch": batch,
                            "chip": chip.name,
                            "hbm_tbps": round(hbm_tbps(chip), 3),
                        }
                        if args.paced:
                            key["contention"] = "paced"
                        key["window"] = "data" if window_data else "positions"
                        print(json.dumps({**key, "notes": notes(scheds, args.paced)}), flush=True)
                if "mesh" in by_chip and "ipu-hbm" in by_chip:
                    _print_fig21(model, batch, fig21(by_chip, "mesh", "ipu-hbm"), args.json)
    if len(bandwidths) > 1 and not args.json:
        _print_fig19(rows)
    return 0


def _print_fig19(rows: list[dict]) -> None:
    """ELK Fig. 19: per-token latency of each design against the HBM bandwidth, per model,
    batch and chip set-up (and ELK-Full over Basic / Static at each bandwidth)."""
    groups: dict[tuple, dict[str, dict[float, dict]]] = {}
    for r in rows:
        g = groups.setdefault((r["model"], r["batch"], r["chip"]), {})
        g.setdefault(r["design"], {})[r["hbm_tbps"]] = r
    for (model, batch, chip), per in groups.items():
        tbs = sorted({t for d in per.values() for t in d})
        print(f"ELK Fig. 19, {model} batch {batch} on {chip}: ms per token at HBM TB/s "
              + ", ".join(f"{t:g}" for t in tbs))  # fmt: skip
        for d in DESIGNS:
            if d in per:
                cells = [
                    f"{per[d][t]['latency_ms']:8.3f}" if t in per[d] else "       -" for t in tbs
                ]
                print(f"  {d:9} " + " ".join(cells))
        full = per.get("elk_full", {})
        for base in ("basic", "static"):
            if base in per:
                ratios = [
                    f"{per[base][t]['cycles'] / full[t]['cycles']:8.2f}"
                    if t in full and t in per[base]
                    else "       -"
                    for t in tbs
                ]
                print(f"  ELK-Full over {base:6} " + " ".join(ratios))


def _print_fig21(model: str, batch: int, f: dict, as_json: bool) -> None:
    """ELK Fig. 21: the mesh preset against the all-to-all ``ipu-hbm`` (one chip each: the
    same cores, link bandwidth and HBM), per design (:func:`elk.interconnect.fig21`)."""
    if as_json:
        print(json.dumps({"model": model, "batch": batch, "fig21": f}), flush=True)
        return
    util = ", ".join(f"{d} {m:.1%} vs {a:.1%}" for d, (m, a) in f["noc_util"].items())
    slow = ", ".join(f"{d} {r:.1f}x" for d, r in f["latency_ratio"].items())
    print(
        f"{model} batch {batch}: ELK Fig. 21, interconnect utilisation on {f['mesh']} vs "
        f"{f['all_to_all']}: {util} (mesh busier for every design: {f['mesh_busier']}); "
        f"mesh latency over all-to-all: {slow}",
        flush=True,
    )


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    raise SystemExit(code)
