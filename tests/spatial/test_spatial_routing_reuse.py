"""One compiled graph serves a second routing (and a second KV-length set) with the unit programs
of the first wherever they do not depend on the new run (torch2step.spatial.unit_reuse).

The routing units (selector, Partition, Reassemble) decide from the selectors' values at run
time, so they are kept for every routing; the elements each run takes through them are counted
from its streams.  An expert's units that read the rows of their tiles at run time (row rules,
buffers allocated at the token count's bound, counted by what they hold: ``Alloc.held``) are
kept for any token count: the matmuls, activation, column split, scaling, the repeats and the
weight loads, and so are the routing weights' Map and Accum, which loop until their input's
stop token, and the FlatMap back to rows, which loops over the count that token carries, and
its Bufferize, which receives its rows until the stop token, reads them back per block as many
times as the count and ends each read with the count as a stop token, which the Accum packing
the rows into a tile loops until.  An expert that gets no token in one run and some in the
other keeps every unit too: its Bufferize sends the stop token instead of its buffer reference,
and every unit after it takes either with a ``RecvValue`` with ``stop`` and runs its program or
only the guard's other arm (torch2step.spatial.guard); its routing weights' Map and packing
build their loops from the declared types when their stream is empty.  The plan so assembled
is the plan a fresh build gives (programs, bookkeeping, cycles and on-chip bytes, exactly), and
the functional result stays PyTorch's.

Decode attention keeps every unit for any KV-length set: the cursor Scan computes the cursors
in registers and sends them as data, the tile addresses, the K and V loads, the query's Expand
and the online softmax loop over each request's tile count at run time
(torch2step.spatial.kv_loop)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from run_checks import assert_run_equals_module

import torch2step
from hwmodel.presets import load_chip
from lowering.isa import Alloc, If, Loop, RecvValue, SendValue, walk
from models import get_layer
from torch2step.lower.blocks.gqa import gqa_decode_graph, gqa_inputs, gqa_reference
from torch2step.lower.blocks.moe import moe_graph, moe_inputs, moe_reference
from torch2step.spatial import simulate_graph, simulate_plan
from torch2step.spatial.plan import build_plan
from torch2step.spatial.reuse import PlanCache
from torch2step.step import run

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16
GQA = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}

#: Routing A: expert 0 gets tokens 0-7, the others share the rest; routing B keeps expert 0's
#: tokens (and so its count, on other rows) and sends nothing to expert 3; routing C gives
#: expert 2 a single token and expert 3 tokens again.
ROUTE_A = np.array([[0, 1 + t % 3] for t in range(8)] + [[1, 3]] * 8)
ROUTE_B = np.array([[0, 1 + t % 2] for t in range(8)] + [[1, 2]] * 8)
ROUTE_C = np.array([[0, 1]] * 7 + [[0, 2]] + [[1, 3]] * 8)

#: Units of expert ``e`` that do not depend on its token count (while it has tokens), and
#: those whose loops still follow it.
KEPT = (
    "per_i", "xt1", "xh", "gate_w", "gate", "up_w", "up", "act", "down_w", "h_rep",
    "down_mm", "down_cat", "down", "scaled",
    # loop over the Partition's output until its stop token (torch2step.spatial.stop_loop)
    "gw", "gw_col",
    # its trip count is the count the stop token forwards
    "out",
    # the rows held in one-row buffers allocated at the bound, received until the stop token
    # and read back count times per tile_i block, each read ending with the count as a stop
    # token that the row packing loops until (torch2step.spatial.buffer_loop)
    "buf", "xt",
)  # fmt: skip
#: Units of an expert that are one program also for no token: all of them.  The routing
#: weights' Map and packing take their element's form from the declared types when their
#: stream is empty (the loop then takes the stop token only and forwards it); the units after
#: the Bufferize learn from its buffer reference's channel whether it holds a row (the
#: reference, or the stop token: torch2step.spatial.guard).
EMPTY_KEPT = KEPT
#: The units that start with the guard (all of an expert's units after its Bufferize).
GUARDED = tuple(u for u in KEPT if u not in ("gw", "gw_col", "buf"))


def _guarded(body: tuple, ref: str) -> tuple:
    """The program of a guarded unit under its guard: ``RecvValue(ref, v, stop=s)``, then
    ``If(s < 0, program, tokens)`` (after its allocations)."""
    take, guard = body  # its buffers are allocated under the guard
    assert isinstance(take, RecvValue) and take.channel == ref and take.stop is not None
    assert isinstance(guard, If) and guard.cond.lhs == take.stop
    return guard.then


def _bodies(plan) -> dict[str, tuple]:
    """Unit name -> its program body."""
    at = {p.core: p.body for p in plan.programs.programs}
    return {u.name: at[u.core] for u in plan.placement.units}


def _iterations(loop: Loop) -> int:
    """The most iterations of a loop until a stop token, its inner loop (under the guard)
    counted (torch2step.spatial.stop_loop.until_stop)."""
    (guard,) = loop.body
    inner = [i for i in guard.then if isinstance(i, Loop)]
    return loop.count * (_iterations(inner[0]) if inner else 1)


def _moe(routes=(ROUTE_A, ROUTE_B)):
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    ins = [moe_inputs(**KW, tokens=T, seed=0, routing=r) for r in routes]
    return g, ins, [run(g, tensors=x, check=False) for x in ins]


def _check_fresh(g, chip, r, plan, sim) -> None:
    """The assembled plan of run ``r`` is its fresh plan: programs, per-unit bookkeeping
    (elements, FLOPs, step cycles, bytes held), placement, cycles and on-chip bytes."""
    fresh = build_plan(g, chip, r)
    assert plan.programs == fresh.programs
    assert plan.units == fresh.units
    assert plan.placement == fresh.placement
    again = simulate_plan(fresh)
    assert sim.cycles == again.cycles
    assert sim.peak_onchip_bytes == again.peak_onchip_bytes
    # the on-chip bytes reported are the simulated peaks of the units' cores
    peaks = {c.core: c.sram_peak_bytes for c in sim.stats.cores}
    assert all(u.sram_bytes == peaks[u.cores[0]] for u in sim.units)


def test_a_second_routing_reuses_every_unit_that_reads_its_sizes_at_run_time() -> None:
    g, ins, (ra, rb) = _moe()
    na, nb = (np.bincount(r.reshape(-1), minlength=4) for r in (ROUTE_A, ROUTE_B))
    assert na[0] == nb[0] and nb[3] == 0 and na[3] > 0 and (na[1:3] != nb[1:3]).all()
    assert (nb[1:3] > 0).all()
    chip = load_chip("step-sda")
    cache = PlanCache()
    cache.simulate(g, chip, ra)
    units = cache.units(g, chip)
    total = units.emitted
    sb = cache.simulate(g, chip, rb)
    assert cache.built == 2 and units.emitted + units.reused == 2 * total
    pa, _ = cache.plan_for(g, chip, ra)
    pb, _ = cache.plan_for(g, chip, rb)
    a, b = _bodies(pa), _bodies(pb)
    kept = [n for n in a if n.startswith("moe_e0_")] + [
        "moe_x_ld", "moe_idx_ld", "moe_w_ld", "moe_sum", "moe_store",
        # the routing units decide from the selectors' values at run time
        "moe_sel", "moe_route", "moe_route_w", "moe_back",
    ]  # fmt: skip
    # experts 1 and 2 get other token counts: every one of their units is kept
    kept += [f"moe_e{e}_{u}" for e in (1, 2) for u in KEPT]
    # no token in routing B: every unit is kept too (its guard takes the stop token)
    kept += [f"moe_e3_{u}" for u in EMPTY_KEPT]
    rebuilt: list[str] = []
    assert sorted(kept + rebuilt) == sorted(a)
    for n in kept:
        assert a[n] is b[n], f"unit %{n} was rebuilt"
    for n in rebuilt:
        assert a[n] is not b[n], f"unit %{n} was kept"
    assert units.reused == len(kept)
    assert (len(a), len(rebuilt)) == (85, 0)  # none, also of the expert without tokens
    for e in range(4):  # every unit after the Bufferize starts with the guard
        for u in GUARDED:
            _guarded(b[f"moe_e{e}_{u}"], f"moe_e{e}_buf")
    # expert 1's matmul holds its tokens' rows in buffers allocated at the bound (16 tokens)
    gate = _guarded(b["moe_e1_gate"], "moe_e1_buf")
    allocs = [i for i in gate if isinstance(i, Alloc) and i.held]
    assert allocs and all(i.shape == (T * 32,) for i in allocs)
    # its routing weights' units loop until the stop token (at most T elements and the token),
    # and the FlatMap back to rows as many times as the token's value says
    loops = {n: [i for i in b[f"moe_e1_{n}"] if isinstance(i, Loop)] for n in ("gw", "gw_col")}
    assert loops["gw"][0].count * 2 == T + 2 and _iterations(loops["gw_col"][0]) >= T + 1
    out = _guarded(b["moe_e1_out"], "moe_e1_buf")
    assert [i.count for i in out if isinstance(i, Loop)] == ["stop.moe_e1_scaled"]
    # its Bufferize receives until the stop token (at most T rows and the token) into T one-row
    # buffers held at the bound; its row packing loops over the two tile_i reads of them
    (recv, *_) = [i for i in b["moe_e1_buf"] if isinstance(i, Loop)]
    assert T + 1 <= _iterations(recv) < T + 1 + 5  # two loops nested 5 deep (until_stop)
    rows = [i for i in b["moe_e1_buf"] if isinstance(i, Alloc)]
    assert len(rows) == T and all(i.held and i.shape == (64,) for i in rows)
    xt = _guarded(b["moe_e1_xt"], "moe_e1_buf")
    assert [i.count for i in xt if isinstance(i, Loop)] == [2]
    _check_fresh(g, chip, rb, pb, sb)
    # the expert without tokens runs its units' guards only: they hold no byte in routing B
    empty = [u for u in sb.units if u.name in [f"moe_e3_{n}" for n in (*GUARDED, "buf")]]
    assert len(empty) == 17 and all(u.sram_bytes == 0 for u in empty)
    assert all(u.sram_bytes > 0 for u in sb.units if u.name in ("moe_e1_gate", "moe_e1_gate_w"))
    # functionally the run that drives both is PyTorch's layer
    for x, r in zip(ins, (ra, rb)):
        want = moe_reference(
            *(torch.as_tensor(x[k]) for k in ("x", "topk_idx", "topk_w")),
            *(torch.as_tensor(x[k]) for k in ("w_gate", "w_up", "w_down")),
        )
        got = torch.as_tensor(np.asarray(r.tensors["out"])).reshape(want.shape)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_third_routing_takes_units_kept_from_the_second() -> None:
    """Routing C after A and B: an expert of a single token and one that has tokens again;
    the units kept through B count their bookkeeping from C's streams."""
    g, _, runs = _moe((ROUTE_A, ROUTE_B, ROUTE_C))
    assert np.bincount(ROUTE_C.reshape(-1), minlength=4).tolist() == [8, 15, 1, 8]
    chip = load_chip("step-sda")
    cache = PlanCache()
    for r in runs[:2]:
        cache.simulate(g, chip, r)
    units = cache.units(g, chip)
    before = units.reused
    sc = cache.simulate(g, chip, runs[2])
    pb, _ = cache.plan_for(g, chip, runs[1])
    pc, _ = cache.plan_for(g, chip, runs[2])
    b, c = _bodies(pb), _bodies(pc)
    assert units.reused > before
    # no unit is built again for B or C: every expert's units serve every routing
    assert units.emitted == len(c) == 85
    assert all(b[n] is c[n] for n in c)
    for u in KEPT:
        assert b[f"moe_e2_{u}"] is c[f"moe_e2_{u}"], f"unit %moe_e2_{u} was rebuilt"
    # expert 3 gets tokens again: the packing kept through B (no token) serves C
    for u in EMPTY_KEPT:
        assert b[f"moe_e3_{u}"] is c[f"moe_e3_{u}"], f"unit %moe_e3_{u} was rebuilt"
    # and so does the packing built for B's empty stream, in a cache that starts with B
    fresh = PlanCache()
    fresh.simulate(g, chip, runs[1])
    sc = fresh.simulate(g, chip, runs[2])
    pb, _ = fresh.plan_for(g, chip, runs[1])
    pc, _ = fresh.plan_for(g, chip, runs[2])
    b, c = _bodies(pb), _bodies(pc)
    for u in EMPTY_KEPT:
        assert b[f"moe_e3_{u}"] is c[f"moe_e3_{u}"], f"unit %moe_e3_{u} was rebuilt"
    _check_fresh(g, chip, runs[2], pc, sc)
    _check_fresh(g, chip, runs[2], pc, sc)


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


