"""Shared by the frontend tests of single layer operations: a compiled module against PyTorch,
an ONNX model against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import nn

import torch2step
from torch2step.layers import evaluate


def compiled_equal(m: nn.Module, inputs: tuple[torch.Tensor, ...], chip: str) -> torch2step.Program:
    """``m`` compiled for ``chip``: its layer graph's evaluation and its run equal PyTorch."""
    prog = torch2step.compile(m, inputs, chip=chip)
    with torch.no_grad():
        want = m(*inputs)
        torch.testing.assert_close(evaluate(prog.layer, *inputs), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prog.run(*inputs), want, atol=1e-5, rtol=1e-5)
    return prog


def onnxruntime_output(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The first output of ``model`` on input ``x`` under onnxruntime's CPU provider."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]
