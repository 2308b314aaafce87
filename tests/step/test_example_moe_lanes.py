"""Time-multiplexed expert regions (seed 000 §5.3): ``lanes=P`` branches serve every expert."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from torch2step.errors import StepTypeError
from torch2step.lower.blocks import moe_graph, moe_inputs, moe_reference
from torch2step.lower.blocks.moe_lanes import lane_experts
from torch2step.spatial import place
from torch2step.step import RunResult, metrics

E, K, H, I = 8, 2, 16, 8  # noqa: E741
# expert 4 gets no token; expert 2 gets four
ROUTING = np.array([[0, 1], [2, 1], [5, 0], [7, 2], [3, 2], [6, 0], [2, 7]])


def _run(
    checked_run: Callable[..., RunResult], lanes: int, tiles: tuple[int | None, int | None]
) -> RunResult:
    prog = moe_graph(
        num_experts=E,
        top_k=K,
        hidden=H,
        intermediate=I,
        tile_h=tiles[0],
        tile_i=tiles[1],
        lanes=lanes,
    )
    inp = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=7, routing=ROUTING)
    res = checked_run(prog, tensors=inp)
    np.testing.assert_allclose(res.tensors["out"], moe_reference(**inp).numpy(), atol=1e-4)
    assert metrics(prog).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
    return res


@pytest.mark.parametrize("tiles", [(8, 4), (None, None)], ids=["tiled", "whole"])
@pytest.mark.parametrize("lanes", [2, 3])
def test_lanes_match_pytorch_and_skip_unused_expert(
    checked_run: Callable[..., RunResult], lanes: int, tiles: tuple[int | None, int | None]
) -> None:
    res = _run(checked_run, lanes, tiles)
    assert res.bindings["moe_n4"] == 0
    used = 7  # experts 0, 1, 2, 3, 5, 6, 7
    weights = sum(
        res.read_bytes[f"moe_l{j}_{w}_w"] for j in range(lanes) for w in ("gate", "up", "down")
    )
    assert weights == used * 3 * I * H * 4  # every used expert's matrices once, none of expert 4
    per_token = H * 4 + K * 8 + K * 4 + H * 4
    assert res.offchip_bytes == 7 * per_token + weights


def test_same_traffic_as_dedicated_regions(checked_run: Callable[..., RunResult]) -> None:
    inp = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=7, routing=ROUTING)
    full = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tile_h=8, tile_i=4)
    assert (
        checked_run(full, tensors=inp).offchip_bytes == _run(checked_run, 3, (8, 4)).offchip_bytes
    )


def test_lane_assignment_and_errors() -> None:
    assert lane_experts(8, 3) == ((0, 1, 2), (3, 4, 5), (6, 7))  # consecutive (§5.3)
    assert lane_experts(128, 4)[1] == tuple(range(32, 64))
    with pytest.raises(StepTypeError, match="lanes=9 must be between 1 and num_experts=8"):
        moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, lanes=9)


def test_fewer_spatial_units() -> None:
    units = {
        lanes: len(
            place(
                moe_graph(
                    num_experts=E,
                    top_k=K,
                    hidden=H,
                    intermediate=I,
                    tile_h=8,
                    tile_i=4,
                    tokens=7,
                    lanes=lanes,
                ),
                "step-sda",
            ).units
        )
        for lanes in (None, 3, 2)
    }
    assert units[None] > units[3] > units[2]


@pytest.mark.parametrize("scale_in_lanes", [True, False], ids=["scale_in_lane", "per_expert"])
@pytest.mark.parametrize("static", [3, None])
@pytest.mark.parametrize("lanes", [2, 3])
def test_static_tiles_and_scaling_in_lanes_match_pytorch(
    checked_run: Callable[..., RunResult], lanes: int, static: int | None, scale_in_lanes: bool
) -> None:
    """Static tiles of 3 rows inside shared regions (STeP §5.3, Fig. 9(a)): every chunk reads
    its expert's weights again, padding rows are dropped, the result is PyTorch's; the routing
    weights scale each lane's output or each expert's rows after it (the artifact's graph)."""
    prog = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tile_h=8, tile_i=4,
                     lanes=lanes, static_tile=static, scale_in_lanes=scale_in_lanes)
    inp = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=7, routing=ROUTING)
    res = checked_run(prog, tensors=inp)
    np.testing.assert_allclose(res.tensors["out"], moe_reference(**inp).numpy(), atol=1e-4)
    counts = np.bincount(ROUTING.ravel(), minlength=E)
    chunks = int(sum(-(-c // (static or max(c, 1))) for c in counts))  # ceil(N_e / N)
    weights = sum(
        res.read_bytes[f"moe_l{j}_{w}_w"] for j in range(lanes) for w in ("gate", "up", "down")
    )
    assert weights == chunks * 3 * I * H * 4
    assert metrics(prog).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
