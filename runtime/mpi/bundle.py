"""A program bundle: a program set, the chip it was made for and its input tensors, in one file
that ``torch2step mpirun`` / ``python -m runtime.mpi`` run on MPI ranks.

The file is a pickle (the program set is a tree of frozen dataclasses): load only bundles you
made.  :func:`dataflow_bundle` makes the matrix-product bundles of Cyclotron's dataflows
(Cannon, SUMMA, PUMMA, weight-stationary, systolic) with seeded random operands.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import hwmodel
from hwmodel.chip import Chip
from lowering.isa import Compute, ProgramSet, walk
from lowering.kernels import KERNELS
from lowering.matmul import matmul_programs
from lowering.recurrence import SCHEDULES
from runtime.mpi.errors import MpiError

__all__ = [
    "Bundle",
    "save_bundle",
    "load_bundle",
    "dataflow_bundle",
    "kernel_modules",
    "import_kernels",
    "DATAFLOWS",
]

#: Dataflow names :func:`dataflow_bundle` accepts.
DATAFLOWS = tuple(SCHEDULES)


@dataclass(frozen=True)
class Bundle:
    """``programs`` for ``chip`` with their ``inputs`` (HBM tensors by name)."""

    programs: ProgramSet
    chip: Chip | None
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.programs.name


def kernel_modules(ps: ProgramSet) -> list[str]:
    """The modules that register the kernels ``ps`` runs (imported again where it runs)."""
    names = {c.kernel for p in ps.programs for c in walk(p.body) if isinstance(c, Compute)}
    return sorted({KERNELS[k].run.__module__ for k in names if k in KERNELS})


def import_kernels(modules: list[str]) -> None:
    """Import the kernel-registering ``modules`` of a bundle."""
    for m in modules:
        importlib.import_module(m)


def save_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Write ``bundle`` to ``path``."""
    path = Path(path)
    d = {
        "programs": bundle.programs,
        "chip": bundle.chip,
        "inputs": dict(bundle.inputs),
        "kernel_modules": kernel_modules(bundle.programs),
    }
    with path.open("wb") as f:
        pickle.dump(d, f)
    return path


def load_bundle(path: str | Path) -> Bundle:
    """Read a bundle written by :func:`save_bundle`."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            d = pickle.load(f)
        import_kernels(d.get("kernel_modules", []))
        return Bundle(d["programs"], d.get("chip"), d.get("inputs", {}))
    except (
        OSError,
        pickle.UnpicklingError,
        KeyError,
        EOFError,
        TypeError,
        ImportError,
        ValueError,
        AttributeError,
        IndexError,
    ) as exc:  # whatever a file that is not a bundle makes pickle raise
        raise MpiError(
            f"{path}: not a program bundle ({type(exc).__name__}: {exc}); write one with "
            "runtime.mpi.bundle.save_bundle"
        ) from None


def dataflow_bundle(
    name: str,
    M: int,
    K: int,
    N: int,
    grid: tuple[int, int],
    *,
    seed: int = 0,
    chip: Chip | None = None,
) -> Bundle:
    """``C = A @ B`` under dataflow ``name`` on a ``grid`` of PEs (a mesh chip of that shape
    unless ``chip`` is given), fp32 operands drawn from a seeded normal distribution."""
    if name not in SCHEDULES:
        raise MpiError(f"unknown dataflow {name!r}; choose one of {', '.join(DATAFLOWS)}")
    if chip is None:
        chip = hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), *grid)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    ps = matmul_programs(chip, M, K, N, name, grid=grid)
    return Bundle(ps, chip, {"A": a, "B": b})
