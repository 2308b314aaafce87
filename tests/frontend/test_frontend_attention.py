"""Decode steps around HF Qwen3Attention / LlamaAttention (sdpa and eager) raise to Linear,
RMSNorm (Qwen3 q/k norm), Rotary, Concat (the cache update) and ONE grouped-query Attention
(patterns ``attention_sdpa``, ``attention_matmul_softmax``, ``rotary``, ``rmsnorm``,
``linear``); one capture serves every KV length (1, 17, 300) and, with ``kv_lengths``, ragged
caches."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch_blocks import HEAD_DIM, HEADS, KV_HEADS, DecodeStep, decode_inputs

from torch2step.frontend import capture, from_exported
from torch2step.frontend.fx_view import ProgramView
from torch2step.frontend.raise_graph import find_matches
from torch2step.layers import (
    Arange,
    Attention,
    Concat,
    Elementwise,
    Linear,
    MatMul,
    RMSNorm,
    Rotary,
    Softmax,
    evaluate,
)

CASES = [
    ("qwen3", "sdpa", False),
    ("qwen3", "eager", True),
    ("llama", "sdpa", True),
    ("llama", "eager", False),
]


@pytest.fixture(
    scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'lens' if c[2] else 'full'}"
)
def raised(request):
    family, impl, lengths = request.param
    step = DecodeStep(family, impl, seed=5)
    example = decode_inputs(3, 10, seed=0, lengths=lengths)
    ep = capture(step, example)
    graph = from_exported(ep, step, example)
    patterns = {m.pattern for m in find_matches(ProgramView(ep))[0].values()}
    return family, impl, lengths, step, graph, patterns


def test_patterns_fired(raised) -> None:
    family, impl, _, _, _, patterns = raised
    spelling = {"sdpa": "sdpa", "eager": "matmul_softmax"}[impl]
    want = {f"attention_{spelling}", "rotary", "linear"} | (
        {"rmsnorm"} if family == "qwen3" else set()
    )
    assert want <= patterns


def test_one_gqa_attention(raised) -> None:
    _, _, lengths, _, graph, _ = raised
    (node,) = graph.ops(Attention)
    assert node.op == Attention(num_q_heads=HEADS, num_kv_heads=KV_HEADS, scale=0.25, causal=False)
    assert (node.inputs[3:] == ("kv_lengths",)) == lengths and len(node.inputs) == 3 + lengths
    q, k, v = (graph.types[i] for i in node.inputs[:3])
    b, length = (sympy.Symbol(n, integer=True, positive=True) for n in ("B", "L"))
    assert q.shape == (b, HEADS, 1, HEAD_DIM)
    assert k.shape == v.shape == (b, KV_HEADS, length + 1, HEAD_DIM)
    # the raised graph has no loose attention arithmetic left
    assert not any(graph.ops(MatMul)) and not any(graph.ops(Softmax))
    assert not any(graph.ops(Elementwise))


def test_rotary_and_norms(raised) -> None:
    family, _, lengths, _, graph, _ = raised
    rot = list(graph.ops(Rotary))
    assert [n.op for n in rot] == [Rotary(theta=10000.0, rotary_dim=HEAD_DIM)] * 2
    producers = graph.producers()
    pos = {producers[n.inputs[1]].inputs[0] for n in rot}
    if lengths:
        assert pos == {"kv_lengths"}
    else:
        (arange,) = graph.ops(Arange)
        length = sympy.Symbol("L", integer=True, positive=True)
        assert arange.op == Arange(length, length + 1) and pos == {arange.outputs[0]}
    norms = list(graph.ops(RMSNorm))
    if family == "qwen3":
        assert [graph.types[n.inputs[0]].shape[2:] for n in norms] == [
            (HEADS, HEAD_DIM),
            (KV_HEADS, HEAD_DIM),
        ]
        assert {n.op.eps for n in norms} == {1e-6}
    else:
        assert norms == []
    assert len(list(graph.ops(Linear))) == 4
    assert len(list(graph.ops(Concat))) == 2


def test_signature_and_dims(raised) -> None:
    _, _, lengths, _, graph, _ = raised
    assert graph.inputs == ["x", "past_k", "past_v"] + (["kv_lengths"] if lengths else [])
    assert not graph.single_output and len(graph.outputs) == 3
    assert {str(s): src for s, src in graph.dims.items()} == {"B": ("x", 0), "L": ("past_k", 2)}
    assert all(n.source for n in graph.nodes if isinstance(n.op, (Attention, Rotary, Linear)))


@pytest.mark.parametrize("past", [1, 17, 300])
def test_equals_module_at_any_kv_length(raised, past: int) -> None:
    _, _, lengths, step, graph, _ = raised
    inputs = decode_inputs(3, past, seed=past, lengths=lengths)
    if lengths:  # a full cache, a half-full one and an empty one (ragged, right-padded)
        inputs = (*inputs[:3], torch.tensor([past, past // 2, 0]))
    with torch.no_grad():
        want = step(*inputs)
    got = evaluate(graph, *inputs)
    assert isinstance(got, tuple) and len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
