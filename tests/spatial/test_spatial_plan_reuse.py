"""A spatial plan is built once per control signature of the run and reused for every run with
the same one (torch2step.spatial.reuse): runs that differ only in floating-point data share the
programs and give the cycles of their own fresh plan; a new routing or KV-length set (what the
expert and decode-attention units are still specialised to) gets its own plan."""

from __future__ import annotations

import dataclasses

import numpy as np
from run_checks import assert_run_equals_module

import torch2step
from hwmodel.presets import load_chip
from models import get_layer
from torch2step.lower.blocks.gqa import gqa_decode_graph, gqa_inputs
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.spatial import simulate_graph, simulate_plan
from torch2step.spatial.plan import build_plan
from torch2step.spatial.reuse import PlanCache, control_signature
from torch2step.step import run

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16
GQA = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def _moe_runs():
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = dict(a)
    b["x"] = np.asarray(a["x"]) * 3.0 + 1.0  # other activations, the same routing
    c = dict(a)  # another routing: expert 3 gets no token
    c["topk_idx"] = np.tile(np.array([[0, 1], [1, 2], [2, 0]], np.int64), (T // 3 + 1, 1))[:T]
    return g, [run(g, tensors=x, check=False) for x in (a, b, c)]


def test_float_data_reuses_the_plan_a_new_routing_builds_one() -> None:
    g, (ra, rb, rc) = _moe_runs()
    chip = load_chip("step-sda")
    assert control_signature(g, ra) == control_signature(g, rb)
    assert control_signature(g, ra) != control_signature(g, rc)
    cache = PlanCache()
    sa = cache.simulate(g, chip, ra)
    sb = cache.simulate(g, chip, rb)
    assert (cache.built, cache.reused) == (1, 1)
    pa, _ = cache.plan_for(g, chip, ra)
    pb, reused = cache.plan_for(g, chip, rb)
    assert reused and pb.programs is pa.programs  # not rebuilt
    assert sb.plan.programs == sa.plan.programs
    cache.built, cache.reused = 1, 1
    assert sb.cycles == simulate_graph(g, chip, rb).cycles
    sc = cache.simulate(g, chip, rc)
    assert (cache.built, cache.reused) == (2, 1)
    # a plan of its own (the run's counts, messages and bytes), but the same programs: every
    # unit, also of the expert without tokens, decides at run time (torch2step.spatial.guard)
    assert sc.plan.programs == sa.plan.programs and sc.plan.messages != sa.plan.messages
    assert sc.cycles == simulate_graph(g, chip, rc).cycles != sa.cycles


def test_a_kv_length_is_part_of_the_signature() -> None:
    g = gqa_decode_graph(**GQA, batch=3, max_len=40, tile_kv=16)
    runs = [
        run(g, tensors=gqa_inputs(**GQA, batch=3, max_len=40, kv_lens=lens, seed=s), check=False)
        for lens, s in (([5, 40, 17], 0), ([5, 40, 17], 1), ([5, 40, 1], 0))
    ]
    sigs = [control_signature(g, r) for r in runs]
    assert sigs[0] == sigs[1] != sigs[2]


def test_report_reuses_its_plan() -> None:
    """``Program.report`` on inputs that differ only in activations re-simulates the plan it
    built, with the same cycles and on-chip memory; its functional output stays PyTorch's."""
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(spec.module, spec.example_inputs, chip="step-sda")
    first = prog.report(*spec.example_inputs)
    x2 = tuple(x * 2.0 for x in spec.example_inputs)  # a bias-free router: same top-k
    again = prog.report(*x2)
    assert (prog._plans.built, prog._plans.reused) == (1, 1)
    assert again.dynamic["tokens_per_expert"] == first.dynamic["tokens_per_expert"]
    assert again.latency_cycles == first.latency_cycles
    assert again.simulated_onchip_bytes == first.simulated_onchip_bytes
    assert_run_equals_module(prog, spec.module, x2)


def _slower_hbm(chip):
    hbm = dataclasses.replace(chip.hbm, bytes_per_cycle_per_channel=8.0, latency_cycles=480)
    return dataclasses.replace(chip, hbm=hbm)


def test_a_slower_hbm_changes_timing_not_programs() -> None:
    """Nothing in a unit's program is chosen from simulated timing: on an HBM with a quarter
    of the bandwidth and three times the latency the MoE and decode-attention programs are the
    same (the DMA prefetch depth, a compile-time buffer count from the HBM latency by Little's
    law, is already at its cap here) but for the K and V loads, whose loops over the tile
    counts keep that many tiles in flight (12 on the fast HBM, the cap of 16 on the slow one;
    this run has 10 tiles, so no tile waits for a buffer on either), the plan built for the
    fast HBM run on the slow one gives the slow plan's cycles, and only the cycles change."""
    fast = load_chip("step-sda")
    slow = _slower_hbm(fast)
    g_moe, (r_moe, _, _) = _moe_runs()
    g_attn = gqa_decode_graph(**GQA, batch=3, max_len=40, tile_kv=16)
    r_attn = run(g_attn, tensors=gqa_inputs(**GQA, batch=3, max_len=40, kv_lens=[5, 40, 1]))
    for g, r in ((g_moe, r_moe), (g_attn, r_attn)):
        plan = build_plan(g, fast, r)
        other = build_plan(g, slow, r)
        at = {u.core: u.name for u in plan.placement.units}
        assert (
            other.placement == plan.placement and other.programs.channels == plan.programs.channels
        )
        changed = [
            at[p.core] for p, q in zip(plan.programs.programs, other.programs.programs) if p != q
        ]
        assert sorted(changed) == ([] if g is g_moe else ["attn_k", "attn_v"])
        a = simulate_plan(plan)
        b = simulate_plan(dataclasses.replace(plan, sim_chip=_slower_hbm(plan.sim_chip)))
        assert b.cycles > a.cycles
        assert b.cycles == simulate_graph(g, slow, r).cycles
        assert (b.hbm_read_bytes, b.hbm_write_bytes) == (a.hbm_read_bytes, a.hbm_write_bytes)
