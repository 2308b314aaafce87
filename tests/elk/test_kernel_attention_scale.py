"""A decode attention whose scale is not 1/sqrt(d) (Gemma 2's query_pre_attn_scalar, Granite's
attention_multiplier) runs kernel by kernel as a vector operator over the concatenated cache;
the cache append is then made as a tensor it reads (``run`` failed: "missing inputs for
tensors the programs read: ['concat', ...]").  The default scale stays an ELK attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2step


class _Decode(nn.Module):
    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q, kc, vc, kn, vn):  # noqa: ANN001, ANN201
        k = torch.cat([kc, kn], dim=2)
        v = torch.cat([vc, vn], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return o, k, v


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default", "other"])
def test_decode_attention_of_any_scale_runs_kernel_by_kernel(scale: float | None) -> None:
    torch.manual_seed(0)
    b, h, d, past = 2, 4, 16, 8
    ins = (
        torch.randn(b, h, 1, d),
        torch.randn(b, h, past, d),
        torch.randn(b, h, past, d),
        torch.randn(b, h, 1, d),
        torch.randn(b, h, 1, d),
    )
    m = _Decode(scale)
    prog = torch2step.compile(m, ins, chip="ipu-hbm")
    kinds = {o.name: o.kind for o in prog.schedule.ops}
    assert ("attention" in kinds.values()) == (scale is None or math.isclose(scale, d**-0.5))
    for got, want in zip(prog.run(*ins), m(*ins)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
