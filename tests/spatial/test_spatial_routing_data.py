"""The MoE routing operators decide from data at run time (STeP, arXiv 2511.07776, §3.2.3):
the selector unit computes each token's k-hot mask from the expert ids it receives (integer
tiles carry their values in timing mode too), Partition routes by it and Reassemble gathers by
it, so their programs are the same for every routing; a plan built from one routing and run on
another's data (with the same token count per expert, which the expert units are still
specialised to) gives that routing's own cycles."""

from __future__ import annotations

import dataclasses

import numpy as np

from lowering.isa import Calc, ReadValue, RecvValue, walk
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.spatial import simulate_graph, simulate_plan
from torch2step.spatial.plan import build_plan
from torch2step.step import run

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16
ROUTING_UNITS = ("moe_sel", "moe_route", "moe_route_w", "moe_back")


def _graph():
    return moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)


def _bodies(plan):
    core = {u.name: u.core for u in plan.placement.units}
    body = {p.core: p.body for p in plan.programs.programs}
    return {name: body[c] for name, c in core.items()}


def _permuted(ins: dict, perm: list[int]) -> dict:
    """The same tokens routed to experts renamed by ``perm`` (same counts per expert set)."""
    out = dict(ins)
    out["topk_idx"] = np.asarray(perm)[np.asarray(ins["topk_idx"])]
    return out


def test_routing_units_are_the_same_for_every_routing() -> None:
    g = _graph()
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = moe_inputs(**KW, tokens=T, seed=1)
    b["topk_idx"] = np.tile(np.array([[0, 1], [1, 2], [2, 0]], np.int64), (T // 3 + 1, 1))[:T]
    ba = _bodies(build_plan(g, "step-sda", run(g, tensors=a, check=False)))
    bb = _bodies(build_plan(g, "step-sda", run(g, tensors=b, check=False)))
    for unit in ROUTING_UNITS:
        assert ba[unit] == bb[unit], unit
    sel = list(walk(ba["moe_sel"]))
    # the mask is computed from the ids the unit receives: no selector value is a literal
    assert sum(isinstance(i, ReadValue) for i in sel) == KW["top_k"]
    assert [i.op for i in sel if isinstance(i, Calc)] == ["shl"] * KW["top_k"]


def test_a_plan_runs_another_routing_from_its_data() -> None:
    """Tokens permuted over the same routing rows: every expert keeps its token count, so the
    whole plan of routing A is the plan of routing B; run on B's ids (the data its routing
    units read), it gives exactly the cycles of B's own plan."""
    g = _graph()
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = dict(a)
    perm = np.random.default_rng(5).permutation(T)
    b["topk_idx"] = np.asarray(a["topk_idx"])[perm].copy()
    assert not np.array_equal(b["topk_idx"], a["topk_idx"])
    plan_a = build_plan(g, "step-sda", run(g, tensors=a, check=False))
    rb = run(g, tensors=b, check=False)
    plan_b = build_plan(g, "step-sda", rb)
    assert plan_a.programs == plan_b.programs
    moved = simulate_plan(dataclasses.replace(plan_a, inputs=plan_b.inputs))
    assert moved.cycles == simulate_graph(g, "step-sda", rb).cycles
    assert moved.hbm_read_bytes == simulate_plan(plan_b).hbm_read_bytes


GQA = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def test_kv_lengths_are_sent_from_the_loaded_values() -> None:
    """The KV-length loader sends each request's length from the tile it loaded (after the
    load lands, not before), and the units up to the cursors are the same for every set of KV
    lengths."""
    from hwmodel.presets import load_chip
    from torch2step.lower.blocks.gqa import gqa_decode_graph, gqa_inputs

    g = gqa_decode_graph(**GQA, batch=3, max_len=40, tile_kv=16)
    runs = [
        run(g, tensors=gqa_inputs(**GQA, batch=3, max_len=40, kv_lens=lens), check=False)
        for lens in ([5, 40, 17], [33, 1, 16])
    ]
    plans = [_bodies(build_plan(g, "step-sda", r)) for r in runs]
    for unit in ("attn_len", "attn_len_h", "attn_cursor", "attn_cursor1"):
        assert plans[0][unit] == plans[1][unit], unit
    assert any(isinstance(i, ReadValue) for i in walk(plans[0]["attn_len"]))
    watch = {"attn_len": -1}
    simulate_graph(g, "step-sda", runs[0], watch=watch)
    assert watch["attn_len"] >= load_chip("step-sda").hbm.latency_cycles


def test_regions_gather_from_partitions_at_run_time() -> None:
    """With time-multiplexed regions (STeP §5.3) the final Reassemble reads the regions'
    Partitions: it takes their stop tokens once its selectors are done, and its program is the
    same for a routing that leaves an expert without tokens."""
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32, lanes=2)
    a = moe_inputs(**KW, tokens=T, seed=0)
    b = dict(a)
    b["topk_idx"] = np.tile(np.array([[0, 1], [1, 2], [2, 0]], np.int64), (T // 3 + 1, 1))[:T]
    ra, rb = (run(g, tensors=x, check=False) for x in (a, b))
    sa, sb = (simulate_graph(g, "step-sda", r) for r in (ra, rb))
    assert sa.cycles > 0 and sb.cycles > 0
    ba, bb = _bodies(sa.plan), _bodies(sb.plan)
    assert ba["moe_back"] == bb["moe_back"]
    stops = [i for i in walk(ba["moe_back"]) if isinstance(i, RecvValue) and "stop" in i.reg]
    assert len(stops) == KW["num_experts"]  # one per input: each region's Partition outputs
