"""``torch2step sweep SPEC.yaml``: the sweep subcommand (:mod:`torch2step.sweep`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_sweep", "interrupted_line", "run_sweep"]


def add_sweep(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = sub.add_parser("sweep", help="run layers x batches x chips x options x traces; resumable")
    s.add_argument("spec", type=Path, help="sweep spec (YAML; see torch2step.sweep)")
    s.add_argument("--out", type=Path, default=None, help="results folder (default: SPEC stem)")
    s.add_argument(
        "--backend", choices=("pool", "ray", "serial"), default="pool", help="where points run"
    )
    s.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPUs)")
    s.add_argument("--address", default=None, help="--backend ray: a Ray cluster's address")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    return s


def interrupted_line(e: Any, args: argparse.Namespace) -> str:
    """What a sweep stopped by Ctrl-C (:class:`torch2step.sweep.SweepInterrupted` ``e``) says:
    the points finished and the command that resumes it."""
    resume = ["torch2step", "sweep", str(args.spec), "--out", str(e.out)]
    if args.backend != "pool":
        resume += ["--backend", args.backend]
    return (
        f"torch2step sweep: interrupted: {e.finished} of {e.total} points finished (kept in "
        f"{e.out}/points); resume with: {shlex.join(resume)}"
    )


def run_sweep(args: argparse.Namespace) -> int:
    from torch2step import sweep

    out = args.out or args.spec.with_suffix("")
    try:
        rows = sweep.run_sweep(
            args.spec,
            out,
            backend=args.backend,
            jobs=args.jobs,
            address=args.address,
            progress=not (args.no_progress or args.quiet),
        )
    except sweep.SweepInterrupted as e:
        print(interrupted_line(e, args), file=sys.stderr)
        return 130
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"{ok} of {len(rows)} points ok; results in {out}/results.csv")
    return 0 if ok == len(rows) else 1
