"""A captured module's operations no output depends on are dropped from its layer graph, as an
ONNX import's are: e.g. the empty pass-through slice ``q[..., rotary_dim:]`` of a full rotary
embedding (Phi-3's default ``partial_rotary_factor=1.0``), which the concatenation leaves
out, was lowered and refused ("tensor slice_3 [4*B, 0] is not a whole number of tiles")."""

from __future__ import annotations

import torch

import torch2step


class _FullRotaryLike(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :16], x[..., 16:]  # rest is empty: every column is rotated
        unused = torch.exp(x)  # noqa: F841 - computed, never returned
        return torch.cat([rot * 2.0, rest], dim=-1)


def test_unused_and_empty_operations_are_dropped() -> None:
    x = torch.randn(4, 2, 16)
    prog = torch2step.compile(_FullRotaryLike(), (x,), chip="step-sda")
    kinds = [type(n.op).__name__ for n in prog.layer.nodes]
    assert "Slice" not in kinds and not any("exp" in str(n.op) for n in prog.layer.nodes)
    torch.testing.assert_close(prog.run(x), _FullRotaryLike()(x))
