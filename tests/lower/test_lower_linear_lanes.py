"""A Linear split over parallel lanes (STeP (arXiv 2511.07776) §5) runs equal to PyTorch and
reads exactly the off-chip bytes of the one-lane lowering."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch2step.frontend import from_torch
from torch2step.lower import LowerOptions, lower
from torch2step.step import Map, run


def _run(model: nn.Module, x: torch.Tensor, lanes: int):
    lw = lower(from_torch(model, (x,), None), LowerOptions(linear_lanes=lanes, tile_cols=4))
    tensors, env = lw.feed((x,))
    res = run(lw.program, tensors=tensors, env=env)
    return lw, res, lw.outputs(res.tensors, (x,))[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_linear_lanes_equal_pytorch_and_keep_offchip_bytes(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    model = nn.Linear(12, 32, bias=bias)
    x = torch.randn(rows, 12)
    want = model(x)
    _, one, y1 = _run(model, x, 1)
    torch.testing.assert_close(y1, want, atol=1e-5, rtol=1e-5)
    for lanes in (2, 4, 8):
        lw, res, y = _run(model, x, lanes)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        assert res.offchip_bytes == one.offchip_bytes
        mm = [op for op in lw.program.nodes if isinstance(op, Map) and op.fn.name == "matmul_t"]
        assert len(mm) == lanes


def test_lanes_capped_by_weight_tiles() -> None:
    model = nn.Linear(12, 12)  # 3 weight tiles of 4 features: 8 lanes -> 3
    x = torch.randn(4, 12)
    lw, _, y = _run(model, x, 8)
    torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)
    mm = [op for op in lw.program.nodes if isinstance(op, Map) and op.fn.name == "matmul_t"]
    assert len(mm) == 3
