"""Errors of the operator-scheduling layer."""

from __future__ import annotations

__all__ = ["ElkError"]


class ElkError(ValueError):
    """No operator schedule satisfies the chip's constraints, or an operator list is malformed;
    the message names the operator and what to change."""
