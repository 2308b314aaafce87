"""The reduce-scatter of a matrix product's partial sums on an all-to-all chip (ELK §2.2): the
per-core programs compute the right values for either slicing axis, by recursive halving on a
power-of-two grid column and directly otherwise; the next operator gathers the spread slices;
each core sends ``log2 tk`` messages when halving; and the cost model predicts the simulated
time."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from elk.cost import ChipCosts, _generated, halves, scatter_axis
from elk.ops import Operator
from hwmodel.presets import load_chip
from lowering.elk_placement import tile_major
from lowering.elk_programs import elk_programs
from lowering.elk_reduce import halving_steps
from lowering.isa import Send, walk
from runtime import simulate
from torch2step.kernel.build import bind_timing, timing_links


def _plan(c: ChipCosts, op: Operator, tk: int, tn: int, axis: int):  # noqa: ANN202
    plans = _generated(c, op.kind, op.dims, op.dtype, op.flops_per_elem, op.param_bytes)
    p = next(p for p in plans if p.tiles[1:] == (tk, tn))
    return dataclasses.replace(p, scatter=axis)


@pytest.mark.parametrize(
    ("tk", "axis"), [(4, 0), (4, 1), (4, -1), (2, 1), (8, 0), (8, 1), (3, 0), (3, 1)]
)
def test_reduce_scatter_products_equal_numpy(tk: int, axis: int) -> None:
    """Two chained products, the first reduce-scattered down grid columns of ``tk`` cores (a
    power of two halves recursively, 3 is direct), the second gathering its spread input."""
    chip = load_chip("ipu-hbm")
    c = ChipCosts.from_chip(chip)
    m, k = 24, 16 * tk
    a = Operator("A", "matmul", (m, k, 96), "fp32")
    b = Operator("B", "matmul", (m, 96, 48), "fp32")
    plans = [_plan(c, a, tk, 2, axis), _plan(c, b, 2, 3, axis if axis < 0 else 1)]
    ops, tensors = bind_timing([a, b], plans)
    links = timing_links(ops, tensors)
    assert links == {"B.x": "A.y"}
    rng = np.random.default_rng(tk)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wa = rng.standard_normal((k, 96)).astype(np.float32)
    wb = rng.standard_normal((96, 48)).astype(np.float32)
    ps = elk_programs(chip, ops, plans, [0, 1], [2, 2], tensors, links=links)
    inputs = {"A.x": x, "A.w": tile_major(wa, plans[0]), "B.w": tile_major(wb, plans[1])}
    rep = simulate(ps, chip, mode="functional", inputs=inputs)
    np.testing.assert_allclose(rep.tensors["B.y"], (x @ wa) @ wb, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tk", [1, 2, 4, 8, 16, 64])
def test_halving_steps_leave_each_core_its_slice(tk: int) -> None:
    """Partners pair up (each sends the other the half it keeps), the sent ranges and the own
    slice tile the column's slices, and the kept range ends at the core's own slice."""
    for r in range(tk):
        steps = halving_steps(tk, r)
        assert len(steps) == int(math.log2(tk))
        covered = sorted([sent for sent, _, _ in steps] + [(r, r + 1)])
        assert _tiles(covered, tk)
        for i, (sent, partner, kept) in enumerate(steps):
            assert halving_steps(tk, partner)[i][0] == kept  # the partner sends my kept half
            assert halving_steps(tk, partner)[i][1] == r
            assert sent[1] - sent[0] == kept[1] - kept[0] == tk >> (i + 1)
        assert (steps[-1][2] if steps else (0, 1)) == (r, r + 1)
    with pytest.raises(Exception, match="power of two"):
        halving_steps(6, 0)
    assert [halves(t) for t in (1, 2, 3, 6, 8)] == [False, True, False, False, True]


def _tiles(ranges: list[tuple[int, int]], tk: int) -> bool:
    return (
        ranges[0][0] == 0
        and ranges[-1][1] == tk
        and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    )


def _sends(ps, op: int) -> dict[int, int]:  # noqa: ANN001
    """Reduce-scatter sends (channels ``o{op}_h`` / ``o{op}_x``) per core."""
    out = {}
    for prog in ps.programs:
        n = sum(
            1
            for ins in walk(prog.body)
            if isinstance(ins, Send) and ins.channel.startswith((f"o{op}_h", f"o{op}_x"))
        )
        if n:
            out[prog.core] = n
    return out


@pytest.mark.parametrize(("tk", "halving"), [(16, True), (14, False)])
def test_messages_per_core(tk: int, halving: bool) -> None:
    """Halving: ``log2 tk`` messages per core and ``tk log2 tk`` channels per grid column;
    direct: ``tk - 1`` messages and ``tk (tk - 1)`` channels."""
    chip = load_chip("ipu-hbm")
    c = ChipCosts.from_chip(chip)
    op = Operator("A", "matmul", (32, 16 * tk * 4, 512), "bf16")
    plan = _plan(c, op, tk, 4, 1)
    ops, tensors = bind_timing([op], [plan])
    ps = elk_programs(chip, ops, [plan], [0], [1], tensors)
    per_core = _sends(ps, 0)
    assert len(per_core) == tk * 4
    want = int(math.log2(tk)) if halving else tk - 1
    assert set(per_core.values()) == {want}
    chans = [ch for ch in ps.channels if ch.name.startswith(("o0_h", "o0_x"))]
    assert len(chans) == 4 * tk * want


def test_reduce_scatter_axis_and_space() -> None:
    """Columns when the grid column divides the block's columns, else rows; the tree when
    neither divides and on a mesh; the pieces and the first received half (halving) or two
    receive buffers (direct) replace the tree's second whole block."""
    assert scatter_axis(32, 56, 8) == 1 and scatter_axis(32, 56, 16) == 0
    assert scatter_axis(32, 56, 64) == -1 and scatter_axis(32, 56, 1) == -1
    c = ChipCosts.from_chip(load_chip("ipu-hbm"))
    op = Operator("g", "matmul", (32, 4096, 14336))
    p = next(p for p in _generated(c, "matmul", op.dims, "bf16", 4, 0) if p.tiles[1:] == (16, 64))
    w, a, cc = 256 * 224 * 2, 32 * 256 * 2, 32 * 224 * 2
    assert p.scatter == 1 and p.core_space == w + a + cc + cc // 2
    down = Operator("d", "matmul", (28, 14336, 4096))
    q = next(q for q in _generated(c, "matmul", down.dims, "bf16", 4, 0) if q.tiles[1:] == (14, 64))
    w, a, cc = 1024 * 64 * 2, 28 * 1024 * 2, 28 * 64 * 2
    assert q.scatter == 0 and q.core_space == w + a + cc + 2 * (cc // 14)
    mesh = ChipCosts.from_chip(load_chip("mesh"))
    assert all(q.scatter == -1 for q in _generated(mesh, "matmul", op.dims, "bf16", 4, 0))


@pytest.mark.parametrize(
    ("dims", "tk", "tn", "axis"),
    [
        ((256, 1024, 1024), 16, 4, 1),
        ((256, 1024, 1024), 8, 8, 1),
        ((32, 2048, 2048), 8, 4, 0),
        ((224, 1792, 1024), 7, 4, 0),
    ],
)
def test_cost_model_matches_simulated(
    dims: tuple[int, int, int], tk: int, tn: int, axis: int
) -> None:
    """Preload and execute of one product reduce-scattered (halving for 16 and 8, direct for
    7): the cost model's preload plus plan time, less the plan's slack, within 10% of the
    simulated cycles.  The execution's traffic passes the preload's pieces at the ports and the
    HBM (runtime.network), so it runs while the preload arrives, its kernel needing the last
    piece ``slack`` cycles in.  At 256 or 224 rows the execute, the accumulating product pieces
    and the reduce-scatter dominate."""
    chip = load_chip("ipu-hbm")
    c = ChipCosts.from_chip(chip)
    op = Operator("A", "matmul", dims, "bf16")
    plan = _plan(c, op, tk, tn, axis)
    assert plan.scatter == axis
    ops, tensors = bind_timing([op], [plan])
    total = simulate(elk_programs(chip, ops, [plan], [0], [1], tensors), chip).cycles
    load = c.load(plan.preload_space, plan.preload_space / plan.cores, grid=(tk, tn))
    assert abs((max(load, plan.slack) + plan.time - plan.slack) / total - 1) < 0.10
