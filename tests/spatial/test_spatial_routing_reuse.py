"""One compiled graph serves a second routing (and a second KV-length set) with the unit programs
of the first wherever the new run is the same for them (torch2step.spatial.unit_reuse): the token
and weight loads, every unit of an expert whose token count did not change, an expert's weight
loads while it still gets tokens, the sum and the store after the merge are the same instruction
tuples (not rebuilt); only the units whose streams changed are emitted again.  The plan so assembled is the
plan a fresh build gives (so its cycles are, exactly), and the functional result stays
PyTorch's."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from run_checks import assert_run_equals_module

import torch2step
from hwmodel.presets import load_chip
from models import get_layer
from torch2step.lower.blocks.gqa import gqa_decode_graph, gqa_inputs
from torch2step.lower.blocks.moe import moe_graph, moe_inputs, moe_reference
from torch2step.spatial import simulate_graph, simulate_plan
from torch2step.spatial.plan import build_plan
from torch2step.spatial.reuse import PlanCache
from torch2step.step import run

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16
GQA = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}

#: Routing A: expert 0 gets tokens 0-7, the others share the rest; routing B keeps expert 0's
#: tokens (and so its count, on other rows) and sends nothing to expert 3.
ROUTE_A = np.array([[0, 1 + t % 3] for t in range(8)] + [[1, 3]] * 8)
ROUTE_B = np.array([[0, 1 + t % 2] for t in range(8)] + [[1, 2]] * 8)


def _bodies(plan) -> dict[str, tuple]:
    """Unit name -> its program body."""
    at = {p.core: p.body for p in plan.programs.programs}
    return {u.name: at[u.core] for u in plan.placement.units}


def _moe():
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    ins = [moe_inputs(**KW, tokens=T, seed=0, routing=r) for r in (ROUTE_A, ROUTE_B)]
    return g, ins, [run(g, tensors=x, check=False) for x in ins]


def test_a_second_routing_reuses_the_units_it_does_not_change() -> None:
    g, ins, (ra, rb) = _moe()
    na, nb = (np.bincount(r.reshape(-1), minlength=4) for r in (ROUTE_A, ROUTE_B))
    assert na[0] == nb[0] and nb[3] == 0 and na[3] > 0 and (na[1:3] != nb[1:3]).all()
    chip = load_chip("step-sda")
    cache = PlanCache()
    cache.simulate(g, chip, ra)
    units = cache.units(g, chip)
    total = units.emitted
    sb = cache.simulate(g, chip, rb)
    assert cache.built == 2 and 0 < units.reused < total
    assert units.emitted + units.reused == 2 * total
    pa, _ = cache.plan_for(g, chip, ra)
    pb, _ = cache.plan_for(g, chip, rb)
    a, b = _bodies(pa), _bodies(pb)
    kept = [n for n in a if n.startswith("moe_e0_")] + [
        "moe_x_ld",
        "moe_idx_ld",
        "moe_w_ld",
        "moe_e1_gate_w",  # expert 1 still has tokens: its weight loads are unchanged
        "moe_sum",
        "moe_store",
    ]
    assert len(kept) > 20
    for n in kept:
        assert a[n] is b[n], f"unit %{n} was rebuilt"
    for n in ("moe_e3_buf", "moe_e3_gate_w", "moe_e1_xt", "moe_e2_xt"):
        assert a[n] != b[n], f"unit %{n} should follow its expert's new token count"
    # an expert's matmuls and activation take the rows from the tiles they receive, into
    # buffers allocated at the count's bound: the same program for another count
    for n in ("moe_e1_gate", "moe_e2_act", "moe_e2_down"):
        assert a[n] == b[n], f"unit %{n} depends on its expert's token count"
    # the routing units decide from data: their programs are kept, and the messages each
    # channel carries and each unit's tallies are counted from the new run's streams
    for n in ("moe_sel", "moe_route", "moe_route_w", "moe_back"):
        assert a[n] is b[n], f"routing unit %{n} was rebuilt"
    assert pb.units == build_plan(g, chip, rb).units  # tallies, FLOPs, bytes: a fresh plan's
    assert units.reused == sum(a[n] is b[n] for n in a)
    # the assembled plan is the fresh plan of routing B, so it gives its cycles exactly
    assert pb.programs == build_plan(g, chip, rb).programs
    assert sb.cycles == simulate_graph(g, chip, rb).cycles
    # functionally the run that drives both is PyTorch's layer
    for x, r in zip(ins, (ra, rb)):
        want = moe_reference(
            *(torch.as_tensor(x[k]) for k in ("x", "topk_idx", "topk_w")),
            *(torch.as_tensor(x[k]) for k in ("w_gate", "w_up", "w_down")),
        )
        got = torch.as_tensor(np.asarray(r.tensors["out"])).reshape(want.shape)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_reused_units_change_only_timing_on_a_slower_hbm() -> None:
    """The plan of routing B assembled from routing A's units, run on an HBM with a quarter of
    the bandwidth and three times the latency, gives the cycles of a fresh slow-HBM plan of B:
    only the simulated timing changes, not a program, not a byte moved."""
    g, _, (ra, rb) = _moe()
    fast = load_chip("step-sda")
    hbm = dataclasses.replace(fast.hbm, bytes_per_cycle_per_channel=8.0, latency_cycles=480)
    slow = dataclasses.replace(fast, hbm=hbm)
    cache = PlanCache()
    cache.simulate(g, fast, ra)
    pb, _ = cache.plan_for(g, fast, rb)
    assert cache.units(g, fast).reused > 0
    quick = simulate_plan(pb)
    sim_slow = dataclasses.replace(
        pb.sim_chip,
        hbm=dataclasses.replace(
            pb.sim_chip.hbm, **{"bytes_per_cycle_per_channel": 8.0, "latency_cycles": 480}
        ),
    )
    late = simulate_plan(dataclasses.replace(pb, sim_chip=sim_slow))
    assert late.cycles > quick.cycles
    assert late.cycles == simulate_graph(g, slow, rb).cycles
    assert (late.hbm_read_bytes, late.hbm_write_bytes) == (
        quick.hbm_read_bytes,
        quick.hbm_write_bytes,
    )


def test_a_second_kv_length_set_reuses_the_units_it_does_not_change() -> None:
    """Decode attention: the query loads, the output Map and the store do not depend on the
    KV lengths and are kept; the units after the KV-tile addresses follow the new lengths."""
    g = gqa_decode_graph(**GQA, batch=3, max_len=40, tile_kv=16)
    ra, rb = (
        run(g, tensors=gqa_inputs(**GQA, batch=3, max_len=40, kv_lens=lens, seed=0), check=False)
        for lens in ([5, 40, 17], [5, 33, 1])
    )
    chip = load_chip("step-sda")
    cache = PlanCache()
    cache.simulate(g, chip, ra)
    sb = cache.simulate(g, chip, rb)
    pa, _ = cache.plan_for(g, chip, ra)
    pb, _ = cache.plan_for(g, chip, rb)
    a, b = _bodies(pa), _bodies(pb)
    for n in ("attn_q", "attn_q1", "attn_o", "attn_store"):
        assert a[n] is b[n], f"unit %{n} was rebuilt"
    assert a["attn_k"] != b["attn_k"]  # its KV tiles follow the lengths
    assert pb.programs == build_plan(g, chip, rb).programs
    assert sb.cycles == simulate_graph(g, chip, rb).cycles


def test_report_on_a_new_routing_takes_the_units_of_the_first() -> None:
    """``Program.report`` with another routing trace re-plans, but emits only the units the new
    routing changes; its cycles are those of a fresh program's report of that routing."""
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    x = spec.example_inputs
    prog = torch2step.compile(spec.module, x, chip="step-sda")
    prog.report(*x)
    ids = np.stack([np.arange(8) % 2, 2 + np.arange(8) % 2], axis=1)
    moved = prog.report(*x, routing=ids)
    units = prog._plans.units(prog.lowered.program, prog.chip)
    assert prog._plans.built == 2 and units.reused > 0
    fresh = torch2step.compile(spec.module, x, chip="step-sda").report(*x, routing=ids)
    assert moved.latency_cycles == fresh.latency_cycles
    assert moved.simulated_onchip_bytes == fresh.simulated_onchip_bytes
    assert_run_equals_module(prog, spec.module, x)
