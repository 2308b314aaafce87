"""``torch2step sweep SPEC.yaml``: the sweep subcommand (:mod:`torch2step.sweep`)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_sweep", "run_sweep"]


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


def run_sweep(args: argparse.Namespace) -> int:
    from torch2step import sweep

    out = args.out or args.spec.with_suffix("")
    rows = sweep.run_sweep(
        args.spec,
        out,
        backend=args.backend,
        jobs=args.jobs,
        address=args.address,
        progress=not (args.no_progress or args.quiet),
    )
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"{ok} of {len(rows)} points ok; results in {out}/results.csv")
    return 0 if ok == len(rows) else 1
