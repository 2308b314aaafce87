"""The walk every group of units downstream of a head unit is found by (STeP arXiv 2511.07776
§5.2 statically tiled experts, §5.3 regions, an expert's guard): Structure.reached walks the
streams' readers, and must reach what a walk over the whole graph in order reaches."""

from __future__ import annotations

import pytest

from torch2step.lower.blocks.moe import moe_graph
from torch2step.spatial.structure import Structure, analyse

KW = {"num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64, "tokens": 16}


def _graph_walk(st: Structure, reach: set[str], head: int) -> list[tuple]:
    """The oracle: every node in graph order that reads a stream reached so far."""
    g = st.graph
    outputs = {op.name: outs for op, outs in zip(g.nodes, g.node_outputs)}
    out = []
    for op in g.nodes:
        if not any(v.name in reach for v in op.inputs()):
            continue
        reach |= {v.name for v in outputs[op.name]}
        if op.name not in st.owner:
            continue
        k = st.unit_index(op.name)
        if k == head:
            continue
        own = {o.name for o in st.units[k]}
        ins = tuple(v.name for o in st.units[k] for v in o.inputs() if v.name not in own)
        outs = tuple(v.name for o in st.units[k] for v in outputs[o.name])
        out.append((op.name, k, ins, outs))
    return out


@pytest.mark.parametrize(
    "extra",
    [{}, {"static_tile": 4}, {"lanes": 2}, {"lanes": 2, "static_tile": 4, "scale_in_lanes": False}],
)
def test_reached_is_the_graph_order_walk(extra: dict) -> None:
    g = moe_graph(**KW, tile_h=32, tile_i=32, **extra)
    st = analyse(g)
    outputs = {op.name: outs for op, outs in zip(g.nodes, g.node_outputs)}
    walked = 0
    for h, ops in enumerate(st.units):
        start = {v.name for o in ops for v in outputs[o.name]}
        got = [(op.name, k, ins, outs) for op, k, ins, outs in st.reached(start, h)]
        assert got == _graph_walk(st, set(start), h)
        assert all(k != h for _, k, _, _ in got)
        walked += len(got)
    assert walked > len(st.units)  # the walks reach through the layer, not only a neighbour
