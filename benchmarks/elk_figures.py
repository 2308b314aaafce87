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
    python benchmarks/elk_figures.py --window-data    # search window counted in data preloads

By default an all-to-all core's port serves execute traffic ahead of queued preload pieces (as
this project's simulator does), so preloads fill the executions' free port cycles and Static,
which preloads as far ahead as its fixed split allows, stays near ELK; ``--paced`` charges
contention as ELK's emulator does (preloads broadcast at HBM pace, saturating the receivers'
inbound links, ELK §5), where Static's preloads queued before each execution slow it (rows
with ``"contention": "paced"``).  ``--window-data`` counts the search window (K of ELK §4.2)
in operators that preload data, so a MoE layer's expert preloads, more than 8 positions apart,
fall within it (rows with ``"window": "data"``).

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
from elk.interconnect import fig21, mesh_note  # noqa: E402
from elk.moe import dynamic_vs_dense  # noqa: E402
from elk.ops import DECODERS, decode_step_ops  # noqa: E402
from elk.plan import ElkSchedule, plan_model  # noqa: E402
from hwmodel.chip import Chip  # noqa: E402
from hwmodel.presets import load_chip  # noqa: E402
from runtime.errors import SimulationError  # noqa: E402
from torch2step.kernel import simulate_schedule  # noqa: E402


def chip_setup(name: str) -> Chip:
    """A preset, or ``ipu-hbm-x4``: four ipu-hbm chips as one all-to-all chip (ELK §6.1)."""
    if name == "ipu-hbm-x4":
        base = load_chip("ipu-hbm")
        return dataclasses.replace(
            base,
            name="ipu-hbm-x4",
            num_cores=4 * base.num_cores,
            hbm=dataclasses.replace(base.hbm, channels=4 * base.hbm.channels),
        )
    return load_chip(name)


