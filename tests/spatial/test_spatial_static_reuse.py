"""A second routing under static tiling (STeP arXiv 2511.07776 §5.2) and under expert regions
shared in time (§5.3): which unit programs of the first routing it keeps (unit_reuse), and
that the plan so assembled is the fresh one and the run PyTorch's.

Static tiling cuts expert ``e``'s ``n_e`` rows into ``C_e = ceil(n_e / N)`` tiles, the last
padded.  Its Bufferize loops over the tiles until the Partition's stop token, sending each
tile's reference with the tile's real rows as its value, then the token; every unit after it
loops over its one-tile program once per reference until that token, the routing weights'
packing loops until its own input's token, and the FilterPadding keeps the rows below the
reference's value (torch2step.spatial.tile_loop): every unit is kept for every routing, whatever
the experts' tile counts (down to none); with the tile packed once (``repeat_tile``) too, its
packing sending each tile's real rows on a control channel.  With regions a lane's units
loop over the chunks its EagerMerge takes and over each chunk's rows, and the merge takes
whichever expert's chunk is ready: a new routing rebuilds no unit either
(test_spatial_regions_reuse.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import torch2step
from hwmodel.presets import load_chip
from lowering.isa import Affine, Cond, If, Loop, Recv, RecvValue, Send, SendValue
from models import get_layer
from torch2step.lower.blocks.moe import moe_graph, moe_inputs, moe_reference
from torch2step.spatial import simulate_plan
from torch2step.spatial.plan import build_plan
from torch2step.spatial.reuse import PlanCache
from torch2step.step import run

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16
N = 4  # the static tile
#: Counts [8, 11, 3, 10]: tiles [2, 3, 1, 3].
ROUTE_A = np.array([[0, 1 + t % 3] for t in range(8)] + [[1, 3]] * 8)
#: Counts [8, 12, 12, 0]: expert 2 gets 3 tiles, expert 3 none.
ROUTE_B = np.array([[0, 1 + t % 2] for t in range(8)] + [[1, 2]] * 8)
#: Counts [8, 12, 3, 9]: as many tiles as routing A, other padding for experts 1 and 3.
ROUTE_D = np.array([[0, 1]] * 4 + [[0, 2]] * 3 + [[0, 3]] + [[1, 3]] * 8)

#: Units of a statically tiled expert (``tile_h=32``: the column split and its concatenation).
STATIC_UNITS = (
    "buf", "per_i", "xt", "xt1", "xh", "gate_w", "gate", "up_w", "up", "act", "down_w", "h_rep",
    "down_mm", "down_cat", "down", "gw", "gw_col", "scaled", "out", "unpad",
)  # fmt: skip
SHARED = (
    "moe_x_ld", "moe_idx_ld", "moe_w_ld", "moe_sel", "moe_route", "moe_route_w", "moe_back",
    "moe_sum", "moe_store",
)  # fmt: skip


def _bodies(plan) -> dict[str, tuple]:
    at = {p.core: p.body for p in plan.programs.programs}
    return {u.name: at[u.core] for u in plan.placement.units}


def _two_routings(extra: dict, routes: tuple) -> tuple[dict, dict]:
    """Unit name -> program of the first and of the second routing, the second assembled from
    the first's units; checks it is the fresh plan and both runs are PyTorch's layer."""
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32, **extra)
    ins = [moe_inputs(**KW, tokens=T, seed=0, routing=r) for r in routes]
    runs = [run(g, tensors=x, check=False) for x in ins]
    chip = load_chip("step-sda")
    cache = PlanCache()
    cache.simulate(g, chip, runs[0])
    sim = cache.simulate(g, chip, runs[1])
    pa, _ = cache.plan_for(g, chip, runs[0])
    pb, _ = cache.plan_for(g, chip, runs[1])
    fresh = build_plan(g, chip, runs[1])
    assert pb.programs == fresh.programs and pb.units == fresh.units
    assert pb.placement == fresh.placement
    again = simulate_plan(fresh)
    assert (sim.cycles, sim.peak_onchip_bytes) == (again.cycles, again.peak_onchip_bytes)
    for x, r in zip(ins, runs):  # functionally PyTorch's layer (also for an empty expert)
        want = moe_reference(
            *(torch.as_tensor(x[k]) for k in ("x", "topk_idx", "topk_w")),
            *(torch.as_tensor(x[k]) for k in ("w_gate", "w_up", "w_down")),
        )
        got = torch.as_tensor(np.asarray(r.tensors["out"])).reshape(want.shape)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return _bodies(pa), _bodies(pb)


def _split(a: dict, b: dict) -> tuple[list[str], list[str]]:
    kept = sorted(n for n in a if a[n] is b[n])
    return kept, sorted(n for n in a if a[n] is not b[n])


def _counts(route: np.ndarray) -> list[int]:
    return np.bincount(route.reshape(-1), minlength=4).tolist()


def _ifs(body: tuple, unrolled: bool = False, env: dict[str, int] | None = None) -> list[If]:
    """The ``If`` instructions of a program (``unrolled``: each as often as it runs for one
    tile: the loops over a tile's rows unrolled, a folded loop (no variable) or a row loop
    (variable ``k.*``) and its condition's left side evaluated at the row; the loop over the
    tiles is not unrolled)."""
    env = {} if env is None else env
    out = []
    for i in body:
        if isinstance(i, If):
            if unrolled and isinstance(i.cond.lhs, Affine):
                i = dataclasses.replace(
                    i, cond=dataclasses.replace(i.cond, lhs=i.cond.lhs.eval(env))
                )
            out.append(i)
            out += _ifs(i.then, unrolled, env) + _ifs(i.orelse, unrolled, env)
        elif isinstance(i, Loop):
            rows = i.var is None or i.var.startswith("k.")
            if unrolled and rows and isinstance(i.count, int):
                for t in range(i.count):
                    out += _ifs(i.body, unrolled, env if i.var is None else {**env, i.var: t})
            else:
                out += _ifs(i.body, unrolled, env)
    return out


def test_static_tiling_keeps_the_units_of_another_padding() -> None:
    """Routing D after A: experts 1 and 3 get other token counts of as many tiles (other
    padding of their last tile); every unit is kept, also their Bufferize, routing-weight
    packing and FilterPadding, which decide the padding of each tile at run time."""
    na, nd = _counts(ROUTE_A), _counts(ROUTE_D)
    assert [-(-n // N) for n in na] == [-(-n // N) for n in nd]
    assert [n % N for n in na] != [n % N for n in nd] and na[0] == nd[0] and na[2] == nd[2]
    a, d = _two_routings({"static_tile": N}, (ROUTE_A, ROUTE_D))
    kept, rebuilt = _split(a, d)
    assert rebuilt == []
    every = [f"moe_e{e}_{u}" for e in range(4) for u in STATIC_UNITS] + list(SHARED)
    assert sorted(kept + rebuilt) == sorted(a) == sorted(every) and len(every) == 89
    # every tile's rows are received until the Partition's stop token, in a loop over at most
    # ceil(T / N) + 1 tiles, and each read sends row j if it is real, else a zero row: decided
    # by the tile's real rows, the value of the reference sent ahead of its reads
    buf = d["moe_e1_buf"]
    stop = "stop.moe_route.1"
    (loop,) = [i for i in buf if isinstance(i, Loop)]
    assert loop.count == T // N + 1
    guarded = [i for i in _ifs(buf) if i.cond == Cond(stop, "<", 0)]
    assert sum(isinstance(i.then[0], Recv) and i.then[0].stop == stop for i in guarded) == N
    rows = [i for i in _ifs(buf) if i.cond.rhs == "rows.moe_e1_buf" and i.orelse]
    assert sorted(i.cond.lhs for i in rows) == list(range(N))  # in a loop over the reads
    assert buf[-1] == SendValue("moe_e1_buf", stop, stop=True)  # the count, after the tiles
    col = [i for i in _ifs(d["moe_e1_gw_col"], True) if i.cond == Cond("stop.moe_e1_gw", "<", 0)]
    assert sum(bool(i.orelse) for i in col) == 2 * (N - 1)  # a tile's first row is real
    # ... the rows' identical steps in a loop, not one branch per row in the program
    assert sum(bool(i.orelse) for i in _ifs(d["moe_e1_gw_col"])) < 2 * (N - 1)
    # the FilterPadding unit reads each tile's reference and keeps the tile's real rows, then
    # takes the count after the tiles
    unpad = d["moe_e1_unpad"]
    assert unpad[0] == RecvValue("moe_e1_buf", "ref.moe_e1_buf", "stop.moe_e1_buf")
    assert unpad[-1] == RecvValue("moe_e1_out", "stop.moe_e1_out")
    keep = [i for i in _ifs(unpad, True) if i.cond.rhs == "ref.moe_e1_buf"]
    assert sorted(i.cond.lhs for i in keep) == list(range(N))
    assert len([i for i in _ifs(unpad) if i.cond.rhs == "ref.moe_e1_buf"]) < N  # a row loop
    assert all(any(isinstance(j, Send) for j in i.then) for i in keep)
    assert not any(isinstance(j, Send) for i in keep for j in i.orelse)


def test_static_tiling_with_the_tile_packed_once_keeps_every_unit() -> None:
    """As the paper's Fig. 2 builds it (``repeat_tile``: the expert's rows packed into its
    tile once by a ``retile_row`` Accum, then repeated per ``tile_i`` block): that packing
    appends the real rows or zeros as the count says, so routing D keeps every unit."""
    a, d = _two_routings({"static_tile": N, "repeat_tile": True}, (ROUTE_A, ROUTE_D))
    assert len(a) == 85 and "moe_e1_xt0" in a
    assert _split(a, d)[1] == []


def test_static_tiling_keeps_every_unit_when_tile_counts_change() -> None:
    """Routing B after A (and A after B): expert 2 goes from one tile to three and expert 3
    from three to none; every unit is kept, their units looping over the tiles until the
    stop token on the Bufferize's references (for expert 3 only the token comes)."""
    a, b = _two_routings({"static_tile": N}, (ROUTE_A, ROUTE_B))
    kept, rebuilt = _split(a, b)
    assert rebuilt == [] and len(kept) == 89
    scaled = b["moe_e3_scaled"]  # no tile: the token arm only, its buffers never allocated
    assert scaled[0] == RecvValue("moe_e3_buf", "ref.moe_e3_buf", "stop.moe_e3_buf")
    assert isinstance(scaled[1], If) and any(isinstance(i, Loop) for i in scaled[1].then)
    assert scaled[-2:] == (
        RecvValue("moe_e3_gw_col", "stop.moe_e3_gw_col"),
        SendValue("moe_e3_scaled", "stop.moe_e3_gw_col"),
    )
    b2, a2 = _two_routings({"static_tile": N}, (ROUTE_B, ROUTE_A))
    assert _split(b2, a2)[1] == []