#: Decode-attention units, every one kept for any KV-length set: the query and length loads,
#: the repeats, the cursor Scan (its cursors computed in registers and written into the tiles
#: it sends), the tile addresses (a loop over ``ceil(n / tile)`` from each cursor's registers,
#: the request's tile count sent ahead of its addresses), the K and V loads and the query's
#: Expand (loops over each request's count, addresses and row counts in registers, tiles held
#: in buffers of ``tile_kv`` rows), the online softmax (a loop over the count the Expand
#: forwards, each update timed by a row rule on the K tile's run-time rows), the output Map
#: and the store (torch2step.spatial.kv_loop).
KV_KEPT = (
    "attn_len", "attn_len_h", "attn_cursor", "attn_cursor1", "attn_q", "attn_q1", "attn_o",
    "attn_store", "attn_kv_addr", "attn_k", "attn_v", "attn_q_kv", "attn_softmax",
)  # fmt: skip


def _kv_plans(lens_a, lens_b):
    g = gqa_decode_graph(**GQA, batch=3, max_len=40, tile_kv=16)
    ins = [
        gqa_inputs(**GQA, batch=3, max_len=40, kv_lens=lens, seed=0) for lens in (lens_a, lens_b)
    ]
    ra, rb = (run(g, tensors=x, check=False) for x in ins)
    chip = load_chip("step-sda")
    cache = PlanCache()
    cache.simulate(g, chip, ra)
    sb = cache.simulate(g, chip, rb)
    pa, _ = cache.plan_for(g, chip, ra)
    pb, _ = cache.plan_for(g, chip, rb)
    _check_fresh(g, chip, rb, pb, sb)
    assert sb.cycles == simulate_graph(g, chip, rb).cycles
    for x, r in zip(ins, (ra, rb)):  # functionally PyTorch's attention
        want = gqa_reference(
            x["q"], x["k_cache"], x["v_cache"], x["kv_len"], num_q_heads=4, num_kv_heads=2,
            scale=1 / math.sqrt(16),
        )  # fmt: skip
        torch.testing.assert_close(torch.as_tensor(np.asarray(r.tensors["out"])), want)
    return _bodies(pa), _bodies(pb)


