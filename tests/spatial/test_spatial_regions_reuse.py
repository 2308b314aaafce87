"""A new chunk order and a new routing of expert regions shared in time (STeP arXiv 2511.07776
§5.3, ``moe_graph(..., lanes=R)``): which unit programs of the first run a plan keeps
(torch2step.spatial.unit_reuse), that the plan so assembled is a fresh build's, and that the run
stays PyTorch's.

What every run keeps:

* a region's expert id, weight-tile addresses, padding index and flags are computed in
  registers from the selector its EagerMerge sends (torch2step.spatial.region_values), and its
  weight RandomOffChipLoads load from the received registers: the region's value path is one
  program for every expert a chunk holds;
* a region's tiles of a chunk's rows are held in buffers allocated at the experts' token
  bound and timed by row rules: its matmuls, activation, repeats and column split are one
  program for every chunk size;
* each expert's chunk FlatMap and its scaling after the region loop until the Partition's
  stop token, also when the expert has no token (torch2step.spatial.region_rows).

* with static tiling, a region's EagerMerge takes whichever expert's tile is ready
  (torch2step.spatial.merge_any: a WaitAny over the experts' channels, decided in simulated
  time) and ends its selectors with a stop token, and every unit of the region loops over its
  chunks until it (torch2step.spatial.region_loop), so a new chunk order, and any routing
  (a new chunk count too, none at all: its units built for one chunk of zero tiles of the
  declared types), rebuild no unit.

* with dynamic tiling, a region's EagerMerge takes whichever expert's chunk is ready
  (torch2step.spatial.merge_any ``emit_ragged_any``: a WaitAny over the experts' channels,
  decided in simulated time), ends each chunk's rows with a stop token carrying their count
  and its selectors with a stop token, and every unit of the region loops over the chunks
  until it (torch2step.spatial.region_loop): the tile units, the units reading the chunk's
  rows (the Bufferize and its row packing, the selector Expand: loops until each chunk's
  token, torch2step.spatial.region_rows ``chunk_channels``), and the units after the tiles
  (torch2step.spatial.region_tail: the selector Map and the Partition back to the experts
  loop until the token the selector Expand forwards after each chunk's indices, the FlatMap
  back to rows over the count it sends), one program for every chunk size, count and order.

* with dynamic tiling and the routing weights applied in the regions (each row zipped with its
  token's expert ids and weights), the same: the merge's WaitAny takes whichever expert's chunk
  is ready, each row's parts from that expert's channel, and the FIFO depths are found for the
  order the timed run takes (torch2step.spatial.fifos).

No unit is rebuilt in any of these cases (a rebuilt unit fails the test).
"""

from __future__ import annotations

import numpy as np
import torch

from hwmodel.presets import load_chip
from lowering.isa import Load, Loop, Recv, RecvValue, SendValue, WaitAny, walk
from torch2step.lower.blocks.moe import moe_graph, moe_inputs, moe_reference
from torch2step.spatial import simulate_plan
from torch2step.spatial.dynamic import simulate_decided
from torch2step.spatial.plan import build_plan
from torch2step.spatial.reuse import PlanCache
from torch2step.step import run

