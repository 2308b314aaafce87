"""Errors of the MPI backend, and the one place that imports mpi4py."""

from __future__ import annotations

from types import ModuleType

from runtime.errors import SimulationError

__all__ = ["MpiError", "MpiUnavailableError", "require_mpi", "INSTALL_HINT"]

#: What to run when MPI is missing.
INSTALL_HINT = "pip install -e '.[mpi]'  (or: pip install 'torch2step[mpi]')"


class MpiError(SimulationError):
    """Running per-core programs on MPI ranks failed (names the rank, core and instruction)."""


class MpiUnavailableError(MpiError):
    """mpi4py or an MPI library is not installed; the message names the ``mpi`` extra."""


def require_mpi() -> ModuleType:
    """``mpi4py.MPI``, or :class:`MpiUnavailableError` saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MpiUnavailableError(
            f"the MPI backend needs mpi4py and an MPI library ({exc}); install the optional "
            f"extra: {INSTALL_HINT}"
        ) from None
    except RuntimeError as exc:  # mpi4py is there but its MPI library cannot be loaded
        raise MpiUnavailableError(
            f"mpi4py could not load an MPI library ({exc}); install one with the optional "
            f"extra: {INSTALL_HINT}"
        ) from None
    return MPI
