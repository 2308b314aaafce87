"""Spatial execution of the time-multiplexed MoE (seed 000 §5.3, ``moe_graph(..., lanes=P)``):
per-lane EagerMerge of whole expert chunks, FlatMap(as_ragged / tile_grid / tile_rows), expert
ids and weight addresses computed in-graph, RandomOffChipLoads, a per-lane Partition back to the
experts.  The programs must carry exactly the run's messages, move the run's bytes, count its
FLOPs, and deepen exactly the FIFOs a restarted search would."""

from __future__ import annotations

import numpy as np
import pytest

from hwmodel import load_chip
from lowering.isa import WaitAny, walk
from runtime import DeadlockError, Simulator
from runtime.ops_select import watch_key
from torch2step.errors import LoweringError
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.lower.blocks.moe_lanes import lane_experts
from torch2step.spatial import (
    EMITTERS,
    SpatialPlan,
    build_plan,
    roofline_cycles,
    simulate_graph,
)
from torch2step.spatial.fifos import blocked_channels, deepen, find_deep
from torch2step.step import FlatMap, run

CHIP = load_chip("step-sda")
E, K, H, I, T = 8, 2, 64, 64, 16  # noqa: E741 - the layer's names
TILE = 32  # H / TILE = I / TILE = 2: a 2 x 2 grid of weight tiles per expert


def _case(lanes: int | None, routing: np.ndarray | None = None) -> tuple:
    kw = {"num_experts": E, "top_k": K, "hidden": H, "intermediate": I}
    prog = moe_graph(**kw, tokens=T, lanes=lanes, tile_h=TILE, tile_i=TILE)
    return prog, run(prog, tensors=moe_inputs(**kw, tokens=T, routing=routing))


@pytest.fixture(scope="module")
def lanes2() -> tuple:
    prog, res = _case(2)
    return prog, res, simulate_graph(prog, CHIP, res)


@pytest.fixture(scope="module")
def dedicated() -> tuple:
    prog, res = _case(None)
    return prog, res, simulate_graph(prog, CHIP, res)


def _counts(res) -> list[int]:
    return [int(res.bindings[f"moe_n{e}"]) for e in range(E)]


def test_lanes_traffic_and_work_equal_the_reference_run(lanes2: tuple) -> None:
    """The programs pass validation (every send has its receive) and move exactly the
    interpreter's off-chip bytes and FLOPs: each used expert's 3 x 4 weight tiles once."""
    _, res, sim = lanes2
    assert sim.hbm_read_bytes == sum(res.read_bytes.values())
    assert sim.hbm_write_bytes == sum(res.write_bytes.values())
    assert sim.flops == res.total_flops > 0
    used = sum(n > 0 for n in _counts(res))
    weights = used * 3 * H * I * 4
    acts = 2 * T * H * 4 + T * K * (8 + 4)  # x and out; topk_idx (int64) and topk_w
    assert sim.hbm_bytes == weights + acts


def test_rank2_expansions_send_every_element(lanes2: tuple) -> None:
    """FlatMap(tile_grid) sends ``rows x cols`` addresses per served expert and
    FlatMap(tile_rows) one row per token of the chunk, not one message per expansion."""
    _, res, sim = lanes2
    n = _counts(res)
    for lane in range(2):
        mine = [n[e] for e in lane_experts(E, 2)[lane]]
        served = sum(c > 0 for c in mine)
        # and the stop token the weight loads loop until (torch2step.spatial.region_loop)
        assert sim.plan.messages[f"moe_l{lane}_gu_a"] == 2 * 2 * served + 1
        assert sim.plan.messages[f"moe_l{lane}_d_a"] == 2 * 2 * served + 1
        assert sim.unit(f"moe_l{lane}_gu_a").sent == 2 * 2 * served
        assert sim.plan.messages[f"moe_l{lane}_out"] == sum(mine)
        assert sim.unit(f"moe_l{lane}_out").sent == sum(mine)
        assert sim.unit(f"moe_l{lane}_merge").received == sum(mine)


def test_lanes_trade_units_for_latency(lanes2: tuple, dedicated: tuple) -> None:
    """Two lanes serve the 8 experts with fewer units than one branch per expert, and take
    longer (experts of a lane run one after another); same traffic, both above the roofline
    bound (the FLOPs differ only by the weight pick: ``pick_weight_of`` compares a dynamic id)."""
    _, _, lanes = lanes2
    _, _, ded = dedicated
    assert lanes.hbm_bytes == ded.hbm_bytes
    assert len(lanes.units) < len(ded.units)
    assert roofline_cycles(lanes, CHIP) == roofline_cycles(ded, CHIP) < ded.cycles < lanes.cycles


def test_lanes_simulation_is_deterministic(lanes2: tuple) -> None:
    prog, res, sim = lanes2
    again = simulate_graph(prog, CHIP, res)
    assert again.cycles == sim.cycles
    assert again.units == sim.units
    assert again.deep_channels == sim.deep_channels
    assert again.plan.programs == sim.plan.programs


