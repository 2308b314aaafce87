"""Kernel-by-kernel execution of MoE experts computes the experts' own activation (GeGLU and
ReGLU as well as SwiGLU: it always applied SiLU), runs a bf16 layer (its values converted for
numpy), and refuses experts it does not lower (plain two-matrix MLPs, biased projections) with
the lowering's error naming the node and the user's line, not a ValueError."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2step
from torch2step.errors import LoweringError


class _LoopMoE(nn.Module):
    def __init__(self, act, gated: bool = True, bias: bool = False, hidden: int = 32) -> None:  # noqa: ANN001
        super().__init__()
        self.act, self.gated = act, gated
        self.router = nn.Linear(hidden, 4, bias=False)
        self.up = nn.ModuleList(nn.Linear(hidden, 16, bias=bias) for _ in range(4))
        self.gate = nn.ModuleList(nn.Linear(hidden, 16, bias=bias) for _ in range(4))
        self.down = nn.ModuleList(nn.Linear(16, hidden, bias=bias) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = torch.topk(F.softmax(self.router(x), dim=-1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(4):
            tok, slot = torch.where(ids == e)
            xe = x[tok]
            up = self.up[e](xe)
            h = self.act(self.gate[e](xe)) * up if self.gated else self.act(up)
            out.index_add_(0, tok, self.down[e](h) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("act", [F.silu, F.gelu, F.relu], ids=["swiglu", "geglu", "reglu"])
def test_kernel_moe_computes_the_experts_activation(act) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    m = _LoopMoE(act).eval()
    x = torch.randn(8, 32)
    got = torch2step.compile(m, (x,), chip="ipu-hbm").run(x)
    torch.testing.assert_close(got, m(x), atol=1e-5, rtol=0)


def test_kernel_moe_runs_in_bf16() -> None:
    torch.manual_seed(0)
    m = _LoopMoE(F.silu).eval().to(torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    got = torch2step.compile(m, (x,), chip="ipu-hbm").run(x)
    torch.testing.assert_close(got.float(), m(x).float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize(
    ("gated", "bias", "what"), [(False, False, "plain two-matrix MLPs"), (True, True, "biased")]
)
def test_kernel_moe_refuses_experts_it_does_not_lower(gated: bool, bias: bool, what: str) -> None:
    m = _LoopMoE(F.gelu, gated=gated, bias=bias).eval()
    x = torch.randn(8, 32)
    with pytest.raises(
        LoweringError, match=rf"MoEExperts at .*test_kernel_moe_forms.py.*are {what}"
    ):
        torch2step.compile(m, (x,), chip="ipu-hbm")
