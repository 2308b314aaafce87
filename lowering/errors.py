"""Errors of the per-core program layer."""

from __future__ import annotations

from hwmodel.errors import Torch2StepError


class ProgramError(Torch2StepError, ValueError):
    """A per-core program is malformed or does not fit the chip (named core, instruction, fix)."""
