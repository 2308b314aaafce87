"""ONNX exports (dynamo, opset 20) of whole decoder layers and of a GQA decode step whose
rotary embedding is written out with ``rotate_half`` (slices, negation, a concatenation along
the last dimension, broadcast multiplies) import, evaluate and compile equal to onnxruntime
for several KV lengths from one import and one compile."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch2step  # noqa: E402
from models.decoder import decode_inputs, decoder_step, tiny_config  # noqa: E402
from torch2step.frontend.onnx_import import import_onnx  # noqa: E402
from torch2step.layers import Attention, Concat, Slice, evaluate  # noqa: E402

FAMILIES = [
    "llama",
    "qwen3_moe",
    pytest.param("qwen3", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("olmoe", marks=pytest.mark.slow),
]


def _export(module: nn.Module, args: tuple, dyn: tuple, path: str) -> str:
    torch.onnx.export(module, args, dynamo=True, opset_version=20, dynamic_shapes=dyn).save(path)
    return path


def _ort(path: str, args: tuple) -> list[torch.Tensor]:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    return [torch.from_numpy(np.asarray(o)) for o in sess.run(None, feeds)]


def _close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert tuple(g.shape) == tuple(w.shape)
        torch.testing.assert_close(g, w, atol=1e-4 * max(1.0, float(w.abs().max())), rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layer_onnx_equals_onnxruntime(family: str, tmp_path) -> None:
    cfg = tiny_config(family)
    step = decoder_step(cfg, device="cpu")
    length = torch.export.Dim("L", min=1, max=8192)
    path = _export(
        step, decode_inputs(cfg, 3, 9), ({}, {2: length}, {2: length}), str(tmp_path / "d.onnx")
    )
    graph = import_onnx(path)
    assert len(list(graph.ops(Attention))) == 1
    prog = None
    for past in (1, 17):
        args = decode_inputs(cfg, 3, past, seed=past)
        want = _ort(path, args)
        _close(evaluate(graph, *args), want)
        prog = prog or torch2step.compile(path, args)
        _close(prog.run(*args), want)
        with torch.no_grad():
            _close(want, step(*args))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RotateHalfStep(nn.Module):
    """A GQA decode step ``(x, cos, sin, past_k, past_v) -> (out, new_k, new_v)`` with RoPE
    written out: ``q * cos + rotate_half(q) * sin`` (cos / sin ``[B, 1, D]`` broadcast over
    heads)."""

    def __init__(self, hidden: int = 64, heads: int = 4, kv_heads: int = 2, dim: int = 16):
        super().__init__()
        torch.manual_seed(3)
        self.q = nn.Linear(hidden, heads * dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.o = nn.Linear(heads * dim, hidden, bias=False)
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim

    def forward(self, x, cos, sin, past_k, past_v):
        b = x.shape[0]
        q = self.q(x).view(b, 1, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, 1, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(x).view(b, 1, self.kv_heads, self.dim).transpose(1, 2)
        c, s = cos[:, None], sin[:, None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(b, 1, -1)), k, v


def _rot_inputs(past: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 100, (3, 1, 1), generator=g).float()
    freq = pos * 10000.0 ** (-torch.arange(8) / 8)
    ang = torch.cat([freq, freq], -1)
    kv = [torch.randn(3, 2, past, 16, generator=g) for _ in range(2)]
    return (torch.randn(3, 1, 64, generator=g), ang.cos(), ang.sin(), *kv)


def test_rotate_half_decode_step_compiles_equal_to_onnxruntime(tmp_path) -> None:
    module = RotateHalfStep().eval()
    length = torch.export.Dim("L", min=1, max=8192)
    dyn = ({}, {}, {}, {2: length}, {2: length})
    path = _export(module, _rot_inputs(9, 0), dyn, str(tmp_path / "rot.onnx"))
    graph = import_onnx(path)
    last = [n for n in graph.ops(Concat) if n.op.dim in (-1, 3)]
    assert len(last) == 2 and len(list(graph.ops(Slice))) == 4  # rotate_half kept general
    prog = None
    for past in (1, 17):
        args = _rot_inputs(past, past)
        want = _ort(path, args)
        _close(evaluate(graph, *args), want)
        prog = prog or torch2step.compile(path, args)
        _close(prog.run(*args), want)
