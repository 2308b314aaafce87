"""The tanh-approximate GELU (``F.gelu(x, approximate="tanh")``, HF ``gelu_pytorch_tanh`` and
``gelu_new``) raises to the elementwise ``gelu_tanh`` (or a ``MoEExperts`` with that
activation), and runs equal to PyTorch on the STeP SDA and kernel by kernel: a plain MLP, HF
``GemmaMLP``, a whole Gemma decoder layer and Mixtral sparse blocks with such experts (all were
refused: "tanh-approximate gelu", the MoE's error blaming an ``expand``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from equal_checks import compiled_equal
from torch import nn
from torch_blocks import HIDDEN, seed_all
from transformers.models.gemma.modeling_gemma import (
    GemmaDecoderLayer,
    GemmaMLP,
    GemmaRotaryEmbedding,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import torch2step
from torch2step.errors import UnsupportedOperatorError
from torch2step.layers import Elementwise, MoEExperts

CHIPS = ["step-sda", "ipu-hbm"]


class _TanhMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, 128, bias=False)
        self.b = nn.Linear(128, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x), approximate="tanh"))


def _gemma_config() -> transformers.GemmaConfig:
    return transformers.GemmaConfig(
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=1,
        attn_implementation="sdpa",
    )


class _GemmaLayer(nn.Module):
    """A Gemma decoder layer over a prompt (causal attention, positions ``0..S-1``)."""

    def __init__(self) -> None:
        super().__init__()
        cfg = _gemma_config()
        self.layer = seed_all(GemmaDecoderLayer(cfg, layer_idx=0), 3)
        self.rope = GemmaRotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return self.layer(x, position_embeddings=self.rope(x, pos))


def _mixtral(hidden_act: str, seed: int = 0) -> nn.Module:
    cfg = transformers.MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        hidden_act=hidden_act,
        experts_implementation="batched_mm",
    )
    return seed_all(MixtralSparseMoeBlock(cfg), seed).eval()


@pytest.mark.parametrize("chip", CHIPS)
def test_a_tanh_gelu_mlp_runs_equal_to_pytorch(chip: str) -> None:
    torch.manual_seed(0)
    prog = compiled_equal(seed_all(_TanhMLP(), 0).eval(), (torch.randn(8, HIDDEN),), chip)
    fns = [n.op.fn for n in prog.layer.nodes if isinstance(n.op, Elementwise)]
    assert fns == ["gelu_tanh"]
    report = prog.report(torch.randn(8, HIDDEN))
    assert (report.latency_cycles if chip == "step-sda" else report.cycles) > 0


@pytest.mark.parametrize("chip", CHIPS)
def test_gemma_mlp_runs_equal_to_pytorch(chip: str) -> None:
    torch.manual_seed(1)
    m = seed_all(GemmaMLP(_gemma_config()), 2).eval()
    compiled_equal(m, (torch.randn(2, 3, HIDDEN),), chip)


@pytest.mark.parametrize("chip", CHIPS)
def test_a_gemma_decoder_layer_runs_equal_to_pytorch(chip: str) -> None:
    torch.manual_seed(2)
    compiled_equal(_GemmaLayer().eval(), (torch.randn(2, 5, HIDDEN),), chip)


@pytest.mark.parametrize("hidden_act", ["gelu_pytorch_tanh", "gelu_new"])
@pytest.mark.parametrize("chip", CHIPS)
def test_mixtral_with_tanh_gelu_experts_runs_equal_to_pytorch(hidden_act: str, chip: str) -> None:
    """``gelu_pytorch_tanh`` is the named op; ``gelu_new`` writes the formula out
    (``0.5 x (1 + tanh(...))``), recognised by what it computes."""
    torch.manual_seed(3)
    prog = compiled_equal(_mixtral(hidden_act), (torch.randn(1, 5, HIDDEN),), chip)
    (moe,) = [n.op for n in prog.layer.nodes if isinstance(n.op, MoEExperts)]
    assert moe.activation == "gelu_tanh" and moe.gated


def test_an_unknown_expert_activation_is_named_with_what_it_computes() -> None:
    """``quick_gelu`` (``x * sigmoid(1.702 x)``) is none of the experts' activations: the
    error names the expert forms and the operators the routed region computes."""
    with pytest.raises(UnsupportedOperatorError) as err:
        torch2step.compile(_mixtral("quick_gelu"), (torch.randn(1, 5, HIDDEN),), chip="step-sda")
    msg = str(err.value)
    assert "gelu (exact or tanh-approximate)" in msg
    assert "it computes" in msg and "sigmoid" in msg