def _kept_and_rebuilt(a, b, kept, rebuilt) -> None:
    assert sorted(kept + rebuilt) == sorted(a)
    for n in kept:
        assert a[n] is b[n], f"unit %{n} was rebuilt"
    for n in rebuilt:
        assert a[n] is not b[n], f"unit %{n} was kept"


def test_a_second_kv_length_set_reuses_every_unit() -> None:
    """Decode attention, lengths with other tile counts per request (one of length 1, one of
    length 0: no tile at all): every unit of :data:`KV_KEPT` is kept, and the plan so
    assembled is a fresh build's (programs, bookkeeping, cycles, on-chip bytes)."""
    for lens_a, lens_b in (([5, 40, 17], [5, 33, 1]), ([5, 40, 17], [0, 1, 40])):
        a, b = _kv_plans(lens_a, lens_b)
        _kept_and_rebuilt(a, b, list(KV_KEPT), [])


def test_a_next_decode_step_keeps_every_unit() -> None:
    """Every length one longer, within the same tiles (also when every tile is shorter than
    ``tile_kv``), or crossing into a new tile: every unit is kept.  The loads and the softmax
    hold the K and V tiles in buffers of ``tile_kv`` rows, counted by what they hold
    (``Alloc.held``), and loop over each request's tile count."""
    cases = (([5, 38, 17], [6, 39, 18]), ([5, 3, 7], [6, 4, 8]), ([15, 16, 31], [16, 17, 32]))
    for lens_a, lens_b in cases:
        a, b = _kv_plans(lens_a, lens_b)
        _kept_and_rebuilt(a, b, list(KV_KEPT), [])
        for n in ("attn_k", "attn_v"):
            allocs = [i for i in b[n] if isinstance(i, Alloc)]
            assert allocs and all(i.shape == (16 * 16,) and i.held for i in allocs)
            # one loop per request over its tile count, received at run time
            loops = [i for i in b[n] if isinstance(i, Loop)]
            assert loops and all(isinstance(i.count, int) for i in loops)
            inner = [j for i in loops for j in i.body if isinstance(j, Loop)]
            assert inner and all(j.count == "ld.n" for j in inner)
        tiles = [i for i in b["attn_softmax"] if isinstance(i, Alloc) and i.shape == (16 * 16,)]
        assert len(tiles) == 2 and all(i.held for i in tiles)
        # the addresses and counts it sends are registers, none the run's literal
        sent = [i.value for i in walk(b["attn_kv_addr"]) if isinstance(i, SendValue)]
        assert sent and not any(isinstance(v, int) for v in sent)


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
