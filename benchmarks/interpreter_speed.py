"""Reference-interpreter speed: ``step.run`` on the MoE example against the same layer in PyTorch.

    python benchmarks/interpreter_speed.py                    # Qwen3-30B-A3B MoE, 64 tokens
    python benchmarks/interpreter_speed.py --config mixtral-quarter
    python benchmarks/interpreter_speed.py --profile          # where step.run spends its time

The graph is :func:`torch2step.lower.blocks.moe_graph` (dynamic tiling, STeP §5.2) at full
size; the routing is the real trace of the STeP evaluation (``models.traces``: ``qwen_b64`` or
``mixtral_b64``, 64 tokens), routing weights and activations random (fp32).  Timed separately:
building + verifying the graph, the symbolic §4.1 metrics, ``step.run`` (with its shape checks)
and :func:`torch2step.lower.blocks.moe_reference` (PyTorch, a loop over the experts that have
tokens; best of ``--repeat`` runs after a warm-up).  The ratio is ``step.run`` time / PyTorch
time, both on one thread (BLAS and torch limited to one thread unless the environment says
otherwise).

Configs: ``qwen3`` is Qwen3-30B-A3B (H=2048, I=768, E=128, k=8: 2.4 GB of fp32 expert
weights); ``mixtral-quarter`` is Mixtral-8x7B with H and I divided by 4 (H=1024, I=3584, E=8,
k=2) — the full Mixtral (H=4096, I=14336: 5.6 GB fp32) does not fit the benchmark machine's
budget.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path

# One BLAS thread, set before numpy loads: both sides then run on one core, and a shared
# 2-core machine's other load cannot make spinning BLAS threads dominate the timings.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.traces import routing as routing_trace  # noqa: E402
from torch2step.lower.blocks import moe_graph, moe_inputs, moe_reference  # noqa: E402
from torch2step.step import metrics, run  # noqa: E402

CONFIGS: dict[str, dict[str, object]] = {
    "qwen3": {
        "label": "Qwen3-30B-A3B MoE (full size)",
        "hidden": 2048,
        "intermediate": 768,
        "num_experts": 128,
        "top_k": 8,
        "trace": "qwen_b64",
    },
    "mixtral-quarter": {
        "label": "Mixtral-8x7B MoE with H and I / 4",
        "hidden": 1024,
        "intermediate": 3584,
        "num_experts": 8,
        "top_k": 2,
        "trace": "mixtral_b64",
    },
}


def _timed(what: str, f, *args, **kw):  # type: ignore[no-untyped-def]
    gc.collect()
    t0 = time.perf_counter()
    out = f(*args, **kw)
    dt = time.perf_counter() - t0
    print(f"  {what:<34s} {dt:8.3f} s")
    return out, dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="qwen3")
    ap.add_argument("--tokens", type=int, default=64, help="tokens T (first T of the trace)")
    ap.add_argument("--profile", action="store_true", help="cProfile step.run, top 20 entries")
    ap.add_argument("--repeat", type=int, default=3, help="PyTorch repeats (best is kept)")
    args = ap.parse_args(argv)
    cfg = CONFIGS[args.config]
    E, k = int(cfg["num_experts"]), int(cfg["top_k"])  # type: ignore[call-overload]
    H, I = int(cfg["hidden"]), int(cfg["intermediate"])  # type: ignore[call-overload]  # noqa: E741
    route = routing_trace(str(cfg["trace"]))[: args.tokens]
    T = route.shape[0]
    counts = np.bincount(route.ravel(), minlength=E)
    print(f"{cfg['label']}: T={T}, H={H}, I={I}, E={E}, top-{k}; routing trace {cfg['trace']}")
    print(
        f"  experts with tokens: {int((counts > 0).sum())}/{E}, max tokens/expert "
        f"{int(counts.max())}"
    )

    inputs, _ = _timed(
        "random inputs (set-up)",
        moe_inputs,
        num_experts=E,
        top_k=k,
        hidden=H,
        intermediate=I,
        tokens=T,
        routing=route,
    )
    prog, t_build = _timed(
        "build + verify graph", moe_graph, num_experts=E, top_k=k, hidden=H, intermediate=I
    )
    print(f"  ({len(prog.nodes)} nodes)")
    m, t_metrics = _timed("symbolic metrics (STeP §4.1)", metrics, prog)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    res, t_run = _timed("step.run", run, prog, tensors=inputs)
    if args.profile:
        prof.disable()
    torch.set_num_threads(1)
    moe_reference(**inputs)  # warm-up (first-call allocations)
    t_torch = float("inf")
    for r in range(args.repeat):
        ref, dt = _timed(f"PyTorch (loop over experts) #{r + 1}", moe_reference, **inputs)
        t_torch = min(t_torch, dt)

    err = float(np.abs(res.tensors["out"] - ref.numpy()).max())
    counted = res.offchip_bytes
    formula = m.evaluate(res.bindings)["offchip_bytes"]
    print(f"  max |step - torch| = {err:.2e}; off-chip bytes counted {counted}, formula {formula}")
    print(
        f"step.run {t_run:.3f} s, PyTorch {t_torch:.3f} s (best of {args.repeat}), "
        f"ratio {t_run / t_torch:.1f}x (one thread each)"
    )
    if args.profile:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    return 0 if err < 1e-3 and counted == formula else 1


if __name__ == "__main__":
    sys.exit(main())