def test_a_lane_without_tokens_idles() -> None:
    """Only experts 0-3 are chosen: lane 1 (experts 4-7) merges no chunk, loads no weight
    tile and sends nothing; the traffic is still the run's."""
    routing = np.array([[0, 2], [2, 1], [3, 0], [1, 3]] * 4)
    prog, res = _case(2, routing)
    sim = simulate_graph(prog, CHIP, res)
    assert sim.hbm_bytes == res.offchip_bytes and sim.flops == res.total_flops
    for name in ("moe_l1_merge", "moe_l1_gu_a", "moe_l1_gate_w", "moe_l1_down_w", "moe_l1_out"):
        assert sim.unit(name).sent == 0, name
    assert sim.unit("moe_l0_gate_w").sent == 4 * 2 * 2


def _restarting(plan: SpatialPlan) -> tuple[int, tuple[str, ...], dict[str, list[int]]]:
    """The deepening search by restarting the simulation after every deadlock; also the
    order the final run's merges took their inputs in (each ``WaitAny`` register's choices)."""
    deep: dict[str, int] = {}
    chip = plan.sim_chip
    regs = {i.reg for p in plan.programs.programs for i in walk(p.body) if isinstance(i, WaitAny)}
    while True:
        sim = Simulator(deepen(plan.programs, deep), chip, inputs=plan.inputs)
        sim.watch = {watch_key(r): [] for r in regs}
        try:
            cycles = sim.run().cycles
            return cycles, tuple(sorted(deep)), {r: sim.watch[watch_key(r)] for r in regs}
        except DeadlockError:
            full = blocked_channels(sim) - set(deep)
            assert full
            for ch in full:
                deep[ch] = max(chip.core.fifo_depth, plan.messages[ch])


def test_resumed_deepening_matches_restarting(lanes2: tuple) -> None:
    """Deepening FIFOs in the deadlocked simulation and resuming it finds the channels that
    restarting after every deadlock finds (a Kahn network deadlocks independently of timing,
    and the merges' WaitAny, the one timing-dependent choice, takes its inputs in the order
    the timed run decides), so the final run's latency is the same."""
    prog, res, sim = lanes2
    assert len(sim.deep_channels) > 1
    plan = build_plan(prog, CHIP, res)
    cycles, deep, order = _restarting(plan)
    assert deep == sim.deep_channels and cycles == sim.cycles
    # the merges decide in simulated time: each region's WaitAny took all four experts
    assert sorted(order) == ["pick.moe_l0_merge", "pick.moe_l1_merge"]
    assert all(sorted(v) == [0, 1, 2, 3] for v in order.values())
    # the untimed replay finds them without the timing model (it is what simulate_graph
    # uses), following the order the timed run's merges took
    fresh = Simulator(plan.programs, CHIP, inputs=plan.inputs)
    found = find_deep(fresh, CHIP, plan.messages, order=order)
    assert found is not None and tuple(sorted(found)) == deep


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The timed simulation's ``run`` and ``resume`` calls, in order."""
    calls: list[str] = []
    run, resume = Simulator.run, Simulator.resume
    monkeypatch.setattr(Simulator, "run", lambda s, **kw: calls.append("run") or run(s, **kw))
    monkeypatch.setattr(Simulator, "resume", lambda s: calls.append("resume") or resume(s))
    return calls


def test_the_timed_simulation_runs_once(dedicated: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programs without a timing-dependent choice (one region per expert: no merge): the FIFOs
    to deepen are found on the untimed replay, so the timed simulation runs once (and never
    resumes), with the same channels deep and the same latency."""
    prog, res, sim = dedicated
    assert sim.deep_channels  # the selector's reconvergence (module torch2step.spatial.fifos)
    calls = _counting(monkeypatch)
    again = simulate_graph(prog, CHIP, res)
    assert calls == ["run"]
    assert again.deep_channels == sim.deep_channels and again.cycles == sim.cycles


def test_the_merges_order_is_searched_in_timed_rounds(
    lanes2: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert regions whose merges take whichever chunk is ready (WaitAny): the replay's first
    guess of the order (the lowest ready input) is not the timed run's, whose run deadlocks on
    a channel the guess did not need and is resumed to its end to record its order; the replay
    following that order finds the channels to deepen, and the second timed run takes that
    order again (torch2step.spatial.fifos: the fixed point), so it is the result."""
    prog, res, sim = lanes2
    calls = _counting(monkeypatch)
    again = simulate_graph(prog, CHIP, res)
    assert calls == ["run", "resume", "run"]
    assert again.deep_channels == sim.deep_channels and again.cycles == sim.cycles


def test_an_emitter_that_drops_messages_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Program generation checks every unit sent all the messages of its output streams."""

    def silent(ctx, b, ops) -> None:
        x = ctx.stream(ops[0].input)
        for k in range(len(x.flat)):
            b.consume(b.recv(x, k))
            b.step()

    monkeypatch.setitem(EMITTERS, FlatMap, silent)
    prog, res = _case(2)
    with pytest.raises(LoweringError, match=r"sent 0 of the \d+ messages of stream"):
        build_plan(prog, CHIP, res)
