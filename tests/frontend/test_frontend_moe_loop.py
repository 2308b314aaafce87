"""A user-written MoE (``for e in range(E)``: ``torch.where``, expert, ``index_add_``) raises to
one TopKRouting + one MoEExperts (pattern ``moe_loop``) over the module's own weights; the
expert choice stays run-time data (the graph is not specialised to the example's routing)."""

from __future__ import annotations

import pytest
import torch
from torch_blocks import HIDDEN, INTER, TOP_K, LoopMoE

from torch2step.frontend import capture, raise_program
from torch2step.frontend.capture import dim_names
from torch2step.frontend.fx_view import ProgramView, op_name
from torch2step.frontend.raise_graph import find_matches, format_matches
from torch2step.layers import MoEExperts, TopKRouting, evaluate

EXPERTS = 4


@pytest.fixture(scope="module")
def raised():
    moe = LoopMoE(experts=EXPERTS, seed=3)
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(0))
    ep = capture(moe, (x,))
    graph = raise_program(ep, name="loop", dim_names=dim_names(moe, (x,)), single_output=True)
    return moe, ep, graph


def test_capture_has_one_unbacked_size_per_expert(raised) -> None:
    _, ep, _ = raised
    nonzeros = [n for n in ep.graph.nodes if n.op == "call_function" and op_name(n) == "nonzero"]
    assert len(nonzeros) == EXPERTS
    sizes = {str(n.meta["val"].shape[0]) for n in nonzeros}
    assert sizes == {f"u{i}" for i in range(EXPERTS)}


def test_pattern_fired(raised) -> None:
    _, ep, _ = raised
    view = ProgramView(ep)
    matches, notes = find_matches(view)
    assert {m.pattern for m in matches.values()} >= {"moe_loop", "topk_routing", "linear"}
    assert not notes
    report = format_matches(view, matches, notes)
    assert f"num_experts={EXPERTS}, top_k={TOP_K}, activation=silu" in report


def test_graph_is_router_and_experts(raised) -> None:
    moe, _, graph = raised
    assert [type(n.op).__name__ for n in graph.nodes] == ["Linear", "TopKRouting", "MoEExperts"]
    (route,) = graph.ops(TopKRouting)
    assert route.op == TopKRouting(TOP_K, softmax_first=True, normalize=True)
    (node,) = graph.ops(MoEExperts)
    assert node.op == MoEExperts(EXPERTS, TOP_K, "silu")
    # the module's parameters already have the op's layout: they are used as they are
    assert node.inputs[3:] == ("w_gate", "w_up", "w_down")
    assert torch.equal(graph.params["w_down"], moe.w_down.detach())
    assert graph.types["w_gate"].shape == (EXPERTS, INTER, HIDDEN)
    assert [str(d) for d in graph.dims] == ["T"] and graph.dims[next(iter(graph.dims))] == ("x", 0)
    assert node.source is not None and "index_add_" in node.source


@pytest.mark.parametrize("tokens", [10, 1, 3, 37])
def test_equals_module(raised, tokens: int) -> None:
    moe, _, graph = raised
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = moe(x)
        ids = torch.topk(moe.router(x).softmax(-1), TOP_K).indices
    if tokens == 1:
        assert len(set(ids.flatten().tolist())) < EXPERTS  # experts without tokens
    torch.testing.assert_close(evaluate(graph, x), want, atol=1e-4, rtol=1e-4)
