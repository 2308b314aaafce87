"""MoE lanes fed by dispatch (``lane_assign="dispatch"``): functionally equal to PyTorch with
experts without tokens, static and dynamic tiling; each lane serves a balanced share of the
used experts; one program serves two routings."""

import numpy as np
import pytest
import torch

from torch2step.lower.blocks.moe import moe_graph, moe_inputs, moe_reference
from torch2step.step import run

E, K, H, I, T = 8, 2, 16, 8, 9  # noqa: E741
ROUTING = np.array([[0, 1], [0, 2], [1, 2], [0, 7], [7, 1], [2, 0], [1, 0], [7, 2], [0, 1]])


@pytest.mark.parametrize("static", [None, 2])
@pytest.mark.parametrize("scale_in_lanes", [True, False])
def test_dispatch_lanes_match_pytorch(static, scale_in_lanes):
    g = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=T, lanes=3,
                  lane_assign="dispatch", static_tile=static, scale_in_lanes=scale_in_lanes,
                  tile_h=8, tile_i=4)
    for routing in (ROUTING, (ROUTING + 3) % E):  # four experts unused in each
        ins = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=T,
                         routing=routing)
        out = run(g, tensors=ins).tensors["out"]
        assert torch.allclose(torch.as_tensor(out), moe_reference(**ins), atol=1e-5)


def test_dispatch_balances_used_experts():
    g = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=T, lanes=3,
                  lane_assign="dispatch", tile_h=8, tile_i=4)
    ins = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=T,
                     routing=ROUTING)
    res = run(g, tensors=ins)
    chunks = [int(res.bindings[f"moe_l{lane}_m"]) for lane in range(3)]
    assert sorted(chunks) == [1, 1, 2]  # 4 used experts (0, 1, 2, 7) over 3 lanes


def test_lane_assign_is_checked():
    with pytest.raises(Exception, match="lane_assign"):
        moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=T, lanes=3,
                  lane_assign="random")