CHIP = load_chip("step-sda")
#: Eight experts in two regions (four each), sixteen tokens: with seed 3 the order the
#: simulation decides for region 1 is not the interpreter's default one.
KW8 = {"num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64}
#: Four experts in two regions; routing A then B (B gives expert 3 no token, so region 1
#: takes one chunk instead of two, and expert 1 one token more).
KW4 = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
ROUTE_A = np.array([[0, 1 + t % 3] for t in range(8)] + [[1, 3]] * 8)
ROUTE_B = np.array([[0, 1 + t % 2] for t in range(8)] + [[1, 2]] * 8)
#: The §5.3 artifact's layer (the figures' configuration): routing weights after the regions.
ARTIFACT = {"scale_in_lanes": False}

#: A region's units that handle its chunks row by row after its tiles (dynamic tiling): they
#: loop over each chunk's rows (torch2step.spatial.region_tail), as the Bufferize, its row
#: packing and the selector Expand ("buf", "xt", "j_r") do until the chunk's stop token.
ROW_UNITS = ("out", "sel", "back")
#: Every unit of a region of the artifact's layer (dynamic tiling; static tiling adds the
#: padding flags' Map and index).
REGION_UNITS = (
    "merge", "j", "buf", "per_i", "xt", "xt1", "xh", "w0", "gu_a", "d_a", "gate_w", "gate",
    "up_w", "up", "act", "down_w", "h_rep", "down_mm", "down_cat", "down", "j1", "j_r", "out",
    "sel", "back",
)  # fmt: skip


def _bodies(plan) -> dict[str, tuple]:
    at = {p.core: p.body for p in plan.programs.programs}
    return {u.name: at[u.core] for u in plan.placement.units}


def _check(g, chip, r, plan, sim) -> None:
    """The assembled plan of run ``r`` is its fresh plan (programs, bookkeeping, placement,
    cycles and on-chip bytes)."""
    fresh = build_plan(g, chip, r)
    assert plan.programs == fresh.programs
    assert plan.units == fresh.units
    assert plan.placement == fresh.placement
    again = simulate_plan(fresh)
    assert (sim.cycles, sim.peak_onchip_bytes) == (again.cycles, again.peak_onchip_bytes)


def _reference(x: dict) -> torch.Tensor:
    return moe_reference(
        *(torch.as_tensor(x[k]) for k in ("x", "topk_idx", "topk_w")),
        *(torch.as_tensor(x[k]) for k in ("w_gate", "w_up", "w_down")),
    )


def _kept_rebuilt(g, runs) -> tuple[list[str], list[str], dict]:
    """Kept and rebuilt units of the second run's plan, assembled from the first's."""
    cache = PlanCache()
    cache.simulate(g, CHIP, runs[0])
    sim = cache.simulate(g, CHIP, runs[1])
    pa, _ = cache.plan_for(g, CHIP, runs[0])
    pb, _ = cache.plan_for(g, CHIP, runs[1])
    _check(g, CHIP, runs[1], pb, sim)
    a, b = _bodies(pa), _bodies(pb)
    units = cache.units(g, CHIP)
    kept = sorted(n for n in a if a[n] is b[n])
    assert units.reused == len(kept) and units.emitted == len(a) + len(a) - len(kept)
    return kept, sorted(n for n in a if a[n] is not b[n]), b


def _decided_order(extra: dict):
    """The graph, its inputs, the interpreter's run (default chunk order) and the run whose
    order the simulation decided (STeP §5.3: whichever expert's chunk is ready first)."""
    g = moe_graph(**KW8, tokens=16, lanes=2, tile_h=32, tile_i=32, **extra)
    ins = moe_inputs(**KW8, tokens=16, seed=3)
    first = run(g, tensors=ins, check=False)
    decided = simulate_decided(g, CHIP, ins, timing_only=False)
    assert decided.converged
    return g, ins, first, decided


def test_a_chunk_order_decided_in_simulated_time_rebuilds_no_unit_static() -> None:
    """Static tiling: the order the simulation decides is not the interpreter's; the merges
    decide it in the one simulation (WaitAny), and every unit keeps its program (every chunk a
    tile of the same rows, the expert's id and weight addresses in registers, the merge
    taking whichever expert is ready)."""
    g, ins, first, decided = _decided_order({**ARTIFACT, "static_tile": 4})
    order = {op: [s.indices[0] for s in first.values[f"{op}.1"].data] for op in decided.arrival}
    assert decided.arrival != order
    assert decided.rounds == 1
    kept, rebuilt, b = _kept_rebuilt(g, (first, decided.run))
    assert rebuilt == []
    assert len(kept) == 81
    # the weight loads read their tile addresses from registers, the id and addresses are
    # computed from the selector's register: no literal value is sent
    for u in ("j", "w0", "gu_a", "d_a", "j1", "j_r", "pad", "jpad", "sel"):
        sent = [i.value for i in walk(b[f"moe_l1_{u}"]) if isinstance(i, SendValue)]
        assert sent and not any(isinstance(v, int) for v in sent), u
    loads = [i for i in walk(b["moe_l1_gate_w"]) if isinstance(i, Load)]
    assert loads and all(i.region.starts[0].terms for i in loads)
    for r in (first, decided.run):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(ins), atol=1e-4, rtol=1e-4)


def test_a_chunk_order_decided_in_simulated_time_dynamic() -> None:
    """Dynamic tiling: region 1's order changes, so its positions get chunks of other rows;
    the merges decide it in the one simulation (WaitAny) and every unit keeps its program
    (the merge taking whichever expert's chunk is ready, every other unit looping over the
    chunks and each chunk's rows)."""
    g, _, first, decided = _decided_order(ARTIFACT)
    assert decided.arrival["moe_l1_merge"] != [0, 1, 2, 3]
    assert decided.rounds == 1
    kept, rebuilt, b = _kept_rebuilt(g, (first, decided.run))
    assert rebuilt == []
    assert {f"moe_l1_{u}" for u in ("merge", *ROW_UNITS)} <= set(kept)
    assert len(kept) == 83
    waits = [i for i in walk(b["moe_l1_merge"]) if isinstance(i, WaitAny)]
    assert len(waits) == 1 and len(waits[0].channels) == 4


