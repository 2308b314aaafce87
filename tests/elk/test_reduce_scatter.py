"""The reduce-scatter of a matrix product's partial sums on an all-to-all chip (ELK §2.2): the
per-core programs compute the right values for either slicing axis, the next operator gathers
the spread slices, and the cost model prefers it to the tree where it applies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from elk.cost import ChipCosts, _generated, scatter_axis
from elk.ops import Operator
from hwmodel.presets import load_chip
from lowering.elk_placement import tile_major
from lowering.elk_programs import elk_programs
from runtime import simulate
from torch2step.kernel.build import bind_timing, timing_links


def _plan(c: ChipCosts, op: Operator, tk: int, tn: int, axis: int):  # noqa: ANN202
    plans = _generated(c, op.kind, op.dims, op.dtype, op.flops_per_elem, op.param_bytes)
    p = next(p for p in plans if p.tiles[1:] == (tk, tn))
    return dataclasses.replace(p, scatter=axis)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_reduce_scatter_products_equal_numpy(axis: int) -> None:
    chip = load_chip("ipu-hbm")
    c = ChipCosts.from_chip(chip)
    a = Operator("A", "matmul", (8, 64, 64), "fp32")
    b = Operator("B", "matmul", (8, 64, 32), "fp32")
    plans = [_plan(c, a, 4, 4, axis), _plan(c, b, 4, 2, axis)]
    ops, tensors = bind_timing([a, b], plans)
    links = timing_links(ops, tensors)
    assert links == {"B.x": "A.y"}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    wa = rng.standard_normal((64, 64)).astype(np.float32)
    wb = rng.standard_normal((64, 32)).astype(np.float32)
    ps = elk_programs(chip, ops, plans, [0, 1], [2, 2], tensors, links=links)
    inputs = {"A.x": x, "A.w": tile_major(wa, plans[0]), "B.w": tile_major(wb, plans[1])}
    rep = simulate(ps, chip, mode="functional", inputs=inputs)
    np.testing.assert_allclose(rep.tensors["B.y"], (x @ wa) @ wb, rtol=1e-4, atol=1e-3)


def test_reduce_scatter_axis_and_space() -> None:
    """Columns when the grid column divides the block's columns, else rows; the tree when
    neither divides and on a mesh; the slices and two receive buffers replace the tree's
    second whole block."""
    assert scatter_axis(32, 56, 8) == 1 and scatter_axis(32, 56, 16) == 0
    assert scatter_axis(32, 56, 64) == -1 and scatter_axis(32, 56, 1) == -1
    c = ChipCosts.from_chip(load_chip("ipu-hbm"))
    op = Operator("g", "matmul", (32, 4096, 14336))
    p = next(p for p in _generated(c, "matmul", op.dims, "bf16", 4, 0) if p.tiles[1:] == (16, 64))
    w, a, cc = 256 * 224 * 2, 32 * 256 * 2, 32 * 224 * 2
    assert p.scatter == 1 and p.core_space == w + a + cc + 2 * (cc // 16)
    mesh = ChipCosts.from_chip(load_chip("mesh"))
    assert all(q.scatter == -1 for q in _generated(mesh, "matmul", op.dims, "bf16", 4, 0))
