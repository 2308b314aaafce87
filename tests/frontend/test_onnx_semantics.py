"""ONNX operator semantics on small hand-built models: what the compiled program computes
(``Program.run``) equals onnxruntime (variadic ``Max``/``Min``/``Sum``/``Mean``, reductions with
``noop_with_empty_axes``, clamped ``Slice`` bounds, ``Transpose`` without ``perm``, ...), and
valid models the importer cannot translate are refused with a message naming the node."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import torch2step
from torch2step.errors import FrontendError, UnsupportedOperatorError
from torch2step.frontend.onnx_import import import_onnx

ort = pytest.importorskip("onnxruntime")

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
_RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=(), opset=20) -> onnx.ModelProto:
    """A model of ``nodes``; ``inputs``/``outputs`` are ``(name, shape[, type])``."""
    vi = [helper.make_tensor_value_info(n, t[0] if t else F32, s) for n, s, *t in inputs]
    vo = [helper.make_tensor_value_info(n, t[0] if t else F32, s) for n, s, *t in outputs]
    inits = [numpy_helper.from_array(v, k) for k, v in inits]
    graph = helper.make_graph(nodes, "g", vi, vo, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8  # what every supported onnxruntime reads
    return model


def _ort(model: onnx.ModelProto, *xs: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), xs)}
    return sess.run(None, feeds)[0]


def _same_as_ort(model: onnx.ModelProto, *xs: torch.Tensor, atol: float = 1e-5) -> None:
    """``compile(model).run(*xs)`` equals onnxruntime's first output."""
    got = torch2step.compile(model, xs).run(*xs)
    want = _ort(model, *xs)
    assert tuple(got.shape) == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=atol)


def _vec(n: int, shift: float = 0.0) -> np.ndarray:
    return (_RNG.standard_normal(n) + shift).astype(np.float32)


# -- variadic Max / Min / Sum / Mean ---------------------------------------------------------
@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_variadic_elementwise_folds_every_operand(op: str, count: int) -> None:
    names = ["x", "a", "b"][:count]
    inits = [("a", _vec(8)), ("b", _vec(8, shift=2.0))][: count - 1]
    model = _model(
        [helper.make_node(op, names, ["y"])], [("x", ["N", 8])], [("y", ["N", 8])], inits
    )
    _same_as_ort(model, torch.randn(4, 8))


def test_max_of_four_runtime_operands_and_a_scalar_constant() -> None:
    nodes = [
        helper.make_node("Max", ["x", "z", "w", "zero"], ["m"]),
        helper.make_node("Min", ["m", "x"], ["y"]),
    ]
    inputs = [("x", ["N", 8]), ("z", ["N", 8]), ("w", ["N", 1])]
    model = _model(nodes, inputs, [("y", ["N", 8])], [("zero", np.array(0.0, np.float32))])
    _same_as_ort(model, torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 1))


def test_variadic_ops_of_constants_are_folded() -> None:
    nodes = [
        helper.make_node("Sum", ["a", "b", "c"], ["s"]),
        helper.make_node("Max", ["a", "b", "c"], ["m"]),
        helper.make_node("Add", ["s", "m"], ["t"]),
        helper.make_node("Add", ["x", "t"], ["y"]),
    ]
    inits = [("a", _vec(8)), ("b", _vec(8)), ("c", _vec(8, shift=1.0))]
    model = _model(nodes, [("x", ["N", 8])], [("y", ["N", 8])], inits)
    assert [type(n.op).__name__ for n in import_onnx(model).nodes] == ["Elementwise"]
    _same_as_ort(model, torch.randn(4, 8))


