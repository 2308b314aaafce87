"""EagerMerge decided in simulated time (STeP, arXiv 2511.07776, §5.3): the order a merge
forwards its inputs follows which producer the simulation makes ready first, so changing only
the timing (a unit's compute bandwidth, the NoC) changes the decision, not the data."""

from __future__ import annotations

import dataclasses

import numpy as np

from hwmodel import load_chip
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.spatial.dynamic import simulate_decided
from torch2step.spatial.timing import UnitConfig
from torch2step.step import Graph, run

H = 64


def _two_producers():
    g = Graph("merge2")
    a = g.tensor("a", (4, H), "fp32")
    b = g.tensor("b", (4, H), "fp32")
    out = g.tensor("out", (8, H), "fp32")
    ra = g.map("exp", g.linear_load(a, (1, H), out_shape=(4,), stride=(1,)), name="pa")
    rb = g.map("exp", g.linear_load(b, (1, H), out_shape=(4,), stride=(1,)), name="pb")
    merged, _ = g.eager_merge([g.promote(ra), g.promote(rb)], name="merge")
    g.linear_store(g.flatten(merged, 0, 1), out)
    prog = g.build()
    x = np.ones((4, H), np.float32)
    return prog, {"a": x, "b": 2 * x}


def test_the_slower_producer_is_merged_second() -> None:
    prog, ins = _two_producers()
    slow_a = simulate_decided(prog, "step-sda", ins, configs={"pa": UnitConfig(1)})
    slow_b = simulate_decided(prog, "step-sda", ins, configs={"pb": UnitConfig(1)})
    assert slow_a.converged and slow_b.converged
    assert slow_a.arrival["merge"] == [1, 0]
    assert slow_b.arrival.get("merge", [0, 1]) == [0, 1]
    # the data follows the decision: b's rows first when a is slow
    out = np.asarray(run(prog, tensors=ins, arrival=slow_a.arrival).tensors["out"])
    np.testing.assert_allclose(out[:4], np.exp(2 * ins["a"]), rtol=1e-6)


