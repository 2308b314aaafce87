"""One exception class per pipeline stage.

Every message names what failed (operator, node, field), where (the user's source line when
known) and what to do instead.  Catch :class:`Torch2StepError` to catch them all.
"""

from __future__ import annotations

from elk.errors import ElkError
from hwmodel.errors import ChipConfigError, Torch2StepError
from lowering.errors import ProgramError
from runtime.errors import DeadlockError, SimulationError

__all__ = [
    "Torch2StepError",
    "ChipConfigError",
    "ElkError",
    "ProgramError",
    "SimulationError",
    "DeadlockError",
    "InputError",
    "FrontendError",
    "UnsupportedOperatorError",
    "StepTypeError",
    "LoweringError",
    "ScheduleError",
]


class InputError(Torch2StepError, ValueError):
    """A value the user gave (a size, a trace, a compile option, a chip override) is invalid;
    the message names the argument, the value and what is allowed."""


class FrontendError(Torch2StepError):
    """Capture (torch.export / ONNX import) or raising to the layer graph failed."""


class UnsupportedOperatorError(FrontendError):
    """One or more operations have no raising rule; the message lists all of them."""


class StepTypeError(Torch2StepError):
    """A STeP operator's shape/type rule (STeP, arXiv 2511.07776, Appendix A) does not hold."""


class LoweringError(Torch2StepError):
    """The layer graph could not be lowered to STeP or STeP to per-core programs."""


class ScheduleError(Torch2StepError):
    """No operator schedule (ELK §4) satisfies the chip's constraints."""
