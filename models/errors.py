"""Lookup errors of the ``models`` package (kept free of other project imports)."""

from __future__ import annotations

__all__ = [
    "UnknownNameError",
    "UnknownLayerError",
    "UnknownTraceError",
    "TraceFormatError",
    "ModelConfigError",
]


class UnknownNameError(KeyError):
    """A name that is not registered; the message lists the valid names.

    A ``KeyError`` subclass whose ``str()`` is the plain message (``KeyError`` would quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownLayerError(UnknownNameError):
    """``models.get_layer`` was given a layer name that is not in ``models.LAYERS``."""


class UnknownTraceError(UnknownNameError):
    """A routing or KV-length trace name (or path) that does not exist."""


class TraceFormatError(ValueError):
    """A trace file that exists but does not hold what its kind needs (shape, integer dtype,
    value range); the message names the file, what it holds and what was expected."""


class ModelConfigError(ValueError):
    """A model config (``config.json``) that cannot be read or whose family is not raised."""
