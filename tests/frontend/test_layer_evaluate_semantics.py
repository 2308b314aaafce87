"""The layer-graph reference evaluator (:func:`torch2step.layers.evaluate`) computes what
onnxruntime, PyTorch and the compiled program compute where integer semantics matter: a
negative gather index counts from the end, and an integer ``Div`` truncates toward zero and
stays an integer (ONNX ``Div``), whether the divisor is a tensor or a constant."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import torch2step
from torch2step.errors import InputError
from torch2step.frontend import from_torch
from torch2step.frontend.onnx_import import import_onnx
from torch2step.layers import evaluate
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph
from torch2step.layers.ops import TensorType

ort = pytest.importorskip("onnxruntime")

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(
    node: onnx.NodeProto,
    inputs: list[onnx.ValueInfoProto],
    out: onnx.ValueInfoProto,
    inits: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "g",
        inputs,
        [out],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _ort(model: onnx.ModelProto, feeds: dict[str, torch.Tensor]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]


# -- Gather with negative indices ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("axis", "xshape", "yshape"),
    [(0, [5, 8], [3, 8]), (1, [2, 5, 8], [2, 3, 8]), (-1, [5, 8], [5, 3])],
    ids=["axis0", "axis1_of_3d", "last_axis"],
)
@pytest.mark.parametrize("constant", [True, False], ids=["constant_index", "index_input"])
def test_gather_negative_index_equals_onnxruntime(
    axis: int, xshape: list[int], yshape: list[int], constant: bool
) -> None:
    idx = np.array([-1, 0, -2], np.int64)
    inputs = [helper.make_tensor_value_info("x", F32, xshape)]
    if not constant:
        inputs.append(helper.make_tensor_value_info("i", I64, [3]))
    model = _model(
        helper.make_node("Gather", ["x", "i"], ["y"], axis=axis),
        inputs,
        helper.make_tensor_value_info("y", F32, yshape),
        {"i": idx} if constant else None,
    )
    x = torch.randn(xshape, generator=torch.Generator().manual_seed(0))
    feeds = {"x": x} if constant else {"x": x, "i": torch.from_numpy(idx)}
    got = evaluate(import_onnx(model), *feeds.values())
    np.testing.assert_array_equal(got.numpy(), _ort(model, feeds))
    wrapped = torch.from_numpy(idx % xshape[axis])  # index + size where negative
    torch.testing.assert_close(got, torch.index_select(x, axis, wrapped))


class IndexCols(nn.Module):
    """``x[:, idx]``: PyTorch's advanced indexing, where ``-1`` is the last column."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x[:, idx] * 2.0


def test_torch_negative_index_equals_pytorch() -> None:
    x, idx = torch.randn(4, 8), torch.tensor([-1, 0, 3, -8])
    graph = from_torch(IndexCols(), (x, idx), None)
    assert any(isinstance(n.op, L.Gather) for n in graph.nodes)
    torch.testing.assert_close(evaluate(graph, x, idx), IndexCols()(x, idx))


@pytest.mark.parametrize("bad", [8, -9])
def test_gather_index_out_of_range_is_an_input_error(bad: int) -> None:
    g = LayerGraph(name="gather")
    g.add_input("x", TensorType((4, 8), "fp32"))
    g.add_input("i", TensorType((2,), "int64"))
    (y,) = g.add(L.Gather(1), ["x", "i"])
    g.outputs, g.single_output = [y], True
    with pytest.raises(InputError, match=rf"index {bad} is outside \[-8, 8\)"):
        evaluate(g, torch.randn(4, 8), torch.tensor([0, bad]))


# -- integer Div --------------------------------------------------------------------------------
_X = torch.arange(-12, 12, dtype=torch.int64).reshape(3, 8)
_Y = torch.tensor([3, -3, 5, -5, 2, -2, 7, 1], dtype=torch.int64).repeat(3, 1)


@pytest.mark.parametrize("divisor", ["tensor", "constant"])
def test_integer_div_truncates_like_onnxruntime(divisor: str) -> None:
    vi = [helper.make_tensor_value_info("x", I64, ["N", 8])]
    if divisor == "tensor":
        vi.append(helper.make_tensor_value_info("y", I64, ["N", 8]))
    model = _model(
        helper.make_node("Div", ["x", "y"], ["z"]),
        vi,
        helper.make_tensor_value_info("z", I64, ["N", 8]),
        {"y": np.array(3, np.int64)} if divisor == "constant" else None,
    )
    feeds = {"x": _X, "y": _Y} if divisor == "tensor" else {"x": _X}
    want = _ort(model, feeds)
    got = evaluate(import_onnx(model), *feeds.values())
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)
    divisor_t = _Y if divisor == "tensor" else torch.tensor(3)
    torch.testing.assert_close(got, torch.div(_X, divisor_t, rounding_mode="trunc"))
    ran = torch2step.compile(model, tuple(feeds.values())).run(*feeds.values())
    torch.testing.assert_close(got, ran)


def test_div_layer_op_truncates_integers_and_divides_floats() -> None:
    for dtype, want in [
        ("int64", torch.div(_X, _Y, rounding_mode="trunc")),
        ("fp32", _X.float() / _Y.float()),
    ]:
        g = LayerGraph(name="div")
        g.add_input("a", TensorType((3, 8), dtype))
        g.add_input("b", TensorType((3, 8), dtype))
        (z,) = g.add(L.Elementwise("div"), ["a", "b"])
        g.outputs, g.single_output = [z], True
        a, b = (_X, _Y) if dtype == "int64" else (_X.float(), _Y.float())
        torch.testing.assert_close(evaluate(g, a, b), want)