def notes(s: dict[str, ElkSchedule], paced: bool = False) -> list[str]:
    """Why this run's designs differ from ELK §6.2-§6.4 (Fig. 17, 18, 21), from its plans;
    ``paced``: planned with preloads arriving at HBM pace (:func:`paced_note`)."""
    full, dyn, static, basic, ideal = (
        s[d] for d in ("elk_full", "elk_dyn", "static", "basic", "ideal")
    )
    c = full.costs
    icn = {d: s[d].breakdown()["interconnect"] / max(s[d].cycles, 1e-9) for d in s}
    cost = (
        f"which costs ELK-Full {icn['elk_full']:.0%} of its time, Static {icn['static']:.0%}, "
        f"Basic {icn['basic']:.0%} (ELK's emulator spreads each preload over all cores at HBM pace)"
    )
    if paced and not c.mesh:
        out = [paced_note(s, cost)]
    elif c.mesh:
        out = [
            "Ideal gives preloads their own interconnect; here every mesh link takes the "
            "preload pieces routed over it before any message an execute sends over it later, "
            "and the HBM channels serve requests in arrival order, so an execute waits for its "
            "cores' preload share from its first message on, and one that reads or stores HBM "
            "activations waits until the HBM has served the preloads issued before it (the "
            f"simulator's links and channels serve first come first served), {cost}"
        ]
    else:
        out = [
            "Ideal gives preloads their own interconnect; here a core's port serves an "
            "execute's messages ahead of the preload pieces queued on it (preload reads are "
            "background traffic, interleaved packet by packet: ELK §3.2, §4.3 preload and "
            "execute traffic share the bandwidth), and the HBM serves an execute's reads and "
            "stores ahead of queued preload reads, so a preload takes the port and HBM cycles "
            "the executions leave free; an execute still waits where a preload's port share "
            "does not fit in the free port cycles before the operator reading it needs it, "
            f"{cost}"
        ]
        # the targets of ELK §6.2 (Fig. 17): why they are or are not reached here
        ratio_b, ratio_s = basic.cycles / full.cycles, static.cycles / full.cycles
        out.append(
            f"ELK-Full is {ratio_b:.2f}x Basic (paper 1.87x), {ratio_s:.2f}x Static (paper "
            f"1.37x) and {ideal.cycles / full.cycles:.1%} of Ideal (paper 94.84%): with preloads "
            "yielding to executions at the ports and the HBM, any design that issues its "
            "preloads early enough runs at the bound of execution and HBM time; Static's "
            "fixed split already holds every operator's fastest plan beside the largest "
            "preload share (see the next note), so it preloads as far ahead as ELK and is "
            f"{ideal.cycles / static.cycles:.1%} of Ideal, and only Basic, one operator ahead, "
            "cannot start a long preload (an attention's KV share) early enough"
            + (
                "; Ideal's plan search keeps a bounded number of plan combinations "
                "(elk.designs.IDEAL_FRONT) and ELK-Full's schedule ends "
                f"{1 - full.cycles / ideal.cycles:.1%} sooner"
                if full.cycles < ideal.cycles
                else ""
            )
        )
        if full.cycles > ideal.cycles / 0.9:
            out.append(_gap_note(full, ideal))
    if not c.mesh:
        out.append(_setup_note(full, paced))
    out.append(_space_note(s))
    out.append(_basic_note(basic, dyn))
    peak = max(st.space for st in full.timeline.steps) / max(c.capacity, 1)
    if full.order == tuple(range(len(full.ops))):
        limit = (
            "is not what limits preloading"
            if peak < 0.9
            else "is full, yet no reordering freed space a later operator could use"
        )
        out.append(
            "ELK-Full keeps the execution order (= ELK-Dyn): no candidate order was faster, on-chip "
            f"memory ({c.capacity / 2**20:.0f} MiB, at most {peak:.0%} used) {limit}, and a queued "
            + (
                "preload holds up whichever execute its cores run next once that execute sends "
                "them a message, light or heavy, so moving it to another execute saves little "
                if c.mesh
                else "preload already fills the free port cycles of whichever executions its "
                "cores run next, so moving it to another execute saves little "
            )
            + "(ELK §4.4's two gains: space for a later operator, preloads moved off busy "
            "executions)"
        )
    if c.hbm_bw < 0.5 * c.hbm_peak:
        out.append(mesh_note(s))
    else:
        out.append(_ideal_note(ideal))
    return out


def _gap_note(full: ElkSchedule, ideal: ElkSchedule) -> str:
    """Why ELK-Full stays below 90% of Ideal on an all-to-all chip: per-core SRAM when the
    heaviest preload fills most of its cores (:func:`_sram_note`), else the exec plans Ideal
    chooses for their faster preloads (:func:`_plan_note`)."""
    mid = len(full.ops) // 2
    heavy = max(range(mid, len(full.ops)), key=lambda k: full.ops[k].hbm_bytes)
    it, st = full.items[heavy], full.timeline.steps[heavy]
    if it.exec_core_space(st.exec_plan) > 0.5 * full.costs.sram:
        return _sram_note(full, ideal)
    return _plan_note(full, ideal)


