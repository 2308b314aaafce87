"""torch2step: compile PyTorch / ONNX MoE and GQA layers to Streaming Tensor Programs and
simulate them on many-core AI chips.

    import torch2step
    prog = torch2step.compile(block, (x,), chip="step-sda")
    y = prog.run(x)          # the compiled STeP program, run functionally: equals block(x)
    rep = prog.report(x)     # simulated latency and where it goes, for this input
"""

from torch2step.api import compile, example_inputs_for, import_onnx
from torch2step.errors import (
    FrontendError,
    LoweringError,
    ScheduleError,
    StepTypeError,
    Torch2StepError,
    UnsupportedOperatorError,
)
from torch2step.frontend.hf_config import compile_config
from torch2step.program import Program
from torch2step.report import Report

__all__ = [
    "FrontendError",
    "LoweringError",
    "Program",
    "Report",
    "ScheduleError",
    "StepTypeError",
    "Torch2StepError",
    "UnsupportedOperatorError",
    "compile",
    "compile_config",
    "example_inputs_for",
    "import_onnx",
]
__version__ = "0.1.0"
