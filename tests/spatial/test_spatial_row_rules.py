"""Unit steps timed from the run-time rows of their input tile (STeP, arXiv 2511.07776, §4.2:
FLOPs of the element's actual shapes): a ``step_unit`` Compute with a row rule costs what the
tile it receives holds, so one instruction serves tiles of any row count."""

from __future__ import annotations

import numpy as np
import sympy as sp

from hwmodel.presets import load_chip
from lowering.isa import Alloc, Channel, Compute, If, Loop, Program, ProgramSet, Recv, Send
from runtime import Simulator
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.spatial import simulate_graph
from torch2step.spatial.plan import build_plan
from torch2step.spatial.rows import row_rule, with_rows
from torch2step.spatial.simulate import simulate_plan
from torch2step.spatial.streams import Part
from torch2step.spatial.timing import (
    STEP_KERNEL,
    RowRule,
    TimingModel,
    UnitConfig,
    simulation_chip,
)
from torch2step.step import run
from torch2step.step.functions import fn
from torch2step.step.types import TileType, TupleType

KW = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
T = 16


def _computes(body):
    for ins in body:
        if isinstance(ins, Compute):
            yield ins
        elif isinstance(ins, Loop):
            yield from _computes(ins.body)
        elif isinstance(ins, If):  # an expert's units run under their guard
            yield from _computes(ins.then)
            yield from _computes(ins.orelse)


def test_one_compute_prices_each_tile_it_receives() -> None:
    """Core 0 sends a 3-row and a 10-row tile; core 1 runs the same Compute (2048 FLOPs per row
    over 512 FLOPs/cycle, plus 100) on both: 1 + 4*3 and 1 + 4*10 cycles, and its output
    holds a*rows + c elements."""
    chip = simulation_chip(load_chip("step-sda"))
    rate = dict(chip.core.flops_per_cycle)[chip.core.flops_per_cycle[0][0]]
    rule = RowRule(0, 8, ((2048, 100, 512),), ((8, 1),))
    assert rule.cycles(3) == 13 and rule.cycles(10) == 41
    make = [
        Compute(STEP_KERNEL, ("t",), (), (("cycles", 1), ("outs", str(8 * r)), ("rate", rate)))
        for r in (3, 10)
    ]
    sender = (Alloc("t", (80,)), make[0], Send("c", "t"), make[1], Send("c", "t"))
    step = Compute(STEP_KERNEL, ("y",), ("x",), rule.params(0, rate))
    receiver = (Alloc("x", (80,)), Alloc("y", (81,)), Loop(2, (Recv("c", "x"), step)))
    ps = ProgramSet((Program(0, sender), Program(1, receiver)), (Channel("c", 0, (1,)),))
    res = Simulator(ps, chip).run()
    assert res.stats.core(1).busy == 13 + 41
    fn = Simulator(ps, chip, mode="functional").run()
    assert fn.cycles == res.cycles


def test_expert_steps_follow_their_tiles_rows() -> None:
    """The expert units' steps on ``[n_e, ...]`` tiles carry row rules, not literal cycles,
    and the plan's cycles are those of the literal roofline (the rules give the same count at
    the run's own rows)."""
    g = moe_graph(**KW, tokens=T, tile_h=32, tile_i=32)
    r = run(g, tensors=moe_inputs(**KW, tokens=T, seed=0), check=False)
    plan = build_plan(g, "step-sda", r)
    core = {u.name: u.core for u in plan.placement.units}
    body = {p.core: p.body for p in plan.programs.programs}
    for unit in ("moe_e0_gate", "moe_e0_act", "moe_e0_down_mm", "moe_e0_scaled"):
        steps = [c for c in _computes(body[core[unit]]) if c.ins]
        assert steps and all(dict(c.params).get("row_in") is not None for c in steps), unit
    for unit in ("moe_x_ld", "moe_sel", "moe_sum"):  # static tiles keep literal cycles
        assert all("row_in" not in dict(c.params) for c in _computes(body[core[unit]])), unit
    res = simulate_plan(plan)
    assert res.cycles == simulate_graph(g, "step-sda", r).cycles
    busy = {u.name: u.step_cycles for u in plan.units}
    assert busy["moe_e0_gate"] > 0


def test_row_rule_matches_the_literal_roofline() -> None:
    """Derived at any row count, the rule of a matmul update gives at every row count the
    literal roofline cycles a plan built for that row count would carry."""
    n = sp.Symbol("n", integer=True, nonnegative=True)
    tm = TimingModel(load_chip("step-sda"))
    f = fn("matmul_t_acc")
    t = TupleType((TileType((n, 32), "fp32"), TileType((32, 32), "fp32")))
    st = TileType((n, 32), "fp32")
    rate = tm.rate("fp32", UnitConfig())
    for rows in (1, 7, 64):
        x = (np.zeros((rows, 32)), np.zeros((32, 32)))
        s = np.zeros((rows, 32))
        parts = (Part("data", "fp32", rows * 32), Part("data", "fp32", 1024))
        out = (Part("data", "fp32", rows * 32),)
        rule = row_rule(
            tm,
            UnitConfig(),
            rate,
            lambda r, x=x, s=s: tm.update_flops(f, with_rows(x, t, r), with_rows(s, st, r)),
            (x, t, parts),
            (s, st, out),
            state=(s, st),
        )
        assert rule is not None and rule.outs == ((32, 0),)
        for other in (1, 3, 50, 128):
            a, w = TileType((other, 32), "fp32"), TileType((32, 32), "fp32")
            fl = tm.update_flops(f, TupleType((a, w)), a)
            assert fl >= 2 * other * 32 * 32
            want = tm.roofline(fl, 0, 0, rate, UnitConfig())
            assert rule.cycles(other) == want
