"""On-chip memory counted as the STeP paper's figures count it
(:mod:`torch2step.step.metrics_artifact`) against the §4.1 text accounting."""

from __future__ import annotations

import numpy as np
import torch

from torch2step.lower.blocks.moe import moe_graph
from torch2step.step import Graph, metrics, run, zeros
from torch2step.step.metrics_artifact import onchip_bytes_artifact, onchip_rule_artifact


def test_one_staging_tile_per_load_nothing_for_a_map_fp32_state() -> None:
    g = Graph("t")
    x = g.tensor("x", (8, 16), "bf16")
    t = g.linear_load(x, (4, 16), out_shape=(2,), stride=(1,), name="ld")  # [2] of [4, 16]
    y = g.map("relu", t, name="act")
    r = g.accum(g.repeat(y, 3, name="rep"), "add", zeros(4, 16, "bf16"), 1, name="sum")
    g.output("r", r)
    p = g.build()
    rule = {op.name: int(onchip_rule_artifact(op)) for op in p.nodes}
    assert rule["ld"] == 4 * 16 * 2  # one bf16 staging tile (the §4.1 text: two)
    assert rule["act"] == 0  # a Map holds nothing
    assert rule["rep"] == 4 * 16 * 4  # the repeated tile, held at 4 bytes per value
    assert rule["sum"] == 4 * 16 * 4  # the accumulator, fp32
    assert int(metrics(p).by_node["ld"]["onchip_bytes"]) == 2 * 4 * 16 * 2


def test_static_tiles_hold_padded_tiles_and_unused_experts_nothing() -> None:
    """Expert tiles of the dynamic graph hold exactly N_e rows, the static graph's N rows; an
    expert without tokens holds nothing in either."""
    E, K, H, I, T = 4, 1, 16, 8, 6  # noqa: E741
    routing = np.array([[0], [0], [0], [1], [2], [2]])  # expert 3 unused
    kw = {"num_experts": E, "top_k": K, "hidden": H, "intermediate": I, "tokens": T,
          "dtype": "bf16", "tile_h": H, "tile_i": 4, "repeat_tile": True}
    tensors = {"x": torch.zeros(T, H), "topk_idx": torch.as_tensor(routing),
               "topk_w": torch.ones(T, K), "w_gate": torch.zeros(E, I, H),
               "w_up": torch.zeros(E, I, H), "w_down": torch.zeros(E, H, I)}
    got = {}
    for st in (None, 4):
        p = moe_graph(**kw, static_tile=st)
        got[st] = onchip_bytes_artifact(p, run(p, tensors=tensors, timing_only=True).bindings)
    # per used expert: [rows, H] gathered tile, its repeat and the down accumulator (fp32)
    # plus [rows, 4] gate / up accumulators and the [rows, 1] weight column: 3*16 + 2*4 + 1 = 57
    # values per row; rows = 3 + 1 + 2 (dynamic) vs 3 tiles of 4 (static)
    assert got[4] - got[None] == (12 - 6) * 57 * 4
