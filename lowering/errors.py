"""Errors of the per-core program layer."""

from __future__ import annotations


class ProgramError(ValueError):
    """A per-core program is malformed or does not fit the chip (named core, instruction, fix)."""
