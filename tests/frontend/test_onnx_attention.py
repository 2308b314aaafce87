"""ONNX import of a GQA decode step (8 query heads, 2 KV heads, head_dim 16) around HF
``Qwen3Attention`` / ``LlamaAttention``, written tensor-in/tensor-out ``(x, past_k, past_v) ->
(out, new_k, new_v)`` and exported by the dynamo exporter with a dynamic KV length: at opset 20
(eager attention and the sdpa decomposition: MatMul/Softmax with repeat_kv) and at opset 23
(``Attention`` and ``RotaryEmbedding`` ops), and with a KV-length mask."""

from __future__ import annotations

import os

import pytest
import sympy
import torch
from torch import nn

pytest.importorskip("onnxscript")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from models.hf import cache_keyword  # noqa: E402
from torch2step.frontend.onnx_import import import_onnx  # noqa: E402
from torch2step.layers import (  # noqa: E402
    Arange,
    Attention,
    Concat,
    Linear,
    Permute,
    Reshape,
    RMSNorm,
    Rotary,
    evaluate,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BATCH = 64, 8, 2, 16, 3


class _TensorCache:
    """What HF attention calls on ``past_key_values``: ``update`` concatenates past and new."""

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.past_k, self.past_v = past_k, past_v

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, cache_kwargs=None, **kw):
        self.k = torch.cat([self.past_k, k], dim=-2)
        self.v = torch.cat([self.past_v, v], dim=-2)
        return self.k, self.v


class DecodeStep(nn.Module):
    """One decode step; with ``masked``, request b's cache holds ``kv_lengths[b]`` valid rows (the
    rest is padding), its new token has position ``kv_lengths[b]`` and sees those rows and itself."""

    def __init__(self, family: str, impl: str, masked: bool) -> None:
        super().__init__()
        mod = modeling_qwen3 if family == "qwen3" else modeling_llama
        cfg_cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
        cfg = cfg_cls(
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            num_hidden_layers=1,
            attn_implementation=impl,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        prefix = "Qwen3" if family == "qwen3" else "Llama"
        self.attn = getattr(mod, f"{prefix}Attention")(cfg, layer_idx=0)
        self.rotary = getattr(mod, f"{prefix}RotaryEmbedding")(cfg)
        self.masked = masked
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        self.eval()

    def forward(self, x, past_k, past_v, kv_lengths=None):
        past = past_k.shape[2]
        mask = None
        if self.masked:
            pos = kv_lengths[:, None]
            j = torch.arange(past + 1)
            visible = (j[None, :] < kv_lengths[:, None]) | (j[None, :] == past)
            mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]
        else:
            pos = (torch.arange(x.shape[1]) + past)[None, :].expand(x.shape[0], -1)
        cos, sin = self.rotary(x, pos)
        cache = _TensorCache(past_k, past_v)
        out, _ = self.attn(x, (cos, sin), mask, **{cache_keyword(self.attn): cache})
        return out, cache.k, cache.v


CASES = {
    "qwen3-sdpa-opset20": ("qwen3", "sdpa", 20, False),
    "llama-eager-opset20": ("llama", "eager", 20, False),
    "qwen3-sdpa-opset23": ("qwen3", "sdpa", 23, False),
    "llama-sdpa-opset23": ("llama", "sdpa", 23, False),
    "qwen3-eager-opset20-kvlengths": ("qwen3", "eager", 20, True),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, str]]:
    out = {}
    for case, (family, impl, opset, masked) in CASES.items():
        module = DecodeStep(family, impl, masked)
        past = torch.randn(BATCH, KV_HEADS, 9, HEAD_DIM)
        args = (torch.randn(BATCH, 1, HIDDEN), past, past.clone())
        length = torch.export.Dim("L", min=1, max=8192)
        dyn: tuple = ({}, {2: length}, {2: length})
        if masked:
            args = (*args, torch.tensor([3, 9, 0]))
            dyn = (*dyn, {})
        path = str(tmp_path_factory.mktemp("attn") / f"{case}.onnx")
        torch.onnx.export(module, args, dynamo=True, opset_version=opset, dynamic_shapes=dyn).save(
            path
        )
        out[case] = (module, path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_decode_step_matches_pytorch_for_kv_lengths_1_17_300(case: str, exported: dict) -> None:
    module, path = exported[case]
    graph = import_onnx(path)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, 1, HIDDEN, generator=gen)
    for past in (1, 17, 300):
        args = [x, torch.randn(BATCH, KV_HEADS, past, HEAD_DIM, generator=gen)]
        args.append(torch.randn(BATCH, KV_HEADS, past, HEAD_DIM, generator=gen))
        if module.masked:
            args.append(torch.randint(0, past + 1, (BATCH,), generator=gen))
        with torch.no_grad():
            want = module(*args)
        got = evaluate(graph, *args)
        assert len(got) == 3
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_step_raises_to_gqa_attention_rotary_and_norms(case: str, exported: dict) -> None:
    family, _, _, masked = CASES[case]
    _, path = exported[case]
    graph = import_onnx(path)
    (attn,) = list(graph.ops(Attention))
    assert attn.op == Attention(num_q_heads=HEADS, num_kv_heads=KV_HEADS, scale=HEAD_DIM**-0.5)
    rotaries = [n.op for n in graph.ops(Rotary)]
    assert rotaries == [Rotary(theta=10000.0, rotary_dim=HEAD_DIM)] * 2
    assert len(list(graph.ops(RMSNorm))) == (2 if family == "qwen3" else 0)
    assert len(list(graph.ops(Linear))) == 4
    allowed = {Linear, Reshape, Permute, RMSNorm, Rotary, Concat, Attention, Arange}
    assert {type(n.op) for n in graph.nodes} <= allowed
    (length,) = graph.dims
    assert str(length) == "L" and graph.dims[length] == ("past_k", 2)
    _, new_k, new_v = graph.outputs
    assert graph.inputs[:3] == ["x", "past_k", "past_v"]
    assert graph.types[new_k].shape == (BATCH, KV_HEADS, length + 1, HEAD_DIM)
    # attention reads the concatenated caches themselves: no repeated copies of KV heads
    assert attn.inputs[1:3] == (new_k, new_v)
    if masked:
        assert attn.inputs[3] == "kv_lengths"
        assert not list(graph.ops(Arange))
    else:
        (arange,) = [n.op for n in graph.ops(Arange)]
        assert (arange.start, arange.end) == (length, length + 1)
        assert isinstance(arange.start, sympy.Symbol)


@pytest.mark.parametrize("case", ["qwen3-sdpa-opset20", "llama-sdpa-opset23"])
def test_compiled_onnx_decode_step_serves_every_kv_length(case: str, exported: dict) -> None:
    """One ``compile(path)`` for KV lengths 1, 17 and 300: equal outputs, growing latency."""
    import torch2step

    module, path = exported[case]
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(BATCH, 1, HIDDEN, generator=gen)
    prog = None
    latencies = []
    for past in (1, 17, 300):
        kv = [torch.randn(BATCH, KV_HEADS, past, HEAD_DIM, generator=gen) for _ in range(2)]
        args = (x, *kv)
        prog = prog or torch2step.compile(path, args)
        with torch.no_grad():
            want = module(*args)
        for g, w in zip(prog.run(*args), want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
        latencies.append(prog.report(*args).latency_cycles)
    assert latencies == sorted(latencies) and latencies[0] < latencies[-1]
