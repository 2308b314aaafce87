"""Partition decides at run time (STeP, arXiv 2511.07776, §3.2.3): its unit program reads each
selector into a register and sends the element to the outputs whose bit is set, so one program
serves every routing of the same number of tokens that gives every output at least one element,
and the simulated cycles are those of the routing the data carries.  (An output that receives
nothing has no channel in the plan, so its guarded send is left out: serving that case with the
same program needs the Partition's stop token, STeP §3.2.3.)"""

from __future__ import annotations

import numpy as np

from lowering.isa import If, Loop
from torch2step.examples.moe import moe_graph, moe_inputs
from torch2step.spatial import simulate_graph
from torch2step.spatial.plan import build_plan
from torch2step.step import run

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16


def _bodies(g, ins):
    plan = build_plan(g, "step-sda", run(g, tensors=ins, check=False))
    core = {u.name: u.core for u in plan.placement.units}
    body = {p.core: p.body for p in plan.programs.programs}
    return plan, {name: body[c] for name, c in core.items()}


def _flat(body):
    for ins in body:
        yield ins
        if isinstance(ins, Loop):
            yield from _flat(ins.body)


def test_one_partition_program_serves_two_routings() -> None:
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = dict(a)
    ids = np.tile(np.array([[0, 1], [1, 2], [2, 0]], np.int64), (T // 3 + 1, 1))[:T]
    ids[-1] = (3, 0)  # expert 3 gets a single token, expert 0 most of them
    b["topk_idx"] = ids
    plan_a, ba = _bodies(g, a)
    plan_b, bb = _bodies(g, b)
    assert plan_a.messages["moe_route.3"] != plan_b.messages["moe_route.3"] == 1
    for unit in ("moe_route", "moe_route_w"):
        assert ba[unit] == bb[unit]
        guards = [i for i in _flat(ba[unit]) if isinstance(i, If)]
        assert {i.cond.rhs for i in guards} <= {1, 2, 4, 8} and guards
    # the routing-dependent units still differ: the experts' token counts shape their programs
    assert ba["moe_e0_gate"] != bb["moe_e0_gate"]


def test_cycles_follow_the_routing_the_selectors_carry() -> None:
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = moe_inputs(**KW, tokens=T, seed=1)
    ra, rb = (run(g, tensors=x, check=False) for x in (a, b))
    sa, sb = (simulate_graph(g, "step-sda", r) for r in (ra, rb))
    # each output channel of the Partition carries exactly the tokens routed to its expert
    for e in range(KW["num_experts"]):
        n = int((np.asarray(b["topk_idx"]) == e).sum())
        assert sb.plan.messages.get(f"moe_route.{e}", 0) == n
    again = simulate_graph(g, "step-sda", ra)
    assert again.cycles == sa.cycles  # deterministic
    assert sa.cycles > 0 and sb.cycles > 0
