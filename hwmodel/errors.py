"""Errors of the chip description layer, and the project's base error.

:class:`Torch2StepError` is defined here, at the bottom of the import graph (``hwmodel``
imports nothing else of the project), so that every package of the project (``hwmodel``,
``lowering``, ``runtime``, ``elk``, ``models``, ``torch2step``) can derive its errors from it;
``torch2step.errors.Torch2StepError`` is the same class.
"""

from __future__ import annotations

__all__ = ["Torch2StepError", "ChipConfigError"]


class Torch2StepError(Exception):
    """Base class of every error raised by this project."""


class ChipConfigError(Torch2StepError, ValueError):
    """A chip description is invalid: the message names the field and what is allowed."""