# -- reductions ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "opset", "axes"),
    [("ReduceSum", 13, []), ("ReduceSum", 13, None), ("ReduceMean", 18, []),
     ("ReduceMax", 18, None)],
)  # fmt: skip
@pytest.mark.parametrize("shape", [[8], ["N", 8]])
def test_reduce_with_noop_and_empty_axes_is_the_identity(op, opset, axes, shape) -> None:
    ins = ["x", "ax"] if axes is not None else ["x"]
    inits = [("ax", np.array(axes, np.int64))] if axes is not None else []
    nodes = [
        helper.make_node(op, ins, ["s"], keepdims=1, noop_with_empty_axes=1),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    model = _model(nodes, [("x", shape)], [("y", shape)], inits, opset=opset)
    assert "Reduce" not in str(import_onnx(model))
    _same_as_ort(model, torch.randn(*[4 if d == "N" else d for d in shape]))


def test_reduce_with_empty_axes_reduces_every_axis() -> None:
    nodes = [
        helper.make_node("ReduceSum", ["x", "ax"], ["s"], keepdims=1),
        helper.make_node("Add", ["s", "b"], ["y"]),
    ]
    inits = [("ax", np.array([], np.int64)), ("b", _vec(8))]
    model = _model(nodes, [("x", [8])], [("y", [8])], inits, opset=13)
    _same_as_ort(model, torch.randn(8), atol=1e-4)


def test_reduce_of_constants_with_noop_and_empty_axes_folds_to_the_constant() -> None:
    nodes = [
        helper.make_node("ReduceSum", ["c", "ax"], ["s"], keepdims=1, noop_with_empty_axes=1),
        helper.make_node("ReduceSum", ["c", "ax"], ["t"], keepdims=1),
        helper.make_node("Add", ["s", "t"], ["st"]),
        helper.make_node("Add", ["x", "st"], ["y"]),
    ]
    inits = [("c", _vec(8)), ("ax", np.array([], np.int64))]
    model = _model(nodes, [("x", ["N", 8])], [("y", ["N", 8])], inits, opset=13)
    _same_as_ort(model, torch.randn(4, 8))


def test_reduce_over_run_time_axes_is_refused_naming_the_node() -> None:
    nodes = [helper.make_node("ReduceSum", ["x", "ax"], ["y"], keepdims=1, name="rs")]
    model = _model(nodes, [("x", ["N", 8]), ("ax", [1], I64)], [("y", ["N", 1])], opset=13)
    with pytest.raises(UnsupportedOperatorError, match=r"rs \(ReduceSum\)[\s\S]*axes must be"):
        import_onnx(model)


# -- arithmetic operands: tensor exponents, 1-D matrix products, constant vectors --------------
@pytest.mark.parametrize("base_first", [True, False])
def test_pow_with_a_tensor_exponent_is_refused_naming_the_node(base_first: bool) -> None:
    ins = ["x", "e"] if base_first else ["e", "x"]
    e = _vec(8) if base_first else np.array(2.0, np.float32)
    nodes = [helper.make_node("Pow", ins, ["y"], name="my_pow")]
    model = _model(nodes, [("x", ["N", 8])], [("y", ["N", 8])], [("e", e)])
    with pytest.raises(UnsupportedOperatorError, match=r"my_pow \(Pow\)") as err:
        import_onnx(model)
    assert "tensor exponent" in str(err.value) and "constant scalar" in str(err.value)


def test_pow_with_a_scalar_exponent_still_runs() -> None:
    nodes = [helper.make_node("Pow", ["x", "e"], ["y"])]
    model = _model(nodes, [("x", ["N", 8])], [("y", ["N", 8])], [("e", np.array(3.0, np.float32))])
    _same_as_ort(model, torch.rand(4, 8))


@pytest.mark.parametrize(
    ("a", "b", "y", "const_b"),
    [(["N", 8], [8], ["N"], True), (["N", 8], [8], ["N"], False),
     (["B", "N", 8], [8], ["B", "N"], True), ([4], [4, 8], [8], False), ([4], [4], [], False)],
)  # fmt: skip
def test_matmul_with_a_one_dimensional_operand_follows_numpy(a, b, y, const_b) -> None:
    size = {"N": 3, "B": 2}
    ta = torch.randn(*[size.get(d, d) for d in a])
    tb = torch.randn(*[size.get(d, d) for d in b])
    inits = [("b", tb.numpy())] if const_b else []
    inputs = [("a", a)] + ([] if const_b else [("b", b)])
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], inputs, [("y", y)], inits)
    _same_as_ort(model, *([ta] if const_b else [ta, tb]))


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul"])
def test_arithmetic_with_an_integer_constant_vector_is_a_tensor_operand(op: str) -> None:
    nodes = [helper.make_node(op, ["x", "c"], ["y"])]
    inits = [("c", np.arange(8, dtype=np.int64) - 3)]
    model = _model(nodes, [("x", ["N", 8], I64)], [("y", ["N", 8], I64)], inits)
    _same_as_ort(model, torch.arange(32).reshape(4, 8) - 16)


