"""The layer registry and the config presets."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

import models
from models import (
    LAYERS,
    LLAMA3_8B_ATTENTION,
    MIXTRAL_8X7B_MOE,
    QWEN3_30B_A3B_ATTENTION,
    QWEN3_30B_A3B_MOE,
    AttentionConfig,
    GQADecode,
    MoEBlock,
    MoEConfig,
    UnknownLayerError,
    get_layer,
)
from models.decoder import DecoderStep

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_published_numbers() -> None:
    m, q = MIXTRAL_8X7B_MOE, QWEN3_30B_A3B_MOE
    assert (m.hidden_size, m.intermediate_size, m.num_experts, m.top_k) == (4096, 14336, 8, 2)
    assert (q.hidden_size, q.intermediate_size, q.num_experts, q.top_k, q.norm_topk_prob) == (
        2048,
        768,
        128,
        8,
        True,
    )
    qa, la = QWEN3_30B_A3B_ATTENTION, LLAMA3_8B_ATTENTION
    assert (qa.hidden_size, qa.num_heads, qa.num_kv_heads, qa.head_dim, qa.rope_theta) == (
        2048,
        32,
        4,
        128,
        1e6,
    )
    assert qa.qk_norm and qa.variant == "qwen3" and qa.num_groups == 8
    assert (la.hidden_size, la.num_heads, la.num_kv_heads, la.head_dim, la.rope_theta) == (
        4096,
        32,
        8,
        128,
        5e5,
    )
    assert not la.qk_norm and la.variant == "llama"
    assert m.expert_param_count == 3 * 8 * 4096 * 14336


def test_tiny_variants_keep_style() -> None:
    t = QWEN3_30B_A3B_MOE.tiny(num_experts=4)
    assert (t.hidden_size, t.num_experts, t.top_k, t.router_style) == (64, 4, 2, "qwen3")
    a = QWEN3_30B_A3B_ATTENTION.tiny()
    assert (a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.qk_norm) == (
        64,
        8,
        2,
        16,
        True,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.head_dim = 8  # type: ignore[misc]


def test_invalid_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        MoEConfig("x", 8, 8, 8, 9)
    with pytest.raises(ValueError, match="always renormalises"):
        MoEConfig("x", 8, 8, 8, 2, norm_topk_prob=False, router_style="mixtral")
    with pytest.raises(ValueError, match="not a multiple"):
        AttentionConfig("x", 64, 6, 4, 16, 1e4, False)
    with pytest.raises(ValueError, match="even head_dim"):
        AttentionConfig("x", 64, 8, 2, 15, 1e4, False)


def test_names_and_unknown_name() -> None:
    names = ["mixtral-moe", "qwen3-moe", "qwen3-gqa", "llama-gqa", "llama-decoder",
             "qwen3-decoder", "mixtral-decoder", "qwen3-moe-decoder"]  # fmt: skip
    assert list(LAYERS) == names
    with pytest.raises(KeyError) as info:
        get_layer("gpt-moe")
    assert isinstance(info.value, UnknownLayerError)
    assert str(info.value) == f"unknown layer 'gpt-moe'; valid names: {', '.join(names)}"
    with pytest.raises(ValueError, match="choose one of sdpa, eager"):
        get_layer("qwen3-gqa", tiny=True, impl="loop")
    with pytest.raises(ValueError, match="kv_len / kv_lengths do not apply"):
        get_layer("mixtral-moe", tiny=True, kv_len=4)


@pytest.mark.parametrize("name", list(LAYERS))
def test_tiny_layers_run(name: str) -> None:
    spec = get_layer(name, tiny=True, batch=5)
    module, inputs, dynamic, meta = spec  # unpacks like a tuple
    assert meta["device"] == "cpu" and meta["tiny"]
    with torch.no_grad():
        out = module(*inputs)
    if meta["kind"] == "moe":
        assert isinstance(module, MoEBlock) and out.shape == (5, 1, 64)
        assert set(dynamic) == {"hidden_states"}
    else:
        assert isinstance(module, DecoderStep if meta["kind"] == "decoder" else GQADecode)
        assert [tuple(t.shape) for t in out] == [(5, 1, 64), (5, 2, 33, 16), (5, 2, 33, 16)]
        assert set(dynamic) == {"x", "past_k", "past_v"}
    assert meta["param_count"] == sum(p.numel() for p in module.parameters())


def test_full_size_is_shape_only_by_default() -> None:
    spec = get_layer("mixtral-moe")
    assert spec.metadata["device"] == "meta"
    assert all(p.device.type == "meta" for p in spec.module.parameters())
    assert spec.example_inputs[0].shape == (64, 1, 4096)
    assert spec.metadata["param_bytes"] == 4 * (3 * 8 * 4096 * 14336 + 8 * 4096)
    assert spec.metadata["routing_trace"] == "mixtral_b64"
    assert get_layer("qwen3-moe", batch=1024).metadata["routing_trace"] == "qwen_b1024"
    assert get_layer("qwen3-moe", batch=100).metadata["routing_trace"] is None


def test_kv_lengths_trace_sets_batch_and_past() -> None:
    spec = get_layer("qwen3-gqa", kv_lengths="b64/med")
    lens = models.traces.kv_lengths("b64/conv_stdev0996_4007_4070")
    assert spec.metadata["batch"] == 64 and spec.metadata["past_len"] == int(lens.max()) == 4088
    assert np.array_equal(spec.metadata["kv_lengths"], lens)
    assert spec.example_inputs[1].shape == (64, 4, 4088, 128)
    assert set(spec.dynamic_shapes) == {"x", "past_k", "past_v", "kv_lengths"}
    with pytest.raises(ValueError, match="must lie in"):
        get_layer("llama-gqa", tiny=True, kv_lengths=np.array([3, 9]), kv_len=8)
    with pytest.raises(ValueError, match="batch=3 but kv_lengths has 2"):
        get_layer("llama-gqa", tiny=True, kv_lengths=np.array([3, 4]), batch=3)


def test_tiny_kv_lengths_layer_runs_on_cpu() -> None:
    spec = get_layer("llama-gqa", tiny=True, kv_lengths=np.array([3, 0, 7]), impl="eager")
    out, new_k, _ = spec.module(*spec.example_inputs)
    assert out.shape == (3, 1, 64) and new_k.shape == (3, 2, 8, 16)
    assert spec.example_inputs[3].tolist() == [3, 0, 7]


def test_seed_determines_weights_and_inputs() -> None:
    a, b, c = (get_layer("qwen3-moe", tiny=True, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])
    assert torch.equal(a.module.w_up, b.module.w_up) and not torch.equal(
        a.module.w_up, c.module.w_up
    )


def test_hf_block_through_registry_equals_ours() -> None:
    pytest.importorskip("transformers")
    ours = get_layer("qwen3-moe", tiny=True, batch=6, seed=3)
    theirs = get_layer("qwen3-moe", tiny=True, batch=6, seed=3, impl="hf_grouped_mm")
    assert type(theirs.module).__name__ == "Qwen3MoeSparseMoeBlock"
    with torch.no_grad():
        torch.testing.assert_close(
            ours.module(*ours.example_inputs),
            theirs.module(*theirs.example_inputs),
            atol=1e-5,
            rtol=0,
        )


def test_full_size_meta_layer_exports() -> None:
    """A full-size layer on meta captures with fake tensors (no weights allocated)."""
    spec = get_layer("qwen3-gqa", kv_lengths="b16/high")
    ep = torch.export.export(
        spec.module,
        spec.example_inputs,
        dynamic_shapes=spec.dynamic_shapes,
        strict=False,
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    hidden = out[0].meta["val"].shape
    assert hidden[1:] == (1, 2048) and isinstance(hidden[0], torch.SymInt)  # batch stays symbolic
    assert all(p.device.type == "meta" for p in spec.module.parameters())
