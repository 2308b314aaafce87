"""Run a :class:`~lowering.isa.ProgramSet` on MPI ranks: the Python entry point.

Cyclotron §9 compiles one set of per-PE programs to two targets, a cycle-level simulator and an
MPI backend on which the same program runs unmodified.  :func:`run_mpi` is that second target
for this project's per-core ISA: call it on every rank of an MPI job (``mpiexec -n 4 python
script.py``) with the same program set; it returns the HBM tensors after the run (on the root
rank) and per-rank timings.  Outputs equal the simulator's functional mode bit for bit for a
program whose HBM writes are ordered by its messages and barriers (every program the project's
generators make).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hwmodel.chip import Chip
from lowering.isa import ProgramSet
from runtime.layout import numpy_dtype
from runtime.mpi.errors import MpiError, require_mpi
from runtime.mpi.placement import plan_ranks, tensor_uses
from runtime.mpi.rank import RankRun

__all__ = ["run_mpi", "MpiResult", "RankStats"]


@dataclass(frozen=True, slots=True)
class RankStats:
    """What one rank did: its cores, wall seconds until its last core finished (all ranks
    start together), kernel seconds, seconds idle (all its cores waiting), instructions executed, messages kept in memory or sent to other ranks, bytes
    moved to and from the shared HBM window, and the traffic of its cores counted as the
    simulator counts it (``hbm_read`` / ``hbm_write`` / ``noc_messages`` bytes in the chip's
    dtypes)."""

    rank: int
    cores: tuple[int, ...]
    wall_s: float
    compute_s: float
    idle_s: float
    instructions: int
    msgs_local: int
    msgs_remote: int
    broadcasts: int
    bytes_remote: int
    hbm_get_bytes: int
    hbm_put_bytes: int
    hbm_read: int
    hbm_write: int
    noc_messages: int


@dataclass(frozen=True)
class MpiResult:
    """HBM tensors after the run (root rank only; empty elsewhere), per-rank statistics (root
    only), the run's wall seconds (until every rank knew it had ended) and which rank ran each
    core."""

    tensors: dict[str, np.ndarray]
    ranks: tuple[RankStats, ...]
    wall_s: float
    rank_of: dict[int, int] = field(default_factory=dict)

    def bytes_moved(self) -> dict[str, int]:
        """HBM and message bytes of all ranks, keyed as ``SimStats.bytes_moved``."""
        keys = ("hbm_read", "hbm_write", "noc_messages")
        return {k: sum(getattr(r, k) for r in self.ranks) for k in keys}


def _check_inputs(
    ps: ProgramSet, inputs: Mapping[str, Any], read: set[str], stored: set[str]
) -> str | None:
    decls = {d.name: d for d in ps.tensors}
    unknown = sorted(set(inputs) - set(decls))
    if unknown:
        return f"inputs {unknown} are not declared tensors; declared: {sorted(decls)}"
    missing = sorted((read - stored) - set(inputs))
    if missing:
        return (
            f"functional mode: missing inputs for tensors the programs read: {missing}; pass "
            "them in `inputs`"
        )
    for name, arr in inputs.items():
        shape = tuple(np.shape(arr))
        if shape != tuple(decls[name].shape):
            return f"input {name!r} has shape {shape}, declared {tuple(decls[name].shape)}"
        np.asarray(arr).astype(numpy_dtype(decls[name].dtype))
    return None


def run_mpi(
    ps: ProgramSet,
    chip: Chip | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    comm: Any = None,
    timeout: float = 10.0,
    fifo_depth: int | None = None,
) -> MpiResult:
    """Run ``ps`` on the ranks of ``comm`` (default ``MPI.COMM_WORLD``); collective.

    ``inputs`` are read on the root rank (rank 0) only.  ``chip`` gives the FIFO depth of
    channels without one, the SRAM per core and mesh names of cores in messages
    (``fifo_depth`` overrides the depth; without a chip it is 2).  A run in which no rank makes
    progress for ``timeout`` seconds while cores are blocked raises
    :class:`~runtime.DeadlockError` on every rank with the report of who waits on whom; other
    failures raise :class:`~runtime.mpi.MpiError` (or the simulator's error class) on every
    rank."""
    MPI = require_mpi()
    base = MPI.COMM_WORLD if comm is None else comm
    comm = base.Dup()
    if fifo_depth is None:
        fifo_depth = chip.core.fifo_depth if chip is not None else 2
    read, stored = tensor_uses(ps)
    problem = _check_inputs(ps, inputs or {}, read, stored) if comm.rank == 0 else None
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        comm.Free()
        raise MpiError(problem)
    plan = plan_ranks(ps, comm.size)
    rr = RankRun(MPI, comm, ps, plan, chip, dict(inputs or {}), stored, timeout, fifo_depth)
    comm.Barrier()
    t0 = time.perf_counter()
    rr.run()
    wall = time.perf_counter() - t0
    tensors = rr.hbm.close()
    stats = RankStats(
        comm.rank,
        plan.cores[comm.rank],
        rr.finish_s if rr.finish_s is not None else wall,
        rr.compute_s,
        rr.idle_s,
        rr.progress,
        rr.net.msgs_local,
        rr.net.msgs_remote,
        rr.net.broadcasts,
        rr.net.bytes_remote,
        rr.hbm.nbytes_get,
        rr.hbm.nbytes_put,
        rr.hbm_read,
        rr.hbm_write,
        rr.net.message_bytes,
    )
    gathered = comm.gather(stats, root=0)
    rr.net.free()
    for g in rr.groups.values():
        if g.comm is not None:
            g.comm.Free()
    rr.ctrl.Free()
    comm.Free()
    if tensors is None:
        return MpiResult({}, (), wall, dict(plan.rank_of))
    return MpiResult(tensors, tuple(gathered), wall, dict(plan.rank_of))
