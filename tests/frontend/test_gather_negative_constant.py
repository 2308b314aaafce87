"""A gather at constant indices with negative entries (counting from the end) along a leading
dimension runs to onnxruntime's / PyTorch's values: the frontends make such an index
``index + size`` when the dimension is static (the lowering addresses rows with the index as it
is: ``tile address -1`` at run time before); along a leading dimension of dynamic size it is
refused at compile time with the node named, and along the last dimension it still runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import torch2step
from torch2step.errors import UnsupportedOperatorError

F32 = TensorProto.FLOAT
_IDX = np.array([-1, 0, -2, 3], np.int64)


def _gather_model(axis: int, xdims: list[object], ydims: list[object]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)],
        "g",
        [helper.make_tensor_value_info("x", F32, xdims)],
        [helper.make_tensor_value_info("y", F32, ydims)],
        [numpy_helper.from_array(_IDX, "i")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    ("axis", "xdims", "ydims"),
    [
        (0, [5, 8], [4, 8]),
        (1, [2, 5, 8], [2, 4, 8]),
        (1, ["N", 5, 8], ["N", 4, 8]),
        (-1, ["N", 5], ["N", 4]),
    ],
    ids=["axis0", "axis1_of_3d", "axis1_dynamic_batch", "last_axis"],
)
def test_onnx_gather_at_negative_constants_equals_onnxruntime(
    axis: int, xdims: list[object], ydims: list[object]
) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = _gather_model(axis, xdims, ydims)
    shape = [d if isinstance(d, int) else (3 if d == "N" else 6) for d in xdims]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x.numpy()})[0]
    np.testing.assert_array_equal(torch2step.compile(model, (x,)).run(x).numpy(), want)


@pytest.mark.parametrize(
    ("axis", "xdims", "ydims"), [(0, ["N", 8], [4, 8]), (1, [2, "S", 8], [2, 4, 8])]
)
def test_onnx_gather_at_negative_constants_along_a_dynamic_leading_axis_is_refused(
    axis: int, xdims: list[object], ydims: list[object]
) -> None:
    x = torch.randn([6 if isinstance(d, str) else d for d in xdims])
    with pytest.raises(
        UnsupportedOperatorError,
        match=rf"(?s)Gather_0 \(Gather\).*axis {axis} of dynamic size \w+ with negative constant",
    ):
        torch2step.compile(_gather_model(axis, xdims, ydims), (x,))


class TakeRows(nn.Module):
    """``x[idx]`` / ``x[:, idx]`` at a constant index where ``-1`` is the last row."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor([-1, 0, -2, 3])
        return (x[idx] if self.dim == 0 else x[:, idx]) * 2.0


@pytest.mark.parametrize(("dim", "shape"), [(0, (5, 8)), (1, (2, 5, 8))])
def test_torch_index_at_negative_constants_equals_pytorch(dim: int, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    prog = torch2step.compile(TakeRows(dim), (x,), dynamic_shapes={"x": {}})
    torch.testing.assert_close(prog.run(x), TakeRows(dim)(x), atol=0, rtol=0)


def test_torch_index_at_negative_constants_along_a_dynamic_dim_is_refused() -> None:
    x = torch.randn(5, 8)
    with pytest.raises(
        UnsupportedOperatorError, match=r"indexing dim 0 of dynamic size \w+ with negative const"
    ):
        torch2step.compile(TakeRows(0), (x,), dynamic_shapes={"x": {0: torch.export.Dim("T")}})
