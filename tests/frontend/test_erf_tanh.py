"""``erf`` and ``tanh`` as elementwise operators: from PyTorch and from ONNX (a legacy export
spells GELU with ``Erf``), run equal to the module on a spatial and an ICCA chip."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch2step


class _Both(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + torch.erf(x)


class _GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128, bias=False)
        self.b = nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


@pytest.mark.parametrize("chip", ["step-sda", "ipu-hbm"])
def test_tanh_and_erf_run_equal_to_pytorch(chip: str) -> None:
    torch.manual_seed(0)
    m, x = _Both().eval(), torch.randn(8, 64)
    prog = torch2step.compile(m, (x,), chip=chip)
    with torch.no_grad():
        torch.testing.assert_close(prog.run(x), m(x), atol=1e-5, rtol=0)


def test_a_legacy_onnx_gelu_imports_through_erf(tmp_path: Path) -> None:
    import onnx

    torch.manual_seed(0)
    m, x = _GeluMLP().eval(), torch.randn(8, 64)
    path = tmp_path / "gelu.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x,), str(path), dynamo=False, input_names=["x"], opset_version=17)
    assert "Erf" in [n.op_type for n in onnx.load(str(path)).graph.node]
    prog = torch2step.compile(str(path))
    with torch.no_grad():
        torch.testing.assert_close(prog.run(x), m(x), atol=1e-5, rtol=0)
    assert prog.report(x).latency_cycles > 0
