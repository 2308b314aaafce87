"""End-to-end CPU seconds of the full-size ``torch2step report`` of every shipped layer.

    python benchmarks/report_speed.py                        # every layer at batch 64
    python benchmarks/report_speed.py --batch 1024 --layers qwen3-moe llama-gqa

Each report runs as ``python -m torch2step.cli report --layer L --batch B -q`` in a child
process started from this repository (so its sources are imported), with a fixed
``PYTHONHASHSEED``; the figure is the child's user + system CPU seconds (``getrusage``), which on
a shared machine is the report's own cost where wall time is not.  It covers everything the
command does: imports, building the layer on the meta device, compiling, the timing run of the
interpreter, the spatial plan and the simulation.  The latency line of each report is printed
next to it, so runs of two versions can be compared for identical cycles as well as for time.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _layers() -> list[str]:
    from models import LAYERS

    return list(LAYERS)


def report_cpu(layer: str, batch: int, extra: list[str]) -> tuple[float, str]:
    """CPU seconds of one report in a child process and its latency line."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch2step.cli",
            "report",
            "--layer",
            layer,
            "--batch",
            str(batch),
            "-q",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if out.returncode != 0:
        return cpu, f"failed: {out.stderr.strip().splitlines()[-1:]}"
    line = next((ln.strip() for ln in out.stdout.splitlines() if "latency" in ln), "?")
    return cpu, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", nargs="*", default=None, help="default: every shipped layer")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="more report arguments after --")
    args = ap.parse_args()
    extra = [a for a in args.extra if a != "--"]
    for layer in args.layers or _layers():
        cpu, line = report_cpu(layer, args.batch, extra)
        print(f"{layer:18s} batch {args.batch:5d}  {cpu:7.2f} CPU s   {line}", flush=True)


if __name__ == "__main__":
    main()
