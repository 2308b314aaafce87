"""Decode attention's KV tile loads on the spatial simulator: one HBM request per KV tile,
exactly the rows used, and lanes that share the HBM bandwidth."""

from __future__ import annotations

import numpy as np
import torch

from torch2step.lower.blocks.gqa import gqa_decode_graph, gqa_inputs
from torch2step.spatial import simulate_graph
from torch2step.step import run


def _sim(lanes: int, lens: list[int], tile_kv: int = 16):
    prog = gqa_decode_graph(
        num_q_heads=4, num_kv_heads=2, head_dim=32, tail_rows=1, tile_kv=tile_kv, lanes=lanes,
        dtype="bf16",
    )
    inp = gqa_inputs(
        num_q_heads=4, num_kv_heads=2, head_dim=32, batch=len(lens), max_len=130,
        kv_lens=lens, tail_rows=1,
    )
    inp = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inp.items()}
    res = run(prog, tensors=inp, timing_only=True)
    return res, simulate_graph(prog, "step-sda", res)


def test_one_request_per_tile_and_exact_bytes() -> None:
    lens = [129, 0, 16, 17]
    res, sim = _sim(1, lens)
    rows = 2 * sum(n + 1 for n in lens)  # 2 KV heads, the new (tail) row included
    assert res.read_bytes["attn_k"] == res.read_bytes["attn_v"] == rows * 32 * 2
    assert sim.hbm_read_bytes == sum(res.read_bytes.values())
    tiles = 2 * sum(-(-n // 16) + 1 for n in lens)  # per segment: ceil(n / 16), then the tail
    k_unit = next(u for u in sim.units if u.name == "attn_k")
    assert k_unit.sent == tiles


def test_lanes_share_the_kv_traffic_and_are_faster() -> None:
    lens = [128, 96, 120, 64, 100, 128, 80, 112]
    one = _sim(1, lens)[1]
    four = _sim(4, lens)[1]
    # the same KV, q and out bytes; each lane reads the 8 KV lengths (8 B each) itself
    assert four.hbm_read_bytes == one.hbm_read_bytes + 3 * 8 * 8
    # 0.48-0.61 of one lane's cycles, depending on where placement puts the lanes' loads
    assert four.cycles < 0.65 * one.cycles, (four.cycles, one.cycles)
    assert np.isfinite(four.cycles)


def _list_schedule(lens: list[int], lanes: int, heads: int = 2, tail: int = 1) -> list[int]:
    """Items per lane: each (request, KV head) to the lane with the fewest rows so far."""
    load, items = [0] * lanes, [0] * lanes
    for n in lens:
        for _ in range(heads):
            lane = load.index(min(load))
            load[lane] += n + tail + 1
            items[lane] += 1
    return items


def test_lane_decisions_are_made_in_registers() -> None:
    """STeP §5.4 lanes: the simulated ``lane_pick`` / ``lane_keep`` programs decide from the
    KV lengths they read at run time which items each lane keeps (each lane's item channel
    carries its items and then the stop token), and the lanes move exactly the interpreter's
    bytes; a lane without an item only passes the token on."""
    for lens in ([128, 1, 2, 3, 90], [1, 128, 3, 110, 1], [5]):
        prog = gqa_decode_graph(
            num_q_heads=4, num_kv_heads=2, head_dim=32, tail_rows=1, tile_kv=16, lanes=3,
            dtype="bf16",
        )
        inp = gqa_inputs(
            num_q_heads=4, num_kv_heads=2, head_dim=32, batch=len(lens), max_len=130,
            kv_lens=lens, tail_rows=1,
        )
        res = run(prog, tensors=inp, timing_only=True)
        watch: dict = {f"attn_l{r}_items": [] for r in range(3)}
        sim = simulate_graph(prog, "step-sda", res, watch=watch)
        got = [len(watch[f"attn_l{r}_items"]) - 1 for r in range(3)]  # less the stop token
        assert got == _list_schedule(lens, 3), (lens, got)
        assert sim.hbm_read_bytes == sum(res.read_bytes.values())
        assert sim.hbm_write_bytes == sum(res.write_bytes.values())
