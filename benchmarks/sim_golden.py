"""Golden outputs of the simulator: cycles, statistics and trace bytes of a fixed set of runs.

    python benchmarks/sim_golden.py > before.txt     # on one version
    python benchmarks/sim_golden.py > after.txt      # on another
    diff before.txt after.txt                        # empty: the simulator's results are identical

Every :meth:`runtime.Simulator.run` the cases make is recorded (spatial reports run the
simulator more than once when they deepen FIFOs): one line per run with its cycles, a SHA-256
of its statistics (per-core cycle breakdown and instruction counts, per-resource busy cycles,
bytes and transfers, bytes moved — everything except the event counters, whose definition is
the simulator's own business), of its final HBM tensors (functional runs) and of its Chrome
trace JSON.  The cases: the three ``sim_speed`` microbenchmarks at reduced size (with and
without traces), an HBM stream on a mesh with attached HBM, functional Cannon, tiny spatial
reports of every registered MoE and attention layer with traces, and kernel-by-kernel layers
on the ``mesh`` and ``ipu-hbm`` presets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from sim_speed import exchange_programs, ipu_chip, stream_programs  # noqa: E402

import runtime.engine as engine  # noqa: E402
from hwmodel import load_chip, with_mesh_shape  # noqa: E402
from lowering import cannon_matmul  # noqa: E402
from runtime import SimResult, Simulator  # noqa: E402

_RUNS: list[SimResult] = []


def _sha(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()[:16]


def _digest(res: SimResult) -> str:
    stats = res.stats.to_dict()
    stats.pop("events")
    tensors = hashlib.sha256()
    for name in sorted(res.tensors) if res.mode == "functional" else ():
        a = np.ascontiguousarray(res.tensors[name])
        tensors.update(name.encode() + str(a.dtype).encode() + a.tobytes())
    trace = _sha(res.trace_json()) if res.trace_events else "-"
    return (
        f"cycles={res.cycles} stats={_sha(json.dumps(stats, sort_keys=True))} "
        f"tensors={tensors.hexdigest()[:16] if res.mode == 'functional' else '-'} trace={trace}"
    )


def _record(run: Callable) -> Callable:
    def wrapped(self: Simulator, *args: object, **kw: object) -> SimResult:
        res = run(self, *args, **kw)
        _RUNS.append(res)
        return res

    return wrapped


def _sim(ps: object, chip: object, **kw: object) -> None:
    mode = kw.pop("mode", "timing")
    inputs = kw.pop("inputs", None)
    Simulator(ps, chip, mode=mode, inputs=inputs).run(**kw)  # type: ignore[arg-type]


def _report(layer: str, chip: str, trace: bool = True) -> None:
    from torch2step.named import report_layer

    report_layer(layer, 64, chip, tiny=True, routing_trace="router", trace=trace)


def _kernel(layer: str, batch: int, chip: str) -> None:
    from torch2step.cli_compare import kernel_layer_report

    kernel_layer_report(layer, batch, load_chip(chip), 512)


def cases() -> dict[str, Callable[[], None]]:
    ipu, _ = ipu_chip()
    mesh = with_mesh_shape(load_chip("mesh"), 16, 16)
    mesh4 = with_mesh_shape(load_chip("mesh"), 4, 4)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    return {
        "exchange-256": lambda: _sim(exchange_programs(256), ipu),
        "exchange-48-trace": lambda: _sim(exchange_programs(48, nbytes=100, rx=3), ipu, trace=True),
        "cannon-16x16": lambda: _sim(cannon_matmul(mesh, 512, 512, 512, grid=(16, 16)), mesh),
        "cannon-4x4-trace": lambda: _sim(
            cannon_matmul(mesh4, 128, 96, 64, grid=(4, 4)), mesh4, trace=True
        ),
        "cannon-4x4-functional": lambda: _sim(
            cannon_matmul(mesh4, 64, 64, 64, grid=(4, 4), dtype="fp32"),
            mesh4,
            mode="functional",
            inputs={"A": a.astype(np.float32), "B": b.astype(np.float32)},
        ),
        "stream-ipu": lambda: _sim(stream_programs(ipu, 1 << 15, 4096), ipu),
        "stream-ipu-trace": lambda: _sim(stream_programs(ipu, 1 << 13, 2048), ipu, trace=True),
        "stream-mesh-trace": lambda: _sim(stream_programs(mesh, 1 << 14, 1536), mesh, trace=True),
        "spatial-qwen3-moe": lambda: _report("qwen3-moe", "step-sda"),
        "spatial-mixtral-moe": lambda: _report("mixtral-moe", "step-sda"),
        "spatial-llama-gqa": lambda: _report("llama-gqa", "step-sda"),
        "spatial-qwen3-gqa": lambda: _report("qwen3-gqa", "step-sda"),
        "spatial-qwen3-moe-notrace": lambda: _report("qwen3-moe", "step-sda", trace=False),
        "spatial-qwen3-decoder": lambda: _report("qwen3-decoder", "step-sda"),
        "kernel-qwen3-moe-ipu": lambda: _kernel("qwen3-moe", 16, "ipu-hbm"),
        "kernel-llama-gqa-ipu": lambda: _kernel("llama-gqa", 8, "ipu-hbm"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("only", nargs="*", help="run only these cases")
    ap.add_argument("--times", action="store_true", help="also print wall times (stderr)")
    args = ap.parse_args()
    engine.Simulator.run = _record(engine.Simulator.run)  # type: ignore[method-assign]
    for name, fn in cases().items():
        if args.only and name not in args.only:
            continue
        _RUNS.clear()
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failing case is part of the golden output
            _RUNS.append(None)  # type: ignore[arg-type]
            print(f"{name} error {type(e).__name__}: {str(e).splitlines()[0]}")
        if args.times:
            print(f"{name}: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
        for k, res in enumerate(_RUNS):
            if res is not None:
                print(f"{name} run{k} {_digest(res)}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
