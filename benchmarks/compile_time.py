"""Capture, raise, lower and simulation times of the compile pipeline on real layer configs.

For the Mixtral-8x7B MoE block, the Qwen3-30B-A3B MoE block and a Qwen3 GQA decode step
(``models.get_layer``; ``--tiny`` for the small test configs) prints, measured in one run:
capture (``torch.export``), raise (layer graph), lower (STeP program), the functional run of
the reference interpreter and the spatial simulation of ``Program.report``.

    python benchmarks/compile_time.py [--tiny] [--batch 64]

With ``--hf-configs`` (names of ``models/hf_configs/*.json``) it times the config-only path
instead: a full-size decoder layer built on the ``meta`` device (no weights), each config in its
own process so that its peak memory (``ru_maxrss``) is its own: raising the small random
stand-in (the checks that run numbers), capture and raise at full size, lower, and the report
(simulated on stand-in values, :mod:`torch2step.layers.standins`).

    python benchmarks/compile_time.py --hf-configs llama-3-8b,mixtral-8x7b --batch 64

A config written ``name:N`` times the decode step of ``N`` identical layers instead
(``torch2step.compile_config(..., layers=N)``: the layers are checked identical on the meta
device, one body is raised, lowered and simulated, the report scaled to ``N`` layers):

    python benchmarks/compile_time.py --hf-configs llama-3-8b:32,llama-2-70b:80 --batch 64
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

import torch

import models
from hwmodel import load_chip
from torch2step.frontend import capture, from_exported
from torch2step.lower import lower
from torch2step.program import Program


def config_only(name: str, batch: int, past: int) -> None:
    """One line of the config-only table (run in its own process)."""
    import torch2step
    from models.decoder import decode_inputs, decoder_step, hf_config, standin_config
    from torch2step.frontend import from_torch
    from torch2step.frontend.hf_config import same_structure

    name, _, count = name.partition(":")
    cfg = hf_config(models.HF_CONFIGS / f"{name}.json")
    if count:
        return stack_only(name, cfg, int(count), batch, past)
    t0 = time.perf_counter()
    tiny = standin_config(cfg)
    small = from_torch(decoder_step(tiny, device="cpu"), decode_inputs(tiny, 2, 4))
    t1 = time.perf_counter()
    step = decoder_step(cfg, device="meta")
    ins = decode_inputs(cfg, 2, 8, device="meta")
    ep = capture(step, ins)
    t2 = time.perf_counter()
    g = from_exported(ep, step, ins)
    assert same_structure(g, small) is None, same_structure(g, small)
    t3 = time.perf_counter()
    prog = torch2step.compile(g, decode_inputs(cfg, batch, past, device="meta"), chip="step-sda")
    t4 = time.perf_counter()
    peak_compile = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rep = prog.report()
    t5 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(t.numel() for t in step.parameters()) / 1e9
    print(
        f"{name:<16} {params:6.2f}B {t1 - t0:8.2f} {t2 - t1:8.2f} {t3 - t2:7.2f} {t4 - t3:7.2f} "
        f"{t5 - t4:8.2f} {peak_compile:7.0f} MB {peak:7.0f} MB {rep.latency_cycles:14,}",
        flush=True,
    )


def stack_only(name: str, cfg: object, count: int, batch: int, past: int) -> None:
    """One line for a decode step of ``count`` identical layers (run in its own process)."""
    import torch2step
    from models.decoder import decode_inputs, decoder_step, standin_config
    from torch2step.frontend import from_torch
    from torch2step.frontend.hf_config import same_structure, stack_from_config

    t0 = time.perf_counter()
    tiny = standin_config(cfg)
    small = from_torch(decoder_step(tiny, device="cpu"), decode_inputs(tiny, 2, 4))
    t1 = time.perf_counter()
    g = stack_from_config(cfg, count, check=False)  # identical-layer check, capture and raise
    assert same_structure(g.nodes[0].op.body, small) is None
    t3 = time.perf_counter()
    x, k, _ = decode_inputs(cfg, batch, past, device="meta")
    k = torch.empty((count, *k.shape), device="meta")
    prog = torch2step.compile(g, (x, k, k.clone()), chip="step-sda")
    t4 = time.perf_counter()
    peak_compile = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rep = prog.report()
    t5 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = count * sum(t.numel() for t in decoder_step(cfg).parameters()) / 1e9
    label = f"{name} x{count}"
    print(
        f"{label:<16} {params:6.2f}B {t1 - t0:8.2f} {'(with raise)':>8} {t3 - t1:7.2f} "
        f"{t4 - t3:7.2f} {t5 - t4:8.2f} {peak_compile:7.0f} MB {peak:7.0f} MB "
        f"{rep.latency_cycles:14,}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the small test configurations")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--past", type=int, default=1024, help="KV rows per request (config-only)")
    ap.add_argument(
        "--layers", default="mixtral-moe,qwen3-moe,qwen3-gqa,llama-decoder,qwen3-decoder"
    )
    ap.add_argument(
        "--hf-configs", default=None, help="e.g. llama-3-8b,mixtral-8x7b,llama-2-70b:80 (N layers)"
    )
    ap.add_argument("--one-config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one_config:
        config_only(args.one_config, args.batch, args.past)
        return
    if args.hf_configs:
        print(
            f"{'config':<16} {'params':>7} {'stand-in':>8} {'capture':>8} {'raise':>7} "
            f"{'lower':>7} {'report':>8} {'peak compile':>12} {'peak all':>10} {'cycles':>14}",
            flush=True,
        )
        for name in args.hf_configs.split(","):
            cmd = [sys.executable, __file__, "--one-config", name, "--batch", str(args.batch)]
            subprocess.run([*cmd, "--past", str(args.past)], check=True)
        return
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
