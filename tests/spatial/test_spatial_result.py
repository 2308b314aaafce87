"""What a spatial simulation reports, and properties that hold on every graph: determinism,
the trace, the roofline bound, traffic equal to the reference run's, data-dependent latency,
empty branches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spatial_graphs import (
    load_store,
    map_chain,
    moe,
    moe_selectors,
    regroup,
    routed,
    tiled_matmul,
    two_stage,
)

from hwmodel import load_chip
from torch2step.spatial import CATEGORIES, UnitConfig, roofline_cycles, simulate_graph
from torch2step.step import sel

CHIP = load_chip("step-sda")

GRAPHS = {
    "load_store": lambda: load_store(8),
    "map_chain": lambda: map_chain(8, ["exp", "relu"]),
    "two_stage": lambda: two_stage(8),
    "routed": lambda: routed([0, 1, 1, 0, 1]),
    "regroup": lambda: regroup([0, 1, 1, 0, 1, 0]),
    "tiled_matmul": lambda: tiled_matmul(128, 256, 128, 64),
    "moe": lambda: moe(6, 512, 128, 4, 2),
}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def simulated(request: pytest.FixtureRequest) -> tuple:
    prog, run = GRAPHS[request.param]()
    return prog, run, simulate_graph(prog, CHIP, run)


def test_traffic_and_work_equal_the_reference_run(simulated: tuple) -> None:
    """Every byte the interpreter reads or writes off-chip is one the simulator moves, and the
    units count the FLOPs of the §4.1 formulas."""
    prog, run, res = simulated
    assert res.hbm_read_bytes == sum(run.read_bytes.values())
    assert res.hbm_write_bytes == sum(run.write_bytes.values())
    assert res.flops == run.total_flops


def test_roofline_is_a_lower_bound(simulated: tuple) -> None:
    prog, run, res = simulated
    assert 0 < res.roofline <= res.cycles
    assert 0 < res.roofline_fraction <= 1
    assert roofline_cycles(prog, CHIP, run) == res.roofline == roofline_cycles(res, CHIP)


def test_cycle_breakdown_adds_up(simulated: tuple) -> None:
    prog, run, res = simulated
    for u in res.units:
        assert sum(getattr(u, c) for c in CATEGORIES) == res.cycles, u.name
    assert sum(res.breakdown.values()) == len(res.units) * res.cycles
    kinds = res.by_kind
    assert sum(row["units"] for row in kinds.values()) == len(res.units)
    assert sum(row["busy"] for row in kinds.values()) == res.breakdown["busy"]
    assert sum(row["flops"] for row in kinds.values()) == res.flops
    util = res.utilisation
    assert set(util) == {"hbm", "noc_links", "noc_links_peak", "units_busy", "compute"}
    assert all(0.0 <= v <= 1.0 for v in util.values()), util
    sram = sum(u.sram_bytes for u in res.units)
    assert res.peak_onchip_bytes == sram + res.fifo_bytes and sram > 0
    peak_sram = {c.core: c.sram_peak_bytes for c in res.stats.cores}
    assert sram == sum(peak_sram[u.cores[0]] for u in res.units)
    doc = json.loads(json.dumps(res.to_dict()))
    assert doc["cycles"] == res.cycles and len(doc["units"]) == len(res.units)
    assert res.events > 0 and res.sim_s > 0 and res.wall_s >= res.sim_s
    assert res.seconds == pytest.approx(res.cycles / (CHIP.clock_ghz * 1e9))


def test_runs_are_deterministic_down_to_the_trace(tmp_path: Path) -> None:
    prog, run = moe(6, 512, 128, 4, 2)
    a = simulate_graph(prog, CHIP, run, trace=tmp_path / "a.json")
    b = simulate_graph(prog, CHIP, run, trace=tmp_path / "b.json")
    assert a.cycles == b.cycles and a.units == b.units and a.stats == b.stats
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_trace_is_chrome_trace_json(tmp_path: Path) -> None:
    prog, run = two_stage(4)
    res = simulate_graph(prog, CHIP, run, trace=tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    assert events and all({"ph", "pid"} <= set(e) for e in events)
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert any("LinearOffChipLoad %ld1" in n for n in names)
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and max(e["ts"] + e["dur"] for e in spans) <= res.cycles
    assert doc["otherData"]["cycles"] == res.cycles
    untraced = simulate_graph(prog, CHIP, run)
    with pytest.raises(Exception, match="no trace was recorded"):
        untraced.trace_json()


def test_latency_follows_the_selector_data() -> None:
    """Partition routes by a selector *stream*: the same graph with other selector values
    sends the tokens to a slower branch, and takes longer."""
    slow = {"b1_m0": UnitConfig(flops_per_cycle=8), "b1_m1": UnitConfig(flops_per_cycle=8)}
    fast_prog, fast_run = routed([0] * 8)
    slow_prog, slow_run = routed([1] * 8)
    mixed_prog, mixed_run = routed([0, 1] * 4)
    fast = simulate_graph(fast_prog, CHIP, fast_run, configs=slow)
    slow_res = simulate_graph(slow_prog, CHIP, slow_run, configs=slow)
    mixed = simulate_graph(mixed_prog, CHIP, mixed_run, configs=slow)
    assert fast.cycles < mixed.cycles < slow_res.cycles
    # 8 tokens x 4 tiles, each a 256-FLOP multiply at 8 FLOPs/cycle: 32 cycles a tile
    assert slow_res.unit("b1_m0").busy == 32 * 32 and fast.unit("b1_m0").busy == 0
    assert fast.hbm_bytes == slow_res.hbm_bytes == mixed.hbm_bytes


def test_expert_without_tokens_loads_nothing_and_finishes() -> None:
    """An expert that receives no token (an empty stream) loads no weight, and the graph
    completes (no deadlock)."""
    sels = [[sel(0, 1), sel(0, 2), sel(1, 2), sel(0, 1)]]  # expert 3 gets nothing
    prog, run = moe(4, 512, 128, 4, 2, selectors=sels)
    assert run.bindings["route_n3"] == 0
    res = simulate_graph(prog, CHIP, run)
    assert res.hbm_bytes == run.offchip_bytes
    for name in ("ld_w1_3", "ld_w3_3", "ld_w2_3", "w1mm3", "st3"):
        u = res.unit(name)
        assert u.received == u.sent == u.busy == 0, name
    full = moe(4, 512, 128, 4, 2, selectors=moe_selectors(4, 4, 2))[1]
    assert full.bindings["route_n3"] > 0 and full.offchip_bytes > run.offchip_bytes


def test_reconvergent_selector_fifo_is_deepened() -> None:
    """The selector stream feeds the Partition and the Reassemble behind branches that take in
    every token before emitting one: with 2-slot FIFOs the run would deadlock, so exactly the
    selector channel (the full FIFO on the wait cycle) is made as deep as its 8 messages, and
    the run is no slower than one whose FIFOs are all that deep (there the token load runs
    ahead and its tiles reach the Partition's core in a different order with the selector
    values, which costs the Partition a few cycles: 536 against 527 here)."""
    prog, run = regroup([0, 1, 1, 0, 1, 0, 0, 1])
    res = simulate_graph(prog, CHIP, run)
    assert res.deep_channels == ("sel",)
    sel_chan = next(c for c in res.plan.programs.channels if c.name == "sel")
    assert sel_chan.depth == 8 and len(sel_chan.dsts) == 2
    assert res.fifo_bytes == 2 * 8 * 4  # two consumers, eight 4-byte selector messages
    assert res.peak_onchip_bytes == sum(u.sram_bytes for u in res.units) + res.fifo_bytes
    deep = simulate_graph(prog, CHIP, run, fifo_depth=8)
    assert deep.deep_channels == () and res.cycles <= deep.cycles
