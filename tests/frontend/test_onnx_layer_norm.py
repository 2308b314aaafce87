"""ONNX ``LayerNormalization`` (opset 17) over the last axis, with or without its bias, imports as
the layer op ``LayerNorm`` and runs equal to onnxruntime on the STeP SDA and kernel by kernel (it
was refused: no translation for ``LayerNormalization``); over more than the last axis it is
refused naming the op and the axis."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from equal_checks import onnxruntime_output
from onnx import TensorProto, helper, numpy_helper

import torch2step
from torch2step.errors import UnsupportedOperatorError
from torch2step.layers import LayerNorm


def _norm_mlp(bias: bool, axis: int = -1, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    scale = (1 + rng.standard_normal(64) * 0.2).astype(np.float32)
    shift = (rng.standard_normal(64) * 0.2).astype(np.float32)
    w1 = (rng.standard_normal((64, 32)) * 0.2).astype(np.float32)
    norm_in = ["x", "scale", "shift"] if bias else ["x", "scale"]
    nodes = [
        helper.make_node("LayerNormalization", norm_in, ["h"], axis=axis, epsilon=1e-6),
        helper.make_node("MatMul", ["h", "w1"], ["y"]),
    ]
    inits = [numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(w1, "w1")]
    if bias:
        inits.append(numpy_helper.from_array(shift, "shift"))
    if axis != -1:  # the gain and bias span every normalised axis
        inits[0] = numpy_helper.from_array(np.ones((3, 64), np.float32), "scale")
    graph = helper.make_graph(
        nodes,
        "norm_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, 32])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # what onnxruntime reads
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chip", ["step-sda", "ipu-hbm"])
def test_onnx_layer_norm_runs_equal_toonnxruntime_output(bias: bool, chip: str) -> None:
    model = _norm_mlp(bias)
    layer = torch2step.import_onnx(model)
    (op,) = [n.op for n in layer.nodes if isinstance(n.op, LayerNorm)]
    assert (op.weight, op.bias) == (True, bias) and op.eps == pytest.approx(1e-6)
    x = (np.random.default_rng(1).standard_normal((2, 3, 64)) * 3 + 1).astype(np.float32)
    want = onnxruntime_output(model, x)
    prog = torch2step.compile(layer, (torch.from_numpy(x),), chip=chip)
    torch.testing.assert_close(
        prog.run(torch.from_numpy(x)), torch.from_numpy(want), atol=1e-5, rtol=1e-5
    )


def test_onnx_layer_norm_over_two_axes_is_refused_naming_it() -> None:
    with pytest.raises(UnsupportedOperatorError) as err:
        torch2step.import_onnx(_norm_mlp(True, axis=-2))
    msg = str(err.value)
    assert "LayerNormalization" in msg and "axis=-1" in msg


class _TorchNormMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.a = torch.nn.Linear(64, 32)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.2)
            self.norm.bias.normal_(0.0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.norm(x))


def test_a_torch_layer_norm_exported_to_onnx_runs_equal_toonnxruntime_output(tmp_path) -> None:
    """torch.onnx.export (dynamo) writes nn.LayerNorm as LayerNormalization."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    m = _TorchNormMLP().eval()
    x = torch.randn(2, 3, 64) * 3 + 1
    path = str(tmp_path / "norm.onnx")
    torch.onnx.export(m, (x,), dynamo=True, opset_version=20).save(path)
    model = onnx.load(path)
    assert "LayerNormalization" in {n.op_type for n in model.graph.node}
    layer = torch2step.import_onnx(model)
    assert any(isinstance(n.op, LayerNorm) for n in layer.nodes)
    want = torch.from_numpy(onnxruntime_output(model, x.numpy()))
    prog = torch2step.compile(layer, (x,), chip="step-sda")
    torch.testing.assert_close(prog.run(x), want, atol=1e-5, rtol=1e-5)