# -- Slice bounds --------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [4, "N"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize(
    ("start", "end"), [(-10, 2), (-6, -1), (-3, 100), (1, 100), (-1, 2**63 - 1), (0, 3)]
)
def test_slice_bounds_are_clamped_as_onnx_does(dim, axis: int, start: int, end: int) -> None:
    shape = [dim, 4] if axis == 0 else [3, dim]
    out = [None, 4] if axis == 0 else [3, None]
    inits = [("s", np.array([start])), ("e", np.array([end])), ("a", np.array([axis]))]
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a"], ["y"])]
    model = _model(nodes, [("x", shape)], [("y", out)], inits)
    _same_as_ort(model, torch.randn(4, 4) if axis == 0 else torch.randn(3, 4))


def test_an_empty_slice_is_refused_naming_the_node() -> None:
    inits = [("s", np.array([1])), ("e", np.array([-10])), ("a", np.array([1]))]
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a"], ["y"], name="my_slice")]
    model = _model(nodes, [("x", [3, 4])], [("y", [3, None])], inits)
    with pytest.raises(UnsupportedOperatorError, match=r"my_slice \(Slice\)[\s\S]*no elements"):
        import_onnx(model)


def test_a_pytorch_slice_from_before_the_start_is_clamped() -> None:
    class Tail(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, -10:] * 2

    x = torch.randn(3, 4)
    torch.testing.assert_close(torch2step.compile(Tail(), (x,)).run(x), x * 2)


