"""PyTorch's true division of integers is a float (``int_tensor / 4 == 1.75``), not the ONNX
integer ``Div`` that truncates: the integer operands are taken in the result's float dtype;
an ONNX ``Div`` of integers keeps truncating (``tests/frontend/test_onnx_integer_div.py``)."""

from __future__ import annotations

import pytest
import torch

import torch2step


class _DivBy(torch.nn.Module):
    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.c


class _Quotient(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x / y


@pytest.mark.parametrize("c", [4, 49, -3, 0])
def test_integer_over_a_constant_is_a_float(c: int) -> None:
    x = torch.arange(-40, 40, dtype=torch.int64).reshape(8, 10)
    m = _DivBy(c)
    got = torch2step.compile(m, (x,)).run(x)
    torch.testing.assert_close(got, m(x), equal_nan=True)


def test_integer_over_integer_is_a_float() -> None:
    x = torch.arange(-40, 40, dtype=torch.int64).reshape(8, 10)
    y = torch.arange(1, 81, dtype=torch.int64).reshape(8, 10)
    got = torch2step.compile(_Quotient(), (x, y)).run(x, y)
    torch.testing.assert_close(got, x / y)
