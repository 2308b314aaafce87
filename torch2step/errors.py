"""One exception class per pipeline stage.

Every message names what failed (operator, node, field), where (the user's source line when
known) and what to do instead.  Catch :class:`Torch2StepError` to catch them all.
"""

from __future__ import annotations

__all__ = [
    "Torch2StepError",
    "FrontendError",
    "UnsupportedOperatorError",
    "StepTypeError",
    "LoweringError",
    "ScheduleError",
]


class Torch2StepError(Exception):
    """Base class of every error raised by this project."""


class FrontendError(Torch2StepError):
    """Capture (torch.export / ONNX import) or raising to the layer graph failed."""


class UnsupportedOperatorError(FrontendError):
    """One or more operations have no raising rule; the message lists all of them."""


class StepTypeError(Torch2StepError):
    """A STeP operator's shape/type rule (seed 000 Appendix A) does not hold."""


class LoweringError(Torch2StepError):
    """The layer graph could not be lowered to STeP or STeP to per-core programs."""


class ScheduleError(Torch2StepError):
    """No operator schedule (seed 002 §4) satisfies the chip's constraints."""
