"""The project's own workloads (``models/``): the loop MoE block and the GQA decode step raise
like the HuggingFace layers they reproduce, and full-size layers on the ``meta`` device (shapes
only) raise to the same ops with the published shapes."""

from __future__ import annotations

import pytest
import torch
from torch_blocks import seed_all  # noqa: F401  (single-threaded tiny tensors)

models = pytest.importorskip("models")

from torch2step.frontend import from_torch  # noqa: E402
from torch2step.layers import Attention, MoEExperts, Rotary, TopKRouting, evaluate  # noqa: E402


def test_models_loop_moe() -> None:
    cfg = models.QWEN3_30B_A3B_MOE.tiny(num_experts=4)
    block = models.MoEBlock(cfg, impl="loop", seed=2)
    x = torch.randn(6, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    graph = from_torch(block, (x,))
    (moe,) = graph.ops(MoEExperts)
    assert moe.op == MoEExperts(4, cfg.top_k, "silu")
    assert moe.inputs[3:] == ("w_gate", "w_up", "w_down")
    for tokens in (6, 1, 13):
        xt = torch.randn(
            tokens, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)
        )
        with torch.no_grad():
            want = block(xt)
        torch.testing.assert_close(evaluate(graph, xt), want, atol=1e-4, rtol=1e-4)


def test_models_gqa_decode_with_kv_lengths() -> None:
    cfg = models.QWEN3_30B_A3B_ATTENTION.tiny()
    step = models.GQADecode(cfg, attn="eager", seed=3)
    gen = torch.Generator().manual_seed(0)

    def inputs(b: int, past: int) -> tuple[torch.Tensor, ...]:
        kv = (b, cfg.num_kv_heads, past, cfg.head_dim)
        lens = torch.randint(0, past + 1, (b,), generator=gen)
        return (torch.randn(b, 1, cfg.hidden_size, generator=gen), torch.randn(kv, generator=gen),
                torch.randn(kv, generator=gen), lens)  # fmt: skip

    graph = from_torch(step, inputs(3, 10))
    (att,) = graph.ops(Attention)
    assert att.op == Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim**-0.5, causal=False)
    assert att.inputs[3] == "kv_lengths"
    assert {n.op.theta for n in graph.ops(Rotary)} == {cfg.rope_theta}
    for past in (1, 17, 300):
        ins = inputs(2, past)
        with torch.no_grad():
            want = step(*ins)
        for got, w in zip(evaluate(graph, *ins), want):
            torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)


def test_full_size_meta_layers_raise_with_published_shapes() -> None:
    moe = models.get_layer("qwen3-moe", impl="hf_batched_mm")
    graph = from_torch(moe.module, moe.example_inputs, moe.dynamic_shapes)
    (route,) = graph.ops(TopKRouting)
    (experts,) = graph.ops(MoEExperts)
    assert route.op.k == 8 and experts.op.num_experts == 128
    assert graph.types[experts.inputs[3]].shape == (128, 768, 2048)
    assert all(p.is_meta for p in graph.params.values())
    assert [str(s) for s in graph.dims] == ["tokens"]

    gqa = models.get_layer("qwen3-gqa", batch=4, kv_len=1000)
    graph = from_torch(gqa.module, gqa.example_inputs, gqa.dynamic_shapes)
    (att,) = graph.ops(Attention)
    assert (att.op.num_q_heads, att.op.num_kv_heads) == (32, 4)
    assert {n.op.theta for n in graph.ops(Rotary)} == {1_000_000.0}  # from the config (meta)
    assert {str(s) for s in graph.dims} == {"batch", "past"}


def test_bf16_qk_norms_raise_to_rmsnorm() -> None:
    """In bf16 the Qwen3 q/k norms cast to fp32 before squaring and back before the weight;
    they are still one RMSNorm each (whose meaning casts exactly so), not a chain of casts and
    elementwise operators, and the raised graph computes the module's outputs."""
    from torch2step.layers import Cast, Elementwise, RMSNorm

    cfg = models.QWEN3_30B_A3B_ATTENTION.tiny()
    step = models.GQADecode(cfg, attn="eager", seed=3, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    kv = (2, cfg.num_kv_heads, 9, cfg.head_dim)
    ins = (
        torch.randn(2, 1, cfg.hidden_size, generator=gen).to(torch.bfloat16),
        torch.randn(kv, generator=gen).to(torch.bfloat16),
        torch.randn(kv, generator=gen).to(torch.bfloat16),
    )
    graph = from_torch(step, ins)
    assert len(list(graph.ops(RMSNorm))) == 2
    assert not list(graph.ops(Cast)) and not list(graph.ops(Elementwise))
    with torch.no_grad():
        want = step(*ins)
    for got, w in zip(evaluate(graph, *ins), want):
        torch.testing.assert_close(got, w, atol=2e-2, rtol=2e-2)
