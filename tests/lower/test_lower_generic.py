"""Layer operators lowered to STeP run to the same values as PyTorch, for several sizes of the
dynamic dims, with the §4.1 traffic formula equal to the interpreter's count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch2step.errors import LoweringError
from torch2step.frontend import from_torch
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph
from torch2step.layers.ops import TensorType
from torch2step.lower import LowerOptions, lower
from torch2step.step import metrics, run


def _check(module: nn.Module, make, sizes, options: LowerOptions | None = None) -> None:
    torch.manual_seed(0)
    g = from_torch(module, make(sizes[0]), None)
    lw = lower(g, options)
    m = metrics(lw.program)
    for s in sizes:
        xs = make(s)
        tensors, env = lw.feed(xs)
        res = run(lw.program, tensors=tensors, env=env)
        outs = lw.outputs(res.tensors, xs)
        want = module(*xs)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(outs, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert m.evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes


class MLPish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128, bias=False)
        self.b = nn.Linear(32, 48, bias=True)
        self.w = nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).reshape(x.shape[0], 4, 32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        y = torch.softmax(y.permute(1, 0, 2), -1)
        return self.b(y) + 1.0


@pytest.mark.parametrize("tile_rows", [64, 4])
def test_linear_norm_permute_softmax(tile_rows: int) -> None:
    _check(MLPish(), lambda t: (torch.randn(t, 64),), [5, 1, 70], LowerOptions(tile_rows=tile_rows))


def test_weight_traffic_is_one_read_per_row_block() -> None:
    mod = nn.Linear(32, 16, bias=False)
    g = from_torch(mod, (torch.randn(10, 32),), None)
    lw = lower(g, LowerOptions(tile_rows=4))
    x = torch.randn(10, 32)
    tensors, env = lw.feed([x])
    res = run(lw.program, tensors=tensors, env=env)
    # x read once, y written once, W read once per block of 4 rows (3 blocks)
    assert res.offchip_bytes == 4 * (10 * 32 + 10 * 16 + 3 * 16 * 32)


class Rows(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.cat([x, y], dim=1)  # [B, 3+2, 8]
        return c[:, 1:4] * 2.0, torch.sigmoid(c).sum(-1)


def test_concat_slice_reduce() -> None:
    _check(Rows(), lambda b: (torch.randn(b, 3, 8), torch.randn(b, 2, 8)), [2, 1, 5])


def _graph_with(op: L.LayerOp, ins: list[tuple[str, TensorType]]) -> LayerGraph:
    g = LayerGraph(name="g")
    for name, ty in ins:
        g.add_input(name, ty)
    (out,) = g.add(op, [n for n, _ in ins])
    g.outputs = [out]
    g.single_output = True
    return g


def test_unsupported_operators_listed_together() -> None:
    g = LayerGraph(name="two_bad")
    g.add_input("a", TensorType((4, 8), "fp32"))
    g.add_input("b", TensorType((8, 4), "fp32"))
    (m,) = g.add(L.Softmax(0), ["a"])
    (t,) = g.add(L.Reduce("sum", (0,)), ["b"])
    g.outputs = [m, t]
    with pytest.raises(LoweringError) as e:
        lower(g)
    msg = str(e.value)
    assert "2 operator(s)" in msg and "Softmax" in msg and "only the last dimension" in msg


def test_gather_rows_by_index_data() -> None:
    g = LayerGraph(name="gather")
    g.add_input("x", TensorType((6, 4), "fp32"))
    g.add_input("i", TensorType((3,), "int64"))
    (y,) = g.add(L.Gather(0), ["x", "i"])
    g.outputs, g.single_output = [y], True
    lw = lower(g)
    x, i = torch.randn(6, 4), torch.tensor([5, 0, 5])
    tensors, env = lw.feed([x, i])
    res = run(lw.program, tensors=tensors, env=env)
    torch.testing.assert_close(lw.outputs(res.tensors, [x, i])[0], x[i])
