"""Small real layers for the frontend tests, built directly with transformers (offline) and
seeded: HF MoE blocks (Mixtral, Qwen3-MoE) in a chosen experts implementation, a user-written
loop MoE, and tensor-in/tensor-out decode steps around HF ``Qwen3Attention``/``LlamaAttention``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

# The layers here are tiny: intra-op threads only add synchronisation (on a loaded 2-core
# machine a 5x64 matmul then takes milliseconds instead of microseconds).
torch.set_num_threads(1)

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


@torch.no_grad()
def seed_all(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn from ``seed`` (standalone HF blocks leave experts uninitialised and
    the Qwen3 router at zeros)."""
    gen = torch.Generator().manual_seed(seed)
    for _, p in sorted(module.named_parameters()):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module


def hf_moe(family: str, experts_implementation: str, seed: int = 0) -> nn.Module:
    """A tiny Mixtral or Qwen3-MoE sparse block (8 experts, top-2, hidden 64, intermediate 32)."""
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            experts_implementation=experts_implementation,
        )
        block = MixtralSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=True,
            experts_implementation=experts_implementation,
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    return seed_all(block, seed).eval()


class LoopMoE(nn.Module):
    """A user-written MoE: router, softmax, top-k, renormalise, then a Python loop over the
    experts with ``torch.where`` and ``index_add_`` (input ``[tokens, hidden]``)."""

    def __init__(self, experts: int = 4, top_k: int = TOP_K, seed: int = 0) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(experts, INTER, HIDDEN))
        self.w_up = nn.Parameter(torch.empty(experts, INTER, HIDDEN))
        self.w_down = nn.Parameter(torch.empty(experts, HIDDEN, INTER))
        self.experts, self.top_k = experts, top_k
        seed_all(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            tok, slot = torch.where(idx == e)
            xs = x[tok]
            h = F.silu(F.linear(xs, self.w_gate[e])) * F.linear(xs, self.w_up[e])
            out.index_add_(0, tok, F.linear(h, self.w_down[e]) * w[tok, slot, None])
        return out


def attention_config(family: str, attn_implementation: str) -> transformers.PretrainedConfig:
    kw = {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "attn_implementation": attn_implementation,
    }
    return transformers.Qwen3Config(**kw) if family == "qwen3" else transformers.LlamaConfig(**kw)


class DecodeStep(nn.Module):
    """One decode step of an HF attention layer, tensors in and out:
    ``(x [B, 1, H], past_k [B, Hkv, P, D], past_v[, kv_lengths [B]]) -> (out, new_k, new_v)``.

    The HF layer's own projections, q/k norm (Qwen3), rotary module (positions ``P``, or
    ``kv_lengths`` for right-padded caches) and attention function (sdpa or eager); the cache
    update is ``cat([past, new], -2)`` (what ``DynamicCache.update`` does).  With
    ``kv_lengths`` key ``j`` is visible iff ``j < kv_lengths[b]`` or ``j == P``."""

    def __init__(self, family: str, attn_implementation: str, seed: int = 0) -> None:
        super().__init__()
        cfg = attention_config(family, attn_implementation)
        attn_cls, rope_cls = (
            (Qwen3Attention, Qwen3RotaryEmbedding)
            if family == "qwen3"
            else (LlamaAttention, LlamaRotaryEmbedding)
        )
        self.attn = seed_all(attn_cls(cfg, layer_idx=0), seed)
        self.rope = rope_cls(cfg)
        self.impl = attn_implementation

    def forward(
        self,
        x: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        kv_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.attn
        b, past = x.shape[0], past_k.shape[2]
        mask = None
        if kv_lengths is None:
            positions = torch.arange(past, past + 1).expand(b, 1)
        else:
            positions = kv_lengths[:, None]
            j = torch.arange(past + 1)
            mask = ((j[None, :] < kv_lengths[:, None]) | (j[None, :] == past))[:, None, None, :]
            if self.impl == "eager":
                mask = torch.where(mask, 0.0, torch.finfo(x.dtype).min)
        cos, sin = self.rope(x, positions)
        shape = (*x.shape[:-1], -1, a.head_dim)
        q, k = a.q_proj(x).view(shape), a.k_proj(x).view(shape)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(shape).transpose(1, 2)
        new_k, new_v = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
        fn = (
            eager_attention_forward
            if self.impl == "eager"
            else transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[self.impl]
        )
        o, _ = fn(a, q, new_k, new_v, mask, dropout=0.0, scaling=a.scaling)
        return a.o_proj(o.reshape(*x.shape[:-1], -1)), new_k, new_v


def decode_inputs(
    batch: int, past: int, seed: int, lengths: bool = False
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, HIDDEN, generator=gen)
    k = torch.randn(batch, KV_HEADS, past, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, past, HEAD_DIM, generator=gen)
    if not lengths:
        return x, k, v
    return x, k, v, torch.randint(0, past + 1, (batch,), generator=gen)
