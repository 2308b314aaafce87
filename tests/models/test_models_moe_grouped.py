"""MoEBlock ``impl="grouped"`` (HF ``grouped_mm`` spelling in plain torch): the grouped matmul
op, equality with the ``loop`` spelling, idle experts and single tokens, and raising to the same
layer graph (Reshape, Linear, TopKRouting, MoEExperts, Reshape) with the block's own weights."""

from __future__ import annotations

import pytest
import torch

from models import LAYERS, MIXTRAL_8X7B_MOE, QWEN3_30B_A3B_MOE, MoEBlock, MoEConfig, get_layer
from models.moe import GROUPED_MM_OP, grouped_mm

TINY = {
    "mixtral": MIXTRAL_8X7B_MOE.tiny(),
    "qwen3": QWEN3_30B_A3B_MOE.tiny(num_experts=16, top_k=4),
}
LAYER_KINDS = ["Reshape", "Linear", "TopKRouting", "MoEExperts", "Reshape"]


def _x(*shape: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _pair(cfg: MoEConfig, seed: int = 3) -> tuple[MoEBlock, MoEBlock]:
    return MoEBlock(cfg, impl="grouped", seed=seed), MoEBlock(cfg, impl="loop", seed=seed)


# -- the grouped matmul op --------------------------------------------------------------------
def test_grouped_mm_is_per_group_matmul_with_empty_groups() -> None:
    x, w = _x(9, 5), _x(4, 5, 3, seed=1)
    offs = torch.tensor([2, 2, 9, 9], dtype=torch.int32)  # groups 1 and 3 have no rows
    want = torch.cat([x[:2] @ w[0], x[2:9] @ w[2]])
    torch.testing.assert_close(grouped_mm(x, w, offs), want, atol=1e-6, rtol=0)
    # rows past offs[-1] belong to no group and stay zero
    short = grouped_mm(x, w, torch.tensor([1, 3, 3, 4], dtype=torch.int64))
    assert torch.equal(short[4:], torch.zeros(5, 3))
    torch.testing.assert_close(short[1:3], x[1:3] @ w[1], atol=1e-6, rtol=0)


def test_grouped_mm_op_name_fake_kernel_and_gradient() -> None:
    assert GROUPED_MM_OP == "torch2step::grouped_mm"
    assert torch.ops.torch2step.grouped_mm.default._name == GROUPED_MM_OP
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        out = grouped_mm(
            mode.from_tensor(_x(7, 5)),
            mode.from_tensor(_x(3, 5, 2)),
            mode.from_tensor(torch.tensor([1, 4, 7], dtype=torch.int32)),
        )
        assert out.shape == (7, 2) and out.dtype == torch.float32
    x = _x(6, 4).double().requires_grad_()
    w = _x(3, 4, 2, seed=2).double().requires_grad_()
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (x, w))


# -- the block ----------------------------------------------------------------------------------
@pytest.mark.parametrize("style", sorted(TINY))
@pytest.mark.parametrize("shape", [(3, 5), (16, 1), (1, 1)])
def test_equals_loop(style: str, shape: tuple[int, int]) -> None:
    cfg = TINY[style]
    grouped, loop = _pair(cfg)
    x = _x(*shape, cfg.hidden_size, seed=sum(shape))
    with torch.no_grad():
        got = grouped(x)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, loop(x), atol=1e-5, rtol=0)
        flat = grouped(x.reshape(-1, cfg.hidden_size))  # (tokens, hidden) input keeps its shape
        torch.testing.assert_close(flat.reshape(x.shape), got, atol=0, rtol=0)


def test_qwen3_without_topk_renormalisation_equals_loop() -> None:
    cfg = MoEConfig("q", 32, 16, 8, 3, norm_topk_prob=False, router_style="qwen3")
    grouped, loop = _pair(cfg, seed=5)
    x = _x(2, 4, 32)
    with torch.no_grad():
        torch.testing.assert_close(grouped(x), loop(x), atol=1e-5, rtol=0)


def test_single_token_leaves_experts_idle() -> None:
    """T = 1, top-4 of 16: twelve experts get no rows; their weights do not matter."""
    cfg = TINY["qwen3"]
    grouped, loop = _pair(cfg)
    x = _x(1, 1, cfg.hidden_size, seed=11)
    _, _, idx = grouped.route(x.reshape(-1, cfg.hidden_size))
    idle = sorted(set(range(cfg.num_experts)) - set(idx.flatten().tolist()))
    assert len(idle) == cfg.num_experts - cfg.top_k
    with torch.no_grad():
        before = grouped(x)
        torch.testing.assert_close(before, loop(x), atol=1e-5, rtol=0)
        grouped.w_gate.data[idle] = 100.0
        grouped.w_up.data[idle] = -50.0
        grouped.w_down.data[idle] = -100.0
        assert torch.equal(grouped(x), before)


