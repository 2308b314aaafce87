"""ONNX ``Div`` of integers by a constant truncates toward zero exactly as onnxruntime does,
exact multiples and negative values included (a multiplication by ``1/c`` is not exact:
``49 * (1/49)`` is just below 1); a float ``Div`` by the constant 0 gives IEEE infinities and an
integer one is refused with the node named."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import torch2step
from torch2step.errors import UnsupportedOperatorError

ort = pytest.importorskip("onnxruntime")

F32, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32


def _model(inputs: list[str], elem: int, c: np.ndarray) -> onnx.ModelProto:
    """``y = Div(*inputs)`` of an ``x[N, 8]`` input and the one-element constant ``c``."""
    graph = helper.make_graph(
        [helper.make_node("Div", inputs, ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, ["N", 8])],
        [helper.make_tensor_value_info("y", elem, ["N", 8])],
        [numpy_helper.from_array(c, "c")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 8
    return model


def _ort(model: onnx.ModelProto, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.numpy()})[0]


@pytest.mark.parametrize("c", [49, 3, 7, -3, -49, 1])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_div_by_constant_equals_onnxruntime(c: int, dtype: torch.dtype) -> None:
    elem = I64 if dtype == torch.int64 else I32
    x = torch.arange(-200, 200, dtype=dtype).reshape(-1, 8)  # every multiple of 49 in range
    model = _model(["x", "c"], elem, np.array(c, x.numpy().dtype))
    got = torch2step.compile(model, (x,)).run(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), _ort(model, x))


@pytest.mark.parametrize("c", [49, 3, -7])
def test_constant_divided_by_integer_equals_onnxruntime(c: int) -> None:
    x = torch.arange(-200, 200, dtype=torch.int64).reshape(-1, 8)
    x[x == 0] = 1
    model = _model(["c", "x"], I64, np.array(c, np.int64))
    np.testing.assert_array_equal(torch2step.compile(model, (x,)).run(x).numpy(), _ort(model, x))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0 * inf
def test_float_div_by_constant_zero_is_infinite_like_onnxruntime() -> None:
    x = torch.tensor([[-1.5, 0.0, 2.0, 3.0, -0.5, 1.0, -2.0, 4.0]])
    model = _model(["x", "c"], F32, np.array(0.0, np.float32))
    np.testing.assert_array_equal(torch2step.compile(model, (x,)).run(x).numpy(), _ort(model, x))


def test_integer_div_by_constant_zero_is_refused() -> None:
    x = torch.arange(8, dtype=torch.int64).reshape(1, 8)
    with pytest.raises(UnsupportedOperatorError, match=r"(?s)Div.*integer division by the const"):
        torch2step.compile(_model(["x", "c"], I64, np.array(0, np.int64)), (x,))
