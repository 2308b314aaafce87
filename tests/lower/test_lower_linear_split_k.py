"""A Linear split over its input features (split-K lanes, :mod:`torch2step.lower.linear`) runs
equal to PyTorch, reads exactly the off-chip bytes of the one-lane lowering (the closed form
``|x| + ceil(R/tm) (|W| + |b|) + |y|``), and on the spatial fabric each lane's on-chip buffer
receives its input block once per row block and serves it once per weight tile."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hwmodel import load_chip
from torch2step.frontend import from_torch
from torch2step.lower import LowerOptions, lower
from torch2step.lower.linear import K_LANE_MIN_BYTES, k_groups, linear_k_lanes, weight_tile
from torch2step.spatial import simulate_graph
from torch2step.step import Bufferize, Map, run

K_IN, N_OUT, TN, TM = 512, 64, 16, 64


def _run(model: nn.Module, x: torch.Tensor, lanes: int):
    opts = LowerOptions(linear_k_lanes=lanes, tile_cols=TN, tile_rows=TM)
    lw = lower(from_torch(model, (x,), None), opts)
    tensors, env = lw.feed((x,))
    res = run(lw.program, tensors=tensors, env=env)
    return lw, res, lw.outputs(res.tensors, (x,))[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_split_k_equal_pytorch_and_offchip_closed_form(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    model = nn.Linear(K_IN, N_OUT, bias=bias)
    x = torch.randn(rows, K_IN)
    want = model(x)
    blocks = math.ceil(rows / TM)
    closed = 4 * (rows * K_IN + blocks * (N_OUT * K_IN + N_OUT * bias) + rows * N_OUT)
    for lanes in (1, 4):
        lw, res, y = _run(model, x, lanes)
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
        assert res.offchip_bytes == closed
        mm = [op for op in lw.program.nodes if isinstance(op, Map) and op.fn.name == "matmul_t"]
        assert len(mm) == lanes


def test_split_k_block_sent_once_per_row_block() -> None:
    """Each lane's Bufferize unit receives one ``[tm, K/P]`` block per row block (plus one
    reference per weight tile) and sends it once per weight tile (its buffer references stay
    inside the unit): the block crosses the NoC
    once, however many weight tiles reuse it."""
    torch.manual_seed(0)
    lanes, rows = 4, 70
    model = nn.Linear(K_IN, N_OUT, bias=False)
    x = torch.randn(rows, K_IN)
    lw, res, y = _run(model, x, lanes)
    torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)
    sim = simulate_graph(lw.program, load_chip("step-sda"), res)
    blocks, tiles = math.ceil(rows / TM), N_OUT // TN
    kp = K_IN // lanes
    lane_bufs = [
        op.name
        for op in lw.program.nodes
        if isinstance(op, Bufferize) and op.input.type.dtype.shape == (TM, kp)
    ]
    assert len(lane_bufs) == lanes
    for u in sim.units:
        if u.ops[0] in lane_bufs:
            assert u.received == blocks + blocks * tiles  # blocks in, one ref per weight tile
            assert u.sent == blocks * tiles  # the block once per weight tile, from the buffer
    assert sim.hbm_read_bytes == 4 * (rows * K_IN + blocks * N_OUT * K_IN)


def test_weight_tile_sized_at_the_served_dtype() -> None:
    ctx = SimpleNamespace(options=LowerOptions(weight_tile_bytes=128 * 1024))
    assert weight_tile(ctx, 4096, 4096, 4) == 8  # type: ignore[arg-type]
    assert weight_tile(ctx, 4096, 4096, 2) == 16  # type: ignore[arg-type]


def test_split_k_lanes_automatic_rule() -> None:
    ctx = SimpleNamespace(options=LowerOptions(linear_k_lanes=32, linear_lanes_auto=True))
    assert linear_k_lanes(ctx, 4096, 32 << 20) == 32  # type: ignore[arg-type]
    assert linear_k_lanes(ctx, 4096, 8 << 20) == 16  # type: ignore[arg-type]
    assert linear_k_lanes(ctx, 4096, K_LANE_MIN_BYTES - 1) == 1  # type: ignore[arg-type]
    assert linear_k_lanes(ctx, 256, 32 << 20) == 4  # type: ignore[arg-type]  # K/P >= 64
    manual = SimpleNamespace(options=LowerOptions(linear_k_lanes=4))
    assert linear_k_lanes(manual, 512, 1) == 4  # type: ignore[arg-type]


class _Viewed(nn.Module):
    """A Linear whose input is stored as narrower rows (``[R, 8, 64]`` viewed as ``[R, 512]``),
    as the attention output feeds the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(K_IN, N_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj((x * 2).reshape(x.shape[0], K_IN))


def test_split_k_reads_slices_of_a_viewed_input_straight_from_hbm() -> None:
    torch.manual_seed(1)
    model, x = _Viewed(), torch.randn(5, 8, 64)
    lw, res, y = _run(model, x, 4)
    torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)
    names = [op.fn.name for op in lw.program.nodes if isinstance(op, Map)]
    assert "slice_cols" not in names  # no lane receives the whole row
    assert res.offchip_bytes == _run(model, x, 1)[1].offchip_bytes


def test_k_groups_rule() -> None:
    """Slices of at least K_LANE_SUM_COLS input features; the remaining lanes split N."""
    assert k_groups(2048, 4096, 32) == (16, 2)  # Qwen3 q_proj: 16 slices x 2 column groups
    assert k_groups(4096, 2048, 32) == (32, 1)  # o_proj: already 128 features per slice
    assert k_groups(2048, 512, 4) == (4, 1)  # k_proj / v_proj
    assert k_groups(512, 4, 8) == (4, 2)
    assert k_groups(512, 3, 8) == (4, 1)  # the groups must divide the weight tiles
    assert k_groups(64, 8, 4) == (1, 4)  # a thin Linear: output lanes only


@pytest.mark.parametrize("bias", [True, False])
def test_split_k_column_groups_equal_pytorch(bias: bool) -> None:
    """8 lanes on K=512 are 4 slices x 2 column groups: equal to PyTorch, the same off-chip
    bytes as one lane, and each slice's block held by one buffer per group, received once
    per row block."""
    torch.manual_seed(1)
    rows, lanes = 70, 8
    model = nn.Linear(K_IN, N_OUT, bias=bias)
    x = torch.randn(rows, K_IN)
    lw, res, y = _run(model, x, lanes)
    torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)
    blocks = math.ceil(rows / TM)
    assert res.offchip_bytes == 4 * (
        rows * K_IN + blocks * (N_OUT * K_IN + N_OUT * bias) + rows * N_OUT
    )
    pk, groups = k_groups(K_IN, N_OUT // TN, lanes)
    assert (pk, groups) == (4, 2)
    mm = [op for op in lw.program.nodes if isinstance(op, Map) and op.fn.name == "matmul_t"]
    assert len(mm) == lanes
    bufs = [
        op.name
        for op in lw.program.nodes
        if isinstance(op, Bufferize) and op.input.type.dtype.shape == (TM, K_IN // pk)
    ]
    assert len(bufs) == lanes
    sim = simulate_graph(lw.program, load_chip("step-sda"), res)
    per = N_OUT // TN // groups
    for u in sim.units:
        if u.ops[0] in bufs:
            assert u.received == blocks + blocks * per
            assert u.sent == blocks * per
