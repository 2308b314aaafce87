"""Errors of the ``models`` package; each derives from the project's base error
(:class:`hwmodel.errors.Torch2StepError`, the bottom of the import graph)."""

from __future__ import annotations

from hwmodel.errors import Torch2StepError

__all__ = [
    "UnknownNameError",
    "UnknownLayerError",
    "UnknownTraceError",
    "TraceFormatError",
    "ModelConfigError",
]


class UnknownNameError(Torch2StepError, KeyError):
    """A name that is not registered; the message lists the valid names.

    A ``KeyError`` subclass whose ``str()`` is the plain message (``KeyError`` would quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownLayerError(UnknownNameError):
    """``models.get_layer`` was given a layer name that is not in ``models.LAYERS``."""


class UnknownTraceError(UnknownNameError):
    """A routing or KV-length trace name (or path) that does not exist."""


class TraceFormatError(Torch2StepError, ValueError):
    """A trace file that exists but does not hold what its kind needs (shape, integer dtype,
    value range); the message names the file, what it holds and what was expected."""


class ModelConfigError(Torch2StepError, ValueError):
    """A model config (``config.json``) that cannot be read or whose family is not raised."""
