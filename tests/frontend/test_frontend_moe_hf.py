"""HF MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock in ``batched_mm`` and ``grouped_mm`` raise to
one TopKRouting + one MoEExperts (patterns ``moe_batched_mm``, ``moe_grouped_mm``) and compute
what the block computes, including tokens batches that leave experts without tokens."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch_blocks import EXPERTS, HIDDEN, INTER, TOP_K, hf_moe

from torch2step.frontend import capture, raise_program
from torch2step.frontend.capture import dim_names
from torch2step.frontend.fx_view import ProgramView
from torch2step.frontend.raise_graph import find_matches
from torch2step.layers import Linear, MoEExperts, Reshape, TopKRouting, evaluate

CASES = [(f, i) for f in ("mixtral", "qwen3") for i in ("batched_mm", "grouped_mm")]
EXAMPLE = (2, 5, HIDDEN)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def raised(request):
    family, impl = request.param
    block = hf_moe(family, impl, seed=1)
    x = torch.randn(*EXAMPLE, generator=torch.Generator().manual_seed(0))
    ep = capture(block, (x,))
    graph = raise_program(ep, name=family, dim_names=dim_names(block, (x,)), single_output=True)
    matches, _ = find_matches(ProgramView(ep))
    return impl, block, graph, {m.pattern for m in matches.values()}


def _experts_hit(block: torch.nn.Module, x: torch.Tensor) -> set[int]:
    logits = x.reshape(-1, HIDDEN) @ block.gate.weight.T
    return set(torch.topk(logits.softmax(-1), TOP_K, dim=-1).indices.flatten().tolist())


def test_pattern_fired(raised) -> None:
    impl, _, _, patterns = raised
    assert f"moe_{impl}" in patterns
    assert "topk_routing" in patterns


def test_one_routing_and_one_experts_op(raised) -> None:
    _, _, graph, _ = raised
    kinds = sorted(type(n.op).__name__ for n in graph.nodes)
    # no per-token weight gather, no bmm: only the router, the routed experts and two views
    assert kinds == ["Linear", "MoEExperts", "Reshape", "Reshape", "TopKRouting"]
    (route,) = graph.ops(TopKRouting)
    assert route.op == TopKRouting(k=TOP_K, softmax_first=True, normalize=True)
    (moe,) = graph.ops(MoEExperts)
    assert moe.op == MoEExperts(num_experts=EXPERTS, top_k=TOP_K, activation="silu")
    assert moe.inputs[1:3] == route.outputs
    assert [graph.types[w].shape for w in moe.inputs[3:]] == [
        (EXPERTS, INTER, HIDDEN),
        (EXPERTS, INTER, HIDDEN),
        (EXPERTS, HIDDEN, INTER),
    ]
    (lin,) = graph.ops(Linear)
    assert graph.types[lin.inputs[1]].shape == (EXPERTS, HIDDEN)
    assert len(list(graph.ops(Reshape))) == 2


def test_expert_weights_are_the_blocks(raised) -> None:
    _, block, graph, _ = raised
    (moe,) = graph.ops(MoEExperts)
    gate, up, down = (graph.params[w] for w in moe.inputs[3:])
    fused = block.experts.gate_up_proj.detach()
    assert torch.equal(gate, fused[:, :INTER]) and torch.equal(up, fused[:, INTER:])
    assert torch.equal(down, block.experts.down_proj.detach())


def test_dims_are_batch_and_sequence(raised) -> None:
    _, _, graph, _ = raised
    names = {str(s): src for s, src in graph.dims.items()}
    assert names == {"B": ("hidden_states", 0), "S": ("hidden_states", 1)}
    b, s = sorted(graph.dims, key=str)
    assert graph.types[graph.outputs[0]].shape == (b, s, HIDDEN)
    (moe,) = graph.ops(MoEExperts)
    assert sympy.expand(graph.types[moe.outputs[0]].shape[0] - b * s) == 0


@pytest.mark.parametrize("shape", [EXAMPLE, (3, 7, HIDDEN), (1, 1, HIDDEN), (1, 2, HIDDEN)])
def test_equals_block(raised, shape) -> None:
    _, block, graph, _ = raised
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    if shape[0] * shape[1] <= 2:
        assert len(_experts_hit(block, x)) < EXPERTS  # some experts get no tokens
    with torch.no_grad():
        want = block(x)
    got = evaluate(graph, x)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
