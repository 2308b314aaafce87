"""A ``bool`` graph input (a ``Where`` / ``torch.where`` condition) compiled as bool is accepted
by ``Program.run`` and the result equals onnxruntime / PyTorch; an input of another kind (a
float or integer tensor for a bool input, a bool tensor for a float or integer one) is still
refused with the input and the compiled dtype named."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import torch2step
from torch2step.errors import FrontendError

ort = pytest.importorskip("onnxruntime")

_GEN = torch.Generator().manual_seed(0)


def _where_model(cond_shape: list[object]) -> onnx.ModelProto:
    """``z = Where(c, x, y)`` with a bool graph input ``c``."""
    graph = helper.make_graph(
        [helper.make_node("Where", ["c", "x", "y"], ["z"])],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, cond_shape),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 8
    return model


def _inputs(cond_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = torch.rand(cond_shape, generator=_GEN) > 0.5
    return c, torch.randn(4, 8, generator=_GEN), torch.randn(4, 8, generator=_GEN)


@pytest.mark.parametrize("cond", [(4, 8), (4, 1)], ids=["same_shape", "per_row"])
def test_onnx_where_of_a_bool_input_equals_onnxruntime(cond: tuple[int, ...]) -> None:
    model = _where_model(["N", cond[1]])
    xs = _inputs(cond)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {n: x.numpy() for n, x in zip("cxy", xs)})[0]
    got = torch2step.compile(model, xs).run(*xs)
    np.testing.assert_array_equal(got.numpy(), want)


class _Where(torch.nn.Module):
    def forward(self, mask: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, y) * 2.0


def test_torch_where_of_a_bool_input_equals_pytorch() -> None:
    xs = _inputs((4, 8))
    prog = torch2step.compile(_Where(), xs)
    torch.testing.assert_close(prog.run(*xs), _Where()(*xs))
    other = _inputs((4, 8))
    torch.testing.assert_close(prog.run(*other), _Where()(*other))


def test_an_input_of_another_kind_than_bool_is_refused() -> None:
    xs = _inputs((4, 8))
    prog = torch2step.compile(_where_model(["N", 8]), xs)
    c, x, y = xs
    with pytest.raises(FrontendError, match=r"input c has dtype torch.float32; compiled for bool"):
        prog.run(c.float(), x, y)
    with pytest.raises(FrontendError, match=r"input c has dtype torch.int64; compiled for bool"):
        prog.run(c.long(), x, y)
    with pytest.raises(FrontendError, match=r"input x has dtype torch.bool; compiled for fp32"):
        prog.run(c, x > 0, y)


def test_a_bool_tensor_for_an_integer_input_is_refused() -> None:
    class Twice(torch.nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids + ids

    ids = torch.arange(8).reshape(2, 4)
    prog = torch2step.compile(Twice(), (ids,))
    with pytest.raises(FrontendError, match=r"input ids has dtype torch.bool; compiled for int64"):
        prog.run(ids > 3)


def test_example_inputs_of_a_bool_input_are_bools(tmp_path) -> None:  # noqa: ANN001
    # import-onnx and compile() without inputs make example inputs: a condition of both values
    graph = torch2step.import_onnx(_where_model(["N", 8]))
    c, x, y = torch2step.example_inputs_for(graph, size=6)
    assert c.dtype == torch.bool and c.shape == (6, 8) and c.any() and not c.all()
    path = tmp_path / "where.onnx"
    onnx.save(_where_model(["N", 8]), path)
    from torch2step.cli import main

    assert main(["import-onnx", str(path), "--dim", "N=5", "--quiet", "--json"]) == 0
