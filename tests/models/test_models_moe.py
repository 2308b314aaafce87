"""MoEBlock: every spelling equals HuggingFace's sparse MoE blocks (transformers 5.x), seeded init."""

from __future__ import annotations

import os

import pytest
import torch

from models import MIXTRAL_8X7B_MOE, MOE_IMPLS, QWEN3_30B_A3B_MOE, MoEBlock, MoEConfig
from models.init import moe_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hf = pytest.importorskip("models.hf", exc_type=ImportError)
pytest.importorskip("transformers")

TINY = {
    "mixtral": MIXTRAL_8X7B_MOE.tiny(),
    "qwen3": QWEN3_30B_A3B_MOE.tiny(num_experts=16, top_k=4),
}


def _x(*shape: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("style", sorted(TINY))
@pytest.mark.parametrize("experts_impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("impl", MOE_IMPLS)
def test_equals_hf_block(style: str, experts_impl: str, impl: str) -> None:
    cfg = TINY[style]
    ours = MoEBlock(cfg, impl=impl, seed=3)
    ref = hf.build_hf_moe(cfg, experts_implementation=experts_impl, seed=3)
    assert type(ref).__name__ == (
        "MixtralSparseMoeBlock" if style == "mixtral" else "Qwen3MoeSparseMoeBlock"
    )
    with torch.no_grad():
        for x in (_x(3, 5, cfg.hidden_size), _x(1, 2, cfg.hidden_size, seed=11)):
            expected = ref(x)
            assert isinstance(expected, torch.Tensor)  # HF 5.x returns one tensor, no router logits
            got = ours(x)
            assert got.shape == x.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_some_experts_get_no_tokens() -> None:
    """Two tokens, top-2 of 8 experts: at least four experts are idle and contribute nothing."""
    cfg = TINY["mixtral"]
    x = _x(1, 2, cfg.hidden_size, seed=11)
    ours = MoEBlock(cfg, impl="loop", seed=3)
    _, _, idx = ours.route(x.reshape(-1, cfg.hidden_size))
    assert len(torch.unique(idx)) <= 4 < cfg.num_experts
    ref = hf.build_hf_moe(cfg, experts_implementation="grouped_mm", seed=3)
    with torch.no_grad():
        # Scramble the idle experts' weights: the output must not change.
        idle = [e for e in range(cfg.num_experts) if e not in idx]
        before = ours(x)
        ours.w_gate.data[idle] = 100.0
        ours.w_down.data[idle] = -100.0
        torch.testing.assert_close(ours(x), before, atol=0, rtol=0)
        torch.testing.assert_close(before, ref(x), atol=1e-5, rtol=0)


def test_qwen3_without_topk_renormalisation_equals_hf() -> None:
    cfg = MoEConfig("q", 32, 16, 8, 3, norm_topk_prob=False, router_style="qwen3")
    x = _x(2, 4, 32)
    with torch.no_grad():
        expected = hf.build_hf_moe(cfg, experts_implementation="batched_mm", seed=5)(x)
        for impl in MOE_IMPLS:
            torch.testing.assert_close(
                MoEBlock(cfg, impl=impl, seed=5)(x), expected, atol=1e-5, rtol=0
            )


def test_routing_weights_closed_form() -> None:
    cfg = TINY["qwen3"]
    block = MoEBlock(cfg, seed=0)
    flat = _x(6, cfg.hidden_size)
    logits, w, idx = block.route(flat)
    probs = torch.softmax(flat @ block.router.weight.T, dim=-1)
    top, top_idx = probs.topk(cfg.top_k, dim=-1)
    assert torch.equal(idx, top_idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    assert logits.shape == (6, cfg.num_experts)


def test_copy_weights_both_directions() -> None:
    cfg = TINY["mixtral"]
    x = _x(2, 3, cfg.hidden_size)
    ours = MoEBlock(cfg, impl="dense", seed=1)
    ref = hf.build_hf_moe(cfg, experts_implementation="batched_mm", seed=2)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() > 1e-3  # different seeds, different blocks
        hf.copy_moe_weights(ours, ref)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)
        other = MoEBlock(cfg, impl="gather", seed=9)
        hf.copy_moe_weights(ref, other)
        torch.testing.assert_close(other(x), ref(x), atol=1e-5, rtol=0)
        assert torch.equal(ref.experts.gate_up_proj, torch.cat([other.w_gate, other.w_up], dim=1))


def test_two_dimensional_input_keeps_shape() -> None:
    cfg = TINY["mixtral"]
    block = MoEBlock(cfg, impl="loop", seed=0)
    x = _x(2, 3, cfg.hidden_size)
    with torch.no_grad():
        flat = block(x.reshape(6, cfg.hidden_size))
        assert flat.shape == (6, cfg.hidden_size)
        torch.testing.assert_close(flat.reshape(2, 3, -1), block(x), atol=0, rtol=0)


def test_seeded_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    cfg = TINY["qwen3"]
    state = torch.random.get_rng_state()
    a, b, c = MoEBlock(cfg, seed=4), MoEBlock(cfg, impl="dense", seed=4), MoEBlock(cfg, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        assert pa.std() > 0, name  # every parameter is initialised
    w = moe_weights(cfg, 4)
    assert torch.equal(a.w_down, w["down"]) and torch.equal(a.router.weight, w["router"])
    torch.testing.assert_close(
        w["gate"].std(), torch.tensor(cfg.hidden_size**-0.5), rtol=0.05, atol=0
    )


def test_meta_device_allocates_nothing() -> None:
    block = MoEBlock(MIXTRAL_8X7B_MOE, device="meta")
    assert all(p.device.type == "meta" for p in block.parameters())
    assert block.w_gate.shape == (8, 14336, 4096)
    out = MoEBlock(MIXTRAL_8X7B_MOE, impl="dense", device="meta")(
        torch.empty(4, 1, 4096, device="meta")
    )
    assert out.shape == (4, 1, 4096) and out.device.type == "meta"
    hf_meta = hf.build_hf_moe(QWEN3_30B_A3B_MOE, device="meta")
    assert hf_meta.experts.gate_up_proj.shape == (128, 1536, 2048)


def test_unknown_impl_is_rejected() -> None:
    with pytest.raises(ValueError, match="loop, dense, gather"):
        MoEBlock(TINY["mixtral"], impl="sorted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batched_mm"):
        hf.build_hf_moe(TINY["mixtral"], experts_implementation="fast")


@pytest.mark.parametrize("impl", MOE_IMPLS)
def test_exports_with_dynamic_tokens(impl: str) -> None:
    """torch.export non-strict captures each spelling; the program is right for other sizes."""
    cfg = TINY["mixtral"]
    block = MoEBlock(cfg, impl=impl, seed=0)
    tokens = torch.export.Dim("tokens", min=1)
    ep = torch.export.export(
        block,
        (_x(16, 1, cfg.hidden_size),),
        dynamic_shapes={"hidden_states": {0: tokens}},
        strict=False,
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    with torch.no_grad():
        for n in (3, 33):
            x = _x(n, 1, cfg.hidden_size, seed=n)
            torch.testing.assert_close(ep.module()(x), block(x), atol=1e-6, rtol=0)
    if impl == "loop":  # one data-dependent size per expert, as FRONTEND_NOTES records
        wheres = [n for n in ep.graph.nodes if n.target is torch.ops.aten.where.default]
        assert len(wheres) == cfg.num_experts
        unbacked = {s for n in wheres for s in n.meta["val"][0].shape[0].node.expr.free_symbols}
        assert len(unbacked) == cfg.num_experts
