"""An elementwise operator reading one value at several operand positions (``x + x``,
``x * x``, ``max(x, x)``, ``(x + y) * x``) lowers to STeP and runs equal to PyTorch and
onnxruntime, on both frontends: the value is read once and its stream feeds each position.
A broadcast operand read twice by ``where(c, y, y)`` (one row expanded on chip, or rows
gathered per output row) is covered too."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import torch2step
from torch2step.frontend import from_torch
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph
from torch2step.layers.ops import TensorType
from torch2step.lower import lower
from torch2step.step import metrics, run

ort = pytest.importorskip("onnxruntime")

F32 = TensorProto.FLOAT


class Fn(nn.Module):
    """``f(x, y)`` as a module."""

    def __init__(self, f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.f(x, y)


TORCH_CASES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add_self": lambda x, y: x + x,
    "mul_self": lambda x, y: x * x,
    "maximum_self": lambda x, y: torch.maximum(x, x),
    "add_then_mul_by_x": lambda x, y: (x + y) * x,
    "mul_self_of_computed": lambda x, y: torch.exp(x) * torch.exp(x) + y,
}


def _pair(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 8, generator=g), torch.randn(t, 8, generator=g)


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_torch_operand_read_twice_equals_pytorch(case: str) -> None:
    module = Fn(TORCH_CASES[case])
    lw = lower(from_torch(module, _pair(4, 0), None))
    m = metrics(lw.program)
    for t, seed in [(4, 1), (1, 2), (7, 3)]:
        xs = _pair(t, seed)
        tensors, env = lw.feed(xs)
        res = run(lw.program, tensors=tensors, env=env)
        (got,) = lw.outputs(res.tensors, xs)
        torch.testing.assert_close(got, module(*xs), atol=1e-5, rtol=1e-5)
        assert m.evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes


def test_compiled_program_runs_x_plus_x() -> None:
    module = Fn(TORCH_CASES["add_self"])
    x, y = _pair(5, 4)
    prog = torch2step.compile(module, (x, y), chip="step-sda")
    torch.testing.assert_close(prog.run(x, y), 2 * x)


def _vi(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F32, shape)


def _model(
    nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], out: list
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [_vi("z", out)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


_XY = [_vi("x", ["N", 8]), _vi("y", ["N", 8])]
ONNX_CASES: dict[str, tuple[onnx.ModelProto, Callable[..., torch.Tensor], list[tuple]]] = {
    "add_self": (
        _model([helper.make_node("Add", ["x", "x"], ["z"])], _XY, ["N", 8]),
        lambda x, y: x + x,
        [(3, 8), (3, 8)],
    ),
    "mul_self": (
        _model([helper.make_node("Mul", ["x", "x"], ["z"])], _XY, ["N", 8]),
        lambda x, y: x * x,
        [(3, 8), (3, 8)],
    ),
    "max_self_three": (
        _model([helper.make_node("Max", ["x", "x", "x"], ["z"])], _XY, ["N", 8]),
        lambda x, y: torch.maximum(x, x),
        [(3, 8), (3, 8)],
    ),
    "add_then_mul_by_x": (
        _model(
            [
                helper.make_node("Add", ["x", "y"], ["s"]),
                helper.make_node("Mul", ["s", "x"], ["z"]),
            ],
            _XY,
            ["N", 8],
        ),
        lambda x, y: (x + y) * x,
        [(3, 8), (3, 8)],
    ),
}


@pytest.mark.parametrize("case", sorted(ONNX_CASES))
def test_onnx_operand_read_twice_equals_onnxruntime(case: str) -> None:
    model, want_fn, shapes = ONNX_CASES[case]
    g = torch.Generator().manual_seed(0)
    xs = tuple(torch.randn(*s, generator=g) for s in shapes)
    prog = torch2step.compile(model, xs, chip="step-sda")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": xs[0].numpy(), "y": xs[1].numpy()})
    got = prog.run(*xs)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, want_fn(*xs))


@pytest.mark.parametrize(
    ("cond", "value"),
    [((2, 1, 8), (3, 8)), ((4, 8), (1, 8))],
    ids=["gathered_rows", "one_row"],
)
def test_where_reads_broadcast_operand_twice(cond: tuple[int, ...], value: tuple[int, ...]) -> None:
    g = LayerGraph(name="where_same")
    g.add_input("c", TensorType(cond, "bool"))
    g.add_input("y", TensorType(value, "fp32"))
    (z,) = g.add(L.Elementwise("where"), ["c", "y", "y"])
    g.outputs, g.single_output = [z], True
    lw = lower(g)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.rand(cond, generator=gen) > 0.5, torch.randn(value, generator=gen)]
    tensors, env = lw.feed(xs)
    res = run(lw.program, tensors=tensors, env=env)
    (got,) = lw.outputs(res.tensors, xs)
    torch.testing.assert_close(got, torch.where(xs[0], xs[1], xs[1]))
    assert metrics(lw.program).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
