"""Capture, raise, lower and simulation times of the compile pipeline on real layer configs.

For the Mixtral-8x7B MoE block, the Qwen3-30B-A3B MoE block and a Qwen3 GQA decode step
(``models.get_layer``; ``--tiny`` for the small test configs) prints, measured in one run:
capture (``torch.export``), raise (layer graph), lower (STeP program), the functional run of
the reference interpreter and the spatial simulation of ``Program.report``.

    python benchmarks/compile_time.py [--tiny] [--batch 64]
"""

from __future__ import annotations

import argparse
import time

import torch

import models
from hwmodel import load_chip
from torch2step.frontend import capture, from_exported
from torch2step.lower import lower
from torch2step.program import Program


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the small test configurations")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", default="mixtral-moe,qwen3-moe,qwen3-gqa")
    args = ap.parse_args()
    torch.set_num_threads(1)
    chip = load_chip("step-sda")
    print(
        f"{'layer':<12} {'capture':>8} {'raise':>7} {'lower':>7} {'run':>7} {'simulate':>9} {'cycles':>12}"
    )
    for name in args.layers.split(","):
        spec = models.get_layer(name, tiny=args.tiny, batch=args.batch, device="cpu")
        t0 = time.perf_counter()
        ep = capture(spec.module, spec.example_inputs, spec.dynamic_shapes)
        t1 = time.perf_counter()
        g = from_exported(ep, spec.module, spec.example_inputs, spec.dynamic_shapes)
        t2 = time.perf_counter()
        lw = lower(g)
        t3 = time.perf_counter()
        prog = Program(g, lw, chip, spec.example_inputs)
        prog.run(*spec.example_inputs)
        t4 = time.perf_counter()
        rep = prog.report(*spec.example_inputs)
        t5 = time.perf_counter()
        t_cap, t_raise, t_lower, t_run, t_rep = t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4
        print(
            f"{name:<12} {t_cap:8.2f} {t_raise:7.2f} {t_lower:7.2f} {t_run:7.2f} "
            f"{rep.simulation_s:9.2f} {rep.latency_cycles:12,}   (report total {t_rep:.2f} s, "
            f"{rep.events:,} events)"
        )


if __name__ == "__main__":
    main()
