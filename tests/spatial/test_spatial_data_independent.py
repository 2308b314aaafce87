"""Partition decides at run time (STeP, arXiv 2511.07776, §3.2.3): its unit program reads each
selector into a register and sends the element to the outputs whose bit is set, so one program
serves every routing of the same number of tokens — including an expert with no tokens, whose
reader gets only the stop token — and the simulated cycles are those of the routing the data
carries."""

from __future__ import annotations

import numpy as np

from lowering.isa import If, Loop, Recv, RecvValue, SendValue, walk
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
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
    b["topk_idx"] = ids  # expert 3 gets no token
    plan_a, ba = _bodies(g, a)
    plan_b, bb = _bodies(g, b)
    # element messages plus the stop token; the empty output carries the stop token only
    assert plan_a.messages["moe_route.3"] > 1 and plan_b.messages["moe_route.3"] == 1
    for unit in ("moe_route", "moe_route_w"):
        assert ba[unit] == bb[unit]
        guards = [i for i in _flat(ba[unit]) if isinstance(i, If)]
        assert {i.cond.rhs for i in guards} <= {1, 2, 4, 8} and guards
    # an expert's matmul takes its token count from the tiles it receives (row rules) and
    # holds them in buffers allocated at the count's bound (the routed tokens, Alloc.held);
    # and so do the units that keep its rows and pack them into a tile: they loop until the
    # stop token, the count it carries (torch2step.spatial.buffer_loop)
    assert ba["moe_e0_gate"] == bb["moe_e0_gate"]
    assert ba["moe_e0_buf"] == bb["moe_e0_buf"] and ba["moe_e0_xt"] == bb["moe_e0_xt"]
    assert "Loop(count='stop.moe_route.0'" in repr(ba["moe_e0_buf"])


def test_cycles_follow_the_routing_the_selectors_carry() -> None:
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = moe_inputs(**KW, tokens=T, seed=1)
    ra, rb = (run(g, tensors=x, check=False) for x in (a, b))
    sa, sb = (simulate_graph(g, "step-sda", r) for r in (ra, rb))
    # each output channel of the Partition carries the tokens routed to its expert, then the
    # stop token
    for e in range(KW["num_experts"]):
        n = int((np.asarray(b["topk_idx"]) == e).sum())
        assert sb.plan.messages[f"moe_route.{e}"] == n + 1
    again = simulate_graph(g, "step-sda", ra)
    assert again.cycles == sa.cycles  # deterministic
    assert sa.cycles > 0 and sb.cycles > 0


def test_an_expert_without_tokens_gets_only_the_stop_token() -> None:
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    ins = moe_inputs(**KW, tokens=T, seed=0)
    ins["topk_idx"] = np.tile(np.array([[0, 1], [1, 2], [2, 0]], np.int64), (T // 3 + 1, 1))[:T]
    sim = simulate_graph(g, "step-sda", run(g, tensors=ins, check=False))
    assert sim.plan.messages["moe_route.3"] == sim.plan.messages["moe_route_w.3"] == 1
    assert sim.cycles > 0


def test_the_stop_token_carries_the_count() -> None:
    """The stop token's value is the number of elements the output received (a register the
    program counts), read by the expert's first unit."""
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    ins = moe_inputs(**KW, tokens=T, seed=2)
    _, bodies = _bodies(g, ins)
    flat = list(_flat(bodies["moe_route"]))
    stops = [i for i in flat if isinstance(i, SendValue)]
    assert [s.channel for s in stops] == [f"moe_route.{e}" for e in range(4)]
    assert all(s.value == f"sent.{e}" for e, s in enumerate(stops))
    # the expert's Bufferize receives its rows until the token (Recv with ``stop``)
    got = [i for i in walk(bodies["moe_e0_buf"]) if isinstance(i, Recv | RecvValue)]
    assert any(r.channel == "moe_route.0" and getattr(r, "stop", None) for r in got)