def test_a_new_routing_keeps_every_expert_unit() -> None:
    """Routing B after A (artifact's layer, dynamic tiling): every unit outside the regions
    is kept (the routing, each expert's chunk and its scaling after the region, also of
    expert 3, which gets no token); region 1 takes one chunk instead of two, and both
    regions keep their tile units (they loop over the chunks until the merge's stop token,
    built for one chunk, their rows read at run time: torch2step.spatial.region_loop), and
    their Bufferize, row packing and selector Expand (loops until each chunk's stop token)
    and the row units after the tiles (loops over each chunk's rows), and their merges
    (whichever expert's chunk is ready, WaitAny): no unit is rebuilt."""
    g = moe_graph(**KW4, tokens=16, lanes=2, tile_h=32, tile_i=32, **ARTIFACT)
    ins = [moe_inputs(**KW4, tokens=16, seed=0, routing=r) for r in (ROUTE_A, ROUTE_B)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    assert runs[1].bindings["moe_n3"] == 0 < runs[0].bindings["moe_n3"]
    kept, rebuilt, b = _kept_rebuilt(g, runs)
    assert rebuilt == []
    assert {f"moe_l1_{u}" for u in REGION_UNITS} <= set(kept)
    # the row units after the tiles loop over each chunk's rows: the selector Map and the
    # Partition until the token the selector Expand forwards per chunk, the FlatMap back to
    # rows over the count it receives
    for u, ch in (("sel", "moe_l1_j_r"), ("back", "moe_l1_sel")):
        got = {i.channel for i in walk(b[f"moe_l1_{u}"]) if isinstance(i, RecvValue) and i.stop}
        assert ch in got, u
    tokens = [i for i in walk(b["moe_l1_j_r"]) if isinstance(i, SendValue)]
    assert [(i.channel, i.stop) for i in tokens[-2:]] == [
        ("moe_l1_j_r", True),
        ("moe_l1_j_r.rows", False),
    ]
    counts = [i for i in walk(b["moe_l1_out"]) if isinstance(i, RecvValue)]
    assert "moe_l1_j_r.rows" in {i.channel for i in counts}
    assert any(
        isinstance(i, Loop) and i.count == "rows.moe_l1_j_r.rows" for i in walk(b["moe_l1_out"])
    )
    experts = [f"moe_e{e}_{u}" for e in range(4) for u in ("chunk", "gw", "scaled")]
    assert set(experts) <= set(kept) and len(kept) + len(rebuilt) == 71
    # a tile unit loops over the chunks: its bookkeeping follows each chunk's rows
    plans = [build_plan(g, CHIP, r) for r in runs]
    gate = [next(u for u in p.units if u.name == "moe_l1_gate") for p in plans]
    assert gate[0].flops > gate[1].flops > 0
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_a_new_routing_with_the_weights_in_the_regions() -> None:
    """Routing B after A, dynamic tiling, the routing weights applied in the regions (the
    default layer: each row carries its token's expert ids and weights): every unit of a
    region that handles its chunks row by row loops over each chunk's rows until its stop
    token (the rows' parts, the expert ids along them, the weight picked per row and packed
    per chunk, back to rows and to the experts), and the merges take whichever expert's chunk
    is ready (WaitAny, decided in simulated time, torch2step.spatial.merge_any), the row's
    parts from the expert's one channel: no unit is rebuilt."""
    g = moe_graph(**KW4, tokens=16, lanes=2, tile_h=32, tile_i=32)
    ins = [moe_inputs(**KW4, tokens=16, seed=0, routing=r) for r in (ROUTE_A, ROUTE_B)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    kept, rebuilt, b = _kept_rebuilt(g, runs)
    assert rebuilt == [] and len(kept) == 76
    (wait,) = [i for i in walk(b["moe_l1_merge"]) if isinstance(i, WaitAny)]
    assert wait.channels == ("moe_e2_chunk", "moe_e3_chunk")
    rows = ("merge", "x", "ids", "wts", "eid", "gw", "gw_col", "scaled", "j_r", "out", "sel",
            "back")  # fmt: skip
    assert {f"moe_l{r}_{u}" for r in (0, 1) for u in rows} <= set(kept)
    # the weight picked per row loops until the tokens of its three inputs' chunk rows
    takes = {i.channel for i in walk(b["moe_l1_gw"]) if isinstance(i, Recv) and i.stop}
    assert takes == {"moe_l1_ids"}
    tokens = {i.channel for i in walk(b["moe_l1_gw"]) if isinstance(i, RecvValue)
              and i.reg == f"stop.{i.channel}"}  # fmt: skip
    assert tokens == {"moe_l1_wts", "moe_l1_eid"}
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_a_routing_of_as_many_static_tiles_keeps_every_unit() -> None:
    """Static tiling, routing D after A: every expert keeps its tile count (experts 1 and 3
    another padding of their last tile), so every region takes as many chunks: every unit is
    kept, the merges too (a row is real until the expert's stop token came, padding after)."""
    route_d = np.array([[0, 1]] * 4 + [[0, 2]] * 3 + [[0, 3]] + [[1, 3]] * 8)
    g = moe_graph(**KW4, tokens=16, lanes=2, tile_h=32, tile_i=32, static_tile=4, **ARTIFACT)
    ins = [moe_inputs(**KW4, tokens=16, seed=0, routing=r) for r in (ROUTE_A, route_d)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    counts = [[runs[i].bindings[f"moe_n{e}"] for e in range(4)] for i in (0, 1)]
    assert [-(-n // 4) for n in counts[0]] == [-(-n // 4) for n in counts[1]]
    assert counts[0] != counts[1]
    kept, rebuilt, _ = _kept_rebuilt(g, runs)
    assert rebuilt == [] and len(kept) == 73
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_static_tiles_with_the_weights_in_the_regions_keep_every_unit() -> None:
    """Static tiling, the routing weights applied in the regions (each row carries its
    token's expert ids and weights, each part from its own channel), routing B after A: the
    merge waits for any expert's rows (a WaitAny over the experts' first parts, the other
    parts and their stop tokens taken with them), so every unit is kept."""
    g = moe_graph(**KW4, tokens=16, lanes=2, tile_h=32, tile_i=32, static_tile=4)
    ins = [moe_inputs(**KW4, tokens=16, seed=0, routing=r) for r in (ROUTE_A, ROUTE_B)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    kept, rebuilt, b = _kept_rebuilt(g, runs)
    assert rebuilt == [] and len(kept) == 88
    (wait,) = [i for i in walk(b["moe_l1_merge"]) if isinstance(i, WaitAny)]
    assert wait.channels == ("moe_e2_part0", "moe_e3_part0")
    tokens = {i.channel for i in walk(b["moe_l1_merge"]) if isinstance(i, RecvValue)}
    assert tokens == {f"moe_e{e}_part{j}" for e in (2, 3) for j in (1, 2)}
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_a_new_chunk_count_keeps_every_unit_static() -> None:
    """Static tiling, routing B after A: region 1 takes three chunks instead of four (expert 3
    gets no token, expert 2 a tile more), region 0 as many in another split: every unit is
    kept (a region's units loop over its chunks until its merge's stop token, built for one
    chunk), the plan is a fresh build's and the run PyTorch's."""
    g = moe_graph(**KW4, tokens=16, lanes=2, tile_h=32, tile_i=32, static_tile=4, **ARTIFACT)
    ins = [moe_inputs(**KW4, tokens=16, seed=0, routing=r) for r in (ROUTE_A, ROUTE_B)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    tiles = [[-(-runs[i].bindings[f"moe_n{e}"] // 4) for e in range(4)] for i in (0, 1)]
    assert tiles == [[2, 3, 1, 3], [2, 3, 3, 0]]
    kept, rebuilt, b = _kept_rebuilt(g, runs)
    assert rebuilt == [] and len(kept) == 73

    # every unit of a region reads its merge's selectors until the stop token, but the
    # weight loads, which load at each address until the address unit forwards the token
    def takes(u: str) -> set[str]:
        return {i.channel for i in walk(b[f"moe_l1_{u}"]) if isinstance(i, RecvValue) and i.stop}

    for u in ("x", "buf", "gu_a", "down", "out", "back"):
        assert "moe_l1_merge.1" in takes(u), u
    assert takes("gate_w") == takes("up_w") == {"moe_l1_gu_a"}
    assert takes("down_w") == {"moe_l1_d_a"}
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_a_region_without_a_chunk_keeps_its_units_static() -> None:
    """Static tiling, a routing that gives region 1 (experts 4-7) no token, then one that
    does, and back: every unit is kept either way (the empty region's units are built for one
    chunk of zero tiles of their declared types and loop over none), the plans are fresh
    builds' and the runs PyTorch's."""
    route_e = np.array([[t % 4, (t + 1) % 4] for t in range(16)])
    route_f = np.array([[t % 8, (t + 3) % 8] for t in range(16)])
    g = moe_graph(**KW8, tokens=16, lanes=2, tile_h=32, tile_i=32, static_tile=4, **ARTIFACT)
    ins = [moe_inputs(**KW8, tokens=16, seed=0, routing=r) for r in (route_e, route_f)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    assert sum(runs[0].bindings[f"moe_n{e}"] for e in range(4, 8)) == 0
    for order in (runs, runs[::-1]):
        kept, rebuilt, b = _kept_rebuilt(g, order)
        assert rebuilt == [] and len(kept) == 81
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_a_region_without_a_chunk_keeps_its_tile_units_dynamic() -> None:
    """Dynamic tiling, region 1 without a token, then with tokens: its units are built for a
    blank chunk of one row when it has none (the units after the tiles too, whose row loops
    give the selector Expand's output a reader), and the merges take the experts' chunks or
    stop tokens as they come: every unit is kept."""
    route_e = np.array([[t % 4, (t + 1) % 4] for t in range(16)])
    route_f = np.array([[t % 8, (t + 3) % 8] for t in range(16)])
    g = moe_graph(**KW8, tokens=16, lanes=2, tile_h=32, tile_i=32, **ARTIFACT)
    ins = [moe_inputs(**KW8, tokens=16, seed=0, routing=r) for r in (route_e, route_f)]
    runs = [run(g, tensors=x, check=False) for x in ins]
    for order in (runs, runs[::-1]):
        kept, rebuilt, _ = _kept_rebuilt(g, order)
        assert rebuilt == [] and len(kept) == 83
    for x, r in zip(ins, runs):
        got = torch.as_tensor(np.asarray(r.tensors["out"]))
        torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)


def test_a_static_merge_decides_in_the_simulation() -> None:
    """Static tiling: each region's merge program waits for any of its experts' channels
    (WaitAny) instead of naming a chunk order, and the order simulate_decided reports is the
    one those WaitAny choices made in a single simulation of the interpreter's run (an
    expert's choice past its tiles took its stop token alone: expert 1 of region 0 has no
    token)."""
    from runtime.ops_select import watch_key
    from torch2step.spatial import simulate_graph
    from torch2step.spatial.merge_any import pick

    g, _, first, decided = _decided_order({**ARTIFACT, "static_tile": 4})
    merges = {op.name: op for op in g.nodes if op.name in decided.arrival}
    bodies = _bodies(build_plan(g, CHIP, first))
    watch = {watch_key(pick(op)): [] for op in merges.values()}
    simulate_graph(g, CHIP, first, watch=watch)
    for name, op in merges.items():
        waits = [i for i in walk(bodies[name]) if isinstance(i, WaitAny)]
        assert len(waits) == 1 and len(waits[0].channels) == len(op.ins)
        # one selector per input, whichever order the run took them in
        sent = [
            i for i in walk(bodies[name]) if isinstance(i, SendValue) and i.channel == f"{name}.1"
        ]
        assert [i.value for i in sent if not i.stop] == [1 << k for k in range(len(op.ins))]
        # then the stop token, carrying the chunks sent (its region's units loop until it)
        assert [i.value for i in sent if i.stop] == [f"chunks.{name}"]
        chose = watch[watch_key(pick(op))]
        left = [len(first.values[v.name].data) for v in op.ins]
        tiles = []
        for i in chose:
            if left[i]:
                left[i] -= 1
                tiles.append(i)
        assert tiles == decided.arrival[name] and not any(left)
    assert len(watch[watch_key("pick.moe_l0_merge")]) > len(decided.arrival["moe_l0_merge"])


def test_a_region_without_tokens_waits_for_its_stop_tokens_only() -> None:
    """Static tiling, no token for region 1 (experts 4-7): its merge is the same run-time
    program (its row type from the declared stream type) and takes only the experts' stop
    tokens; the simulation decides in one round and the run is PyTorch's."""
    route = np.array([[t % 4, (t + 1) % 4] for t in range(16)])
    g = moe_graph(**KW8, tokens=16, lanes=2, tile_h=32, tile_i=32, static_tile=4, **ARTIFACT)
    x = moe_inputs(**KW8, tokens=16, seed=0, routing=route)
    decided = simulate_decided(g, CHIP, x, timing_only=False)
    assert decided.converged and decided.rounds == 1
    assert decided.arrival["moe_l1_merge"] == []
    body = _bodies(build_plan(g, CHIP, decided.run))["moe_l1_merge"]
    assert [len(i.channels) for i in walk(body) if isinstance(i, WaitAny)] == [4]
    got = torch.as_tensor(np.asarray(decided.run.tensors["out"]))
    torch.testing.assert_close(got.reshape(16, 64), _reference(x), atol=1e-4, rtol=1e-4)
