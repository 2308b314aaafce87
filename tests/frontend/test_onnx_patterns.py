"""Each raising pattern on a small hand-built ONNX graph: what it recognises, the layer op it
produces, and that the result computes what ``onnx.reference`` computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from torch2step.errors import UnsupportedOperatorError
from torch2step.frontend.onnx_emit import Unsupported
from torch2step.frontend.onnx_import import import_onnx
from torch2step.frontend.raise_rotary import theta_of
from torch2step.layers import Attention, Linear, RMSNorm, Rotary, TopKRouting, evaluate

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=(), opset=20, extra=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits]
    )
    ops = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, 1) for d in extra]]
    return helper.make_model(graph, opset_imports=ops)


def _vi(name: str, shape, t=F32):
    return helper.make_tensor_value_info(name, t, shape)


def _same_as_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray], atol=1e-5):
    g = import_onnx(model)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = evaluate(g, *[torch.from_numpy(feeds[i]) for i in g.inputs])
    for a, b in zip((got,) if g.single_output else got, want):
        np.testing.assert_allclose(a.numpy(), b, atol=atol, rtol=1e-5)
    return g


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- rmsnorm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["pow_reciprocal", "mul_div"])
def test_rmsnorm_decomposed(spelling: str) -> None:
    w = (1 + 0.1 * _f(8)).astype(np.float32)
    inits = [
        ("w", w),
        ("two", np.array(2.0, np.float32)),
        ("eps", np.array(1e-6, np.float32)),
        ("ax", np.array([-1], np.int64)),
    ]
    sq = (
        helper.make_node("Pow", ["x", "two"], ["sq"])
        if spelling == "pow_reciprocal"
        else helper.make_node("Mul", ["x", "x"], ["sq"])
    )
    nodes = [
        sq,
        helper.make_node("ReduceMean", ["sq", "ax"], ["m"], keepdims=1),
        helper.make_node("Add", ["m", "eps"], ["v"]),
        helper.make_node("Sqrt", ["v"], ["r"]),
    ]
    if spelling == "pow_reciprocal":
        nodes += [
            helper.make_node("Reciprocal", ["r"], ["ir"]),
            helper.make_node("Mul", ["x", "ir"], ["n"]),
        ]
    else:
        nodes += [helper.make_node("Div", ["x", "r"], ["n"])]
    nodes.append(helper.make_node("Mul", ["w", "n"], ["y"]))
    model = _model(nodes, [_vi("x", ["t", 8])], [_vi("y", ["t", 8])], inits)
    g = _same_as_reference(model, {"x": _f(5, 8)})
    assert [type(n.op) for n in g.nodes] == [RMSNorm] and g.nodes[0].op == RMSNorm(eps=1e-6)


def test_rmsnorm_fused_ops() -> None:
    w = (1 + 0.1 * _f(8)).astype(np.float32)
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-5)
    model = _model([node], [_vi("x", [2, 3, 8])], [_vi("y", [2, 3, 8])], [("w", w)], opset=23)
    g = _same_as_reference(model, {"x": _f(2, 3, 8)})
    assert g.nodes[0].op == RMSNorm(eps=1e-5)
    ms = helper.make_node(
        "SimplifiedLayerNormalization",
        ["x", "w"],
        ["y"],
        axis=-1,
        epsilon=1e-6,
        domain="com.microsoft",
    )
    g2 = import_onnx(
        _model([ms], [_vi("x", [4, 8])], [_vi("y", [4, 8])], [("w", w)], extra=["com.microsoft"])
    )
    assert [n.op for n in g2.nodes] == [RMSNorm(eps=1e-6)]
    x = torch.from_numpy(_f(4, 8))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(w)
    torch.testing.assert_close(evaluate(g2, x), want)


# -- linear -----------------------------------------------------------------------------------------
def test_linear_from_matmul_with_bias_and_from_gemm() -> None:
    w, b, w2, c = _f(6, 5), _f(5), _f(5, 4), _f(4)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["h"]),
        helper.make_node("Gemm", ["h", "w2", "c"], ["y"], alpha=2.0, beta=0.5, transB=0),
    ]
    model = _model(
        nodes,
        [_vi("x", ["n", 6])],
        [_vi("y", ["n", 4])],
        [("w", w), ("b", b), ("w2", w2), ("c", c)],
    )
    g = _same_as_reference(model, {"x": _f(3, 6)})
    assert [type(n.op) for n in g.nodes] == [Linear, Linear]
    assert [len(n.inputs) for n in g.nodes] == [3, 3]  # both carry their bias
    torch.testing.assert_close(g.params[g.nodes[1].inputs[1]], torch.from_numpy(2 * w2.T))


# -- router ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("softmax_first", [True, False])
def test_router_patterns(softmax_first: bool) -> None:
    k = [("k", np.array([2], np.int64))]
    if softmax_first:
        nodes = [
            helper.make_node("Softmax", ["logits"], ["p"], axis=-1),
            helper.make_node("TopK", ["p", "k"], ["w", "e"], axis=-1),
        ]
    else:
        nodes = [
            helper.make_node("TopK", ["logits", "k"], ["v", "e"], axis=-1),
            helper.make_node("Softmax", ["v"], ["w"], axis=-1),
        ]
    outs = [_vi("w", ["t", 2]), _vi("e", ["t", 2], I64)]
    g = _same_as_reference(_model(nodes, [_vi("logits", ["t", 8])], outs, k), {"logits": _f(6, 8)})
    assert [n.op for n in g.nodes] == [
        TopKRouting(k=2, softmax_first=softmax_first, normalize=False)
    ]


# -- rotary ---------------------------------------------------------------------------------------------
def _inv_freq(theta: float, d: int) -> np.ndarray:
    return (1.0 / theta ** (np.arange(0, d, 2) / d)).astype(np.float32)


def test_rotary_embedding_op_with_position_ids_and_caches() -> None:
    d, theta = 16, 500000.0
    ang = np.arange(64)[:, None] * _inv_freq(theta, d)[None, :]
    inits = [("cos", np.cos(ang).astype(np.float32)), ("sin", np.sin(ang).astype(np.float32))]
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], num_heads=4)
    model = _model(
        [node],
        [_vi("x", [2, 4, 3, d]), _vi("pos", [2, 3], I64)],
        [_vi("y", [2, 4, 3, d])],
        inits,
        opset=23,
    )
    feeds = {"x": _f(2, 4, 3, d), "pos": RNG.integers(0, 64, (2, 3)).astype(np.int64)}
    g = _same_as_reference(model, feeds, atol=1e-4)
    assert [n.op for n in g.nodes] == [Rotary(theta=theta, rotary_dim=d)]


def test_theta_is_recovered_and_scaled_rope_is_refused() -> None:
    assert theta_of(_inv_freq(10000.0, 128)) == (10000.0, "float32")
    assert theta_of(_inv_freq(1234.5, 64))[0] == pytest.approx(1234.5, rel=1e-5)
    scaled = _inv_freq(10000.0, 64)
    scaled[16:] /= 8.0  # llama3-style low-frequency scaling
    with pytest.raises(Unsupported, match="scaled RoPE"):
        theta_of(scaled)


# -- attention --------------------------------------------------------------------------------------------
def _attention_model(mask_kind: str) -> onnx.ModelProto:
    """``softmax(q k^T * 0.35 + mask) v`` with repeat_kv by Tile-free Expand/Reshape."""
    s = ["S"] if mask_kind != "static" else [4]
    q, k, v = _vi("q", [1, 4, *s, 8]), _vi("k", [1, 2, *s, 8]), _vi("v", [1, 2, *s, 8])
    inits = [
        ("sc", np.array(0.35, np.float32)),
        ("ax2", np.array([2], np.int64)),
        ("rep", np.array([1, 2, 2, 1, 1], np.int64)),
        ("heads", np.array([1, 4, -1, 8], np.int64)),
        ("zero", np.array(0.0, np.float32)),
        ("ninf", np.array(-np.inf, np.float32)),
        ("i0", np.array(0, np.int64)),
        ("i1", np.array(1, np.int64)),
        ("ax0", np.array([0], np.int64)),
        ("ax1", np.array([1], np.int64)),
    ]
    nodes = []
    for t in ("k", "v"):
        nodes += [
            helper.make_node("Unsqueeze", [t, "ax2"], [f"{t}u"]),
            helper.make_node("Expand", [f"{t}u", "rep"], [f"{t}e"]),
            helper.make_node("Reshape", [f"{t}e", "heads"], [f"{t}r"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "sc"], ["scaled"]),
    ]
    scores = "scaled"
    inputs = [q, k, v]
    if mask_kind == "static":
        tri = np.triu(np.full((4, 4), -np.inf, np.float32), 1)[None, None]
        inits.append(("mask", tri))
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
        scores = "masked"
    elif mask_kind == "causal":  # built from Shape(q) at run time: key j visible iff j <= i
        nodes += [
            helper.make_node("Shape", ["q"], ["qs"], start=2, end=3),
            helper.make_node("Squeeze", ["qs"], ["n"]),
            helper.make_node("Range", ["i0", "n", "i1"], ["j"]),
            helper.make_node("Unsqueeze", ["j", "ax0"], ["jrow"]),
            helper.make_node("Unsqueeze", ["j", "ax1"], ["icol"]),
            helper.make_node("LessOrEqual", ["jrow", "icol"], ["vis"]),
            helper.make_node("Where", ["vis", "zero", "ninf"], ["mask"]),
            helper.make_node("Add", ["scaled", "mask"], ["masked"]),
        ]
        scores = "masked"
    elif mask_kind == "input":
        inputs.append(_vi("mask", [1, 1, *s, *s]))
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
        scores = "masked"
    nodes += [
        helper.make_node("Softmax", [scores], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vr"], ["y"]),
    ]
    return _model(nodes, inputs, [_vi("y", [1, 4, *s, 8])], inits)


@pytest.mark.parametrize("mask_kind", ["none", "static", "causal"])
def test_attention_matmul_softmax_with_repeat_kv_and_masks(mask_kind: str) -> None:
    model = _attention_model(mask_kind)
    feeds = {"q": _f(1, 4, 4, 8), "k": _f(1, 2, 4, 8), "v": _f(1, 2, 4, 8)}
    g = _same_as_reference(model, feeds)
    (node,) = g.nodes
    assert node.op == Attention(
        num_q_heads=4, num_kv_heads=2, scale=pytest.approx(0.35), causal=mask_kind != "none"
    )
    assert node.inputs == ("q", "k", "v")


def test_attention_with_an_arbitrary_mask_input_is_reported() -> None:
    with pytest.raises(UnsupportedOperatorError) as err:
        import_onnx(_attention_model("input"))
    msg = str(err.value)
    assert "Expand" in msg and "attention_matmul_softmax" in msg and "graph input" in msg