def test_static_tiling_packed_once_keeps_every_unit_when_tile_counts_change() -> None:
    """With the tile packed once (``repeat_tile``, no Bufferize references) the packing sends
    each tile's real rows, then the stop token, on a control channel of its own, which the
    units after it read as references: routing B after A rebuilds no unit either."""
    a, b = _two_routings({"static_tile": N, "repeat_tile": True}, (ROUTE_A, ROUTE_B))
    kept, rebuilt = _split(a, b)
    assert rebuilt == [] and len(kept) == 85
    head = b["moe_e2_xt0"]
    ctl = "moe_e2_xt0.tiles"
    assert head[-1] == SendValue(ctl, "stop.moe_route.2", stop=True)
    assert any(isinstance(i, SendValue) and i.channel == ctl for j in _ifs(head) for i in j.then)
    assert not any(isinstance(i, SendValue) and i.channel == "moe_e2_xt0" for i in head)
    # a weight load takes the control message as its reference, not the packed tile, and loads
    # one tile's weights per message
    gate_w = b["moe_e2_gate_w"]
    assert gate_w[0] == RecvValue(ctl, f"v.{ctl}.0", "stop." + ctl)
    assert "'moe_e2_xt0'" not in repr(gate_w)  # no instruction on the tiles' channel
    # the next tile's reference is taken inside the loop, amid the current tile's sends (the
    # loads pipelined across tiles)
    (arm,) = [i for i in gate_w if isinstance(i, If)]
    (loop,) = [i for i in arm.then if isinstance(i, Loop)]
    assert repr(loop).count(f"RecvValue(channel='{ctl}'") == 1
    assert "Send(" in repr(loop)


