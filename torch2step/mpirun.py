"""``torch2step mpirun PROGRAM -n N``: run per-core programs on N MPI ranks (Cyclotron §9).

``PROGRAM`` is a program bundle file (:mod:`runtime.mpi.bundle`), a dataflow name (``cannon``,
``summa``, ``pumma``, ``weight_stationary``, ``systolic``: ``C = A @ B`` of ``--size`` on a
``--grid`` of PEs with seeded operands), or ``layer:NAME`` (the spatial per-core programs of a
registered layer's tiny configuration, compiled for ``--chip``).  Writes each run's
``outputs.npz`` and ``result.json`` (per-rank timings and traffic) in ``--out/0/`` and prints
the per-rank table; ``--check`` also runs the simulator's functional mode and compares the
outputs bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["add_parser", "run_mpirun", "layer_bundle", "random_inputs"]


def add_parser(sub: Any) -> None:
    """Register the ``mpirun`` subcommand on the CLI's subparsers."""
    m = sub.add_parser("mpirun", help="run per-core programs on MPI ranks (needs the mpi extra)")
    m.add_argument("program", help="bundle file, dataflow name, or layer:NAME")
    m.add_argument("-n", type=int, default=2, help="MPI ranks (default 2)")
    m.add_argument("--size", default="64x64x64", help="dataflows: MxKxN (default 64x64x64)")
    m.add_argument("--grid", default="4x4", help="dataflows: PE grid RxC (default 4x4)")
    m.add_argument("--chip", default="step-sda", help="layer:NAME: chip preset")
    m.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    m.add_argument(
        "--timeout", type=float, default=10.0, help="seconds without progress = deadlock"
    )
    m.add_argument("--out", type=Path, default=Path("mpirun_out"), help="output directory")
    m.add_argument("--check", action="store_true", help="compare with the simulator bit for bit")


def _dims(parser: argparse.ArgumentParser, text: str, n: int, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != n or min(dims) < 1:
        parser.error(f"argument {what}: expected {n} positive integers joined by 'x', got {text!r}")
    return dims


def random_inputs(ps: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every tensor the programs read and no program stores."""
    from runtime.layout import numpy_dtype
    from runtime.mpi.placement import tensor_uses

    read, stored = tensor_uses(ps)
    rng = np.random.default_rng(seed)
    out = {}
    for d in ps.tensors:
        if d.name in read and d.name not in stored:
            dt = numpy_dtype(d.dtype)
            if np.issubdtype(dt, np.floating):
                out[d.name] = rng.standard_normal(d.shape).astype(dt)
            else:
                out[d.name] = rng.integers(0, 2, d.shape).astype(dt)
    return out


def layer_bundle(name: str, chip: str = "step-sda", batch: int = 2, seed: int = 0) -> Any:
    """The spatial per-core programs of layer ``name`` (tiny configuration, ``batch``) compiled
    for ``chip`` — the programs the simulator ran for its report — with seeded inputs.  Their
    compute is the simulator's timing kernel (zeros in functional mode): running them checks
    control flow, messages and HBM traffic, not the layer's arithmetic."""
    import torch2step
    from models import get_layer
    from runtime.mpi.bundle import Bundle

    spec = get_layer(name, tiny=True, batch=batch, device="cpu")
    prog = torch2step.compile(
        spec.module, spec.example_inputs, chip=chip, dynamic_shapes=spec.dynamic_shapes
    )
    prog.report(*spec.example_inputs)
    plan = prog._last.plan  # the programs that ran (FIFOs deepened where the run needed it)
    # the run's control data (integer tensors: routing, KV lengths) with seeded data around it
    inputs = random_inputs(plan.programs, seed) | dict(plan.inputs)
    return Bundle(plan.programs, plan.sim_chip, inputs)


def _bundle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    from runtime.mpi.bundle import DATAFLOWS, dataflow_bundle, load_bundle

    if args.program in DATAFLOWS:
        M, K, N = _dims(parser, args.size, 3, "--size")
        R, C = _dims(parser, args.grid, 2, "--grid")
        return dataflow_bundle(args.program, M, K, N, (R, C), seed=args.seed)
    if args.program.startswith("layer:"):
        from models import LAYERS

        name = args.program.split(":", 1)[1]
        if name not in LAYERS:
            parser.error(
                f"argument program: unknown layer {name!r} (choose from {', '.join(LAYERS)})"
            )
        return layer_bundle(name, args.chip, seed=args.seed)
    if not Path(args.program).is_file():
        parser.error(
            f"argument program: {args.program!r} is neither a bundle file, a dataflow "
            f"({', '.join(DATAFLOWS)}) nor layer:NAME"
        )
    return load_bundle(args.program)


def _table(res: Any) -> str:
    head = (
        f"{'rank':>4} {'cores':>6} {'wall s':>8} {'kernel s':>9} {'idle s':>8} {'instr':>8} "
        f"{'msgs mem':>9} {'msgs MPI':>9} {'MPI bytes':>10}"
    )
    rows = [head]
    for s in res.ranks:
        rows.append(
            f"{s.rank:>4} {len(s.cores):>6} {s.wall_s:>8.3f} {s.compute_s:>9.3f} "
            f"{s.idle_s:>8.3f} {s.instructions:>8} {s.msgs_local:>9} {s.msgs_remote:>9} "
            f"{s.bytes_remote:>10}"
        )
    return "\n".join(rows)


def run_mpirun(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``mpirun`` subcommand (exit status 0 ok, 1 failed run or mismatch)."""
    from lowering.errors import ProgramError
    from runtime.errors import SimulationError
    from runtime.mpi.launch import find_mpiexec, launch
    from torch2step.errors import Torch2StepError

    if args.n < 1:
        parser.error("argument -n: must be a positive integer")
    try:
        find_mpiexec()  # fail before compiling anything when MPI is missing
        bundle = _bundle(args, parser)
        ps = bundle.programs
        print(f"running {ps.name!r} ({len(ps.programs)} cores) on {args.n} MPI rank(s)", flush=True)
        if args.n > len(ps.programs):
            print(
                f"note: {args.n - len(ps.programs)} of the {args.n} ranks get no core (one "
                f"core runs on one rank; at most {len(ps.programs)} ranks do work)",
                flush=True,
            )
        res = launch([bundle], args.n, timeout=args.timeout, out=args.out)[0].check()
    except (SimulationError, ProgramError, Torch2StepError) as e:
        print(f"torch2step: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(_table(res))
    print(f"wall {res.wall_s:.3f} s; outputs and per-rank timings in {res.out_dir}")
    if args.check:
        import runtime

        sim = runtime.simulate(ps, bundle.chip, mode="functional", inputs=bundle.inputs)
        bad = [k for k, v in sim.tensors.items() if not np.array_equal(res.tensors.get(k), v)]
        if bad:
            print(f"differs from the simulator's functional mode in {bad}", file=sys.stderr)
            return 1
        print(f"equal to the simulator's functional mode bit for bit ({len(sim.tensors)} tensors)")
    return 0