def test_empty_experts_at_both_ends_of_the_sort() -> None:
    """Route every token to experts 3 and 4 only: experts 0-2 (offsets 0) and 5-7 (offsets at
    the end) are empty groups; the result is still the loop's."""
    cfg = TINY["mixtral"]
    grouped, loop = _pair(cfg)
    with torch.no_grad():
        bias = torch.zeros(cfg.num_experts, cfg.hidden_size)
        bias[3:5] = 1.0
        for block in (grouped, loop):
            block.router.weight.copy_(0.01 * block.router.weight + 10.0 * bias)
        x = _x(5, 1, cfg.hidden_size).abs() + 0.5  # positive: experts 3 and 4 win everywhere
        _, _, idx = grouped.route(x.reshape(-1, cfg.hidden_size))
        assert set(idx.flatten().tolist()) == {3, 4}
        torch.testing.assert_close(grouped(x), loop(x), atol=1e-5, rtol=0)


def test_bf16_activations_match_loop() -> None:
    cfg = TINY["qwen3"]
    grouped = MoEBlock(cfg, impl="grouped", seed=1, dtype=torch.bfloat16)
    loop = MoEBlock(cfg, impl="loop", seed=1, dtype=torch.bfloat16)
    x = _x(4, 2, cfg.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        got = grouped(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, loop(x), atol=2e-2, rtol=2e-2)


# -- registry and raising ---------------------------------------------------------------------
def test_registry_default_is_grouped_and_loop_stays() -> None:
    for name in ("qwen3-moe", "mixtral-moe"):
        assert LAYERS[name].default_impl == "grouped"
        assert {"grouped", "loop"} <= set(LAYERS[name].impls)
    assert get_layer("qwen3-moe", tiny=True).module.impl == "grouped"
    assert get_layer("qwen3-moe", tiny=True, impl="loop").module.impl == "loop"


def test_raises_to_the_same_layer_graph_as_loop() -> None:
    from torch2step.frontend import from_torch
    from torch2step.layers import MoEExperts, TopKRouting, evaluate

    graphs = {}
    for impl in ("grouped", "loop"):
        spec = get_layer("qwen3-moe", tiny=True, batch=6, seed=2, impl=impl)
        graphs[impl] = (spec, from_torch(spec.module, spec.example_inputs, spec.dynamic_shapes))
    (spec, graph), (_, loop_graph) = graphs["grouped"], graphs["loop"]
    cfg = spec.metadata["config"]
    assert [type(n.op).__name__ for n in graph.nodes] == LAYER_KINDS
    assert [n.op for n in graph.nodes] == [n.op for n in loop_graph.nodes]
    (route,) = graph.ops(TopKRouting)
    (moe,) = graph.ops(MoEExperts)
    assert moe.op == MoEExperts(cfg.num_experts, cfg.top_k, "silu")
    assert moe.inputs[1:3] == route.outputs
    block = spec.module
    for name, want in zip(moe.inputs[3:], (block.w_gate, block.w_up, block.w_down)):
        assert torch.equal(graph.params[name], want.detach())
    (lmoe,) = loop_graph.ops(MoEExperts)
    for a, b in zip(moe.inputs[3:], lmoe.inputs[3:]):
        assert torch.equal(graph.params[a], loop_graph.params[b])
    for tokens in (6, 1, 13):  # the token count stays dynamic
        x = _x(tokens, 1, cfg.hidden_size, seed=tokens)
        with torch.no_grad():
            want = block(x)
        torch.testing.assert_close(evaluate(graph, x), want, atol=1e-4, rtol=1e-4)


def test_full_size_meta_layer_raises() -> None:
    """The command line's default: full-size Qwen3-30B-A3B on meta (shapes only)."""
    from torch2step.frontend import from_torch
    from torch2step.layers import MoEExperts

    spec = get_layer("qwen3-moe", batch=64)
    graph = from_torch(spec.module, spec.example_inputs, spec.dynamic_shapes)
    assert [type(n.op).__name__ for n in graph.nodes] == LAYER_KINDS
    (moe,) = graph.ops(MoEExperts)
    assert moe.op == MoEExperts(128, 8, "silu")
    shapes = [graph.types[w].shape for w in moe.inputs[3:]]
    assert shapes == [(128, 768, 2048), (128, 768, 2048), (128, 2048, 768)]
    assert all(p.is_meta for p in graph.params.values())
    out = spec.module(spec.example_inputs[0])  # eager on meta: the op's fake kernel
    assert out.shape == (64, 1, 2048) and out.is_meta
