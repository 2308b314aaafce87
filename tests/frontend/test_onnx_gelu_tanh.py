"""ONNX ``Gelu`` with ``approximate="tanh"`` (opset 20) imports as the elementwise
``gelu_tanh`` and runs equal to onnxruntime on the STeP SDA and kernel by kernel (it was
refused as "tanh-approximate gelu")."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from equal_checks import onnxruntime_output
from onnx import TensorProto, helper, numpy_helper

import torch2step
from torch2step.layers import Elementwise


def _gelu_mlp(approximate: str, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((64, 128)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((128, 64)) * 0.2).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Gelu", ["h"], ["a"], approximate=approximate),
        helper.make_node("MatMul", ["a", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9  # what onnxruntime reads
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("chip", ["step-sda", "ipu-hbm"])
def test_onnx_tanh_gelu_runs_equal_toonnxruntime_output(chip: str) -> None:
    model = _gelu_mlp("tanh")
    layer = torch2step.import_onnx(model)
    assert [n.op.fn for n in layer.nodes if isinstance(n.op, Elementwise)] == ["gelu_tanh"]
    x = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    want = onnxruntime_output(model, x)
    # the check tells the forms apart: the exact GELU differs beyond its tolerance here
    assert np.abs(want - onnxruntime_output(_gelu_mlp("none"), x)).max() > 1e-4
    prog = torch2step.compile(layer, (torch.from_numpy(x),), chip=chip)
    torch.testing.assert_close(
        prog.run(torch.from_numpy(x)), torch.from_numpy(want), atol=1e-5, rtol=1e-5
    )
