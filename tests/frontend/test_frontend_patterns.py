"""Each raising pattern on a small module of its own, plus the pattern language itself."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_blocks import HIDDEN, seed_all
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from torch2step.frontend import capture, from_torch
from torch2step.frontend.fx_pattern import Cap, P, match
from torch2step.frontend.fx_view import op_name
from torch2step.frontend.raise_rotary import rope_theta
from torch2step.layers import Attention, Linear, RMSNorm, Rotary, TopKRouting, evaluate


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _kinds(graph) -> list[str]:
    return [type(n.op).__name__ for n in graph.nodes]


# -- the pattern language -----------------------------------------------------------------------
class _Square(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 2.0 * (x * x), x * y


def test_pattern_language_commutes_and_binds_consistently() -> None:
    ep = capture(_Square(), (_x(3, 4), _x(3, 4, seed=1)))
    muls = [n for n in ep.graph.nodes if n.op == "call_function" and op_name(n) == "mul"]
    scaled, xx, xy = (
        next(n for n in muls if isinstance(n.args[1], float)),
        next(n for n in muls if n.args[0] is n.args[1]),
        next(n for n in muls if n.args[0] is not n.args[1] and not isinstance(n.args[1], float)),
    )
    square = P("mul", Cap("a"), Cap("a"))
    assert match(square, xx) == {"a": xx.args[0]}
    assert match(square, xy) is None  # the same name must bind the same node
    # the scalar sits second in the graph; the pattern names it first: add/mul commute
    caps = match(P("mul", 2.0, P("mul", Cap("a"), Cap("a"), name="sq")), scaled)
    assert caps == {"a": xx.args[0], "sq": xx}
    assert match(P("add", Cap("a"), Cap("b")), scaled) is None


# -- linear -------------------------------------------------------------------------------------
def test_linear_with_bias_keeps_leading_dims() -> None:
    lin = seed_all(nn.Linear(HIDDEN, 24), 0)
    graph = from_torch(lin, (_x(2, 5, HIDDEN),))
    assert _kinds(graph) == ["Linear"]
    (node,) = graph.ops(Linear)
    assert node.inputs == ("input", "weight", "bias")
    x = _x(3, 7, HIDDEN, seed=2)
    torch.testing.assert_close(evaluate(graph, x), lin(x).detach(), atol=1e-5, rtol=1e-5)


# -- rmsnorm ------------------------------------------------------------------------------------
def test_hf_rmsnorm() -> None:
    norm = seed_all(Qwen3RMSNorm(HIDDEN, eps=1e-5), 1)
    graph = from_torch(norm, (_x(4, HIDDEN),))
    assert [n.op for n in graph.nodes] == [RMSNorm(eps=1e-5)]
    x = _x(9, HIDDEN, seed=3)
    torch.testing.assert_close(evaluate(graph, x), norm(x).detach(), atol=1e-5, rtol=1e-5)


# -- top-k routing ------------------------------------------------------------------------------
class _Router(nn.Module):
    def __init__(self, softmax_first: bool, normalize: bool) -> None:
        super().__init__()
        self.gate = seed_all(nn.Linear(HIDDEN, 6, bias=False), 2)
        self.softmax_first, self.normalize = softmax_first, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        if self.softmax_first:
            w, e = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), 3, dim=-1)
        else:
            top, e = torch.topk(logits, 3, dim=-1)
            w = F.softmax(top, dim=-1)
        if self.normalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, e


@pytest.mark.parametrize("softmax_first,normalize", [(True, False), (False, False), (True, True)])
def test_topk_routing(softmax_first: bool, normalize: bool) -> None:
    router = _Router(softmax_first, normalize)
    graph = from_torch(router, (_x(7, HIDDEN),))
    assert _kinds(graph) == ["Linear", "TopKRouting"]
    (node,) = graph.ops(TopKRouting)
    assert node.op == TopKRouting(3, softmax_first, normalize)
    x = _x(5, HIDDEN, seed=4)
    (w, e), (rw, re) = evaluate(graph, x), router(x)
    assert torch.equal(e, re)
    torch.testing.assert_close(w, rw.detach(), atol=1e-6, rtol=1e-5)


# -- rotary -------------------------------------------------------------------------------------
class _Rope(nn.Module):
    """HF rotate-half RoPE on q [B, H, S, D] at integer positions [B, S]."""

    def __init__(self, theta: float, llama3_scaling: bool = False) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
        if llama3_scaling:
            inv = torch.where(torch.arange(8) > 3, inv / 8.0, inv)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        out, _ = apply_rotary_pos_emb(q, q, emb.cos(), emb.sin())
        return out


def test_rotary_fits_theta() -> None:
    rope = _Rope(500000.0)
    q, pos = _x(2, 4, 3, 16), torch.tensor([[5, 6, 7], [0, 1, 2]])
    graph = from_torch(rope, (q, pos))
    assert [n.op for n in graph.ops(Rotary)] == [Rotary(theta=500000.0, rotary_dim=16)]
    q2, pos2 = _x(3, 4, 5, 16, seed=1), torch.randint(0, 4000, (3, 5))
    torch.testing.assert_close(evaluate(graph, q2, pos2), rope(q2, pos2), atol=1e-4, rtol=1e-4)


def test_scaled_rope_raises_with_its_own_table() -> None:
    # Llama 3.1's "llama3" scaling: not theta ** (-2i / d), so the Rotary carries the table
    q, pos = _x(2, 4, 3, 16), torch.tensor([[5, 6, 7], [0, 1, 2]])
    rope = _Rope(10000.0, llama3_scaling=True)
    graph = from_torch(rope, (q, pos))
    (rot,) = [n.op for n in graph.nodes if isinstance(n.op, Rotary)]
    assert len(rot.inv_freq) == 8
    torch.testing.assert_close(evaluate(graph, q, pos), rope(q, pos), atol=1e-4, rtol=1e-4)


def test_rope_theta_rejects_other_tables() -> None:
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert rope_theta(inv, 16) == 10000.0
    assert rope_theta(inv.flip(0), 16) is None
    assert rope_theta(inv[:4], 16) is None


# -- attention masks ----------------------------------------------------------------------------
class _Prefill(nn.Module):
    """Self-attention over S tokens with a causal mask: sdpa(is_causal) or an explicit
    lower-triangular bool mask built from the sequence length."""

    def __init__(self, explicit: bool) -> None:
        super().__init__()
        self.explicit = explicit

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.explicit:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("explicit", [False, True])
def test_causal_prefill(explicit: bool) -> None:
    mod = _Prefill(explicit)
    q, kv = _x(2, 4, 6, 8), _x(2, 2, 6, 8, seed=1)
    graph = from_torch(mod, (q, kv, kv))
    (node,) = graph.ops(Attention)
    assert node.op == Attention(4, 2, 1.0 / math.sqrt(8), causal=True)
    q2, k2, v2 = _x(3, 4, 9, 8, seed=2), _x(3, 2, 9, 8, seed=3), _x(3, 2, 9, 8, seed=4)
    torch.testing.assert_close(evaluate(graph, q2, k2, v2), mod(q2, k2, v2), atol=1e-5, rtol=1e-5)
