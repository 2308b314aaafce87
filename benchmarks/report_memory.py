"""Peak memory of the full-size report of every shipped layer at batch 64, with and without
``--out`` (a run directory with the trace).

Each report runs in its own process (``python -m torch2step.cli report ...``); its peak
resident set size comes from ``os.wait4``'s resource usage.  Prints one line per layer and
mode: peak GB, wall seconds, exit status, and the trace size when one was written.

    python benchmarks/report_memory.py [--layers qwen3-gqa llama-gqa] [--batch 64] [--no-out]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peak(argv: list[str]) -> tuple[float, float, int]:
    """(peak RSS in GB, wall seconds, exit status) of running ``argv``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode:
        print(f"    {err.strip().splitlines()[-1] if err.strip() else ''}", flush=True)
    return usage.ru_maxrss / 1024**2, time.perf_counter() - t0, proc.returncode


def main() -> None:
    from models import LAYERS

    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--layers", nargs="*", default=list(LAYERS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-out", action="store_true", help="only without --out")
    args = ap.parse_args()
    print(f"{'layer':<12} {'mode':<8} {'peak GB':>8} {'wall s':>8} {'exit':>5}  trace")
    for layer in args.layers:
        modes = ["no out"] if args.no_out else ["no out", "--out"]
        for mode in modes:
            argv = [sys.executable, "-m", "torch2step.cli", "report", "--layer", layer]
            argv += ["--batch", str(args.batch), "-q"]
            with tempfile.TemporaryDirectory() as d:
                if mode == "--out":
                    argv += ["--out", d]
                gb, wall, code = peak(argv)
                trace = Path(d) / "trace.json"
                size = f"{trace.stat().st_size / 1e6:,.1f} MB" if trace.is_file() else ""
            print(f"{layer:<12} {mode:<8} {gb:>8.2f} {wall:>8.1f} {code:>5}  {size}", flush=True)


if __name__ == "__main__":
    main()