def _plan_note(full: ElkSchedule, ideal: ElkSchedule) -> str:
    """The operator whose exec plan costs ELK-Full the most preload time against Ideal's (ELK
    §4.2: a plan on more cores receives its preload through more ports; it pays when its
    preload is issued far enough ahead to overlap its slower execution)."""
    mid = len(full.ops) // 2
    k = max(
        range(mid, len(full.ops)),
        key=lambda j: (
            full.items[j].load_time(full.timeline.steps[j].exec_plan)
            - ideal.items[j].load_time(ideal.timeline.steps[j].exec_plan)
        ),
    )
    op = full.ops[k]
    ef, ei = full.timeline.steps[k].exec_plan, ideal.timeline.steps[k].exec_plan
    pf, pi = full.plans[k], ideal.plans[k]
    it = full.items[k]
    same = sum(
        1
        for j in range(len(full.ops))
        if full.ops[j].kind == op.kind
        and full.timeline.steps[j].exec_plan != ideal.timeline.steps[j].exec_plan
    )
    return (
        f"ELK-Full reaches {ideal.cycles / full.cycles:.1%} of Ideal, on-chip memory not being "
        f"the limit: Ideal runs {op.name.split('.')[-1]} ({same} of them in the step) on "
        f"{pi.label()} ({pi.cores} cores: preload {it.load_time(ei):.0f} cycles, execution "
        f"{it.execs[ei].time:.0f}) where ELK-Full keeps {pf.label()} ({pf.cores} cores: "
        f"preload {it.load_time(ef):.0f}, execution {it.execs[ef].time:.0f}); each core "
        f"receives its share through a {full.costs.port:.3f}-byte/cycle port, so the plan on "
        "more cores preloads at HBM pace and the step is HBM-bound instead of port-bound. "
        "The slower execution pays only if that preload is issued many operators ahead, more "
        "than the preload numbers this benchmark lets the planner try per operator "
        "(window=8, a search budget; ELK §4.2 tries every number up to K, the operators that "
        "fit on chip): a search limit of the benchmark's settings, not of the chip"
    )


def _sram_note(full: ElkSchedule, ideal: ElkSchedule) -> str:
    """Why ELK-Full stays below 90% of Ideal on an all-to-all chip, from its plans: the
    heaviest preload fills most of its cores' SRAM, so what executes on those cores while it
    is on chip must fit beside it (ELK §3.1-§3.2: on-chip memory bounds how far ahead an
    operator is preloaded); Ideal has unbounded memory."""
    c = full.costs
    mid = len(full.ops) // 2  # an operator in the steady state, not the first layer
    heavy = max(range(mid, len(full.ops)), key=lambda k: full.ops[k].hbm_bytes)
    op, it, st = full.ops[heavy], full.items[heavy], full.timeline.steps[heavy]
    plan = full.plans[heavy]
    own = it.exec_core_space(st.exec_plan)
    room = c.sram - own
    left = c.cores - plan.cores
    # the executions its preload overlaps, and how long it takes at the HBM's pace
    a, b = full.timeline.preload_start[heavy], full.timeline.preload_end[heavy]
    over = sum(
        max(0.0, min(b, t.end) - max(a, t.start)) for t in full.timeline.steps if t.op != heavy
    )
    during = [
        k for k, t in enumerate(full.timeline.steps) if k != heavy and t.end > a and t.start < b
    ]
    beside = {}
    for k in range(max(0, heavy - len(during) - 8), heavy):
        p, ik = full.plans[k], full.items[k]
        if not full.ops[k].hbm_bytes or p.cores <= left or p.core_space <= room:
            continue
        # its fastest plan that fits beside the heavy one, against the plan it runs
        fit = [
            o.time
            for e, o in enumerate(ik.execs)
            if o.ref.cores <= left or ik.exec_core_space(e) <= room
        ]
        slow = f"{min(fit) / p.time:.1f}x slower" if fit else "none: no plan fits"
        beside.setdefault(
            full.ops[k].name.split(".")[-1],
            f"{full.ops[k].name.split('.')[-1]} {p.core_space / 1024:.0f} KiB on "
            f"{p.cores} cores, the fastest plan beside it {slow}",
        )
    hbm = op.hbm_bytes / c.hbm_peak
    gap = full.cycles - ideal.cycles
    stalls = sum(t.stall for t in full.timeline.steps)
    return (
        f"ELK-Full reaches {ideal.cycles / full.cycles:.1%} of Ideal because of per-core SRAM: "
        f"{op.name.split('.')[-1]} ({op.hbm_bytes / 2**20:.0f} MiB, {hbm:.0f} HBM cycles, the "
        f"step's largest preload) has one plan that fits, {plan.label()} on {plan.cores} of "
        f"{c.cores} cores holding {own / 1024:.0f} KiB of each core's {c.sram / 1024:.0f} KiB, "
        f"so while it is on chip an operator on those cores has {room / 1024:.0f} KiB per core "
        f"(or must run on the other {left} cores); the plans of the operators before it need "
        "more ("
        + ("; ".join(beside.values()) or "none")
        + "), so its preload is issued only once they have executed: in the steady state it "
        f"overlaps {over / max(b - a, 1e-9):.0%} of its {b - a:.0f} preload cycles with "
        f"executions, and the wait behind it ({stalls / max(gap, 1e-9):.0%} of the gap to "
        "Ideal is execution held up behind preloads) is what Ideal's unbounded memory does "
        "not have (ELK §6.1's Ideal: full-size memory; the paper's 4-chip set-up holds a "
        "layer's KV in a smaller share of each core, see the ipu-hbm-x4 rows)"
    )


