"""Scale of the spatial simulation: wall time of the reference run, plan building and event
simulation of large STeP graphs (not a test; run by hand)::

    python tests/spatial/bench_scale.py                      # all cases
    python tests/spatial/bench_scale.py moe --experts 128    # the full-size MoE block only
    python tests/spatial/bench_scale.py matmul --profile     # cProfile of plan + simulation
    python tests/spatial/bench_scale.py replan --experts 32 --tokens 256   # a second routing

Cases: ``matmul`` (a tiled matmul with thousands of tile products), ``moe`` (the SwiGLU MoE
block of :func:`spatial_graphs.moe` at Qwen3-30B-A3B size: hidden 2048, intermediate 768, 128
experts, top-8, 64 tokens, bf16), ``moe-example`` (``torch2step.lower.blocks.moe_graph``, fp32, at the
same size); ``replan`` (``moe_graph`` H=512, I=256, top-4: the plan of a second routing, fresh
and re-planned from the first routing's unit programs, :mod:`torch2step.spatial.reuse`, once
with every expert routed tokens in both and once with one expert routed none in the second).
Both MoE graphs give every expert a dedicated region, so they run on a 50x50 mesh
of step-sda cores (the 1040-core preset is too small for ~2400 units).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's sources
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spatial_graphs import moe, tiled_matmul  # noqa: E402

from hwmodel import load_chip, with_mesh_shape  # noqa: E402
from torch2step.spatial import build_plan, simulate_plan  # noqa: E402


def _measure(name: str, make, chip, profile: bool) -> None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    prog, res = make()
    t1 = time.perf_counter()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    plan = build_plan(prog, chip, res)
    t2 = time.perf_counter()
    out = simulate_plan(plan)
    t3 = time.perf_counter()
    if prof:
        prof.disable()
    instrs = out.stats.events.instructions
    print(
        f"{name}: {len(prog.nodes)} nodes, {len(out.units)} units; reference run {t1 - t0:.2f} s, "
        f"plan {t2 - t1:.2f} s, simulation {t3 - t2:.2f} s; {out.cycles} cycles, "
        f"{out.events} events ({out.events / max(t3 - t2, 1e-9):,.0f} events/s), "
        f"{instrs} instructions, roofline {out.roofline_fraction:.1%}"
    )
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def _example_moe(tokens: int, experts: int) -> tuple:
    from torch2step.lower.blocks import moe_graph, moe_inputs
    from torch2step.step import run

    kw = dict(num_experts=experts, top_k=min(8, experts), hidden=2048, intermediate=768)
    prog = moe_graph(tokens=tokens, **kw)
    return prog, run(prog, tensors=moe_inputs(tokens=tokens, **kw))


def _replan(tokens: int, experts: int) -> None:
    """Wall time of the plan of a second routing: fresh, and re-planned from the units of the
    first (:class:`~torch2step.spatial.reuse.PlanCache`), with the units reused."""
    import numpy as np

    from torch2step.lower.blocks import moe_graph, moe_inputs
    from torch2step.spatial.reuse import PlanCache
    from torch2step.step import run

    kw = dict(num_experts=experts, top_k=4, hidden=512, intermediate=256)
    prog = moe_graph(tokens=tokens, **kw)
    chip = load_chip("step-sda")
    rng = np.random.default_rng(0)

    def routing(skip: int | None) -> np.ndarray:
        ids = np.stack([rng.permutation(experts)[:4] for _ in range(tokens)])
        if skip is not None:  # expert `skip` gets no token: its choices go to the next one
            ids[ids == skip] = (skip + 1) % experts
            for row in ids:  # keep each token's choices distinct
                while len(set(row)) < 4:
                    row[np.argmax(np.bincount(row, minlength=experts)[row] > 1)] = rng.integers(
                        experts
                    )
                    row[row == skip] = (skip + 2) % experts
        return ids

    first = run(prog, tensors=moe_inputs(tokens=tokens, seed=0, routing=routing(None), **kw))
    for what, skip in (("every expert routed in both", None), ("one expert routed none", 0)):
        ids = routing(skip)
        second = run(prog, tensors=moe_inputs(tokens=tokens, seed=0, routing=ids, **kw))
        t0 = time.perf_counter()
        build_plan(prog, chip, second)
        t1 = time.perf_counter()
        cache = PlanCache()
        cache.plan_for(prog, chip, first)
        units = cache.units(prog, chip)
        total = units.emitted
        t2 = time.perf_counter()
        cache.plan_for(prog, chip, second)
        t3 = time.perf_counter()
        empty = int((np.bincount(ids.reshape(-1), minlength=experts) == 0).sum())
        print(
            f"replan T={tokens} E={experts} top-4 ({what}: {empty} without tokens): {total} "
            f"units, fresh plan {t1 - t0:.2f} s, re-plan {t3 - t2:.2f} s, "
            f"{units.reused} units reused"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["matmul", "moe", "moe-example"])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    # one unit per operator: 128 dedicated expert regions need more than step-sda's 1040 cores
    big = with_mesh_shape(load_chip("step-sda"), 50, 50)
    for case in args.cases:
        if case == "matmul":
            _measure(
                "tiled matmul 1024x2048x1024 in 64x64 tiles",
                lambda: tiled_matmul(1024, 2048, 1024, 64),
                load_chip("step-sda"),
                args.profile,
            )
        elif case == "moe":
            _measure(
                f"spatial_graphs.moe T={args.tokens} H=2048 I=768 E={args.experts} top-8 bf16",
                lambda: moe(args.tokens, 2048, 768, args.experts, 8, weights=False),
                big,
                args.profile,
            )
        elif case == "moe-example":
            _measure(
                f"examples.moe_graph T={args.tokens} H=2048 I=768 E={args.experts} top-8 fp32",
                lambda: _example_moe(args.tokens, args.experts),
                big,
                args.profile,
            )
        elif case == "replan":
            _replan(args.tokens, args.experts)
        else:
            raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main()