def test_a_slower_hbm_keeps_a_decided_order_consistent() -> None:
    """Expert lanes: the decided order is a fixed point of the simulation on either HBM."""
    kw = {"num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64}
    g = moe_graph(**kw, tokens=16, lanes=2, tile_h=32, tile_i=32)
    ins = moe_inputs(**kw, tokens=16, seed=3)
    chip = load_chip("step-sda")
    slow = dataclasses.replace(chip, hbm=dataclasses.replace(chip.hbm, latency_cycles=4000))
    fast_d = simulate_decided(g, chip, ins)
    slow_d = simulate_decided(g, slow, ins)
    assert fast_d.converged and slow_d.converged
    assert slow_d.result.cycles > fast_d.result.cycles
    for d in (fast_d, slow_d):
        again = run(g, tensors=ins, arrival=d.arrival, check=False)
        assert again.offchip_bytes == d.run.offchip_bytes


def test_a_merge_names_a_chunk_only_once_its_data_is_there() -> None:
    """An EagerMerge cannot say which input it took before that input is ready: each chunk's
    selector leaves the merge after the chunk's first element arrived, so the region's weight
    addresses (computed from the selector, STeP §5.3) follow the tokens, not the program's
    start.  The merge takes the chunks in the order its WaitAny decides in the simulation
    (an expert without a token only gives its stop token: no selector)."""
    from runtime.ops_select import watch_key
    from torch2step.spatial import simulate_graph
    from torch2step.spatial.dynamic import _sources
    from torch2step.spatial.merge_any import pick
    from torch2step.step.ops_routing import EagerMerge

    kw = {"num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64}
    g = moe_graph(**kw, tokens=16, lanes=2, tile_h=32, tile_i=32)
    ins = moe_inputs(**kw, tokens=16, seed=3)
    src = _sources(g)
    merges = [op for op in g.nodes if isinstance(op, EagerMerge)]
    assert merges
    watch: dict = {}
    for op in merges:
        watch[op.out_names()[1]] = []
        watch[watch_key(pick(op))] = []
        for v in op.ins:
            watch[src.get(v.name, v.name)] = -1
    res = run(g, tensors=ins, check=False)
    simulate_graph(g, "step-sda", res, watch=watch)
    for op in merges:
        sels = watch[op.out_names()[1]]
        chunks = [len(res.values[v.name].data) for v in op.ins]
        order = [i for i in watch[watch_key(pick(op))] if chunks[i]]
        assert sorted(order) == [i for i, n in enumerate(chunks) if n]
        # then the stop token its region's units loop until (torch2step.spatial.region_loop)
        assert len(sels) == len(order) + 1 and len(order) > 0
        assert sels[-1] > sels[-2]
        for cycle, i in zip(sels, order):
            first = watch[src.get(op.ins[i].name, op.ins[i].name)]
            assert 0 <= first < cycle  # the chunk's input had sent before its selector left


def test_a_slower_noc_flips_a_region_merge() -> None:
    """Expert regions with dynamic tiling (the §5.3 artifact's layer): only the chip's NoC hop
    latency changes (1 -> 20 cycles), not the data, and region 1's merge takes its experts'
    chunks in another order (each expert's chunk unit sits at its own distance from the
    merge, so which chunk is ready first follows the simulated timing); either order is a
    fixed point of its simulation and the layer's result is PyTorch's."""
    import torch

    from torch2step.lower.blocks.moe import moe_reference

    kw = {"num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64}
    g = moe_graph(**kw, tokens=16, lanes=2, tile_h=32, tile_i=32, scale_in_lanes=False)
    ins = moe_inputs(**kw, tokens=16, seed=3)
    chip = load_chip("step-sda")
    slow = dataclasses.replace(chip, noc=dataclasses.replace(chip.noc, hop_latency_cycles=20))
    fast_d = simulate_decided(g, chip, ins, timing_only=False)
    slow_d = simulate_decided(g, slow, ins, timing_only=False)
    assert fast_d.converged and slow_d.converged
    assert fast_d.arrival["moe_l0_merge"] == slow_d.arrival["moe_l0_merge"]
    assert fast_d.arrival["moe_l1_merge"] != slow_d.arrival["moe_l1_merge"]
    assert sorted(fast_d.arrival["moe_l1_merge"]) == sorted(slow_d.arrival["moe_l1_merge"])
    want = moe_reference(
        *(torch.as_tensor(ins[k]) for k in ("x", "topk_idx", "topk_w")),
        *(torch.as_tensor(ins[k]) for k in ("w_gate", "w_up", "w_down")),
    )
    for d in (fast_d, slow_d):
        got = torch.as_tensor(np.asarray(d.run.tensors["out"])).reshape(16, 64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_slower_noc_reorders_a_default_tiling_merge() -> None:
    """The default layer (dynamic tiling, the routing weights applied in the regions: each row
    zipped with its token's expert ids and weights): the region merges take whichever expert's
    chunk arrives first (WaitAny, torch2step.spatial.merge_any), decided in the one simulation.
    On a chip whose FIFOs hold 16 messages (the Partition sends a token's rows on without
    waiting for credits) only the NoC hop latency changes (1 -> 20 cycles), not the data:
    each expert's chunk unit sits at its own distance from the merge, and region 0 takes its
    experts' chunks in another order.  The FIFOs deepened are those each run's own order needs
    (torch2step.spatial.fifos), and either run's result is PyTorch's."""
    import torch

    from torch2step.lower.blocks.moe import moe_reference

    kw = {"num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64}
    g = moe_graph(**kw, tokens=16, lanes=2, tile_h=32, tile_i=32)
    ins = moe_inputs(**kw, tokens=16, seed=0)
    base = load_chip("step-sda")
    chip = dataclasses.replace(base, core=dataclasses.replace(base.core, fifo_depth=16))
    slow = dataclasses.replace(chip, noc=dataclasses.replace(chip.noc, hop_latency_cycles=20))
    fast_d = simulate_decided(g, chip, ins, timing_only=False)
    slow_d = simulate_decided(g, slow, ins, timing_only=False)
    for d in (fast_d, slow_d):  # decided in the one simulation (no re-simulated order)
        assert d.converged and d.rounds == 1
    assert fast_d.arrival["moe_l0_merge"] != slow_d.arrival["moe_l0_merge"]
    assert sorted(fast_d.arrival["moe_l0_merge"]) == sorted(slow_d.arrival["moe_l0_merge"])
    # the interpreter's own order (by input) is neither
    assert fast_d.arrival["moe_l0_merge"] != sorted(fast_d.arrival["moe_l0_merge"])
    want = moe_reference(
        *(torch.as_tensor(ins[k]) for k in ("x", "topk_idx", "topk_w")),
        *(torch.as_tensor(ins[k]) for k in ("w_gate", "w_up", "w_down")),
    )
    for d in (fast_d, slow_d):
        got = torch.as_tensor(np.asarray(d.run.tensors["out"])).reshape(16, 64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
