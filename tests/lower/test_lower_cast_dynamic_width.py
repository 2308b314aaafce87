"""A ``Cast`` whose last dim is dynamic is lowered element by element (``[1, 1]`` tiles, as an
elementwise operator of a dynamic width is) and runs to PyTorch's / onnxruntime's values for
several widths; an operator that must read whole rows of a dynamic width is refused by the
lowering stage with the node, the dynamic dim and what to do named (a bare ``TypeError:
Cannot convert symbols to int`` before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn
from torch.export import Dim

import torch2step
from torch2step.errors import LoweringError

_B, _S = Dim("B"), Dim("S")


class DivToHalf(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x / y).to(torch.float16)


def test_cast_of_a_dynamic_width_equals_pytorch() -> None:
    gen = torch.Generator().manual_seed(0)
    dyn = {"x": {0: _B, 1: _S}, "y": {0: _B, 1: _S}}
    example = (torch.randn(2, 6, generator=gen), torch.rand(2, 6, generator=gen) + 0.5)
    prog = torch2step.compile(DivToHalf(), example, dynamic_shapes=dyn)
    for shape in [(2, 6), (3, 5), (1, 9)]:
        x, y = torch.randn(shape, generator=gen), torch.rand(shape, generator=gen) + 0.5
        got = prog.run(x, y)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, DivToHalf()(x, y), atol=0, rtol=0)


def test_onnx_cast_of_a_dynamic_width_equals_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", "K"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", "K"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    prog = torch2step.compile(model, (torch.arange(24).reshape(4, 6),))
    for shape in [(4, 6), (2, 3), (1, 7)]:
        x = torch.arange(int(np.prod(shape))).reshape(shape) * 37 - 100
        want = sess.run(None, {"x": x.numpy()})[0]
        np.testing.assert_array_equal(prog.run(x).numpy(), want)


class RowSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1)


def test_a_row_operator_of_a_dynamic_width_is_a_lowering_error() -> None:
    with pytest.raises(LoweringError, match=r"(?s)Softmax.*last dim S is dynamic.*static last dim"):
        torch2step.compile(RowSoftmax(), (torch.randn(2, 6),), dynamic_shapes={"x": {0: _B, 1: _S}})