# -- Transpose -------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "out"), [([2, 3, 4], [4, 3, 2]), (["N", 8], [8, "N"])])
def test_transpose_without_perm_reverses_the_axes(shape, out) -> None:
    nodes = [helper.make_node("Transpose", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    model = _model(nodes, [("x", shape)], [("y", out)])
    _same_as_ort(model, torch.randn(*[4 if d == "N" else d for d in shape]))


# -- dim_param spellings -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "symbol"),
    [("batch-size", "batch_size"), ("2*N", "d_2_N"), ("N/A", "N_A"), ("seq.len", "seq_len")],
)
def test_a_dim_param_that_is_no_identifier_is_an_opaque_dim(text: str, symbol: str) -> None:
    w = _RNG.standard_normal((8, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    model = _model(nodes, [("x", [text, 8])], [("y", [text, 4])], [("w", w)])
    g = import_onnx(model)
    assert {str(s): v for s, v in g.dims.items()} == {symbol: ("x", 0)}
    prog = torch2step.compile(model, (torch.randn(6, 8),))
    for n in (6, 4):
        x = torch.randn(n, 8)
        np.testing.assert_allclose(prog.run(x).numpy(), _ort(model, x), rtol=1e-5, atol=1e-5)
    assert prog.report(torch.randn(4, 8)).latency_cycles > 0


def test_a_dim_param_expression_of_other_input_dims_stays_derived() -> None:
    nodes = [helper.make_node("Concat", ["x", "z"], ["y"], axis=0)]
    inputs = [("x", ["N", 8]), ("z", ["N + 1", 8]), ("u", ["2*M", 8])]
    nodes.append(helper.make_node("Relu", ["u"], ["v"]))
    model = _model(nodes, inputs, [("y", ["2*N + 1", 8]), ("v", ["2*M", 8])])
    g = import_onnx(model)
    assert [str(g.types[i].shape[0]) for i in g.inputs] == ["N", "N + 1", "d_2_M"]
    assert sorted(str(s) for s in g.dims) == ["N", "d_2_M"]


# -- dims ONNX shape inference left unknown --------------------------------------------------
def test_a_legacy_export_with_unknown_dims_is_a_frontend_error_naming_the_node(tmp_path) -> None:
    from models import get_layer

    module, inputs, dynamic, _ = get_layer("qwen3-moe", tiny=True, batch=8, impl="loop")
    path = tmp_path / "moe_ts.onnx"
    axes = {n: {int(k): f"{n}_{k}" for k in d} for n, d in dynamic.items()}
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation and tracer ones
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(inputs), path, dynamo=False, opset_version=17,
                          input_names=list(dynamic), dynamic_axes=axes)  # fmt: skip
    with pytest.raises(FrontendError, match=r"\(TopK\): trying pattern") as err:
        import_onnx(path)
    assert "unk__" in str(err.value) and "dynamo=True" in str(err.value)


def test_shape_of_a_value_with_unknown_dims_advises_a_dynamo_export() -> None:
    nodes = [
        helper.make_node("Reshape", ["x", "s"], ["r"]),
        helper.make_node("Shape", ["r"], ["sh"], name="shape_r"),
        helper.make_node("Reshape", ["x", "sh"], ["y"]),
        helper.make_node("NonZero", ["x"], ["nz"]),
        helper.make_node("Shape", ["nz"], ["shz"], name="shape_nz"),
        helper.make_node("Reshape", ["x", "shz"], ["z"]),
    ]
    inputs = [("x", ["N", 8]), ("s", [2], I64)]
    model = _model(nodes, inputs, [("y", [None, None]), ("z", [None, None])])
    with pytest.raises(UnsupportedOperatorError) as err:
        import_onnx(model)
    why = {
        line.split("(")[0].strip("- "): nxt
        for line, nxt in zip(str(err.value).splitlines(), str(err.value).splitlines()[1:])
    }
    assert "unk__" in why["shape_r"] and "dynamo=True" in why["shape_r"]
    assert "data-dependent" in why["shape_nz"] and "dynamo" not in why["shape_nz"]


# -- Softmax before opset 13 ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "axis"), [(["N", 8], None), ([8], 0), ([8], -1), ([2, 3, "N", 8], 3)]
)
def test_softmax_before_opset_13_over_the_last_axis_is_accepted(shape, axis) -> None:
    attrs = {} if axis is None else {"axis": axis}
    nodes = [helper.make_node("Softmax", ["x"], ["y"], **attrs)]
    model = _model(nodes, [("x", shape)], [("y", shape)], opset=11)
    _same_as_ort(model, torch.randn(*[4 if d == "N" else d for d in shape]))


def test_softmax_before_opset_13_over_flattened_axes_is_refused() -> None:
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=1, name="sm")]
    model = _model(nodes, [("x", [2, 3, 8])], [("y", [2, 3, 8])], opset=11)
    with pytest.raises(UnsupportedOperatorError, match=r"sm \(Softmax\)[\s\S]*opset >= 13"):
        import_onnx(model)


# -- loading -------------------------------------------------------------------------------------
def test_a_missing_external_data_file_is_named(tmp_path) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    w = _RNG.standard_normal((8, 4)).astype(np.float32)
    model = _model(nodes, [("x", ["N", 8])], [("y", ["N", 4])], [("w", w)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.weights", size_threshold=0)
    assert import_onnx(path).params
    (tmp_path / "m.onnx.weights").unlink()
    with pytest.raises(FrontendError, match=r"m\.onnx\.weights.*place m\.onnx\.weights next"):
        import_onnx(path)


# -- example inputs by name ------------------------------------------------------------------
def test_compile_takes_example_inputs_by_onnx_input_name() -> None:
    nodes = [helper.make_node("Sub", ["x", "z"], ["y"])]
    model = _model(nodes, [("x", ["N", 8]), ("z", ["N", 8])], [("y", ["N", 8])])
    x, z = torch.randn(4, 8), torch.randn(4, 8)
    prog = torch2step.compile(model, {"z": z, "x": x})
    np.testing.assert_allclose(prog.run(x, z).numpy(), _ort(model, x, z), rtol=1e-6)
    with pytest.raises(FrontendError, match=r"by name .*\(x, z\); missing z; unknown w"):
        torch2step.compile(model, {"x": x, "w": z})
    with pytest.raises(FrontendError, match="positional tensors, a tuple"):
        torch2step.compile(torch.nn.ReLU(), {"x": x})
