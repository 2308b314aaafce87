"""Errors of the chip description layer (imports nothing else of the project)."""

from __future__ import annotations


class ChipConfigError(ValueError):
    """A chip description is invalid: the message names the field and what is allowed."""
