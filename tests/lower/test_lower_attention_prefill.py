"""Causal and masked-free multi-token attention (``scaled_dot_product_attention`` with
``is_causal`` / without a mask, GQA) lowers to STeP and runs equal to PyTorch for several
prompt lengths from one lowering."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch2step.frontend import from_torch
from torch2step.lower import lower
from torch2step.step import metrics, run


class _Sdpa(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)


def _qkv(b: int, s: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 4, s, 8, generator=g),
        *(torch.randn(b, 2, s, 8, generator=g) for _ in "kv"),
    )


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_prefill_lowers(causal: bool) -> None:
    mod = _Sdpa(causal)
    lw = lower(from_torch(mod, _qkv(2, 6, 0)))
    m = metrics(lw.program)
    for b, s in ((3, 9), (1, 1), (2, 17)):
        xs = _qkv(b, s, b + s)
        tensors, env = lw.feed(xs)
        res = run(lw.program, tensors=tensors, env=env)
        (got,) = lw.outputs(res.tensors, xs)
        torch.testing.assert_close(got, mod(*xs), atol=1e-5, rtol=1e-5)
        assert m.evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
