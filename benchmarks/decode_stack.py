"""Where the time of a kernel-by-kernel decode step goes: plan, per-core programs, compile, run.

    python benchmarks/decode_stack.py --layers 4            # Llama-3-8B, 4 layers, ipu-hbm
    python benchmarks/decode_stack.py --layers 32 --digest  # and digests to compare versions
    python benchmarks/decode_stack.py --layers 32 --sim-layers 5  # the steady-period report
    python benchmarks/decode_stack.py --layers 12 --sim-layers 5 --check --design elk_dyn

The Llama-3-8B config (``models/hf_configs/llama-3-8b.json``, batch 32, KV 2048) compiled with
:func:`torch2step.compile_config` for kernel execution (ELK-Full, ELK §4.4: the layers planned
as one model), all layers simulated in timing mode — the path of ``torch2step report
--hf-config ... --layers N --sim-layers N``.  Printed, one JSON object: the plan's seconds
(``ElkSchedule.plan_seconds``), CPU seconds of this process for building the per-core
programs, compiling them (the :class:`runtime.Simulator` constructor) and the event loop (on a
shared machine CPU seconds are the work's own, wall seconds are not; the plan's candidate
orders run on ``plan_jobs`` processes, ``TORCH2STEP_PLAN_JOBS``), the wall seconds of
planning, building, compiling and running together (``total_wall_s``; not the digests, which
write out the text of every instruction), instructions (``copied``: those in equal layers'
copies, compiled once as their template), simulated cycles, peak RSS and, with ``--digest``,
SHA-256 prefixes of the schedule, the program set and the run's statistics (events excluded,
as ``sim_golden.py`` does), so two versions can be shown
to plan, build and simulate the same thing.

``--sim-layers K`` instead times what ``torch2step report ... --layers N --sim-layers K``
runs: a ``K``-layer step planned on its own and simulated, the other layers timed by its
steady period (:mod:`torch2step.kernel.steady`); the shorter step is built and simulated in
a worker process while the whole step is planned, so their seconds overlap.  Printed: its
cycles for the whole step, the period and the layers that showed it, the wall seconds of both
plans, the build and the simulation, and from the config to the report (``total_wall_s``).
``--check`` then simulates every layer of the same plan and prints its cycles, the relative
error of the steady-period figure and the speed-up (``total_wall_s_every_layer /
total_wall_s``, each from the config: the step planned afresh, alone on the CPUs, then every
layer simulated).  ``--design`` chooses the ELK design (default ELK-Full).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch2step  # noqa: E402
from elk.reorder import plan_jobs  # noqa: E402
from hwmodel.presets import load_chip  # noqa: E402
from runtime import Simulator, gc_paused  # noqa: E402


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _peak_gb() -> float:
    """The peak resident memory of this process or of a worker it ran (the steady-period
    report simulates its shorter step in one), in GB."""
    peak = max(
        resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return round(peak / 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kv-len", type=int, default=2048)
    ap.add_argument("--chip", default="ipu-hbm")
    ap.add_argument("--config", default=str(ROOT / "models/hf_configs/llama-3-8b.json"))
    ap.add_argument(
        "--dtype", default=None, help="bf16, fp16 or fp32 (default: the config's, as served)"
    )
    ap.add_argument("--digest", action="store_true", help="digests of schedule, programs, stats")
    ap.add_argument(
        "--sim-layers",
        type=int,
        default=None,
        help="simulate K layers, time the rest by their period",
    )
    ap.add_argument(
        "--check", action="store_true", help="with --sim-layers: also simulate every layer, compare"
    )
    ap.add_argument("--design", default="elk_full", help="basic, static, elk_dyn, elk_full")
    args = ap.parse_args()
    chip = load_chip(args.chip)

    def compiled() -> Any:  # a KernelStackProgram
        return torch2step.compile_config(
            args.config, batch=args.batch, past=args.kv_len, chip=chip, layers=args.layers,
            execution="kernel", design=args.design, dtype=args.dtype,
        )  # fmt: skip

    w_start = time.perf_counter()
    prog = compiled()
    if args.sim_layers is not None:
        rep = prog.report(sim_layers=args.sim_layers)
        total = time.perf_counter() - w_start  # from the config: both plans, build, simulation
        d = rep.to_dict()
        out: dict[str, object] = {
            "layers": args.layers,
            "design": args.design,
            "sim_layers": args.sim_layers,
            "cycles": rep.cycles,
            "cycles_simulated": rep.sim.cycles,
            "rest": d.get("rest", "none"),
            "steady": str(rep.steady) if rep.steady is not None else None,
            "plan_s": round(rep.schedule.plan_seconds, 2),
            "plan_s_simulated": round(rep.sim.schedule.plan_seconds, 2),
            "build_s": round(rep.build_seconds, 2),
            "sim_s": round(rep.sim.sim_seconds, 2),
            "total_wall_s": round(total, 2),
            "peak_rss_gb": _peak_gb(),
        }
        if args.check:  # the reference: every layer simulated, from the config, planned afresh
            w0 = time.perf_counter()
            every = compiled().report(sim_layers=args.layers)
            wall = time.perf_counter() - w0
            assert every.schedule.cycles == rep.schedule.cycles  # the same plan
            out.update(
                cycles_every_layer=every.cycles,
                error=round(rep.cycles / every.cycles - 1, 5),
                total_wall_s_every_layer=round(wall, 2),
                speedup=round(wall / total, 2),
            )
        print(json.dumps(out), flush=True)
        return
    s = prog.schedule
    # plan_s: wall seconds; the candidate preload orders run on plan_jobs processes
    out: dict[str, object] = {
        "layers": args.layers,
        "dtype": prog.graph.dtype,
        "plan_s": round(s.plan_seconds, 2),
        "plan_jobs": plan_jobs(),
    }
    with gc_paused():  # as KernelStackProgram.report: one pause across build, compile and run
        w0 = time.perf_counter()
        t0 = time.process_time()
        ps = prog.programs(args.layers)
        t1 = time.process_time()
        sim = Simulator(ps, chip, mode="timing", inputs={})
        t2 = time.process_time()
        res = sim.run()
        t3 = time.process_time()
        w1 = time.perf_counter()
    out.update(
        build_cpu_s=round(t1 - t0, 2),
        compile_cpu_s=round(t2 - t1, 2),
        run_cpu_s=round(t3 - t2, 2),
        # the step planned and simulated: the plan's wall seconds plus building, compiling and
        # running (wall), the figure a target for the whole step compares with
        total_wall_s=round(s.plan_seconds + w1 - w0, 2),
        instructions=sum(len(p.body) for p in ps.programs),
        # of which in layer copies run from their compiled template (runtime.program_layers)
        copied=sum(n for marks in getattr(ps, "copies", {}).values() for _, n, _, _ in marks),
        events=res.stats.events.events,
        cycles=res.cycles,
        peak_rss_gb=_peak_gb(),
    )
    if args.digest:
        stats = res.stats.to_dict()
        stats.pop("events")
        body = hashlib.sha256()
        for p in ps.programs:
            body.update(repr((p.core, p.body)).encode())
        body.update(repr((ps.channels, ps.tensors, ps.barriers, ps.name, ps.meta)).encode())
        out.update(
            schedule=_sha(repr((s.plans, s.order, s.issued, s.cycles))),
            programs=body.hexdigest()[:16],
            stats=_sha(json.dumps(stats, sort_keys=True)),
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