def _setup_note(full: ElkSchedule, paced: bool) -> str:
    """The chip set-up against ELK §6.1 and what one core holds per layer (ELK §2.1)."""
    c = full.costs
    ghz = c.clock_ghz
    layers = max(1, len({op.name.split(".")[0] for op in full.ops}))
    per_layer = sum(op.hbm_bytes for op in full.ops) / layers / c.cores
    kv = sum(op.hbm_bytes for op in full.ops if op.name.endswith("attention")) / layers / c.cores
    model = (
        "preloads here arrive at HBM pace as in ELK §5's emulator (--paced)"
        if paced
        else "preloads here yield to execute traffic at the ports (this project's simulator); "
        "ELK §5's emulator instead broadcasts every preload at HBM pace, saturating the "
        "receivers' inbound links, and an execution sharing those cores slows: --paced plans "
        "that (rows with contention 'paced'), where Static's preloads queued before each "
        "execution cost it and ELK's allocation avoids them (ELK §4.3)"
    )
    return (
        f"set-up (ELK §6.1): {c.cores} cores x {c.sram / 1024:.0f} KiB = "
        f"{c.cores * c.sram / 2**30:.2f} GiB on chip, {c.hbm_peak * ghz / 1e3:.1f} TB/s HBM, "
        f"{c.port * ghz:.1f} GB/s per core port ({c.cores * c.port * ghz / 1e3:.1f} TB/s "
        "all-to-all); the four chips are one all-to-all chip (IPU-POD4's inter-chip links "
        "are not modelled); a decoder layer's preloads average "
        f"{per_layer / 1024:.0f} KiB per core ({kv / 1024:.0f} KiB of it KV cache) if spread "
        "over every core, so per-core SRAM holds several layers' operators and decode plans "
        f"meet little memory pressure; {model}"
    )


def _space_note(s: dict[str, ElkSchedule]) -> str:
    """Why ELK-Dyn gains little over Static (ELK §3.1, §3.3), from the plans' per-core space:
    Basic runs every operator's fastest plan."""
    basic, static = s["basic"], s["static"]
    c = basic.costs
    fast = max(p.core_space for p in basic.plans)
    pre = max(p.preload_space / max(1, p.cores) for p in basic.plans)
    room = c.FILL * c.sram
    if fast + pre <= room:
        fits = (
            f"so one fixed split fits every operator's fastest plan with the largest per-core "
            f"preload share ({pre / 1024:.0f} KiB) beside it"
        )
    else:
        fits = (
            f"which with the largest per-core preload share ({pre / 1024:.0f} KiB) exceeds a "
            "core, so a fixed split gives up faster plans or preload space for some operators, "
            "a loss confined to those operators"
        )
    return (
        f"ELK-Dyn is {static.cycles / s['elk_dyn'].cycles:.2f}x Static: the fastest execute "
        f"plans need at most {fast / 1024:.0f} KiB of a core's {c.sram / 1024:.0f} KiB, {fits} "
        "(ELK §3.1's faster plans in more space end early here: a decode plan's time is its "
        "cores' port traffic, activation multicast and partial-sum reduce-scatter, and its "
        "compute, which a larger tile does not shorten); weights and KV blocks have one owner "
        "core (weight-stationary products, one tile per KV block), so no preloaded data is "
        "shared that a preload could broadcast or an execute fetch, and the preload-state plan "
        "is the execute-state plan (no ELK §3.3 space trade-off, where the paper's ELK-Dyn "
        "gains over Static's fixed largest-or-smallest choice)"
    )


