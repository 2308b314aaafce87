"""LayerNorm over the last dim (``nn.LayerNorm`` with or without gain and bias, ``F.layer_norm``)
raises to the layer op ``LayerNorm`` and runs equal to PyTorch on the STeP SDA and kernel by
kernel: a plain module and the decoder layers of HF GPT-NeoX, Phi and Starcoder2 (all were
refused: "native_layer_norm: no rule for this op").  A LayerNorm over more than the last dim is
refused naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from equal_checks import compiled_equal
from torch import nn
from torch_blocks import HIDDEN, seed_all
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer, GPTNeoXRotaryEmbedding
from transformers.models.phi.modeling_phi import PhiDecoderLayer, PhiRotaryEmbedding
from transformers.models.starcoder2.modeling_starcoder2 import (
    Starcoder2DecoderLayer,
    Starcoder2RotaryEmbedding,
)

import torch2step
from torch2step.errors import UnsupportedOperatorError
from torch2step.layers import LayerNorm
from torch2step.step.functions import fn

CHIPS = ["step-sda", "ipu-hbm"]

#: (weight, bias) of each form, and the nn.LayerNorm arguments giving it (None: F.layer_norm
#: with a bias and no gain, which no nn.LayerNorm has)
FORMS = {
    "affine": ((True, True), {}),
    "no_affine": ((False, False), {"elementwise_affine": False}),
    "no_bias": ((True, False), {"bias": False}),
    "bias_only": ((False, True), None),
}


class _NormMLP(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        kwargs = FORMS[form][1]
        plain = {"elementwise_affine": False}
        self.norm = nn.LayerNorm(HIDDEN, eps=1e-6, **(plain if kwargs is None else kwargs))
        self.shift = nn.Parameter(torch.zeros(HIDDEN)) if kwargs is None else None
        self.a = nn.Linear(HIDDEN, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift is not None:
            x = F.layer_norm(x, (HIDDEN,), None, self.shift, 1e-6)
        else:
            x = self.norm(x)
        return self.a(x)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("chip", CHIPS)
def test_a_layer_norm_runs_equal_to_pytorch(form: str, chip: str) -> None:
    torch.manual_seed(0)
    m = seed_all(_NormMLP(form), 1).eval()
    x = torch.randn(2, 3, HIDDEN) * 3 + 1  # off-centre rows: the mean matters
    prog = compiled_equal(m, (x,), chip)
    (op,) = [n.op for n in prog.layer.nodes if isinstance(n.op, LayerNorm)]
    assert (op.weight, op.bias) == FORMS[form][0]
    assert op.eps == pytest.approx(1e-6)
    report = prog.report(x)
    assert (report.latency_cycles if chip == "step-sda" else report.cycles) > 0


def test_layer_norm_flops_count_mean_and_variance() -> None:
    """Per element: the mean's sum, centring, square, the variance's sum, scaling by 1/sigma
    (5), then one each for the gain and the bias (RMSNorm, with no mean, counts 4)."""
    from torch2step.step.types import TileType

    tile = TileType((4, 64), "fp32")
    arity = {"layernorm": 1, "layernorm_w": 2, "layernorm_b": 2, "layernorm_wb": 3}
    count = {}
    for name, k in arity.items():
        f = fn(name, eps=1e-5)
        count[name] = int(f.spec.flops_of(f, (tile,) * k))
    assert count == {"layernorm": 5 * 256, "layernorm_w": 6 * 256, "layernorm_b": 6 * 256,
                     "layernorm_wb": 7 * 256}  # fmt: skip


def _rope_layer(layer_cls: type, rope_cls: type, cfg: transformers.PretrainedConfig) -> nn.Module:
    class _Layer(nn.Module):
        """An HF decoder layer over a prompt (causal attention, positions ``0..S-1``)."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = seed_all(layer_cls(cfg, layer_idx=0), 3)
            self.rope = rope_cls(cfg)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
            out = self.layer(x, position_embeddings=self.rope(x, pos), position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    return _Layer().eval()


def _decoder(name: str) -> nn.Module:
    common = dict(hidden_size=HIDDEN, intermediate_size=32, num_attention_heads=4)
    common.update(num_hidden_layers=1, attn_implementation="sdpa")
    if name == "gpt_neox":  # parallel attention and MLP, partial rotary
        cfg = transformers.GPTNeoXConfig(rotary_pct=0.5, **common)
        return _rope_layer(GPTNeoXLayer, GPTNeoXRotaryEmbedding, cfg)
    if name == "phi":  # one LayerNorm feeding attention and MLP in parallel
        cfg = transformers.PhiConfig(num_key_value_heads=4, partial_rotary_factor=0.5, **common)
        return _rope_layer(PhiDecoderLayer, PhiRotaryEmbedding, cfg)
    cfg = transformers.Starcoder2Config(num_key_value_heads=2, **common)
    return _rope_layer(Starcoder2DecoderLayer, Starcoder2RotaryEmbedding, cfg)


@pytest.mark.parametrize("name", ["gpt_neox", "phi", "starcoder2"])
@pytest.mark.parametrize("chip", CHIPS)
def test_a_layer_norm_decoder_layer_runs_equal_to_pytorch(name: str, chip: str) -> None:
    torch.manual_seed(2)
    prog = compiled_equal(_decoder(name), (torch.randn(2, 5, HIDDEN),), chip)
    norms = [n.op for n in prog.layer.nodes if isinstance(n.op, LayerNorm)]
    assert len(norms) == (1 if name == "phi" else 2)
    assert all(op.weight and op.bias for op in norms)


class _TwoDimNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((3, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def test_a_layer_norm_over_more_than_the_last_dim_is_refused_naming_it() -> None:
    with pytest.raises(UnsupportedOperatorError) as err:
        torch2step.compile(_TwoDimNorm().eval(), (torch.randn(2, 3, HIDDEN),), chip="step-sda")
    msg = str(err.value)
    assert "native_layer_norm" in msg
    assert "last 2 dims" in msg and "only over the last dimension" in msg


@pytest.mark.parametrize("family", ["starcoder2", "phi"])
def test_a_layer_norm_decode_step_runs_kernel_by_kernel(family: str) -> None:
    """The registered Starcoder2 / Phi decode steps (KV cache in and out) equal PyTorch on the
    kernel-by-kernel chip (tests/models runs them on the STeP SDA)."""
    from models.decoder import decode_inputs, decoder_step, tiny_config

    cfg = tiny_config(family)
    step, args = decoder_step(cfg, device="cpu", seed=1), decode_inputs(cfg, 3, 9)
    prog = torch2step.compile(step, args, chip="ipu-hbm")
    with torch.no_grad():
        want = step(*args)
    for got, w in zip(prog.run(*args), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


def test_a_two_layer_phi_causal_lm_decode_step() -> None:
    """A 2-layer ``PhiForCausalLM`` decode step: its final norm is a LayerNorm named
    ``final_layernorm`` (3 LayerNorms: one per layer, the final one)."""
    from models.decoder import model_dynamic_shapes, model_inputs, model_step, tiny_config

    cfg = tiny_config("phi", num_hidden_layers=2)
    step = model_step(cfg, device="cpu", seed=5)
    prog = torch2step.compile(
        step, model_inputs(cfg, 3, 5), chip="step-sda", dynamic_shapes=model_dynamic_shapes()
    )
    assert len(list(prog.layer.ops(LayerNorm))) == 3
    for b, p in ((2, 9), (4, 1)):
        ins = model_inputs(cfg, b, p, seed=b)
        with torch.no_grad():
            want = step(*ins)
        for got, w in zip(prog.run(*ins), want):
            torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)


_CONFIGS = {
    "starcoder2": {
        "model_type": "starcoder2", "hidden_size": 256, "intermediate_size": 1024,
        "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "vocab_size": 64, "use_bias": True, "norm_epsilon": 1e-5,
    },
    "phi": {
        "model_type": "phi", "hidden_size": 256, "intermediate_size": 1024,
        "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4,
        "vocab_size": 64, "partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", list(_CONFIGS))
@pytest.mark.parametrize("chip", CHIPS)
def test_a_layer_norm_config_compiles_and_reports_without_weights(family: str, chip: str) -> None:
    prog = torch2step.compile_config(_CONFIGS[family], batch=4, past=16, chip=chip)
    norms = [n.op for n in prog.layer.nodes if isinstance(n.op, LayerNorm)]
    assert len(norms) == (1 if family == "phi" else 2)
    assert all(op.weight and op.bias for op in norms)
    report = prog.report()
    assert (report.latency_cycles if chip == "step-sda" else report.cycles) > 0