#: Under two regions (each shared in time by two experts, §5.3) a new routing keeps every unit
#: (test_spatial_regions_reuse.py has the full account): the loads, the routing units, the sum
#: and store, every expert's chunk (a loop until its stop token), every region's units that
#: handle its chunks tile by tile (the expert id and weight addresses in registers, the tiles'
#: rows at run time) and row by row (loops over each chunk's rows until its stop token: the
#: rows' parts, the expert ids along them, the routing weights picked and packed per chunk,
#: torch2step.spatial.region_rows, .region_tail), and the merges, which take whichever
#: expert's chunk is ready (a WaitAny decided in simulated time, the rows' routing data
#: taken with them, torch2step.spatial.merge_any) although region 0's chunks have other
#: sizes, expert 1 a token more, and region 1 takes one chunk instead of two.


def test_regions_keep_every_unit_when_their_chunks_change() -> None:
    a, b = _two_routings({"lanes": 2}, (ROUTE_A, ROUTE_B))
    kept, rebuilt = _split(a, b)
    assert rebuilt == [] and len(kept) == 76
    assert {"moe_l0_merge", "moe_l1_merge"} <= set(kept)
    rows = ("x", "buf", "xt", "j_r", "eid", "ids", "wts", "gw", "gw_col", "out", "sel", "back")
    assert {f"moe_l{r}_{u}" for r in (0, 1) for u in rows} <= set(kept)
    assert {f"moe_e{e}_chunk" for e in range(4)} <= set(kept)
    assert {"moe_l1_gate", "moe_l1_gate_w", "moe_l1_j", "moe_l1_down"} <= set(kept)


def test_report_on_a_new_routing_under_static_tiling() -> None:
    """``Program.report`` with another routing under static tiling takes units of the first
    routing; its cycles and on-chip bytes are a fresh program's."""
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    x = spec.example_inputs
    prog = torch2step.compile(spec.module, x, chip="step-sda", moe_static_tile=2)
    prog.report(*x)
    ids = np.stack([np.arange(8) % 2, 2 + np.arange(8) % 3], axis=1)
    moved = prog.report(*x, routing=ids)
    units = prog._plans.units(prog.lowered.program, prog.chip)
    assert prog._plans.built == 2 and units.reused > 0
    fresh = torch2step.compile(spec.module, x, chip="step-sda", moe_static_tile=2)
    again = fresh.report(*x, routing=ids)
    assert moved.latency_cycles == again.latency_cycles
    assert moved.simulated_onchip_bytes == again.simulated_onchip_bytes
