"""Kernel execution of attention whose keys and values are computed in the step (a layer's
slice of a stacked cache, a scaled cache): ELK preloads an attention's KV cache from HBM ahead
of its turn, so such an attention runs as a vector operator after its producers, and says so."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torch2step


class _GQA(nn.Module):
    def __init__(self, d: int = 64, h: int = 4, kvh: int = 2, hd: int = 16) -> None:
        super().__init__()
        self.h, self.kvh, self.hd = h, kvh, hd
        self.q = nn.Linear(d, h * hd, bias=False)
        self.k = nn.Linear(d, kvh * hd, bias=False)
        self.v = nn.Linear(d, kvh * hd, bias=False)
        self.o = nn.Linear(h * hd, d, bias=False)

    def forward(self, x: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        keys, vals = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        rep = self.h // self.kvh
        kr, vr = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
        p = (q @ kr.transpose(-1, -2) / math.sqrt(self.hd)).softmax(-1)
        return self.o((p @ vr).transpose(1, 2).reshape(b, t, self.h * self.hd))


class _Stacked(nn.Module):
    """Layer ``i``'s attention over its slice of caches stacked over the layers."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.g, self.i = _GQA(), i

    def forward(self, x: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        return self.g(x, pk[self.i], pv[self.i])


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = _GQA()

    def forward(self, x: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        return self.g(x, pk * 0.5, pv * 2.0)


@pytest.mark.parametrize("case", ["stacked0", "stacked1", "scaled"])
def test_attention_over_computed_kv_equals_pytorch(case: str) -> None:
    torch.manual_seed(0)
    b, s = 4, 10
    x = torch.randn(b, 1, 64)
    if case == "scaled":
        m: nn.Module = _Scaled().eval()
        pk, pv = torch.randn(b, 2, s, 16), torch.randn(b, 2, s, 16)
    else:
        m = _Stacked(int(case[-1])).eval()
        pk, pv = torch.randn(2, b, 2, s, 16), torch.randn(2, b, 2, s, 16)
    dims = {"x": {}, "pk": {}, "pv": {}}
    prog = torch2step.compile(m, (x, pk, pv), chip="ipu-hbm", dynamic_shapes=dims)
    with torch.no_grad():
        want = m(x, pk, pv)
    assert torch.allclose(prog.run(x, pk, pv), want, atol=1e-5)
    assert any("computed in the step" in n for n in prog.graph.notes)
    assert all(o.kind != "attention" for o in prog.graph.ops)


def test_attention_over_a_cache_input_stays_an_elk_attention() -> None:
    torch.manual_seed(0)
    x, pk, pv = torch.randn(4, 1, 64), torch.randn(4, 2, 10, 16), torch.randn(4, 2, 10, 16)
    m = _GQA().eval()
    dims = {"x": {}, "pk": {}, "pv": {}}
    prog = torch2step.compile(m, (x, pk, pv), chip="ipu-hbm", dynamic_shapes=dims)
    with torch.no_grad():
        assert torch.allclose(prog.run(x, pk, pv), m(x, pk, pv), atol=1e-5)
    assert [o.kind for o in prog.graph.ops].count("attention") == 1
    assert not any("computed in the step" in n for n in prog.graph.notes)
