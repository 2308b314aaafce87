"""An MPI backend for the per-core ISA (Cyclotron §9: one compiled program, two targets).

The per-core programs the simulator runs (:mod:`lowering`: Cannon, SUMMA, PUMMA,
weight-stationary and systolic products, the spatial units of a compiled layer) run unmodified
on MPI ranks: cores are spread over ranks (:mod:`.placement`), each rank interprets its cores
(:mod:`.interp`, numpy kernels), messages between cores of a rank stay in memory and between
ranks are nonblocking MPI messages or broadcasts (:mod:`.net`), HBM is replicated read-only
data plus one MPI window for what programs store (:mod:`.hbm`), and a deadlock is reported by
a timeout with who waits on whom (:mod:`.rank`).

    mpiexec -n 4 python -c "from runtime.mpi import run_mpi; ..."   # in an MPI job
    torch2step mpirun summa --size 64x64x64 --grid 4x4 -n 4 --check  # or launched for you

Needs the ``mpi`` extra (mpi4py and an MPI library from a wheel): ``pip install -e '.[mpi]'``.
"""

from runtime.mpi.errors import INSTALL_HINT, MpiError, MpiUnavailableError, require_mpi
from runtime.mpi.placement import RankPlan, plan_ranks
from runtime.mpi.run import MpiResult, RankStats, run_mpi

__all__ = [
    "run_mpi",
    "MpiResult",
    "RankStats",
    "RankPlan",
    "plan_ranks",
    "MpiError",
    "MpiUnavailableError",
    "require_mpi",
    "INSTALL_HINT",
]
