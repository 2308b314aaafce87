"""Row-wise operators stream into each other (``stream_rows``): a chain of elementwise
operators reads each intermediate from the previous operator's row stream instead of loading it
back from HBM and, as nothing reads the intermediate from HBM any more, does not store it either;
it computes the same values and moves exactly two tensors' bytes less per streamed
intermediate (its store and its load)."""

from __future__ import annotations

import torch
from torch import nn

from torch2step.frontend import from_torch
from torch2step.lower import LowerOptions, lower
from torch2step.step import LinearOffChipLoad, LinearOffChipStore, run


class _Chain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2.0 + 1.0) * x.shape[-1]


def _run(x: torch.Tensor, stream: bool):
    lw = lower(from_torch(_Chain(), (x,), None), LowerOptions(stream_rows=stream))
    tensors, env = lw.feed((x,))
    res = run(lw.program, tensors=tensors, env=env)
    return lw, res, lw.outputs(res.tensors, (x,))[0]


def test_stream_rows_equal_pytorch_and_elide_loads() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 32)
    want = _Chain()(x)
    lw_off, off, y_off = _run(x, False)
    lw_on, on, y_on = _run(x, True)
    torch.testing.assert_close(y_off, want)
    torch.testing.assert_close(y_on, want)
    loads = [
        sum(isinstance(op, LinearOffChipLoad) for op in lw.program.nodes) for lw in (lw_off, lw_on)
    ]
    elided = loads[0] - loads[1]
    assert elided >= 1
    stores = [
        sum(isinstance(op, LinearOffChipStore) for op in lw.program.nodes)
        for lw in (lw_off, lw_on)
    ]
    # every intermediate is streamed, so none is stored either: only the output is written
    assert stores == [elided + 1, 1]
    assert off.offchip_bytes - on.offchip_bytes == 2 * elided * x.numel() * 4


class _ProjHeads(nn.Module):
    """A projection viewed as heads, then a row-wise chain per head (as a q projection feeds
    its per-head RMSNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).view(x.shape[0], 4, 16)
        return torch.relu(h * 2.0 + 1.0)


def test_linear_output_streams_into_its_per_head_consumer() -> None:
    """The Linear's row count after dropping its block padding is the layer's row count, so
    the consumer reads the Linear's row stream (split into heads on chip), not HBM."""
    torch.manual_seed(0)
    m = _ProjHeads()
    x = torch.randn(5, 32)
    lw = lower(from_torch(m, (x,), None), LowerOptions(tile_rows=4))
    tensors, env = lw.feed((x,))
    res = run(lw.program, tensors=tensors, env=env)
    torch.testing.assert_close(lw.outputs(res.tensors, (x,))[0], m(x))
    stored = {op.tensor.name for op in lw.program.nodes if isinstance(op, LinearOffChipStore)}
    reloaded = [
        op.tensor.name
        for op in lw.program.nodes
        if isinstance(op, LinearOffChipLoad) and op.tensor.name in stored
    ]
    assert stored and not reloaded
