"""Errors of the operator-scheduling layer."""

from __future__ import annotations

from hwmodel.errors import Torch2StepError

__all__ = ["ElkError"]


class ElkError(Torch2StepError, ValueError):
    """No operator schedule satisfies the chip's constraints, or an operator list is malformed;
    the message names the operator and what to change."""
