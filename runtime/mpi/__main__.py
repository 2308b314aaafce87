"""``python -m runtime.mpi BUNDLE... --out DIR [--timeout S[,S...]]``, run under ``mpiexec``: every
rank runs each bundle in turn (rank 0 reads it and broadcasts the programs; inputs are
broadcast by the HBM set-up); rank 0 writes ``DIR/<k>/outputs.npz`` and ``result.json`` (per-rank
timings and traffic, or the error) per bundle."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from runtime.errors import DeadlockError, SimulationError
from runtime.mpi.bundle import import_kernels, kernel_modules, load_bundle
from runtime.mpi.errors import MpiError, require_mpi
from runtime.mpi.run import run_mpi


def _kind(exc: BaseException) -> str:
    if isinstance(exc, DeadlockError):
        return "deadlock"
    return "mpi" if isinstance(exc, MpiError) else "simulation"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.mpi", description=__doc__)
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", default="10", help="seconds, or one per bundle joined by ','")
    args = p.parse_args(argv)
    MPI = require_mpi()
    comm = MPI.COMM_WORLD
    failed = 0
    timeouts = [float(t) for t in args.timeout.split(",")]
    if len(timeouts) == 1:
        timeouts *= len(args.bundles)
    for k, path in enumerate(args.bundles):
        head = None
        if comm.rank == 0:
            try:
                b = load_bundle(path)
                head = (b.programs, b.chip, kernel_modules(b.programs))
            except MpiError as exc:
                head = exc
        head = comm.bcast(head, root=0)
        out = args.out / str(k)
        result: dict = {"bundle": str(path), "ranks_n": comm.size}
        if isinstance(head, MpiError):
            result["error"] = {"kind": "mpi", "message": str(head)}
        else:
            ps, chip, modules = head
            import_kernels(modules)
            result["name"] = ps.name
            try:
                r = run_mpi(ps, chip, b.inputs if comm.rank == 0 else None, timeout=timeouts[k])
                if comm.rank == 0:
                    out.mkdir(parents=True, exist_ok=True)
                    np.savez(out / "outputs.npz", **r.tensors)
                    result["wall_s"] = r.wall_s
                    result["ranks"] = [asdict(s) for s in r.ranks]
                    result["rank_of"] = {str(c): n for c, n in r.rank_of.items()}
            except SimulationError as exc:
                result["error"] = {"kind": _kind(exc), "message": str(exc)}
        if comm.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result, indent=1))
            failed += "error" in result
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
