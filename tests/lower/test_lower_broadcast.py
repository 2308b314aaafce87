"""Elementwise operators with any broadcast lower to STeP and run equal to PyTorch, on random
shapes (hypothesis), with the §4.1 traffic formula equal to the interpreter's count."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from torch2step.frontend import from_torch
from torch2step.lower import lower
from torch2step.step import metrics, run


class Bcast(nn.Module):
    """``x [A, 1, C] * y [B, C] + z [A, B, 1]`` and ``lens[:, None] + arange(B)``."""

    def forward(self, x, y, z, lens):
        pos = lens[:, None] + torch.arange(y.shape[0])
        return x * y + z, pos


def _inputs(a: int, b: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(a, 1, 8, generator=g),
        torch.randn(b, 8, generator=g),
        torch.randn(a, b, 1, generator=g),
        torch.randint(0, 9, (a,), generator=g),
    )


_LOWERED = {}


def _lowered():
    if not _LOWERED:
        g = from_torch(Bcast(), _inputs(3, 4, 0), None)
        lw = lower(g)
        _LOWERED["lw"] = (lw, metrics(lw.program))
    return _LOWERED["lw"]


@settings(max_examples=10, deadline=None)
@given(a=st.integers(1, 4), b=st.integers(1, 7), seed=st.integers(0, 99))
def test_broadcasts_equal_pytorch(a: int, b: int, seed: int) -> None:
    lw, m = _lowered()
    xs = _inputs(a, b, seed)
    tensors, env = lw.feed(xs)
    res = run(lw.program, tensors=tensors, env=env)
    outs = lw.outputs(res.tensors, xs)
    for got, want in zip(outs, Bcast()(*xs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert m.evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
