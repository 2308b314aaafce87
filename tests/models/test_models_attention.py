"""GQADecode: equals HF Qwen3/Llama attention for a decode step; kv_lengths semantics."""

from __future__ import annotations

import os

import pytest
import torch

from models import (
    ATTN_IMPLS,
    LLAMA3_8B_ATTENTION,
    QWEN3_30B_A3B_ATTENTION,
    GQADecode,
    kv_length_mask,
)
from models.attention import rope_cos_sin, rope_inv_freq

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hf = pytest.importorskip("models.hf", exc_type=ImportError)
pytest.importorskip("transformers")

TINY = {"qwen3": QWEN3_30B_A3B_ATTENTION.tiny(), "llama": LLAMA3_8B_ATTENTION.tiny()}


def _inputs(cfg, batch: int, past: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    kv = (batch, cfg.num_kv_heads, past, cfg.head_dim)
    return (
        torch.randn(batch, 1, cfg.hidden_size, generator=g),
        torch.randn(*kv, generator=g),
        torch.randn(*kv, generator=g),
    )


@pytest.mark.parametrize("variant", sorted(TINY))
@pytest.mark.parametrize("attn", ATTN_IMPLS)
@pytest.mark.parametrize("past", [1, 17, 300])
@pytest.mark.parametrize("ragged", [False, True])
def test_equals_hf_attention(variant: str, attn: str, past: int, ragged: bool) -> None:
    cfg = TINY[variant]
    ours = GQADecode(cfg, attn=attn, seed=4)
    ref = hf.build_hf_attention(cfg, attn_implementation=attn, seed=4)
    assert type(ref).__name__ == ("Qwen3Attention" if variant == "qwen3" else "LlamaAttention")
    x, pk, pv = _inputs(cfg, 3, past, seed=past)
    lens = torch.tensor([0, past // 2, past]) if ragged else None
    with torch.no_grad():
        got = ours(x, pk, pv, lens)
    expected = hf.hf_decode_step(ref, x, pk, pv, lens)
    for name, a, b in zip(("out", "new_k", "new_v"), got, expected):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_equals_qwen3_moe_attention_class() -> None:
    """Qwen3-30B-A3B's own attention class (Qwen3MoeAttention) computes the same."""
    cfg = TINY["qwen3"]
    ref = hf.build_hf_attention(
        cfg, attn_implementation="eager", seed=2, module_class="Qwen3MoeAttention"
    )
    x, pk, pv = _inputs(cfg, 2, 9)
    with torch.no_grad():
        got = GQADecode(cfg, attn="sdpa", seed=2)(x, pk, pv)
    torch.testing.assert_close(got[0], hf.hf_decode_step(ref, x, pk, pv)[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="does not fit"):
        hf.build_hf_attention(cfg, module_class="LlamaAttention")


def test_hf_attention_returns_output_and_weights() -> None:
    """HF attention returns (attn_output, attn_weights); weights are None for sdpa."""
    cfg = TINY["llama"]
    x, pk, pv = _inputs(cfg, 1, 4)
    cos, sin = rope_cos_sin(
        torch.tensor([[0]]), rope_inv_freq(cfg.head_dim, cfg.rope_theta), x.dtype
    )
    for attn, weights_shape in (("sdpa", None), ("eager", (1, cfg.num_heads, 1, 1))):
        layer = hf.build_hf_attention(cfg, attn_implementation=attn)
        with torch.no_grad():
            out, weights = layer(x, position_embeddings=(cos, sin), attention_mask=None)
        assert out.shape == x.shape
        assert (weights is None) if weights_shape is None else weights.shape == weights_shape


@pytest.mark.parametrize("attn", ATTN_IMPLS)
def test_kv_lengths_equal_truncated_caches(attn: str) -> None:
    """Request b with length L sees exactly past[b, :, :L] plus the new token at position L."""
    cfg = TINY["qwen3"]
    layer = GQADecode(cfg, attn=attn, seed=1)
    past = 12
    x, pk, pv = _inputs(cfg, 4, past, seed=3)
    lens = torch.tensor([5, 0, 12, 1])
    with torch.no_grad():
        out, new_k, new_v = layer(x, pk, pv, lens)
        for b, length in enumerate(lens.tolist()):
            sl = slice(b, b + 1)
            solo, solo_k, _ = layer(x[sl], pk[sl, :, :length], pv[sl, :, :length])
            torch.testing.assert_close(out[sl], solo, atol=1e-5, rtol=0)
            torch.testing.assert_close(new_k[sl, :, past], solo_k[:, :, length], atol=1e-6, rtol=0)
        # Padding rows (L_b .. P-1) do not matter.
        pk2, pv2 = pk.clone(), pv.clone()
        for b, length in enumerate(lens.tolist()):
            pk2[b, :, length:] = 1e3
            pv2[b, :, length:] = -1e3
        torch.testing.assert_close(layer(x, pk2, pv2, lens)[0], out, atol=1e-5, rtol=0)
    assert torch.equal(new_k[:, :, :past], pk) and torch.equal(new_v[:, :, :past], pv)


def test_full_kv_lengths_equal_no_mask() -> None:
    cfg = TINY["llama"]
    layer = GQADecode(cfg, attn="eager", seed=0)
    x, pk, pv = _inputs(cfg, 3, 7)
    with torch.no_grad():
        masked = layer(x, pk, pv, torch.full((3,), 7))
        plain = layer(x, pk, pv)
    for a, b in zip(masked, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_length_zero_is_closed_form() -> None:
    """L = 0: RoPE position 0 is the identity and the softmax has one key, so
    new_k[P] = k_norm(k_proj(x)) and out = o_proj(v of each query head's KV head)."""
    cfg = TINY["qwen3"]
    layer = GQADecode(cfg, attn="sdpa", seed=6)
    x, pk, pv = _inputs(cfg, 1, 5)
    with torch.no_grad():
        out, new_k, new_v = layer(x, pk, pv, torch.tensor([0]))
        k = layer.k_norm(layer.k_proj(x).view(1, 1, cfg.num_kv_heads, cfg.head_dim)).transpose(1, 2)
        v = layer.v_proj(x).view(1, cfg.num_kv_heads, cfg.head_dim)
        expected = layer.o_proj(v.repeat_interleave(cfg.num_groups, dim=1).reshape(1, 1, -1))
    torch.testing.assert_close(new_k[:, :, 5:], k, atol=1e-6, rtol=0)
    torch.testing.assert_close(new_v[0, :, 5], v[0], atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_kv_length_mask_values() -> None:
    mask = kv_length_mask(torch.tensor([0, 2, 3]), 3)
    assert mask.shape == (3, 1, 1, 4)
    assert mask[:, 0, 0].tolist() == [
        [False, False, False, True],
        [True, True, False, True],
        [True, True, True, True],
    ]


def test_rope_frequencies_closed_form() -> None:
    inv = rope_inv_freq(4, 10000.0)
    torch.testing.assert_close(inv, torch.tensor([1.0, 0.01]))
    cos, sin = rope_cos_sin(torch.tensor([[2]]), inv, torch.float32)
    torch.testing.assert_close(cos[0, 0], torch.cos(torch.tensor([2.0, 0.02, 2.0, 0.02])))
    torch.testing.assert_close(sin[0, 0], torch.sin(torch.tensor([2.0, 0.02, 2.0, 0.02])))


def test_seeded_weights_and_variants() -> None:
    q, ll = TINY["qwen3"], TINY["llama"]
    a, b = GQADecode(q, seed=3), GQADecode(q, attn="eager", seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert {n for n, _ in a.named_parameters()} == {
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
        "q_norm.weight",
        "k_norm.weight",
    }
    assert not torch.equal(a.q_norm.weight, a.k_norm.weight)
    assert GQADecode(ll).q_norm is None
    assert not torch.equal(GQADecode(q, seed=4).q_proj.weight, a.q_proj.weight)


def test_shape_errors_name_the_expected_shape() -> None:
    cfg = TINY["llama"]
    layer = GQADecode(cfg)
    x, pk, pv = _inputs(cfg, 2, 3)
    with pytest.raises(ValueError, match=r"\(batch, 1, 64\)"):
        layer(torch.randn(2, 2, 64), pk, pv)
    with pytest.raises(ValueError, match=r"\(batch, 2, past_len, 16\)"):
        layer(x, pk.transpose(1, 2), pv)
    with pytest.raises(ValueError, match="sdpa, eager"):
        GQADecode(cfg, attn="flash")  # type: ignore[arg-type]


@pytest.mark.parametrize("attn", ATTN_IMPLS)
def test_exports_with_dynamic_batch_and_past(attn: str) -> None:
    cfg = TINY["qwen3"]
    layer = GQADecode(cfg, attn=attn, seed=0)
    x, pk, pv = _inputs(cfg, 4, 20)
    batch, past = torch.export.Dim("batch", min=1), torch.export.Dim("past", min=1)
    ep = torch.export.export(
        layer,
        (x, pk, pv, torch.tensor([3, 0, 20, 7])),
        dynamic_shapes={
            "x": {0: batch},
            "past_k": {0: batch, 2: past},
            "past_v": {0: batch, 2: past},
            "kv_lengths": {0: batch},
        },
        strict=False,
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    x2, pk2, pv2 = _inputs(cfg, 3, 41, seed=9)
    lens = torch.tensor([41, 2, 17])
    with torch.no_grad():
        for a, b in zip(ep.module()(x2, pk2, pv2, lens), layer(x2, pk2, pv2, lens)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
