"""A RoPE whose inverse frequencies are not theta ** (-2i / d) (a scaled RoPE: Llama 3.1's
"llama3" rope_scaling divides the low frequencies) raises to a Rotary carrying the module's own
table, and runs equal to PyTorch on the STeP SDA and kernel by kernel (it was refused: "RoPE
inv_freq is not theta ** (-2i / D) (scaled RoPE variant)")."""

from __future__ import annotations

import pytest
import torch

import torch2step


class _ScaledRope(torch.nn.Module):
    def __init__(self, d: int = 16, theta: float = 500000.0) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        inv[d // 4 :] = inv[d // 4 :] / 8.0  # the low frequencies scaled, as "llama3" does
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


@pytest.mark.parametrize("chip", ["step-sda", "ipu-hbm"])
def test_a_scaled_rope_runs_with_its_own_table(chip: str) -> None:
    torch.manual_seed(0)
    m = _ScaledRope()
    x = torch.randn(2, 4, 3, 16)
    pos = torch.tensor([[5, 6, 7], [100, 101, 102]])
    prog = torch2step.compile(m, (x, pos), chip=chip)
    (rot,) = [n.op for n in prog.layer.nodes if type(n.op).__name__ == "Rotary"]
    assert len(rot.inv_freq) == 8 and rot.inv_freq[-1] == pytest.approx(m.inv_freq[-1].item())
    torch.testing.assert_close(prog.run(x, pos), m(x, pos), atol=1e-5, rtol=1e-5)
