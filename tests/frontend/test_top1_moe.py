"""A reduction over axes of size 1 is the value itself (a top-1 router's sum over its k axis):
raised as a reshape, so a top-1 MoE block compiles for the STeP SDA (it was refused: "sum over
dims (1,): only the last dimension is supported") and runs equal to PyTorch."""

from __future__ import annotations

import pytest
import torch

import torch2step

transformers = pytest.importorskip("transformers")


class _SumUnit(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1) * 2.0


def test_a_sum_over_an_axis_of_size_one_is_a_reshape() -> None:
    x = torch.randn(6, 1, 16)
    prog = torch2step.compile(_SumUnit(), (x,))
    assert not any(type(n.op).__name__ == "Reduce" for n in prog.layer.nodes)
    torch.testing.assert_close(prog.run(x), _SumUnit()(x))


def test_a_top1_mixtral_moe_block_runs_on_the_sda() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    c = MixtralConfig(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=1,
        num_hidden_layers=1,
    )
    c._experts_implementation = "batched_mm"
    m = MixtralSparseMoeBlock(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    x = torch.randn(1, 8, 64)
    got = torch2step.compile(m, (x,), chip="step-sda").run(x)
    want = m(x)
    want = want[0] if isinstance(want, tuple) else want
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
