"""Errors of the simulator."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The simulator could not run a set of per-core programs."""


class DeadlockError(SimulationError):
    """Nothing is pending but programs are unfinished; the message lists who waits on whom."""
