"""Decode attention over parallel regions (STeP, arXiv 2511.07776, §5.4): every assignment
computes what PyTorch computes, and the dynamic assignment is decided in simulated time."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch2step.errors import ScheduleError, StepTypeError
from torch2step.lower.blocks.gqa import gqa_decode_graph, gqa_inputs, gqa_reference
from torch2step.lower.blocks.gqa_regions import assign_coarse, assign_interleave
from torch2step.spatial.dispatch import greedy_assignment, list_schedule, simulate_dispatched
from torch2step.spatial.timing import UnitConfig
from torch2step.step import run

D, HQ, HKV, L = 8, 4, 2, 24


def _case(lens: list[int], regions: int):
    prog = gqa_decode_graph(
        num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, regions=regions, tail_rows=1, tile_kv=4
    )
    inp = gqa_inputs(
        num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, batch=len(lens), max_len=L,
        kv_lens=lens, tail_rows=1,
    )
    ref = gqa_reference(**inp, num_q_heads=HQ, num_kv_heads=HKV, scale=1 / math.sqrt(D),
                        tail_rows=1)
    return prog, inp, ref.numpy()


def test_assignments() -> None:
    assert assign_coarse(6, 3).ravel().tolist() == [0, 0, 1, 1, 2, 2]
    # the paper's 16 requests per region: B=80 gives region 0 requests 0-15 and 64-79
    c = assign_coarse(80, 4, 16).ravel()
    assert (c[:16] == 0).all() and (c[64:] == 0).all() and (c[16:32] == 1).all()
    assert assign_interleave(5, 2).ravel().tolist() == [0, 1, 0, 1, 0]
    assert greedy_assignment(5, 2, {0: [10, 30], 1: [20]}) == [0, 1, 0, 1, 0]
    assert list_schedule([5, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    with pytest.raises(ScheduleError, match="completions"):
        greedy_assignment(5, 2, {0: [1], 1: []})


@pytest.mark.parametrize("assign", ["coarse", "interleave"])
@pytest.mark.parametrize("lens", [[1, 1, 1], [0, 1, 22, 3, 17, 2, 9]])
def test_static_assignment_equals_pytorch(assign: str, lens: list[int]) -> None:
    prog, inp, ref = _case(lens, 3)
    B = len(lens)
    inp["region"] = torch.as_tensor(
        assign_coarse(B, 3) if assign == "coarse" else assign_interleave(B, 3)
    )
    res = run(prog, tensors=inp)  # checks the §4.1 formulas against what the run counted
    np.testing.assert_allclose(res.tensors["out"], ref, atol=1e-5, rtol=0)


def test_dynamic_assignment_equals_pytorch() -> None:
    lens = [1, 22, 0, 3, 17, 2, 9, 1]
    prog, inp, ref = _case(lens, 3)
    start = list_schedule([n + 1 for n in lens], 3)
    d = simulate_dispatched(prog, "step-paper", inp, timing_only=False, start=start)
    assert d.assignment[:3] == [0, 1, 2] and sorted(set(d.assignment)) == [0, 1, 2]
    np.testing.assert_allclose(d.run.tensors["out"], ref, atol=1e-5, rtol=0)
    # every region's completions are in the result and ordered in time
    assert sum(len(v) for v in d.completions.values()) == len(lens)
    assert all(v == sorted(v) for v in d.completions.values())


def test_dynamic_assignment_follows_simulated_time() -> None:
    """Equal requests: balanced regions share them evenly; slowing region 0's softmax (only
    the timing changes, not the data) moves requests to region 1."""
    lens = [12] * 8
    prog, inp, _ = _case(lens, 2)
    even = simulate_dispatched(prog, "step-paper", inp)
    slow = {
        f"attn_r0_{n}": UnitConfig(flops_per_cycle=1) for n in ("softmax", "o", "kv")
    }
    skew = simulate_dispatched(prog, "step-paper", inp, configs=slow)
    assert even.assignment.count(0) == 4
    assert skew.assignment[:2] == [0, 1]
    assert skew.assignment.count(0) < even.assignment.count(0)
    assert skew.result.cycles > even.result.cycles


def test_regions_need_a_region_tensor() -> None:
    from torch2step.lower.blocks.gqa import add_gqa_decode
    from torch2step.step import Graph

    g = Graph("x")
    t = {
        "q": g.tensor("q", (4 * HQ, D)),
        "k_cache": g.tensor("k_cache", (4 * HKV * L, D)),
        "v_cache": g.tensor("v_cache", (4 * HKV * L, D)),
        "kv_len": g.tensor("kv_len", (4, 1), "int64"),
        "out": g.tensor("out", (4 * HQ, D)),
    }
    with pytest.raises(StepTypeError, match="region"):
        add_gqa_decode(g, **t, num_q_heads=HQ, num_kv_heads=HKV, scale=1.0, regions=2)


def test_request_queues_let_coarse_regions_start_together() -> None:
    """Requests are routed in order: with 2-deep FIFOs region 1 waits for region 0 to take its
    requests; queues as deep as a region's share (``depths``) let both start at once."""
    from torch2step.spatial import simulate_graph

    lens = [20] * 8
    prog, inp, _ = _case(lens, 2)
    inp["region"] = torch.as_tensor(assign_coarse(8, 2))
    res = run(prog, tensors=inp, check=False, timing_only=True)
    firsts = []
    for depths in (None, {f"attn_route_{v}.{r}": 4 for v in ("cursor", "q") for r in (0, 1)}):
        watch = {"attn_r1_o": -1}
        sim = simulate_graph(prog, "step-paper", res, watch=watch, depths=depths)
        firsts.append((watch["attn_r1_o"], sim.cycles))
    (late, slow), (early, fast) = firsts
    assert early < late and fast < slow
