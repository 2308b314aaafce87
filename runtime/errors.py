"""Errors of the simulator."""

from __future__ import annotations

from hwmodel.errors import Torch2StepError


class SimulationError(Torch2StepError, RuntimeError):
    """The simulator could not run a set of per-core programs."""


class DeadlockError(SimulationError):
    """Nothing is pending but programs are unfinished; the message lists who waits on whom."""
