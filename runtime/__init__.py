"""Event-driven simulator of per-core programs on a many-core chip (the pipeline's last stage, see the README).

``simulate(programs, chip, mode=..., inputs=..., trace=..., max_cycles=...)`` runs a
:class:`lowering.isa.ProgramSet` on a :class:`hwmodel.chip.Chip` and returns a
:class:`SimResult` (cycles, :class:`SimStats`, final HBM tensors, Chrome trace).  The timing model
is documented in :mod:`runtime.engine` (events, queue, deadlock), :mod:`runtime.ops` (what each
instruction costs), :mod:`runtime.network` (links, ports, routes) and :mod:`runtime.layout` (HBM
placement and channel interleaving).
"""

from runtime.engine import Simulator, gc_paused, simulate
from runtime.errors import DeadlockError, SimulationError
from runtime.stats import CoreStats, EventCounts, ResourceStats, SimResult, SimStats

__all__ = [
    "simulate",
    "gc_paused",
    "Simulator",
    "SimResult",
    "SimStats",
    "CoreStats",
    "ResourceStats",
    "EventCounts",
    "SimulationError",
    "DeadlockError",
]
