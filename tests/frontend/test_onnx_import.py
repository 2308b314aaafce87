"""ONNX import basics on small hand-built models: loading errors, inputs/dims/params/outputs,
one-to-one translation of elementwise and view ops (checked against ``onnx.reference``), and one
error that lists every unsupported node."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
import sympy
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from torch2step.errors import FrontendError, UnsupportedOperatorError
from torch2step.frontend.onnx_import import import_onnx
from torch2step.layers import Arange, Concat, Elementwise, Linear, Permute, Reshape, Slice, evaluate

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=(), opset=20) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


# -- loading errors ------------------------------------------------------------------------------
def test_missing_file_names_the_path(tmp_path) -> None:
    path = tmp_path / "nope.onnx"
    with pytest.raises(FrontendError, match=r"nope\.onnx does not exist.*export"):
        import_onnx(path)


def test_corrupt_file_is_a_frontend_error(tmp_path) -> None:
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"\x08\x07\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(FrontendError, match="garbage.onnx") as err:
        import_onnx(str(path))
    assert "re-export" in str(err.value)


def test_truncated_model_is_a_frontend_error(tmp_path) -> None:
    x = helper.make_tensor_value_info("x", F32, [2, 3])
    y = helper.make_tensor_value_info("y", F32, [2, 3])
    data = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [y]).SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FrontendError, match="cut.onnx"):
        import_onnx(path)


def test_invalid_model_and_wrong_argument_type() -> None:
    x = helper.make_tensor_value_info("x", F32, [2])
    y = helper.make_tensor_value_info("y", F32, [2])
    bad = _model([helper.make_node("Relu", ["undefined"], ["y"])], [x], [y])
    with pytest.raises(FrontendError, match="not a valid ONNX model"):
        import_onnx(bad)
    with pytest.raises(FrontendError, match="file path or an onnx.ModelProto"):
        import_onnx(42)  # type: ignore[arg-type]


def test_unsupported_ops_are_listed_together_with_names_and_advice() -> None:
    x = helper.make_tensor_value_info("x", F32, ["n", 4])
    y = helper.make_tensor_value_info("y", F32, ["n", 4])
    nodes = [
        helper.make_node("Sin", ["x"], ["t"], name="my_sin"),
        helper.make_node("Relu", ["t"], ["r"], name="relu_after"),
        helper.make_node("Floor", ["x"], ["e"], name="my_floor"),
        helper.make_node("Add", ["r", "e"], ["a"]),
        helper.make_node("Cos", ["a"], ["y"], name="my_cos"),
    ]
    with pytest.raises(UnsupportedOperatorError) as err:
        import_onnx(_model(nodes, [x], [y]))
    msg = str(err.value)
    assert "3 operation(s)" in msg
    for name, op in (("my_sin", "Sin"), ("my_floor", "Floor"), ("my_cos", "Cos")):
        assert f"{name} ({op})" in msg
    assert "relu_after" not in msg  # translatable, only downstream of a problem
    assert "What to do" in msg
    assert isinstance(err.value, FrontendError)


# -- inputs, dims, params, outputs -----------------------------------------------------------------
def test_dims_params_inputs_and_outputs() -> None:
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    x = helper.make_tensor_value_info("tokens", F32, ["batch size", "seq", 4])
    m = helper.make_tensor_value_info("scale", F32, [None])
    y = helper.make_tensor_value_info("y", F32, ["batch size", "seq", 3])
    z = helper.make_tensor_value_info("z", F32, [None])
    nodes = [
        helper.make_node("MatMul", ["tokens", "w"], ["y"]),
        helper.make_node("Mul", ["scale", "scale"], ["z"]),
    ]
    model = _model(nodes, [x, m], [y, z], [("w", w)])
    model.graph.name = "tiny"
    g = import_onnx(model)
    assert g.name == "tiny" and g.inputs == ["tokens", "scale"] and not g.single_output
    names = {str(s): v for s, v in g.dims.items()}
    assert names == {"batch_size": ("tokens", 0), "seq": ("tokens", 1), "scale_0": ("scale", 0)}
    assert all(isinstance(s, sympy.Symbol) for s in g.dims)
    (lin,) = list(g.ops(Linear))
    torch.testing.assert_close(g.params[lin.inputs[1]], torch.from_numpy(w.T.copy()))
    t, s = torch.randn(2, 5, 4), torch.randn(6)
    y_out, z_out = evaluate(g, t, s)
    torch.testing.assert_close(y_out, t @ torch.from_numpy(w))
    torch.testing.assert_close(z_out, s * s)


def _check_against_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    g = import_onnx(model)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = evaluate(g, *[torch.from_numpy(feeds[i]) for i in g.inputs])
    got = (got,) if g.single_output else got
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-6)


def test_elementwise_and_view_ops_match_the_reference_evaluator() -> None:
    x = helper.make_tensor_value_info("x", F32, ["b", 6, 4])
    y = helper.make_tensor_value_info("y", F32, [1, None, 6])
    consts = [
        ("two", np.array(2.0, np.float32)),
        ("shape", _i64(0, 3, 8)),
        ("ax", _i64(-1)),
        ("st", _i64(1)),
        ("en", _i64(5)),
        ("ax1", _i64(1)),
        ("idx", _i64(2, 0)),
        ("bias", np.linspace(-1, 1, 8, dtype=np.float32)),
        ("split", _i64(3, 5)),
        ("zero", _i64(0)),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["m"]),
        helper.make_node("Sub", ["two", "m"], ["s"]),
        helper.make_node("Div", ["s", "two"], ["d"]),
        helper.make_node("Reshape", ["d", "shape"], ["r"]),  # [b, 3, 8]
        helper.make_node("Add", ["r", "bias"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["sg"]),
        helper.make_node("Pow", ["sg", "two"], ["p"]),
        helper.make_node("Transpose", ["p"], ["t"], perm=[0, 2, 1]),  # [b, 8, 3]
        helper.make_node("Slice", ["t", "st", "en", "ax1"], ["sl"]),  # [b, 4, 3]
        helper.make_node("Gather", ["sl", "idx"], ["ga"], axis=1),  # [b, 2, 3]
        helper.make_node("Gather", ["sl", "zero"], ["g0"], axis=1),  # [b, 1, 3] -> via const
        helper.make_node("Softmax", ["ga"], ["sm"], axis=-1),
        helper.make_node("ReduceMean", ["sm", "ax"], ["rm"], keepdims=1),  # [b, 2, 1]
        helper.make_node("Split", ["r", "split"], ["h0", "h1"], axis=2),
        helper.make_node("ReduceSum", ["h1", "ax"], ["rs"], keepdims=1),  # [b, 3, 1]
        helper.make_node("Concat", ["rm", "rs", "g0"], ["c"], axis=1),  # [b, 6, 1] (g0 [b,1,3]?)
        helper.make_node("Squeeze", ["c", "ax"], ["sq"]),
        helper.make_node("Unsqueeze", ["sq", "zero"], ["us"]),
        helper.make_node("Neg", ["us"], ["y"]),
    ]
    # g0 is [b, 3] after a scalar Gather; reduce it to [b, 1, 1] before the concat
    nodes[10] = helper.make_node("Gather", ["sl", "zero_s"], ["g0a"], axis=1)
    nodes.insert(11, helper.make_node("ReduceMax", ["g0a", "ax"], ["g0m"], keepdims=1))
    nodes.insert(12, helper.make_node("Unsqueeze", ["g0m", "ax"], ["g0"]))
    consts.append(("zero_s", np.array(0, dtype=np.int64)))
    model = _model(nodes, [x], [y], consts)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 6, 4)).astype(np.float32)}
    _check_against_reference(model, feeds)
    g = import_onnx(model)
    kinds = {type(n.op) for n in g.nodes}
    assert {Reshape, Permute, Slice, Concat, Elementwise} <= kinds
    scalars = [n.op for n in g.ops(Elementwise) if n.op.fn.endswith("_scalar")]
    assert Elementwise("mul_scalar", 2.0) in scalars and Elementwise("mul_scalar", 0.5) in scalars


def test_shape_arithmetic_of_dynamic_dims_is_folded() -> None:
    """``Reshape(x, Concat(Shape(x)[0] * Shape(x)[1], 4))`` becomes one symbolic Reshape and
    a position range computed from a dynamic size becomes Arange."""
    x = helper.make_tensor_value_info("x", F32, ["B", "S", 4])
    y = helper.make_tensor_value_info("y", F32, [None, 4])
    pos = helper.make_tensor_value_info("pos", I64, [1])
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["sh", "i1"], ["s"], axis=0),
        helper.make_node("Mul", ["b", "s"], ["bs"]),
        helper.make_node("Unsqueeze", ["bs", "zero"], ["bs1"]),
        helper.make_node("Concat", ["bs1", "four"], ["tgt"], axis=0),
        helper.make_node("Reshape", ["x", "tgt"], ["y"]),
        helper.make_node("Add", ["s", "one"], ["s1"]),
        helper.make_node("Range", ["s", "s1", "one"], ["pos"]),
    ]
    inits = [
        ("i0", np.array(0, np.int64)),
        ("i1", np.array(1, np.int64)),
        ("zero", _i64(0)),
        ("four", _i64(4)),
        ("one", np.array(1, np.int64)),
    ]
    g = import_onnx(_model(nodes, [x], [y, pos], inits))
    b, s = sorted(g.dims, key=str)
    (reshape,) = [n.op for n in g.ops(Reshape)]
    assert reshape.shape == (b * s, 4)
    (arange,) = [n.op for n in g.ops(Arange)]
    assert (arange.start, arange.end) == (s, s + 1)
    out, positions = evaluate(g, torch.ones(2, 5, 4))
    assert out.shape == (10, 4) and positions.tolist() == [5]


def test_shape_inference_errors_are_reported_not_swallowed() -> None:
    # y is declared [2, 3] but MatMul([2, 4], [4, 5]) makes it [2, 5]: strict inference fails
    x = helper.make_tensor_value_info("x", F32, [2, 4])
    y = helper.make_tensor_value_info("y", F32, [2, 3])
    w = np.ones((4, 5), dtype=np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], [("w", w)])
    # a handler on the logger itself: the CLI's set-up stops "torch2step" records at its logger
    logger, records = logging.getLogger("torch2step.frontend.onnx_import"), _Records()
    logger.addHandler(records)
    try:
        try:
            import_onnx(model)
        except FrontendError:
            pass  # whether the import then succeeds is not the point: the warning is
    finally:
        logger.removeHandler(records)
    (rec,) = [r for r in records.records if "shape inference" in r.getMessage()]
    assert "the given ModelProto" in rec.getMessage() and "Error" in rec.getMessage()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