def _basic_note(basic: ElkSchedule, dyn: ElkSchedule) -> str:
    """Where Basic loses against ELK-Dyn, from the two timelines (ELK §6.2 Fig. 18 (a))."""
    lost: dict[str, float] = {}
    for b, d in zip(basic.timeline.steps, dyn.timeline.steps):
        name = basic.ops[b.op].name.split(".")[-1]
        lost[name] = lost.get(name, 0.0) + (b.end - b.start) - (d.end - d.start)
    gap = max(basic.cycles - dyn.cycles, 1e-9)
    top = sorted(lost.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{n} {v / gap:.0%}" for n, v in top)
    # executions during which the next operator's preload (if it reads HBM) was under way
    pos = {op: k for k, op in enumerate(basic.order)}
    nxt = [
        st.P > pos[st.op + 1]
        for st in basic.timeline.steps[:-1]
        if basic.ops[st.op + 1].hbm_bytes > 0
    ]
    return (
        f"Basic is {basic.cycles / dyn.cycles:.2f}x ELK-Dyn (paper 1.87x over ELK-Full): the "
        f"next operator's preload runs during {sum(nxt) / max(1, len(nxt)):.0%} of the "
        "executions followed by one that reads HBM (its fastest plans leave the space; ELK's "
        "Basic fills the memory with its fastest plans and 'poorly overlaps'), and it loses "
        "where an execution is shorter than the next operator's preload, which it cannot start "
        f"earlier; share of the gap by operator (all layers; others gain some back): {parts}"
    )


def _ideal_note(ideal: ElkSchedule) -> str:
    """What bounds Ideal (ELK §6.3: 64% HBM), from its plans."""
    c = ideal.costs
    ex: dict[str, float] = {}
    hb: dict[str, float] = {}
    for op, p in zip(ideal.ops, ideal.plans):
        ex[op.kind] = ex.get(op.kind, 0.0) + p.time
        hb[op.kind] = hb.get(op.kind, 0.0) + op.hbm_bytes / c.hbm_peak
    mm = [(op, p) for op, p in zip(ideal.ops, ideal.plans) if op.kind == "matmul"]
    if not mm:
        return f"Ideal uses {ideal.hbm_utilisation():.0%} of HBM (ELK §6.3: 64%)"
    op, p = max(mm, key=lambda x: x[0].hbm_bytes)
    (m, k, n), (tk, tn) = op.dims, p.tiles[1:]
    act = m * (k // tk) * op.elem / c.port
    part = (tk - 1) * m * (n // tn) * op.elem / tk / c.port
    flops = 2 * m * (k // tk) * (n // tn) / c.flops
    kinds = ", ".join(
        f"{k} {ex[k] / max(hb[k], 1e-9):.1f}x" for k in ("matmul", "attention") if k in ex
    )
    return (
        f"Ideal uses {ideal.hbm_utilisation():.0%} of HBM (ELK §6.3: 64%): its execution alone "
        f"takes {sum(ex.values()) / max(sum(hb.values()), 1e-9):.2f}x the HBM time of the "
        f"step (execution over HBM time: {kinds}); e.g. {op.name.split('.')[-1]} "
        f"{p.label()} ({p.time:.0f} cycles against {op.hbm_bytes / c.hbm_peak:.0f} of HBM): "
        f"{flops:.0f} cycles of multiply-adds per core, its activation block gathered and "
        f"multicast through {c.port:.3f}-byte/cycle ports ({act:.0f} cycles each) and its "
        f"partial sums reduce-scattered ({part:.0f} cycles), plus the accumulator re-read "
        "per preloaded weight piece"
    )


def paced_note(s: dict[str, ElkSchedule], cost: str) -> str:
    """The all-to-all run planned as ELK §5's emulator charges contention (``--paced``)."""
    full, static, basic, ideal = (s[d] for d in ("elk_full", "static", "basic", "ideal"))
    hbm = {d: s[d].hbm_utilisation() for d in s}
    return (
        "preloads arrive at HBM pace (ELK §5's emulator broadcasts every preload to all cores "
        "and saturates their inbound links; §3.3 adds a core's HBM-to-core demand to its "
        "inter-core demand), so an execution sharing cores with a queued preload slows by the "
        "port cycles the preload takes beyond its free ones instead of the preload waiting "
        f"for them, {cost}: ELK-Full is {basic.cycles / full.cycles:.2f}x Basic (paper "
        f"1.87x), {static.cycles / full.cycles:.2f}x Static (paper 1.37x) and "
        f"{ideal.cycles / full.cycles:.1%} of Ideal (paper 94.84%); HBM utilisation Basic "
        f"{hbm['basic']:.0%}, Static {hbm['static']:.0%}, ELK-Dyn {hbm['elk_dyn']:.0%}, "
        f"ELK-Full {hbm['elk_full']:.0%}, Ideal {hbm['ideal']:.0%} (paper 35/46/52/62/64%): "
        "Static's many preloads issued before each execution now cost it where they share "
        "its cores, which ELK's allocation and grid choice avoid (ELK §4.3)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b,qwen3-30b-a3b")
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
        "--window-data",
        action="store_true",
        help="count the search window (8) in operators that preload data (ELK §4.2's K over "
        "real preloads: a MoE layer's expert preloads lie further apart than 8 positions)",
    )
    args = p.parse_args()
    if args.moe:
        for batch in (int(b) for b in args.batches.split(",")):
            for chip_name in args.chips.split(","):
                rep = dynamic_vs_dense(
                    "qwen3-30b-a3b",
                    batch,
                    args.kv_len,
                    chip_setup(chip_name),
                    layers=args.layers,
                    window=8,
                    beam=2,
                    max_orders=4,
                )
                rep["chip"] = chip_name
                print(json.dumps(rep), flush=True)
        return 0
    rows = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            by_chip: dict[str, dict[str, dict]] = {}
            for chip_name in args.chips.split(","):
                chip = chip_setup(chip_name)
                ops = decode_step_ops(model, batch, args.kv_len, args.layers)
                per: dict[str, dict] = {}
                scheds: dict[str, ElkSchedule] = {}
                ideal_cycles = None
                for design in ("ideal", *(d for d in DESIGNS if d != "ideal")):
                    try:
                        s = plan_model(
                            ops,
                            chip,
                            design,
                            window=8,
                            beam=2,
                            max_orders=4,
                            paced=args.paced,
                            window_data=args.window_data,
                        )
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
                        "design": design,
                        "contention": "paced" if args.paced else "priority",
                        "window": "data" if args.window_data else "positions",
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
                        sp = plan_model(sub, chip, design, window=8, beam=2, max_orders=4)
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
                        f"{model} batch {batch} kv {args.kv_len} on {chip.name}: ELK-Full "
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
                    key = {"model": model, "batch": batch, "chip": chip.name}
                    if args.paced:
                        key["contention"] = "paced"
                    if args.window_data:
                        key["window"] = "data"
                    print(json.dumps({**key, "notes": notes(scheds, args.paced)}), flush=True)
            if "mesh" in by_chip and "ipu-hbm" in by_chip:
                _print_fig21(model, batch, fig21(by_chip, "mesh", "ipu-hbm"), args.json)
    return 0


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
