"""How simulation cost grows with the work: wall time and events per sweep, with log-log slopes.

    python benchmarks/sim_scaling.py                      # every sweep at its default sizes
    python benchmarks/sim_scaling.py --sweeps moe,gqa     # some of them
    python benchmarks/sim_scaling.py --full               # full-size layers (slow, GBs of memory)

Sweeps (the work grows along the first column):

* ``moe``: spatial report of ``qwen3-moe`` (tiny configuration unless ``--full``) at batch
  16 -> 1024 tokens, routed by the layer's own router;
* ``gqa``: spatial report of ``llama-gqa`` (tiny unless ``--full``) at batch 16 -> 1024 decode
  requests;
* ``layers``: a Llama-3-8B decode step of 1 -> 32 layers planned by ELK and simulated kernel by
  kernel on the 1472-core ``ipu-hbm`` preset (batch ``--decode-batch``, KV length ``--kv-len``);
* ``cores``: weak scaling kernel by kernel on ``ipu-hbm`` cut to 64 -> 1472 cores: a
  projection ``[64, 1024] x [1024, 32 n]`` and its activation on ``n`` cores, so the work per
  core stays the same (a full-size layer's weights do not fit 64 cores' SRAM).

For each point: the simulation's wall time and its events (:mod:`runtime.engine`).  For the
spatial sweeps the time is the report's ``simulation_s``: building the spatial plan for the
run, validating, compiling, the untimed replay that finds the FIFOs to deepen and the event
loop (it runs once, with them deep: :mod:`torch2step.spatial.fifos`);
for the kernel sweeps it is building the per-core programs, compiling and the event loop (ELK
planning is not timed), also in CPU seconds of this process (on a shared machine the wall time
includes other processes' work; the CPU time is the simulator's own).  Each sweep ends with
the slopes of least-squares fits of ``log(wall)`` and ``log(events)`` against ``log(work)``
(``numpy.polyfit``): 1.0 means cost proportional to the work, and the slope of ``log(wall)``
against ``log(events)`` says whether the cost per event stays flat.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from hwmodel.presets import load_chip  # noqa: E402

#: One point: (wall seconds of simulation, events, CPU seconds of this process over the same
#: span or None where the span is not timed here).
Point = tuple[float, int, float | None]


def spatial_point(layer: str, batch: int, full: bool) -> Point:
    """Simulate a registered layer's spatial report; its simulation seconds and events."""
    from torch2step.named import report_layer

    kw = {"routing_trace": "router"} if "moe" in layer else {}
    run = report_layer(layer, batch, "step-sda", tiny=not full, **kw)
    return run.report.simulation_s, run.report.events, None


def kernel_point(ops: list, chip: object) -> Point:
    """Plan ``ops`` with ELK on ``chip`` (not timed) and simulate the schedule kernel by kernel."""
    from elk.plan import plan_model
    from torch2step.kernel import simulate_schedule
    from torch2step.kernel.build import build_programs

    sched = plan_model(ops, chip)
    t0, c0 = time.perf_counter(), time.process_time()
    rep = simulate_schedule(sched, chip, programs=build_programs(sched, chip))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, rep.result.stats.events.events, cpu


def sweep(name: str, xs: list[int], point: Callable[[int], Point], unit: str) -> None:
    """Run ``point`` at every ``x`` and print the table and the log-log slopes."""
    print(f"\n{name}")
    print(f"  {unit:>8} {'wall s':>9} {'CPU s':>9} {'events':>11} {'events/s':>11}")
    walls, events, cpus = [], [], []
    for x in xs:
        gc.collect()
        wall, ev, cpu = point(x)
        walls.append(wall)
        events.append(ev)
        cpus.append(cpu)
        c = "-" if cpu is None else f"{cpu:.3f}"
        print(
            f"  {x:>8} {wall:>9.3f} {c:>9} {ev:>11} {ev / wall if wall else 0:>11,.0f}", flush=True
        )
    lx, lw, le = np.log(xs), np.log(walls), np.log(events)
    print(
        f"  slopes (log-log fit): wall vs {unit} {np.polyfit(lx, lw, 1)[0]:.2f}, "
        f"events vs {unit} {np.polyfit(lx, le, 1)[0]:.2f}, wall vs events "
        f"{np.polyfit(le, lw, 1)[0]:.2f}"
    )
    if None not in cpus:  # on a shared machine CPU seconds are the simulator's own cost
        lc = np.log(cpus)
        print(
            f"  CPU slopes: CPU vs {unit} {np.polyfit(lx, lc, 1)[0]:.2f}, CPU vs events "
            f"{np.polyfit(le, lc, 1)[0]:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweeps", default="moe,gqa,layers,cores")
    ap.add_argument("--full", action="store_true", help="full-size layers for moe and gqa")
    ap.add_argument("--batches", default="16,64,256,1024")
    ap.add_argument("--layers", default="1,2,4", help="e.g. 1,2,4,8,16,32 (minutes)")
    ap.add_argument("--cores", default="64,184,368,736,1472")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--kv-len", type=int, default=512)
    args = ap.parse_args()
    todo = args.sweeps.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    size = "full size" if args.full else "tiny configuration"
    if "moe" in todo:
        sweep(
            f"qwen3-moe spatial report on step-sda ({size})",
            batches,
            lambda b: spatial_point("qwen3-moe", b, args.full),
            "batch",
        )
    if "gqa" in todo:
        sweep(
            f"llama-gqa spatial report on step-sda ({size})",
            batches,
            lambda b: spatial_point("llama-gqa", b, args.full),
            "batch",
        )
    ipu = load_chip("ipu-hbm")
    if "layers" in todo:
        from elk.ops import decode_step_ops

        sweep(
            f"Llama-3-8B decode step, kernel by kernel on ipu-hbm (batch {args.decode_batch}, "
            f"KV {args.kv_len})",
            [int(n) for n in args.layers.split(",")],
            lambda n: kernel_point(
                decode_step_ops("llama3-8b", args.decode_batch, args.kv_len, layers=n), ipu
            ),
            "layers",
        )
    if "cores" in todo:
        from elk.ops import Operator

        def weak(n: int) -> list:
            return [
                Operator("proj", "matmul", (64, 1024, 32 * n), slot=0),
                Operator("act", "vector", (64, 32 * n), slot=1, flops_per_elem=5),
            ]

        sweep(
            "projection [64,1024]x[1024,32n] + activation, kernel by kernel on ipu-hbm cut to "
            "n cores",
            [int(n) for n in args.cores.split(",")],
            lambda n: kernel_point(weak(n), dataclasses.replace(ipu, num_cores=n)),
            "cores",
        )


if __name__ == "__main__":
    main()
